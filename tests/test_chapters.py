"""The chapters cannot drift from the code: every reference, figure and notebook they name exists.

A chapter quotes code by reference (`nano_v1/core/block_pool.py::BlockPool.touch`),
never by a copy; this test resolves each reference with `ast` (no imports, so a chapter
about CUDA graphs is checked on a laptop too). The tests a chapter cites as evidence are
held to the same rule: `tests/test_x.py` must exist and `tests/test_x.py::test_name` must
define `test_name`. It also checks that each chapter opens with its box (files, notebook,
test marker; chapters/TEMPLATE.md), that every image it embeds and every notebook it names
is in the repository.
"""

from __future__ import annotations

import ast
import itertools
import json
import re
from pathlib import Path

import pytest
from helpers.chapters import expand_braces

pytestmark = pytest.mark.ch00

REPO_ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((REPO_ROOT / "chapters").glob("[0-9][0-9]-*.md"))

# The package, the checkout's top-level benchmarks/, examples/ and tools/, and notebooks/nb.py (not vLLM's
# own vllm/benchmarks/).
CODE_REF_RE = re.compile(
    r"(?<![\w/])((?:nano_v1|benchmarks|examples|tools|notebooks)/[\w/]+\.py)::([A-Za-z_][\w.]*[\w])"
)
CODE_SPAN_RE = re.compile(r"`([^`\n]+)`")
IMAGE_RE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)")
FIGURE_RE = re.compile(r"(?<![\w/.])(?:\.\./)?(figures/[\w./-]+\.(?:png|svg|jpg|json))")
# This checkout's tests: tests/<module>.py and tests/helpers/<module>.py, maybe with ::Symbol. vLLM's
# own tests, which chapters also cite, live deeper (tests/v1/core/...) and do not match.
TEST_REF_RE = re.compile(r"(?<![\w/])(tests/(?:helpers/)?\w+\.py)(?:::([A-Za-z_][\w.]*[\w]))?")
NOTEBOOK_RE = re.compile(r"(?<![\w/])notebooks/[\w.-]+\.(?:py|ipynb)")
BOX_RE = re.compile(
    r"> \*\*Files\*\*: (?P<files>.+) · \*\*Notebook\*\*: (?P<notebook>.+) · \*\*Run\*\*: (?P<run>.+)"
    r" · \*\*vLLM\*\*: v[\d.]+"
)


