"""The notebooks: the generated .ipynb matches its .py source, and each one runs top to bottom.

notebooks/NN_slug.py (jupytext percent format) is the reviewed source; NN_slug.ipynb is
generated from it (`jupytext --to ipynb notebooks/[0-9]*.py`). The drift test compares
cell types and sources, not outputs or metadata. The execution test runs every notebook
through a real Jupyter kernel with NANO_V1_SMOKE=1 (every size shrunk; figures go to a
temporary directory instead of over the committed ones) and checks that the kernel
imported this checkout's nano_v1 and that the notebook wrote its plot and its raw numbers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# The notebooks' Jupyter tooling; the GPU image has none of it (the notebooks run there as scripts).
jupytext = pytest.importorskip("jupytext")
nbformat = pytest.importorskip("nbformat")
NotebookClient = pytest.importorskip("nbclient").NotebookClient
pytest.importorskip("ipykernel")

pytestmark = pytest.mark.notebooks

REPO_ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
# What every results JSON records about where its numbers came from (benchmarks/utils.py::environment).
ENVIRONMENT_KEYS = {"date", "device", "python", "torch", "transformers"}


def cells(notebook) -> list[tuple[str, str]]:
    return [(cell.cell_type, cell.source.strip()) for cell in notebook.cells]


@pytest.fixture(params=NOTEBOOKS, ids=[n.stem for n in NOTEBOOKS])
def notebook_py(request) -> Path:
    return request.param


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/NN_slug.py files are missing"


@pytest.mark.ch00
def test_ipynb_matches_its_source(notebook_py):
    ipynb = notebook_py.with_suffix(".ipynb")
    regenerate = f"regenerate it: jupytext --to ipynb {notebook_py.relative_to(REPO_ROOT)}"
    assert ipynb.is_file(), f"{ipynb.name} is missing; {regenerate}"
    assert cells(nbformat.read(ipynb, as_version=4)) == cells(jupytext.read(notebook_py)), (
        f"{ipynb.name} has drifted from {notebook_py.name}; {regenerate}"
    )


@pytest.mark.slow
def test_notebook_runs_in_smoke_mode(notebook_py, tmp_path, monkeypatch):
    # The kernel is a child process: it inherits this environment.
    monkeypatch.setenv("NANO_V1_SMOKE", "1")
    monkeypatch.setenv("NANO_V1_FIGURES_DIR", str(tmp_path))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    )
    notebook = nbformat.read(notebook_py.with_suffix(".ipynb"), as_version=4)
    notebook.cells.append(nbformat.v4.new_code_cell("import nano_v1\nprint(nano_v1.__file__)"))
    client = NotebookClient(
        notebook,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(notebook_py.parent)}},  # cwd, as Jupyter runs it
    )
    client.execute()

    imported_from = Path(notebook.cells[-1].outputs[0]["text"].strip())
    assert imported_from.resolve().is_relative_to(REPO_ROOT / "nano_v1"), imported_from
    number = notebook_py.name[:2]
    figures = sorted(p.name for p in tmp_path.glob(f"{number}_*.png"))
    data = sorted(tmp_path.glob(f"data/{number}_*.json"))
    assert figures, f"{notebook_py.name} wrote no figure {number}_*.png"
    assert data, f"{notebook_py.name} wrote no raw numbers data/{number}_*.json"
    for path in data:
        record = json.loads(path.read_text())
        assert record["smoke"] is True
        assert ENVIRONMENT_KEYS <= record["environment"].keys(), path.name


@pytest.mark.ch00
def test_committed_results_say_where_they_ran():
    """figures/data/NN_*.json are full runs, each with its date, device and versions."""
    records = sorted((REPO_ROOT / "figures" / "data").glob("[0-9][0-9]_*.json"))
    for path in records:
        record = json.loads(path.read_text())
        assert record.get("smoke") is False, (
            f"{path.name} is a smoke run; rerun the notebook without NANO_V1_SMOKE"
        )
        assert ENVIRONMENT_KEYS <= record["environment"].keys(), path.name


@pytest.mark.ch00
def test_smoke_figures_say_so_in_their_title(tmp_path, monkeypatch):
    """A smoke run's figure (shrunk sizes, numbers that mean nothing) is titled "[SMOKE] ...", once,
    however the notebook titled it; a full run's title is the notebook's."""
    from matplotlib.figure import Figure

    from notebooks import nb

    monkeypatch.setenv("NANO_V1_FIGURES_DIR", str(tmp_path))

    def saved_title(smoke: bool, title: str | None) -> str:
        monkeypatch.setattr(nb, "SMOKE", smoke)
        fig = Figure()
        fig.add_subplot().plot([1, 2])
        if title is not None:
            fig.suptitle(title, fontsize=10)
        assert nb.save_figure(fig, "00_title").is_file()
        nb.save_figure(fig, "00_title")  # saved twice, marked once
        return fig.get_suptitle()

    assert saved_title(True, "decode step: 2-core CPU") == "[SMOKE] decode step: 2-core CPU"
    assert saved_title(True, None) == "[SMOKE]"
    assert saved_title(False, "decode step: 2-core CPU") == "decode step: 2-core CPU"


@pytest.mark.ch00
def test_no_figure_has_two_y_axes():
    """A panel with a second y-axis (`twinx`, `secondary_yaxis`) is easily read against the
    wrong scale: one quantity per panel, side by side."""
    offenders = [
        f"{notebook.name}:{n}"
        for notebook in NOTEBOOKS
        for n, line in enumerate(notebook.read_text(encoding="utf-8").splitlines(), start=1)
        if "twinx(" in line or "secondary_yaxis(" in line
    ]
    assert not offenders, "panels with two y-axes: " + ", ".join(offenders)
