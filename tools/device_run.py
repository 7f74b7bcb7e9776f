"""One GPU session in one command: the GPU suite, `pytest -m gpu` and the notebooks' GPU branches, time-capped.

Mirrors no vLLM file: vLLM's CI has GPUs; this project borrows one for 15 minutes now and
then (chapter 00).
Needs a source checkout (`pip install .` installs only nano_v1): run from its root,
`python -m tools.device_run`.

Why it exists: a lent H200 runs one command of at most 10 minutes and returns at most 8
files, and a start costs minutes of the session. So everything a GPU session should do
is one prepared command, run with `timeout_s` 560:

    python -m tools.device_run --out $OUT

Parts, in order, each a child process killed at its cap (so none can stall the rest),
each given at most what is left of the 9-minute budget (`PARTS`):
  - environment: Python, torch, Triton, transformers and numpy versions, `nvidia-smi`;
  - gpu_suite: `python -m benchmarks.gpu_suite` (its own 300 s budget);
  - pytest_gpu: `pytest -m gpu` (the compiled kernels, real CUDA graphs, the suite's smoke
    sizes on CUDA);
  - notebooks: each notebook's GPU branch as a plain script, at smoke sizes (the full
    sizes take far longer than a session: `--full-notebooks`, alone, for a later one), in
    `NOTEBOOKS` order until the budget is spent.
Each part's elapsed seconds are printed and recorded. $OUT gets six files: device_run.json
(every part's status, exit code, seconds, and the versions), device_run.log (everything
printed), nvidia_smi.txt, gpu_suite.json, gpu_suite.log, and device_run.tar.gz with the
rest (each part's log, pytest's JUnit XML, the notebooks' figures and data, written
under `$NANO_V1_FIGURES_DIR`). `--smoke` runs the same parts at CPU sizes (tests).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from benchmarks import NEEDS_CHECKOUT
from benchmarks.gpu_suite import DEFAULT_TIME_BUDGET_S

NAME = "device_run"
REPO_ROOT = Path(__file__).resolve().parents[1]  # tools/ sits in the checkout's root
# The whole run: 9 minutes, inside the 10 a command may take, with time to bundle and return.
TIME_BUDGET_S = 540.0
VERSIONS = ("torch", "triton", "transformers", "numpy")
# Notebooks in the order they run: first those whose GPU branch no run has proved yet (two
# engines alive at once: 03, 08, 10; engines built one after another: 01, 02, 04), then the rest.
NOTEBOOKS = (
    "03_prefix_caching",
    "08_cuda_graphs",
    "10_spec_decode",
    "01_model",
    "02_paged_kv_cache",
    "04_scheduler",
    "00_why_v1",
    "05_persistent_batch",
    "06_attention_backend",
    "07_cascade_attention",
    "09_processes",
    "11_multimodal",
    "12_hybrid_kv_cache",
    "13_tensor_parallel",
    "14_async_scheduling",
    "15_structured_outputs",
    "16_kv_connectors",
)
# Packages a notebook needs beyond the GPU image's: 09 and 14 start engine-core processes (ZMQ, msgpack);
# 15 needs the grammar engine and its oracle; 16 starts OpenAI servers and the proxy.
NOTEBOOK_NEEDS = {
    "09_processes": ("zmq", "msgspec"),
    "14_async_scheduling": ("zmq", "msgspec"),
    "15_structured_outputs": ("xgrammar", "jsonschema"),
    "16_kv_connectors": ("zmq", "msgspec", "fastapi", "uvicorn", "httpx"),
}
NOTEBOOK_CAP_S = 60.0  # one notebook at smoke sizes: start-up, compiled engines, its own sweeps


@dataclass(frozen=True, slots=True)
class Part:
    """One step of the run: a command line, the most seconds it may take, and variables of its own."""

    name: str
    command: list[str]
    cap_s: float
    env: dict[str, str] = field(default_factory=dict)


def parts(
    work: Path, smoke: bool, full_notebooks: bool, notebooks: list[str], measurements: list[str] | None
) -> list[Part]:
    """The child processes of a run, in order. `work` is the scratch directory the bundle is made of."""
    python = sys.executable
    suite = [python, "-m", "benchmarks.gpu_suite", "--out", str(work / "gpu_suite")]
    suite += (["--smoke"] if smoke else []) + (["--only", *measurements] if measurements else [])
    steps = [Part("gpu_suite", suite, DEFAULT_TIME_BUDGET_S + 20)]
    steps.append(
        Part(
            "pytest_gpu",
            [
                python,
                "-m",
                "pytest",
                "-m",
                "gpu",
                "-p",
                "no:cacheprovider",
                f"--junitxml={work / 'pytest_gpu.xml'}",
            ],
            90.0,
        )
    )
    # Notebooks write their figures and data into `work`, at smoke sizes unless asked for the full ones.
    notebook_env = {
        "NANO_V1_FIGURES_DIR": str(work / "notebooks"),
        "NANO_V1_SMOKE": "0" if full_notebooks else "1",
    }
    for name in notebooks:
        path = REPO_ROOT / "notebooks" / f"{name}.py"
        cap_s = 4 * NOTEBOOK_CAP_S if full_notebooks else NOTEBOOK_CAP_S
        steps.append(Part(f"notebook {name}", [python, str(path)], cap_s, notebook_env))
    return steps


def child_env() -> dict[str, str]:
    """The environment of every part: this checkout first on the path, output unbuffered, nothing
    downloaded, no display, engine cores in-process (the GPU image has no pyzmq)."""
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        MPLBACKEND="Agg",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
    )
    return env


def environment(nvidia_smi_path: Path) -> dict[str, Any]:
    """Versions of Python and the packages that decide what runs; `nvidia-smi`'s report goes to its own file."""
    versions = {"python": platform.python_version()}
    for package in VERSIONS:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    smi = shutil.which("nvidia-smi")
    if smi is None:
        nvidia_smi_path.write_text("nvidia-smi: not found (no NVIDIA driver on this machine)\n")
    else:
        result = subprocess.run([smi], check=False, capture_output=True, text=True, timeout=30)
        nvidia_smi_path.write_text(result.stdout + result.stderr)
    return {**versions, "nvidia_smi": smi is not None, "platform": platform.platform()}


