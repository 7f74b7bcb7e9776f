"""Every vLLM path and symbol that nano_v1 cites exists in vLLM v0.11.0, the release it mirrors.

The oracle is v0.11.0's own source tree, read once by tests/vllm_v0_11_0/make_manifest.py
into tests/vllm_v0_11_0/manifest.json (its files, and what each .py defines); no vLLM is
needed here. Checked: every `vllm/...` path in nano_v1's sources, the chapters and the
README; every symbol cited as `vllm/x.py::Symbol`, as `vllm/x.py (`A`, `B`)` or as
"`A` in vllm/x.py"; that each nano_v1 module's docstring says which vLLM module it
mirrors (or that it has none); and that each chapter's box names the release.

A chapter's "## In vLLM today" section names what changed since, so its paths are
checked against vLLM 0.33.0's files instead (tests/vllm_v0_33_0/manifest.json, paths
only, written by the same script), except a path written as "v0.11.0's `vllm/...`",
which is the old location and is checked against v0.11.0. Symbols named in that section
are not checked here: the later manifest holds no symbols.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
from helpers.chapters import expand_braces

pytestmark = pytest.mark.ch00

REPO_ROOT = Path(__file__).resolve().parents[1]
MANIFEST = json.loads((REPO_ROOT / "tests" / "vllm_v0_11_0" / "manifest.json").read_text())
FILES = set(MANIFEST["files"])
SYMBOLS: dict[str, list[str]] = MANIFEST["symbols"]
VERSION = MANIFEST["vllm_version"]
MANIFEST_TODAY = json.loads((REPO_ROOT / "tests" / "vllm_v0_33_0" / "manifest.json").read_text())
FILES_TODAY = set(MANIFEST_TODAY["files"])
VERSION_TODAY = MANIFEST_TODAY["vllm_version"]

SOURCES = sorted((REPO_ROOT / "nano_v1").rglob("*.py"))
DOCUMENTS = sorted((REPO_ROOT / "chapters").glob("*.md")) + [REPO_ROOT / "README.md"]

# A vLLM path: `vllm/` not preceded by a name, a path or a URL (nano_v1/, vllm-project/vllm/).
PATH_RE = re.compile(r"(?<![\w./-])vllm/[\w./-]*")
SYMBOL_REF_RE = re.compile(r"(?<![\w./-])(vllm/[\w./-]+\.py)::([A-Za-z_][\w.]*\w)")
# `vllm/x.py (`A`, `B`)`, the list possibly running onto the next line.
PAREN_LIST_RE = re.compile(
    r"(?<![\w./-])(vllm/[\w./-]+\.py)`?\s+\(((?:`[A-Za-z_][\w.]*`(?:,\s+|\s+and\s+|\s+/\s+)?)+)"
)
# "`A` in vllm/x.py", "`A` and `B` live in vLLM's `vllm/x.py`", "`A` from vllm/x.py".
IN_FILE_RE = re.compile(
    r"((?:`[A-Za-z_][\w.]*`(?:,\s+|\s+and\s+|\s+/\s+))*`[A-Za-z_][\w.]*`)\s+(?:(?:lives?|is|are)\s+)?"
    r"(?:in|from)\s+(?:vLLM's\s+)?`?(vllm/[\w./-]+\.py)"
)
# Chapter 00's map: "| `core/block_pool.py`, ... | same paths under `vllm/v1/core/` |".
SAME_PATHS_RE = re.compile(
    r"^\|(?P<ours>[^|]+)\|\s*same paths under `(?P<under>vllm/[\w./-]+/)`\s*\|", re.MULTILINE
)
CODE_SPAN_RE = re.compile(r"`([^`\n]+)`")
NAME_RE = re.compile(r"`([A-Za-z_][\w.]*)`")
# A chapter's "## In vLLM today" section, up to the next "## " heading or the end.
TODAY_RE = re.compile(r"^## In vLLM today\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
# Inside it, "v0.11.0's `vllm/x.py`" names the old location.
OLD_PATH_RE = re.compile(r"v0\.11\.0's\s+`?(vllm/[\w./-]*)")
NO_COUNTERPART_RE = re.compile(
    r"nano_v1's own|[Nn]o vLLM counterpart|vLLM has no counterpart|Mirrors no (?:single )?vLLM"
)


def relative(path: Path) -> str:
    return path.relative_to(REPO_ROOT).as_posix()


def cited_paths(text: str) -> set[str]:
    """Every `vllm/...` path, and the paths a "same paths under `vllm/...`" row stands for."""
    paths = {match.rstrip(".,") for match in PATH_RE.findall(text)}
    for row in SAME_PATHS_RE.finditer(text):
        under = row["under"]
        for ours in CODE_SPAN_RE.findall(row["ours"]):
            for path in expand_braces(ours):
                # `core/block_pool.py` under `vllm/v1/core/` is vllm/v1/core/block_pool.py.
                head, _, rest = path.partition("/")
                paths.add(under + rest if under.endswith(f"/{head}/") else under + path)
    return paths


def cited_symbols(text: str) -> set[tuple[str, str]]:
    """(vLLM file, symbol) pairs in the three citation forms."""
    pairs = set(SYMBOL_REF_RE.findall(text))
    for path, names in PAREN_LIST_RE.findall(text):
        pairs |= {(path, name) for name in NAME_RE.findall(names)}
    for names, path in IN_FILE_RE.findall(text):
        pairs |= {(path, name) for name in NAME_RE.findall(names)}
    return pairs


def path_exists(path: str, files: set[str] = FILES) -> bool:
    """A file of the manifest, or (ending in /) a directory holding some."""
    if path.endswith("/"):
        return any(file.startswith(path) for file in files)
    return path in files


def split_today(text: str) -> tuple[str, str]:
    """(the text without its "In vLLM today" sections, those sections)."""
    return TODAY_RE.sub("", text), "".join(TODAY_RE.findall(text))


def defines(path: str, symbol: str) -> bool:
    """`symbol` (a name or Class.member) is defined in `path`; a bare name may be a member."""
    names = SYMBOLS.get(path, [])
    return symbol in names or ("." not in symbol and any(name.endswith("." + symbol) for name in names))


def citing_texts():
    """Every source and document, without the sections about later releases."""
    for path in SOURCES + DOCUMENTS:
        yield relative(path), split_today(path.read_text(encoding="utf-8"))[0]


def today_sections():
    for chapter in sorted((REPO_ROOT / "chapters").glob("*.md")):
        today = split_today(chapter.read_text(encoding="utf-8"))[1]
        if today:
            yield chapter.name, today


def test_manifest_is_v0_11_0():
    assert VERSION == "0.11.0"
    assert "vllm/v1/core/sched/scheduler.py" in FILES
    assert "Scheduler.schedule" in SYMBOLS["vllm/v1/core/sched/scheduler.py"]


def test_cited_paths_exist_in_v0_11_0():
    missing = [
        f"{where}: {path}"
        for where, text in citing_texts()
        for path in sorted(cited_paths(text))
        if not path_exists(path)
    ]
    assert not missing, f"paths that vLLM {VERSION} does not have:\n" + "\n".join(missing)


def test_cited_symbols_resolve_in_v0_11_0():
    found, unresolved = 0, []
    for where, text in citing_texts():
        for path, symbol in sorted(cited_symbols(text)):
            found += 1
            if not defines(path, symbol):
                unresolved.append(f"{where}: {path}::{symbol}")
    assert found > 20, "the citation patterns matched almost nothing: has the citation style changed?"
    assert not unresolved, f"symbols that vLLM {VERSION} does not define there:\n" + "\n".join(unresolved)


@pytest.mark.parametrize("source", SOURCES, ids=relative)
def test_module_docstring_names_its_vllm_counterpart(source):
    """A paragraph "Mirrors vllm/..." (the path is checked above), or a plain statement that there is none."""
    text = source.read_text(encoding="utf-8")
    if not text.strip():
        return  # an empty package marker says nothing and needs no docstring
    docstring = ast.get_docstring(ast.parse(text)) or ""
    mirrors = any("Mirrors" in paragraph and cited_paths(paragraph) for paragraph in docstring.split("\n\n"))
    assert mirrors or NO_COUNTERPART_RE.search(docstring), (
        f"{relative(source)}: the module docstring must say which vLLM module it mirrors "
        "('Mirrors vllm/...') or that it has no counterpart (\"nano_v1's own; vLLM has no counterpart\")"
    )


def test_today_sections_cite_what_vllm_0_33_0_has():
    assert VERSION_TODAY == "0.33.0"
    assert "vllm/v1/engine/input_processor.py" in FILES_TODAY
    problems = []
    for name, today in today_sections():
        if f"vLLM {VERSION_TODAY}" not in today:
            problems.append(f"{name}: the In vLLM today section must name vLLM {VERSION_TODAY}")
        for path in OLD_PATH_RE.findall(today):
            if not path_exists(path.rstrip(".,")):
                problems.append(f"{name}: {path} is not in vLLM {VERSION}")
        for path in sorted(cited_paths(OLD_PATH_RE.sub("", today))):
            if not path_exists(path, FILES_TODAY):
                problems.append(f"{name}: {path} is not in vLLM {VERSION_TODAY}")
    assert not problems, "\n".join(problems)


def test_chapter_boxes_name_the_release():
    for chapter in sorted((REPO_ROOT / "chapters").glob("*.md")):
        box = next(
            line
            for line in chapter.read_text(encoding="utf-8").splitlines()
            if line.startswith("> **Files**")
        )
        assert box.endswith(f" · **vLLM**: v{VERSION}"), (
            f"{chapter.name}: the box must end with '· **vLLM**: v{VERSION}'"
        )


def test_the_checks_can_see_citations():
    """The patterns above on known forms, so a silent regex change cannot pass everything."""
    text = (
        "Mirrors vllm/v1/core/block_pool.py (`BlockPool`, `touch`) and `Scheduler` in "
        "vllm/v1/core/sched/scheduler.py; see vllm/_custom_ops.py::reshape_and_cache_flash, "
        "nano_v1/core/ and https://github.com/vllm-project/vllm/tree/main."
    )
    assert cited_paths(text) == {
        "vllm/v1/core/block_pool.py",
        "vllm/v1/core/sched/scheduler.py",
        "vllm/_custom_ops.py",
    }
    assert cited_symbols(text) == {
        ("vllm/v1/core/block_pool.py", "BlockPool"),
        ("vllm/v1/core/block_pool.py", "touch"),
        ("vllm/v1/core/sched/scheduler.py", "Scheduler"),
        ("vllm/_custom_ops.py", "reshape_and_cache_flash"),
    }
    assert all(defines(path, symbol) for path, symbol in cited_symbols(text))
    assert not path_exists("vllm/compilation/piecewise_backend.py")  # renamed after v0.11.0
    assert path_exists("vllm/compilation/piecewise_backend.py", FILES_TODAY)
    assert not path_exists("vllm/compilation/cuda_piecewise_backend.py", FILES_TODAY)
    assert not defines("vllm/v1/core/block_pool.py", "Scheduler")

    chapter = (
        "See vllm/v1/core/block_pool.py.\n\n## In vLLM today\n\n> moved from v0.11.0's "
        "`vllm/attention/layer.py` to `vllm/model_executor/layers/attention/attention.py`\n\n"
        "## Your turn\n\nvllm/v1/request.py\n"
    )
    rest, today = split_today(chapter)
    assert cited_paths(rest) == {"vllm/v1/core/block_pool.py", "vllm/v1/request.py"}
    assert OLD_PATH_RE.findall(today) == ["vllm/attention/layer.py"]
    assert cited_paths(OLD_PATH_RE.sub("", today)) == {"vllm/model_executor/layers/attention/attention.py"}