def scope_names(node: ast.AST) -> dict[str, ast.AST]:
    """Names a module or class body defines: defs, classes, assignments, imports; for a class
    also the `self.<name> = ...` attributes its methods set."""
    names: dict[str, ast.AST] = {}
    for child in node.body:
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[child.name] = child
        elif isinstance(child, (ast.Assign, ast.AnnAssign)):
            targets = child.targets if isinstance(child, ast.Assign) else [child.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        names[name.id] = child
        elif isinstance(child, (ast.Import, ast.ImportFrom)):
            for alias in child.names:
                names[(alias.asname or alias.name).split(".")[0]] = child
    if isinstance(node, ast.ClassDef):
        for attribute in ast.walk(node):
            if (
                isinstance(attribute, ast.Attribute)
                and isinstance(attribute.ctx, ast.Store)
                and isinstance(attribute.value, ast.Name)
                and attribute.value.id == "self"
            ):
                names.setdefault(attribute.attr, attribute)
    return names


def resolve(path: str, symbol: str) -> str | None:
    """None if `symbol` (maybe `Class.method`) is defined in `path`, else why not."""
    source = REPO_ROOT / path
    if not source.is_file():
        return f"{path} does not exist"
    node: ast.AST = ast.parse(source.read_text(encoding="utf-8"))
    for depth, part in enumerate(symbol.split(".")):
        if not isinstance(node, (ast.Module, ast.ClassDef)):
            return f"{'.'.join(symbol.split('.')[:depth])} in {path} is not a class"
        names = scope_names(node)
        if part not in names:
            return f"{path} defines no {'.'.join(symbol.split('.')[: depth + 1])}"
        node = names[part]
    return None


def resolve_test_reference(path: str, symbol: str) -> str | None:
    """None if the test module `path` exists and, when `symbol` is given, defines it; else why not."""
    if symbol:
        return resolve(path, symbol)
    return None if (REPO_ROOT / path).is_file() else f"{path} does not exist"


def chapter_id(chapter: Path) -> str:
    return chapter.name[:2]


@pytest.fixture(params=CHAPTERS, ids=[c.name for c in CHAPTERS])
def chapter(request) -> Path:
    return request.param


def test_there_are_chapters():
    assert CHAPTERS, "chapters/NN-slug.md files are missing"


def test_opens_with_heading_and_box(chapter):
    lines = [line for line in chapter.read_text(encoding="utf-8").splitlines() if line.strip()]
    number = chapter_id(chapter)
    assert lines[0].startswith(f"# {number} · "), (
        f"first line must be '# {number} · <title>', got {lines[0]!r}"
    )
    box = BOX_RE.fullmatch(lines[1])
    assert box, (
        f"second line must be the box '> **Files**: ... · **Notebook**: ... · **Run**: ... · **vLLM**: v...', "
        f"got {lines[1]!r}"
    )
    assert f"pytest -m ch{number}" in box["run"], f"the box's Run must name `pytest -m ch{number}`"
    assert "nano_v1/" in box["files"]
    for notebook in NOTEBOOK_RE.findall(box["notebook"]):
        assert Path(notebook).name.startswith(f"{number}_"), f"{notebook} is not chapter {number}'s notebook"


def test_code_references_resolve(chapter):
    text = chapter.read_text(encoding="utf-8")
    problems = [problem for path, symbol in CODE_REF_RE.findall(text) if (problem := resolve(path, symbol))]
    assert not problems, "\n".join(problems)


def test_test_references_resolve(chapter):
    """Every test module a chapter names exists, and every `tests/...py::name` it cites is defined there."""
    text = chapter.read_text(encoding="utf-8")
    problems = sorted(
        {
            problem
            for path, symbol in TEST_REF_RE.findall(text)
            if (problem := resolve_test_reference(path, symbol))
        }
    )
    assert not problems, f"{chapter.name} cites tests that do not exist:\n" + "\n".join(problems)


def test_named_paths_exist(chapter):
    """Every `nano_v1/...`, `benchmarks/...`, `tools/...` and `notebooks/...` path in a code span (braces expanded) and every notebook named."""
    text = chapter.read_text(encoding="utf-8")
    missing = []
    for span in CODE_SPAN_RE.findall(text):
        if span.startswith(("nano_v1/", "benchmarks/", "tools/", "notebooks/")):
            for path in expand_braces(span.split("::")[0]):
                if not (REPO_ROOT / path).exists():
                    missing.append(path)
    missing += [path for path in NOTEBOOK_RE.findall(text) if not (REPO_ROOT / path).is_file()]
    assert not missing, f"{chapter.name} names paths that do not exist: {sorted(set(missing))}"


def test_embedded_figures_exist(chapter):
    text = chapter.read_text(encoding="utf-8")
    missing = [src for src in IMAGE_RE.findall(text) if not (chapter.parent / src).resolve().is_file()]
    missing += [path for path in FIGURE_RE.findall(text) if not (REPO_ROOT / path).is_file()]
    assert not missing, f"{chapter.name} embeds figures that do not exist: {sorted(set(missing))}"


# ----------------------------------------------------------------------------- the checker itself


def test_resolve_finds_nested_symbols_and_reports_misses():
    path = "tests/test_chapters.py"  # this file, a module the checker can read like any other
    assert resolve(path, "resolve") is None
    assert resolve(path, "REPO_ROOT") is None
    assert resolve(path, "Path") is None  # imported names count: modules re-export
    assert resolve(path, "nope") == f"{path} defines no nope"
    assert resolve(path, "resolve.inner") == f"resolve in {path} is not a class"
    assert resolve("nano_v1/no_such.py", "X") == "nano_v1/no_such.py does not exist"
    assert resolve("nano_v1/core/block_pool.py", "BlockPool.touch") is None
    assert resolve("nano_v1/core/block_pool.py", "BlockPool.free_block_queue") is None  # self.<attr>
    assert resolve("nano_v1/core/block_pool.py", "BlockPool.nope").endswith("defines no BlockPool.nope")
    assert resolve_test_reference("tests/test_chapters.py", "") is None
    assert resolve_test_reference("tests/test_chapters.py", "test_there_are_chapters") is None
    assert resolve_test_reference("tests/test_no_such.py", "") == "tests/test_no_such.py does not exist"
    assert resolve_test_reference("tests/test_chapters.py", "test_renamed") == (
        "tests/test_chapters.py defines no test_renamed"
    )


def test_patterns_pick_out_what_chapters_write():
    text = (
        "See `nano_v1/core/block_pool.py::BlockPool.touch`. ![plot](../figures/02_x.png)\n"
        "`nano_v1/model_executor/models/{llama,qwen3}.py` and notebooks/02_paged_kv_cache.py, "
        "raw numbers in figures/data/02_x.json."
    )
    assert CODE_REF_RE.findall(text) == [("nano_v1/core/block_pool.py", "BlockPool.touch")]
    assert IMAGE_RE.findall(text) == ["../figures/02_x.png"]
    assert FIGURE_RE.findall(text) == ["figures/02_x.png", "figures/data/02_x.json"]
    assert NOTEBOOK_RE.findall(text) == ["notebooks/02_paged_kv_cache.py"]
    tests = (
        "`tests/test_kv_cache.py::test_free_queue_matches_list_model`, tests/helpers/scheduler.py::FakeModelRunner, "
        "`tests/test_llm.py`; vLLM's own `tests/v1/core/test_async_scheduler.py` is not ours."
    )
    assert TEST_REF_RE.findall(tests) == [
        ("tests/test_kv_cache.py", "test_free_queue_matches_list_model"),
        ("tests/helpers/scheduler.py", "FakeModelRunner"),
        ("tests/test_llm.py", ""),
    ]
    assert expand_braces("a/{b,c}.py") == ["a/b.py", "a/c.py"]


def test_no_reader_facing_file_cites_the_developers_notes():
    """Chapters, notebooks, the package and README are read without the project's internal
    notes (goals, map, style guide): they must state numbers and names themselves."""
    internal = re.compile(r"GOALS\.md|STYLE\.md|MAP\.md|\.\./shared")
    files = [REPO_ROOT / "README.md", *CHAPTERS]
    for folder, pattern in (("nano_v1", "*.py"), ("benchmarks", "*.py"), ("tools", "*.py"), ("notebooks", "*.py")):
        files += sorted((REPO_ROOT / folder).rglob(pattern))
    cited = [
        f"{path.relative_to(REPO_ROOT)}:{n}"
        for path in files
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        if internal.search(line)
    ]
    assert not cited, "files a reader has cite notes a reader does not have:\n" + "\n".join(cited)


# Chapter 00's map: "| `core/block_pool.py`, `core/{a,b}.py`, `multimodal/` (...) | vLLM | chapters |".
MAP_HEADER = "| nano_v1 | vLLM | chapter |"
MAP_PATH_RE = re.compile(r"[\w/{},.]+(?:\.py|/)")
PARENTHESES_RE = re.compile(r"\([^()]*\)")  # a description: (`LLM`, `LLM.generate`), (`inputs.py`, ...)


def map_paths(chapter_text: str) -> list[str]:
    """The nano_v1 paths (relative to nano_v1/) of the map's first column, braces expanded."""
    lines = chapter_text.split(MAP_HEADER + "\n", 1)[1].splitlines()
    rows = list(itertools.takewhile(lambda line: line.startswith("|"), lines))[1:]  # past "| --- |"
    return [
        path
        for row in rows
        for span in CODE_SPAN_RE.findall(PARENTHESES_RE.sub("", row.split("|")[1]))
        if MAP_PATH_RE.fullmatch(span)
        for path in expand_braces(span)
    ]


def defines_code(module: Path) -> bool:
    """A module defines a function or a class (a package that only re-exports does not)."""
    tree = ast.parse(module.read_text(encoding="utf-8"))
    return any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for node in tree.body)