def run_part(part: Part, cap_s: float, env: dict[str, str], log: TextIO, cwd: Path) -> dict[str, Any]:
    """Run one part, its output copied to ours and to `log` line by line; kill its process group at `cap_s`."""
    start = time.perf_counter()
    print(f"=== [{part.name}] {' '.join(part.command)} (cap {cap_s:.0f} s)", flush=True)
    child = subprocess.Popen(
        part.command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**env, **part.env},
        cwd=cwd,
        start_new_session=True,
    )

    def copy_output() -> None:
        for line in child.stdout:
            sys.stdout.write(line)
            log.write(line)

    reader = threading.Thread(target=copy_output, daemon=True)
    reader.start()
    try:
        returncode = child.wait(timeout=cap_s)
        status = "ok" if returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)  # the part and everything it started
        returncode, status = child.wait(), "timed_out"
    reader.join(timeout=10)
    elapsed = time.perf_counter() - start
    print(f"=== [{part.name}] {status} (exit code {returncode}) in {elapsed:.1f} s", flush=True)
    return {
        "command": part.command,
        "cap_s": cap_s,
        "status": status,
        "returncode": returncode,
        "elapsed_s": elapsed,
    }


def missing_packages(part: Part) -> list[str]:
    notebook = part.name.removeprefix("notebook ")
    return [p for p in NOTEBOOK_NEEDS.get(notebook, ()) if importlib.util.find_spec(p) is None]


