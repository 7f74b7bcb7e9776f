"""The device script a GPU session runs as its one command: every part runs, is timed and capped, and $OUT
holds at most the 8 files a lent GPU returns.

On a CPU the parts run at smoke sizes (`--smoke`): the suite's first measurement, `pytest -m
gpu` (all skipped here), one notebook; a part that runs past its cap is killed with what it
started, and the run goes on. The notebooks' helpers it relies on are checked too: files
go where it collects them, and engines alive at once share the GPU.
"""

from __future__ import annotations

import json
import sys
import tarfile

import pytest

from benchmarks.gpu_suite import DEFAULT_TIME_BUDGET_S, MEASUREMENTS
from nano_v1.config import CacheConfig
from notebooks import nb
from tools import device_run
from tools.ledger import LEDGER_DIR

pytestmark = pytest.mark.ch00

MAX_FILES_BACK = 8  # what the device tool returns from $OUT


@pytest.mark.slow
def test_a_smoke_run_writes_every_part_into_at_most_eight_files(tmp_path):
    out = tmp_path / "out"
    report = device_run.run(out, smoke=True, notebooks=["02_paged_kv_cache"], measurements=["ceilings"])
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= MAX_FILES_BACK and all(p.is_file() for p in out.iterdir())
    assert files == [
        "device_run.json",
        "device_run.log",
        "device_run.tar.gz",
        "gpu_suite.json",
        "gpu_suite.log",
        "nvidia_smi.txt",
    ]
    assert json.loads((out / "device_run.json").read_text()) == report
    env = report["environment"]
    assert env["python"] and env["torch"] and env["transformers"] and env["numpy"] and "triton" in env
    assert (out / "nvidia_smi.txt").read_text()
    parts = report["parts"]
    assert list(parts) == ["environment", "gpu_suite", "pytest_gpu", "notebook 02_paged_kv_cache"]
    for name, part in parts.items():
        assert part["status"] == "ok" and part["elapsed_s"] >= 0, (name, part)
    assert "[ceilings] ok" in (out / "device_run.log").read_text()
    assert json.loads((out / "gpu_suite.json").read_text())["measurements"]["ceilings"]["status"] == "ok"
    with tarfile.open(out / "device_run.tar.gz") as bundle:
        names = bundle.getnames()
    assert "device_run/notebooks/02_paged_kv_cache.png" in names
    assert "device_run/notebooks/data/02_paged_kv_cache.json" in names
    assert "device_run/pytest_gpu.xml" in names and "device_run/logs/pytest_gpu.log" in names


def test_a_part_past_its_cap_is_killed_and_the_run_goes_on(tmp_path, monkeypatch):
    script = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print('started', flush=True); time.sleep(60)"
    )
    hang = device_run.Part("hang", [sys.executable, "-c", script], cap_s=2.0)
    after = device_run.Part("after", [sys.executable, "-c", "print('ran')"], cap_s=30.0)
    monkeypatch.setattr(device_run, "parts", lambda *args: [hang, after])
    report = device_run.run(tmp_path, notebooks=[])
    assert report["parts"]["hang"]["status"] == "timed_out" and report["parts"]["hang"]["elapsed_s"] < 15
    assert report["parts"]["after"]["status"] == "ok"
    assert "started" in (tmp_path / "device_run.log").read_text()


def test_the_budgets_fit_a_gpu_session(tmp_path):
    # Nine minutes in all, inside a command's ten, with room for two notebooks after the suite
    # and pytest; the suite's caps add up to its own budget.
    assert sum(m.cap_s for m in MEASUREMENTS.values()) == DEFAULT_TIME_BUDGET_S
    suite, pytest_gpu = device_run.parts(tmp_path, False, False, [], None)
    assert (
        suite.cap_s + pytest_gpu.cap_s + 2 * device_run.NOTEBOOK_CAP_S <= device_run.TIME_BUDGET_S <= 9 * 60
    )


def test_every_notebook_is_run():
    # A notebook left out of NOTEBOOKS would never have its GPU branch run.
    on_disk = sorted(p.stem for p in (device_run.REPO_ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
    assert sorted(device_run.NOTEBOOKS) == on_disk


def test_notebook_files_go_to_the_directory_given_at_any_size(tmp_path, monkeypatch):
    # A full-size notebook run on a GPU writes where the device script bundles from, not over figures/.
    monkeypatch.setattr(nb, "SMOKE", False)
    monkeypatch.setenv("NANO_V1_FIGURES_DIR", str(tmp_path))
    assert nb.save_data("99_check", {"value": 1}) == tmp_path / "data" / "99_check.json"
    monkeypatch.delenv("NANO_V1_FIGURES_DIR")
    assert nb.figures_dir() == LEDGER_DIR.parent


def test_engines_alive_together_share_the_gpu(monkeypatch):
    assert nb.gpu_memory_share(3) == ({"gpu_memory_utilization": 0.3} if nb.ON_GPU else {})
    monkeypatch.setattr(nb, "ON_GPU", True)
    shares = [nb.gpu_memory_share(4)["gpu_memory_utilization"]] * 4
    assert sum(shares) == pytest.approx(CacheConfig.gpu_memory_utilization)
