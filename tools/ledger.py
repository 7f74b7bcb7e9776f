"""The results ledger: GPU results committed under figures/data/, named by benchmark, date and device.

Mirrors no vLLM file (vLLM publishes its numbers on a dashboard); chapter 00.
Needs a source checkout (`pip install .` installs only nano_v1): run from its root,
`python -m tools.ledger`.

Why it exists: GPU time is rare here (a few minutes, now and then), so every GPU run is
kept as a file in the repository, `figures/data/<name>-YYYY-MM-DD-<device-slug>.json`
(e.g. `gpu_suite-2025-11-30-nvidia-h200.json`), and notebooks plot the latest one beside
the CPU measurements they make themselves, labelled with its device and date.

    python -m tools.ledger add OUT/gpu_suite.json   # copy a run into the ledger
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path
from typing import Any

from benchmarks import NEEDS_CHECKOUT

# figures/data/ of the source checkout whose tools/ this is.
LEDGER_DIR = Path(__file__).resolve().parents[1] / "figures" / "data"
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


def device_slug(device: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200': lowercase, runs of anything else than [a-z0-9] become one dash."""
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    if not slug:
        raise ValueError(f"device name {device!r} has no letters or digits to name a file by.")
    return slug


def result_filename(name: str, date: str, device: str) -> str:
    """`<name>-YYYY-MM-DD-<device-slug>.json`; `date` may be a full ISO timestamp (its day is used)."""
    day = date[:10]
    if not _DATE.match(day):
        raise ValueError(f"date must start with YYYY-MM-DD, got {date!r}.")
    if not re.fullmatch(r"[a-z0-9_]+", name):
        raise ValueError(f"result name must be lowercase letters, digits and underscores, got {name!r}.")
    return f"{name}-{day}-{device_slug(device)}.json"


def list_gpu_results(name: str, data_dir: str | Path | None = None) -> list[Path]:
    """Every ledger file of benchmark `name`, oldest first (by the date in its name, then its device)."""
    data_dir = Path(data_dir) if data_dir is not None else LEDGER_DIR
    pattern = re.compile(rf"^{re.escape(name)}-(\d{{4}}-\d{{2}}-\d{{2}})-[a-z0-9-]+\.json$")
    found = [(m.group(1), p.name, p) for p in data_dir.glob(f"{name}-*.json") if (m := pattern.match(p.name))]
    return [p for _, _, p in sorted(found)]


def latest_gpu_results(name: str = "gpu_suite", data_dir: str | Path | None = None) -> dict[str, Any] | None:
    """The newest ledger entry of benchmark `name` as a dict (with its file under "ledger_file"), or None."""
    files = list_gpu_results(name, data_dir)
    if not files:
        return None
    return {**json.loads(files[-1].read_text()), "ledger_file": files[-1].name}


def add_to_ledger(report_path: str | Path, data_dir: str | Path | None = None) -> Path:
    """Copy a results JSON (with "benchmark" and an "environment" of date and device) into the ledger."""
    report = json.loads(Path(report_path).read_text())
    try:
        name, env = report["benchmark"], report["environment"]
        filename = result_filename(name, env["date"], env["device"])
    except KeyError as e:
        raise ValueError(f"{report_path} is not a benchmark report: it lacks {e}.") from None
    target = (Path(data_dir) if data_dir is not None else LEDGER_DIR) / filename
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(report_path, target)
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.ledger", description=__doc__.splitlines()[0],
                                     epilog=NEEDS_CHECKOUT)
    sub = parser.add_subparsers(dest="command", required=True)
    add = sub.add_parser("add", help="copy a results JSON into figures/data/ under its ledger name")
    add.add_argument("report", help="e.g. OUT/gpu_suite.json")
    add.add_argument("--data-dir", default=None, help=f"ledger directory (default {LEDGER_DIR})")
    args = parser.parse_args(argv)
    print(add_to_ledger(args.report, args.data_dir))


if __name__ == "__main__":
    main()