def test_chapter_00_map_lists_every_module_and_only_modules_that_exist():
    """Every path in the map exists under nano_v1/, and every module that defines a function or
    a class is in it, named or under a directory it names."""
    listed = map_paths((REPO_ROOT / "chapters" / "00-why-v1.md").read_text(encoding="utf-8"))
    package = REPO_ROOT / "nano_v1"
    missing = [path for path in listed if not (package / path).exists()]
    assert not missing, f"chapter 00's map names paths that do not exist under nano_v1/: {missing}"
    directories = tuple(path for path in listed if path.endswith("/"))
    unlisted = [
        relative
        for module in sorted(package.rglob("*.py"))
        if defines_code(module)
        and (relative := module.relative_to(package).as_posix()) not in listed
        and not relative.startswith(directories)
    ]
    assert not unlisted, f"modules missing from chapter 00's map: {unlisted}"


def test_map_paths_reads_the_first_column():
    text = (
        f"{MAP_HEADER}\n| --- | --- | --- |\n"
        "| `core/{a,b}.py`, `x.py` (`X`, `y.py`) | `vllm/v1/core/` | 02 |\n"
        "| `multimodal/` | `vllm/multimodal/` | 11 |\n"
        "\n| `after.py` |\n"
    )
    assert map_paths(text) == ["core/a.py", "core/b.py", "x.py", "multimodal/"]


