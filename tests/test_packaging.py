"""The wheel is the engine: `pip install .` ships `nano_v1` alone, and nothing in it needs the checkout.

The GPU suite, the kernel studies (`benchmarks/`), the device script, the ledger and the
demo model's trainer (`tools/`) live beside the package and are run from a source
checkout. A wheel built from this tree must hold none of them, and every module it does
hold must import and find its files from site-packages, where there is no repository
around it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ch00, pytest.mark.slow]
REPO_ROOT = Path(__file__).resolve().parents[1]
# A path computed from a module's own file that leaves the package: the repository's layout.
LAYOUT_RE = re.compile(r"parents\[|\.parent\.parent|\bREPO_ROOT\b|\bLEDGER_DIR\b|dirname\(os\.path\.dirname")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built by setuptools from a copy of what `pip install .` reads, benchmarks/ and tools/ included."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO_ROOT / name, src / name)
    for name in ("nano_v1", "benchmarks", "tools"):
        shutil.copytree(REPO_ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("dist")
    build = f"from setuptools import build_meta; print(build_meta.build_wheel({str(out)!r}))"
    result = subprocess.run([sys.executable, "-c", build], cwd=src, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return out / result.stdout.strip().splitlines()[-1]


def test_the_wheel_holds_the_package_alone(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"nano_v1", "nano_v1-0.1.0.dist-info"}
    assert not [name for name in names if name.endswith("/train.py")]
    benchmarks = {Path(name).name for name in names if name.startswith("nano_v1/benchmarks/")}
    assert benchmarks == {"__init__.py", "processes.py", "roofline.py", "scheduler_overhead.py",
                          "scheduler_peer_vllm.py", "serve.py", "spec_decode.py", "throughput.py", "utils.py"}
    assert "nano_v1/demo_model/checkpoint/model.safetensors" in names


def test_no_module_in_the_wheel_reaches_outside_the_package(wheel):
    with zipfile.ZipFile(wheel) as archive:
        found = [
            f"{name}:{n}: {line.strip()}"
            for name in archive.namelist() if name.endswith(".py")
            for n, line in enumerate(archive.read(name).decode().splitlines(), start=1)
            if LAYOUT_RE.search(line)
        ]
    assert not found, "\n".join(found)


def test_every_module_imports_from_site_packages(wheel, tmp_path):
    # Unpacked as pip would install it, run from a directory that is not a checkout, with
    # only site-packages on the path: every module imports (or lacks only a third-party
    # package this environment does not have: the GPU image has no fastapi), `nano-v1 bench`
    # lists its benchmarks, the demo model is found, and the assignments say they need a checkout.
    site_packages = tmp_path / "site-packages"
    zipfile.ZipFile(wheel).extractall(site_packages)
    script = (
        "import importlib, pkgutil, sys\n"
        "import nano_v1\n"
        f"assert nano_v1.__path__ == [{str(site_packages / 'nano_v1')!r}], nano_v1.__path__\n"
        "for module in pkgutil.walk_packages(nano_v1.__path__, 'nano_v1.'):\n"
        "    try:\n"
        "        importlib.import_module(module.name)\n"
        "    except ModuleNotFoundError as e:\n"
        "        if e.name.split('.')[0] in {'nano_v1', 'benchmarks', 'tools', 'notebooks', 'nb', 'tests'}:\n"
        "            raise\n"
        "from nano_v1.demo_model import DEMO_MODEL_PATH\n"
        "assert (DEMO_MODEL_PATH / 'model.safetensors').is_file()\n"
        "from nano_v1.entrypoints import cli\n"
        "cli.main(['bench', '--help'])\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site_packages), "HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert all(name in result.stdout for name in ("throughput", "scheduler", "serve", "processes", "spec"))
    result = subprocess.run([sys.executable, "-m", "nano_v1.assignments", "list"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "need a source checkout" in result.stderr, result.stderr