def run(
    out: Path,
    smoke: bool = False,
    full_notebooks: bool = False,
    notebooks: list[str] | None = None,
    measurements: list[str] | None = None,
    time_budget_s: float = TIME_BUDGET_S,
) -> dict[str, Any]:
    """Every part within the budget; $OUT gets the report, the log, nvidia-smi, the suite's files and the bundle."""
    out.mkdir(parents=True, exist_ok=True)
    run_start = time.perf_counter()
    report: dict[str, Any] = {
        "benchmark": NAME,
        "smoke": smoke,
        "full_notebooks": full_notebooks,
        "time_budget_s": time_budget_s,
        "parts": {},
    }
    with (
        tempfile.TemporaryDirectory(prefix="nano_v1_device_") as scratch,
        open(out / f"{NAME}.log", "w") as log,
    ):
        work = Path(scratch)
        (work / "logs").mkdir()
        start = time.perf_counter()
        report["environment"] = environment(out / "nvidia_smi.txt")
        report["parts"]["environment"] = {"status": "ok", "elapsed_s": time.perf_counter() - start}
        print(f"=== [environment] {report['environment']} in {time.perf_counter() - start:.1f} s", flush=True)
        env = child_env()
        chosen = list(NOTEBOOKS if notebooks is None else notebooks)
        for part in parts(work, smoke, full_notebooks, chosen, measurements):
            left = time_budget_s - (time.perf_counter() - run_start)
            missing = missing_packages(part)
            if missing:
                record = {"status": "skipped", "reason": f"needs {', '.join(missing)}, not installed here"}
            elif left < 5.0:
                record = {"status": "skipped", "reason": "the run's time budget is spent"}
            else:
                with open(work / "logs" / f"{part.name.replace(' ', '_')}.log", "w") as part_log:
                    record = run_part(part, min(part.cap_s, left), env, _Tee(log, part_log), REPO_ROOT)
            if record["status"] == "skipped":
                print(f"=== [{part.name}] skipped: {record['reason']}", flush=True)
            report["parts"][part.name] = record
            report["elapsed_s"] = time.perf_counter() - run_start
            (out / f"{NAME}.json").write_text(json.dumps(report, indent=2) + "\n")
        for name in ("gpu_suite.json", "gpu_suite.log"):
            if (work / "gpu_suite" / name).exists():
                shutil.copyfile(work / "gpu_suite" / name, out / name)
        with tarfile.open(out / f"{NAME}.tar.gz", "w:gz") as bundle:
            bundle.add(work, arcname=NAME)
    report["elapsed_s"] = time.perf_counter() - run_start
    (out / f"{NAME}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"=== {NAME}: {len(report['parts'])} parts in {report['elapsed_s']:.1f} s; wrote {sorted(os.listdir(out))}"
    )
    return report


class _Tee:
    """Writes to the run's log and to one part's log."""

    def __init__(self, *streams: TextIO) -> None:
        self.streams = streams

    def write(self, text: str) -> None:
        for stream in self.streams:
            stream.write(text)
            stream.flush()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.device_run", description=__doc__.splitlines()[0], epilog=NEEDS_CHECKOUT
    )
    parser.add_argument(
        "--out", required=True, help="where the files to bring back go (the device tool's $OUT)"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="the suite at smoke sizes: runs on a CPU (tests)"
    )
    parser.add_argument(
        "--full-notebooks",
        action="store_true",
        help="the notebooks at their GPU sizes (minutes each: pass --notebooks too)",
    )
    parser.add_argument(
        "--notebooks",
        nargs="*",
        default=None,
        metavar="NN_NAME",
        help=f"which notebooks, in this order (default: all, {' '.join(NOTEBOOKS)})",
    )
    parser.add_argument(
        "--measurements",
        nargs="+",
        default=None,
        metavar="NAME",
        help="only these measurements of the GPU suite (its --only)",
    )
    parser.add_argument(
        "--time-budget-s",
        type=float,
        default=TIME_BUDGET_S,
        help=f"the whole run (default {TIME_BUDGET_S:.0f} s)",
    )
    args = parser.parse_args(argv)
    run(
        Path(args.out), args.smoke, args.full_notebooks, args.notebooks, args.measurements, args.time_budget_s
    )


if __name__ == "__main__":
    main()