# Chapter 13's counts: "161 all-reduces", "162 collectives", "162 of them at 10 µs".
COUNT_RE = re.compile(r"(\d+)\s+(all-reduces|collectives|of\s+them)(\s+at\s+\d+\s+µs)?")


def tensor_parallel_counts(record: dict) -> tuple[set[int], set[int]]:
    """(all-reduces, collectives) per decode step that figures/data/13_tensor_parallel.json holds:
    the predicted models' collectives (their fixed cost over the link's latency; one of them is
    the logits' all-gather, the rest all-reduces) and the CPU models' `2 x layers + 1` all-reduces."""
    latency_s = record["link"]["latency_s"]
    collectives = {
        round(row["comm_latency_s"] / latency_s)
        for rows in record["predictions"].values()
        for row in rows
        if row["tp_size"] > 1
    }
    all_reduces = {count - 1 for count in collectives}
    all_reduces |= {2 * shape["num_hidden_layers"] + 1 for shape in record["cpu_models"].values()}
    return all_reduces, collectives


def wrong_counts(text: str, all_reduces: set[int], collectives: set[int]) -> list[str]:
    """Counts in `text` the JSON does not give: a count charged at a latency ('N ... at 10 µs') is
    one of collectives, 'N collectives' too, 'N all-reduces' one of all-reduces."""
    wrong = []
    for match in COUNT_RE.finditer(text):
        count, kind, at_latency = int(match[1]), match[2], bool(match[3])
        if at_latency or kind == "collectives":
            if count not in collectives:
                wrong.append(f"{match[0]!r}: collectives per step are {sorted(collectives)}")
        elif kind == "all-reduces" and count not in all_reduces:
            wrong.append(f"{match[0]!r}: all-reduces per step are {sorted(all_reduces)}")
    return wrong


def test_chapter_13_counts_the_collectives_its_json_counts():
    record = json.loads((REPO_ROOT / "figures" / "data" / "13_tensor_parallel.json").read_text())
    all_reduces, collectives = tensor_parallel_counts(record)
    text = (REPO_ROOT / "chapters" / "13-tensor-parallel.md").read_text(encoding="utf-8")
    problems = wrong_counts(text, all_reduces, collectives)
    assert not problems, "chapter 13 quotes counts its JSON does not give:\n" + "\n".join(problems)


def test_wrong_counts_reads_what_chapter_13_writes():
    text = "161 all-reduces of 1 MiB; 161 of them at 10 µs; its 162 collectives at 10 µs; 9 all-reduces; 8 of them"
    assert wrong_counts(text, {161, 9}, {162}) == ["'161 of them at 10 µs': collectives per step are [162]"]
    assert wrong_counts("and 17\nall-reduces", {161}, {162}) == ["'17\\nall-reduces': all-reduces per step are [161]"]


# A measurement's conditions are data too: a chapter that calls its run quiet, or quotes the load
# average, says what its JSON recorded, and cites no run the repository has no record of.
# Every chapter is audited for it (issue 31): where a notebook records no load, its chapter claims none.
LOAD_AUDITED_CHAPTERS = tuple(chapter_id(chapter) for chapter in CHAPTERS)
# The numbers right after it, decimals included (a "." ends the claim only when no digit follows).
LOAD_CLAIM_RE = re.compile(r"load\s+average(?:[^.;)]|\.(?=\d)){0,40}|quiet", re.IGNORECASE)
NUMBER_RE = re.compile(r"\d+(?:\.\d+)?")
UNRECORDED_RUN_RE = re.compile(r"one-off|(?:earlier|previous|other)\s+runs?\b|run\s+before\s+this\s+one", re.IGNORECASE)


def recorded_loads(text: str) -> list[float]:
    """The load averages (before and after) the figures/data JSONs that `text` cites record."""
    loads = []
    for path in sorted(set(FIGURE_RE.findall(text))):
        if path.startswith("figures/data/") and path.endswith(".json"):
            record = json.loads((REPO_ROOT / path).read_text())
            loads += record.get("load_average_before", []) + record.get("load_average_after", [])
    return loads


def unbacked_load_claims(text: str, loads: list[float]) -> list[str]:
    """Claims about the machine's load that `loads` does not back: any claim when nothing is
    recorded, and any number quoted after 'load average' that no recorded value rounds to."""
    problems = [f"{match[0]!r}: no run on record" for match in UNRECORDED_RUN_RE.finditer(text)]
    for match in LOAD_CLAIM_RE.finditer(text):
        claim = " ".join(match[0].split())
        if not loads:
            problems.append(f"{claim!r}: the JSONs cited record no load average")
        for number in NUMBER_RE.findall(claim):
            decimals = len(number.partition(".")[2])
            if not any(round(load, decimals) == float(number) for load in loads):
                problems.append(f"{claim!r}: {number} is not a recorded load average ({loads})")
    return problems


@pytest.mark.parametrize("number", LOAD_AUDITED_CHAPTERS)
def test_load_claims_are_recorded(number):
    (chapter,) = [c for c in CHAPTERS if chapter_id(c) == number]
    text = chapter.read_text(encoding="utf-8")
    problems = unbacked_load_claims(text, recorded_loads(text))
    assert not problems, f"{chapter.name} claims what no committed data records:\n" + "\n".join(problems)


def test_unbacked_load_claims_reads_what_chapters_write():
    text = "on a quiet 2-core CPU (load\naverage 0.45 before the run, 1.63 after), a one-off profile"
    assert unbacked_load_claims(text, [0.45166, 0.91, 1.62744]) == ["'one-off': no run on record"]
    assert unbacked_load_claims("load average 0.8 before", [0.45]) == [
        "'load average 0.8 before': 0.8 is not a recorded load average ([0.45])"
    ]
    assert unbacked_load_claims("a load average of 8 to 9", [0.45]) == [
        "'load average of 8 to 9': 8 is not a recorded load average ([0.45])",
        "'load average of 8 to 9': 9 is not a recorded load average ([0.45])",
    ]
    assert unbacked_load_claims("three rounds on a quiet machine", []) == [
        "'quiet': the JSONs cited record no load average"
    ]


def test_readme_references_resolve():
    """README cites code and tests as the chapters do (`nano_v1/x.py::Name`, `tests/test_x.py::test_y`):
    each must still resolve."""
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    problems = sorted(
        {problem for path, symbol in CODE_REF_RE.findall(text) if (problem := resolve(path, symbol))}
        | {problem for path, symbol in TEST_REF_RE.findall(text) if (problem := resolve_test_reference(path, symbol))}
    )
    assert not problems, "README.md cites what does not exist:\n" + "\n".join(problems)
