"""Every vLLM path and symbol that nano_v1 cites exists in vLLM v0.11.0, the release it mirrors.

The oracle is v0.11.0's own source tree, read once by tests/vllm_v0_11_0/make_manifest.py
into tests/vllm_v0_11_0/manifest.json (its files, and what each .py defines); no vLLM is
needed here. Checked: every `vllm/...` path in nano_v1's sources, the chapters and the
README; every symbol cited as `vllm/x.py::Symbol`, as `vllm/x.py (`A`, `B`)` or as
"`A` in vllm/x.py"; that each nano_v1 module's docstring says which vLLM module it
mirrors (or that it has none); and that each chapter's box names the release.

Names, too: every public function and public method of a module that says "Mirrors
vllm/..." is defined in that v0.11.0 file (a function there, or the same Class.method; in
any of the files, for a module that mirrors several), unless `OWN_NAMES` below lists it as
nano_v1's own, with the reason.

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


# Public names of mirroring modules that their v0.11.0 files do not define: nano_v1's own, and why
# (module -> name -> reason).
OWN_NAMES: dict[str, dict[str, str]] = {
    "nano_v1/attention/backends/flash_attn.py": {
        "triton_attention_ops": "our Triton kernels stand in for vLLM's FlashAttention ops",
        "get_num_sms": (
            "vLLM reads the SM count in vllm/utils/deep_gemm.py; the backend's split plan needs it here"
        ),
        "FlashAttentionImpl.get_attention_ops": (
            "picks the kernels (Triton's or the reference), where vLLM calls FlashAttention's"
        ),
    },
    "nano_v1/attention/backends/triton_attn.py": {
        "TritonAttentionMetadataBuilder.use_cascade_attention": (
            "v0.11.0 has it on TritonAttentionBackend (always False there); ours runs cascade"
        ),
    },
    "nano_v1/attention/layer.py": {
        "Attention.attend_into": (
            "the layer's op body, which v0.11.0 spreads over unified_attention_with_output"
        ),
    },
    "nano_v1/attention/ops/reference.py": {
        "plan_batch_split": "teaching reference kernel: the split plan in plain PyTorch",
    },
    "nano_v1/compilation/backends.py": {
        "op_name": "names a graph's splitting op; v0.11.0's splits by op string inline",
        "compile_pieces_with_inductor": (
            "v0.11.0 compiles each piece inside PiecewiseBackend via CompilerManager"
        ),
    },
    "nano_v1/compilation/cuda_graph.py": {
        "GraphPool.create": (
            "the graph memory pool, which v0.11.0 keeps in current_platform.get_global_graph_pool"
        ),
        "weak_ref_tensor": "v0.11.0 has it in vllm/utils/__init__.py (a C++ op there)",
        "weak_ref_tensors": "v0.11.0 has it in vllm/utils/__init__.py",
        "tensor_addresses": "the replay-time address check, a debug aid vLLM keeps inline",
        "CUDAGraphWrapper.capture": "the halves of v0.11.0's CUDAGraphWrapper.__call__",
        "CUDAGraphWrapper.replay": "the halves of v0.11.0's CUDAGraphWrapper.__call__",
    },
    "nano_v1/config/compilation.py": {
        "CompilationConfig.from_arg": (
            "LLM(compilation_config=...) accepts an int, a dict or JSON; vLLM parses it in EngineArgs"
        ),
        "CompilationConfig.resolve": "what v0.11.0's VllmConfig.__post_init__ settles for compilation",
        "CompilationConfig.pad_for_cudagraph": "v0.11.0 has it on VllmConfig (vllm/config/__init__.py)",
    },
    "nano_v1/config/model.py": {
        "default_model": "the bundled demo checkpoint; vLLM defaults to a Hub model id",
    },
    "nano_v1/config/scheduler.py": {
        "SchedulerConfig.resolve": (
            "what v0.11.0's SchedulerConfig.__post_init__ does, once max_model_len is known"
        ),
        "SchedulerConfig.resolve_encoder_budget": (
            "v0.11.0's compute_encoder_budget, settled once in the config"
        ),
    },
    "nano_v1/config/speculative.py": {
        "SpeculativeConfig.from_dict": (
            "LLM(speculative_config=...) as a dict or JSON; vLLM builds it in EngineArgs"
        ),
    },
    "nano_v1/config/utils.py": {
        "check_positive_int": "field checks that vLLM leaves to pydantic",
        "config_from_dict": (
            "a whole config given as a dict or JSON (speculative_config, kv_transfer_config); vLLM parses "
            "them with pydantic in EngineArgs"
        ),
    },
    "nano_v1/core/kv_cache_coordinator.py": {
        "UnitaryKVCacheCoordinator.get_num_blocks_to_allocate": (
            "with one group, the call goes to the manager without v0.11.0's loop over groups (issue 27's cost)"
        ),
        "UnitaryKVCacheCoordinator.save_new_computed_blocks": (
            "with one group, the call goes to the manager without v0.11.0's loop over groups (issue 27's cost)"
        ),
        "UnitaryKVCacheCoordinator.allocate_new_blocks": (
            "with one group, the call goes to the manager without v0.11.0's loop over groups (issue 27's cost)"
        ),
        "UnitaryKVCacheCoordinator.cache_blocks": (
            "with one group, the call goes to the manager without v0.11.0's loop over groups (issue 27's cost)"
        ),
    },
    "nano_v1/core/kv_cache_manager.py": {
        "KVCacheManager.record_prefix_cache_stats": (
            "counts a lookup once the request is admitted (v0.11.0 counts per attempt, in "
            "get_computed_blocks)"
        ),
    },
    "nano_v1/core/kv_cache_utils.py": {
        "get_num_blocks_per_request": (
            "the max-concurrency arithmetic inline in v0.11.0's get_max_concurrency_for_kv_cache_config"
        ),
    },
    "nano_v1/core/sched/scheduler.py": {
        "Scheduler.has_unfinished_requests": (
            "v0.11.0 has it on SchedulerInterface (vllm/v1/core/sched/interface.py)"
        ),
        "Scheduler.has_requests": "v0.11.0 has it on SchedulerInterface (vllm/v1/core/sched/interface.py)",
    },
    "nano_v1/cudagraph_dispatcher.py": {
        "CudagraphDispatcher.get_capture_descriptors": (
            "the capture order, which v0.11.0's runner builds in capture_model"
        ),
    },
    "nano_v1/distributed/device_communicators/shm_broadcast.py": {
        "ShmRingBuffer.close": "an explicit close, where v0.11.0 relies on __del__",
        "MessageQueue.close": "an explicit close, where v0.11.0 relies on __del__",
    },
    "nano_v1/engine/arg_utils.py": {
        "EngineArgs.from_kwargs": "LLM(**kwargs) rejects unknown names with the list of known ones",
        "EngineArgs.config_kwargs": "builds a config from the fields get_field tagged with it",
    },
    "nano_v1/engine/async_llm.py": {
        "AsyncLLM.end_requests": "ends open requests with an error on a forced shutdown, our hardening",
        "AsyncLLM.run_in_tokenizer_thread": (
            "tokenizer work off the event loop; v0.11.0's uses an AsyncMicrobatchTokenizer in the server"
        ),
        "AsyncLLM.get_num_unfinished_requests": "v0.11.0 has it on LLMEngine only; the server's tests ask it",
    },
    "nano_v1/engine/core.py": {
        "EngineCore.get_kv_cache_usage": "the tests' leak probe across the process boundary (call_utility)",
        "EngineCore.get_num_unfinished_requests": (
            "the in-process client's count, which v0.11.0 asks the scheduler for"
        ),
    },
    "nano_v1/engine/core_client.py": {
        "EngineCoreClient.call_utility": "v0.11.0 has it on SyncMPClient only; ours on every client",
        "InprocClient.call_utility": "v0.11.0 has it on SyncMPClient only; ours on every client",
        "AsyncMPClient.shutdown": "v0.11.0's is MPClient.shutdown, which AsyncMPClient inherits",
        "BackgroundResources.death_error": "the core's cause of death in the error; v0.11.0's says see the log",
    },
    "nano_v1/engine/detokenizer.py": {
        "find_stop_string": "finds only; v0.11.0's check_stop_strings also truncates",
    },
    "nano_v1/engine/llm_engine.py": {
        "fan_out": "n > 1 as n requests, which v0.11.0 does inside add_request with ParentRequest",
        "LLMEngine.process_request": (
            "the halves of v0.11.0's LLMEngine.add_request, so LLM can validate a batch before adding any"
        ),
        "LLMEngine.add_processed_request": "the halves of v0.11.0's LLMEngine.add_request",
        "LLMEngine.shutdown": "stops the engine core at once; v0.11.0 waits for garbage collection",
    },
    "nano_v1/engine/output_processor.py": {
        "ParentRequest.finished": (
            "v0.11.0 tracks finished children in ParentRequest.observe_finished_request"
        ),
        "RequestState.visible_text": (
            "holds back a possible stop string's prefix, inline in v0.11.0's detokenizer"
        ),
    },
    "nano_v1/engine/processor.py": {
        "load_tokenizer": "v0.11.0 loads it in vllm/transformers_utils/tokenizer.py",
        "max_prompt_chars": "a bound on a prompt's length in characters before tokenizing, our own guard",
        "Processor.tokenize": "v0.11.0 tokenizes in its InputPreprocessor (vllm/inputs/preprocess.py)",
    },
    "nano_v1/entrypoints/launcher.py": {
        "IdleTimeoutH11Protocol.data_received": "bounds how long a request takes to arrive, our hardening",
        "IdleTimeoutH11Protocol.connection_lost": "bounds how long a request takes to arrive, our hardening",
        "end_open_requests": "a second Ctrl-C ends open streams cleanly, our hardening",
        "IdleTimeoutH11Protocol.connection_made": (
            "closes idle connections, our hardening of uvicorn's protocol"
        ),
        "create_server_socket": "v0.11.0 has it in vllm/entrypoints/openai/api_server.py",
    },
    "nano_v1/entrypoints/llm.py": {
        "LLM.from_engine_args": "v0.11.0 has from_engine_args on LLMEngine and AsyncLLM, not LLM",
    },
    "nano_v1/entrypoints/openai/api_server.py": {
        "metrics": "the /metrics route, which v0.11.0 mounts from prometheus_client",
        "validation_exception_handler": "v0.11.0 defines it inside build_app, out of the manifest's sight",
        "http_exception_handler": "v0.11.0 defines it inside build_app, out of the manifest's sight",
        "make_stat_loggers": "the server's stat loggers, which v0.11.0 builds in AsyncLLM",
        "default_served_model_name": "v0.11.0 derives it in its CLI arguments",
        "install_signal_handlers": "graceful shutdown, which v0.11.0 leaves to uvicorn",
    },
    "nano_v1/entrypoints/openai/serving_engine.py": {
        "usage_info": "the usage block both endpoints answer with; v0.11.0 builds UsageInfo inline in each",
    },
    "nano_v1/entrypoints/openai/protocol.py": {
        "CompletionRequest.prompts": "the prompt field as a batch; v0.11.0 parses it in serving_completion",
        "SamplingRequest.num_logprobs": "a base class of the two requests, which v0.11.0 does not share",
        "SamplingRequest.to_sampling_params": (
            "a base class of the two requests, which v0.11.0 does not share"
        ),
        "CompletionRequest.num_logprobs": "v0.11.0 reads request.logprobs inline",
        "ChatCompletionRequest.num_logprobs": "v0.11.0 reads request.top_logprobs inline",
        "SamplingRequest.num_prompt_logprobs": "v0.11.0 reads request.prompt_logprobs inline in to_sampling_params",
        "CompletionRequest.num_prompt_logprobs": "v0.11.0 reads request.prompt_logprobs (or, with echo, logprobs) inline",
        "random_id": "v0.11.0 uses random_uuid from vllm/utils/__init__.py",
    },
    "nano_v1/envs.py": {
        "http_timeout_request_s": "nano_v1's own NANO_V1_HTTP_TIMEOUT_REQUEST (how long a request may take to arrive)",
        "enable_v1_multiprocessing": "v0.11.0: the attribute envs.VLLM_ENABLE_V1_MULTIPROCESSING",
        "worker_multiproc_method": "v0.11.0: the attribute envs.VLLM_WORKER_MULTIPROC_METHOD",
        "attention_backend": "v0.11.0: the attribute envs.VLLM_ATTENTION_BACKEND",
        "rpc_timeout_s": "v0.11.0: the attribute envs.VLLM_RPC_TIMEOUT",
        "api_key": "v0.11.0: the attribute envs.VLLM_API_KEY",
        "log_stats_interval_s": "v0.11.0: the attribute envs.VLLM_LOG_STATS_INTERVAL",
        "http_timeout_keep_alive_s": "v0.11.0: the attribute envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE",
    },
    "nano_v1/executor/abstract.py": {
        "Executor.check_health": "v0.11.0 has it on ExecutorBase (vllm/executor/executor_base.py)",
        "Executor.shutdown": "v0.11.0 has it on ExecutorBase (vllm/executor/executor_base.py)",
    },
    "nano_v1/metrics/reader.py": {
        "prefix_cache_metrics": (
            "reads a snapshot for the notebooks; v0.11.0's reader stops at get_metrics_snapshot"
        ),
        "spec_decoding_metrics": (
            "reads a snapshot for the notebooks; v0.11.0's reader stops at get_metrics_snapshot"
        ),
        "spec_decoding_stats_from_metrics": (
            "reads a snapshot for the notebooks; v0.11.0's reader stops at get_metrics_snapshot"
        ),
    },
    "nano_v1/metrics/stats.py": {
        "PrefixCacheStats.add": "sums intervals; v0.11.0 sums them in its loggers",
    },
    "nano_v1/spec_decode/metrics.py": {
        "SpecDecodingStats.add": "sums intervals; v0.11.0 sums them in SpecDecodingLogging",
        "SpecDecodingStats.acceptance_rate": "v0.11.0 computes it in SpecDecodingLogging.log",
        "SpecDecodingStats.mean_acceptance_length": "v0.11.0 computes it in SpecDecodingLogging.log",
    },
    "nano_v1/model_executor/layers/activation.py": {
        "SiluAndMul.forward": "nn.Module.forward; v0.11.0's CustomOp has forward_native",
        "GeluAndMul.forward": "nn.Module.forward; v0.11.0's CustomOp has forward_native",
        "QuickGELU.forward": "nn.Module.forward; v0.11.0's CustomOp has forward_native",
    },
    "nano_v1/model_executor/layers/layernorm.py": {
        "RMSNorm.forward": "nn.Module.forward; v0.11.0's CustomOp has forward_native",
    },
    "nano_v1/model_executor/layers/rotary_embedding.py": {
        "RotaryEmbedding.forward": "nn.Module.forward; v0.11.0's CustomOp has forward_native",
    },
    "nano_v1/model_executor/layers/vocab_parallel_embedding.py": {
        "VocabParallelEmbedding.forward": "nn.Module.forward; v0.11.0's CustomOp has forward_native",
    },
    "nano_v1/model_executor/layers/linear.py": {
        "LinearBase.weight_loader": "one loader on the base, where v0.11.0 has one per subclass",
        "LinearBase.forward": "one forward on the base, where v0.11.0 has one per subclass",
        "LinearBase.extra_repr": "one extra_repr on the base, where v0.11.0 has one per subclass",
    },
    "nano_v1/model_executor/model_loader.py": {
        "check_shape": "the loader's shape check, inline in v0.11.0's weight loaders",
        "load_stacked_weights": "the stacked-parameter loop each v0.11.0 model writes in its load_weights",
    },
    "nano_v1/model_executor/models/clip.py": {
        "CLIPVisionModel.is_unused_weight": (
            "skips the checkpoint tensors of layers we do not build, inline in v0.11.0's load_weights"
        ),
    },
    "nano_v1/model_executor/models/gemma3.py": {
        "get_gemma3_rope_config": "the RoPE settings v0.11.0's Gemma3Attention reads inline",
    },
    "nano_v1/model_executor/models/llama.py": {
        "get_rope_config": "the RoPE settings v0.11.0's LlamaAttention reads inline",
        "LlamaAttention.projection_biases": (
            "a hook for the Qwen2 subclass; v0.11.0's models each write their attention"
        ),
        "LlamaAttention.normalize_qk": (
            "a hook for the Qwen3 subclass; v0.11.0's models each write their attention"
        ),
    },
    "nano_v1/model_executor/models/qwen2.py": {
        "Qwen2Attention.projection_biases": "a hook of our Llama attention; v0.11.0's Qwen2 writes its own",
    },
    "nano_v1/model_executor/models/qwen3.py": {
        "Qwen3Attention.normalize_qk": "a hook of our Llama attention; v0.11.0's Qwen3 writes its own",
    },
    "nano_v1/model_executor/models/llava.py": {
        "LlavaProcessingInfo.get_num_image_tokens": "v0.11.0 has it on BaseLlavaProcessingInfo",
        "LlavaProcessingInfo.get_mm_max_tokens_per_item": (
            "v0.11.0 has it on BaseProcessingInfo (vllm/multimodal/processing.py)"
        ),
        "LlavaMultiModalProcessor.get_placeholder_token_id": (
            "v0.11.0 finds the placeholder through its prompt updates"
        ),
    },
    "nano_v1/multimodal/processing.py": {
        "BaseMultiModalProcessor.get_placeholder_token_id": (
            "v0.11.0 finds the placeholder through its prompt updates"
        ),
    },
    "nano_v1/request.py": {
        "Request.output_token_ids": "a read-only view; v0.11.0 sets the attribute in Request.__init__",
        "Request.all_token_ids": "a read-only view; v0.11.0 sets the attribute in Request.__init__",
        "Request.update_block_hashes": "v0.11.0 extends block_hashes inline in append_output_token_ids",
    },
    "nano_v1/sampling_params.py": {
        "SamplingParams.greedy": "v0.11.0 asks sampling_type == SamplingType.GREEDY",
    },
    "nano_v1/spec_decode/metadata.py": {
        "SpecDecodeMetadata.max_spec_len": "v0.11.0 stores it as a field; ours is derived",
        "segment_arange": "teaching helper of calc_spec_decode_metadata",
        "calc_spec_decode_metadata": "v0.11.0 has it as GPUModelRunner._calc_spec_decode_metadata",
    },
    "nano_v1/spec_decode/ngram_proposer.py": {
        "find_ngram_drafts": "a batched NumPy search, where v0.11.0 runs a numba kernel per request",
    },
    "nano_v1/utils.py": {
        "start_process": "starts a daemon process with a readable name; v0.11.0 does it inline",
        "exit_when_parent_dies": "a child's watchdog on its parent; v0.11.0 relies on its process monitor",
        "describe_exit": "says how a dead worker ended, for the error; v0.11.0 logs only that one died",
        "use_mp_temp_dir_in": "a killed engine core's pymp-* directory goes with the client's IPC directory",
    },
    "nano_v1/worker/gpu_input_batch.py": {
        "CachedRequestState.from_new_request": "v0.11.0 builds it inline in GPUModelRunner._update_states",
        "CachedRequestState.num_prompt_tokens": "v0.11.0 sets it as a field in __post_init__",
        "InputBatch.sampling_metadata_for_step": (
            "drops discarded rows' generators; v0.11.0 does it in the runner"
        ),
    },
    "nano_v1/worker/gpu_worker.py": {
        "Worker.start_step_timing": "the step timing the scheduler-overhead measurement reads",
        "Worker.stop_step_timing": "the step timing the scheduler-overhead measurement reads",
        "StepTimer.execute_model": "the benchmarks' step timer, nano_v1's own (start_step_timing)",
        "StepTimer.execute_mm_encoder": "the benchmarks' step timer, nano_v1's own (start_step_timing)",
        "StepTimer.remove": "the benchmarks' step timer, nano_v1's own (start_step_timing)",
    },
}
# Packages whose public names are all nano_v1's own.
OWN_PACKAGES: dict[str, str] = {
    "nano_v1/benchmarks/": "the course's measurement harness around vLLM's benchmark entry points",
}


def mirrored_files(docstring: str) -> list[str]:
    """The v0.11.0 .py files the docstring's "Mirrors ..." paragraph names (a directory: its files)."""
    paragraph = next((p for p in docstring.split("\n\n") if "Mirrors" in p and cited_paths(p)), "")
    paths = cited_paths(paragraph)
    return sorted(
        file
        for file in SYMBOLS
        if any(file.startswith(path) if path.endswith("/") else file == path for path in paths)
    )


def public_names(tree: ast.Module) -> list[str]:
    """Module-level public functions, and Class.method for the public methods of public classes."""
    names = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            names.append(node.name)
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            names += [
                f"{node.name}.{member.name}"
                for member in node.body
                if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef))
                and not member.name.startswith("_")
            ]
    return names


def resolves(files: list[str], name: str) -> bool:
    """A function resolves to a function or a method there; a method to the same Class.method."""
    if "." in name:
        return any(name in SYMBOLS[file] for file in files)
    return any(defines(file, name) for file in files)


def checked_and_unresolved() -> tuple[int, set[str]]:
    """(how many public names were checked, the `path::name`s that do not resolve)."""
    checked, unresolved = 0, set()
    for source in SOURCES:
        where = relative(source)
        if where.startswith(tuple(OWN_PACKAGES)):
            continue
        tree = ast.parse(source.read_text(encoding="utf-8"))
        files = mirrored_files(ast.get_docstring(tree) or "")
        if not files:
            continue
        for name in public_names(tree):
            checked += 1
            if not resolves(files, name):
                unresolved.add(f"{where}::{name}")
    return checked, unresolved


def test_public_names_of_mirroring_modules_are_v0_11_0s():
    checked, unresolved = checked_and_unresolved()
    assert checked > 300, "the check saw almost no public names: has the docstring style changed?"
    own = {f"{module}::{name}" for module, names in OWN_NAMES.items() for name in names}
    unexplained = sorted(unresolved - own)
    assert not unexplained, (
        f"public names that vLLM {VERSION} does not define in the file their module mirrors; use "
        "v0.11.0's name, or list the name in OWN_NAMES with the reason it is nano_v1's own:\n"
        + "\n".join(unexplained)
    )
    stale = sorted(own - unresolved)
    assert not stale, "OWN_NAMES entries that resolve now, or no longer exist:\n" + "\n".join(stale)
    assert all(reason.strip() for names in OWN_NAMES.values() for reason in names.values())


def test_the_name_check_resolves_what_it_should():
    files = mirrored_files("Mirrors vllm/v1/core/sched/scheduler.py (chapter 04).")
    assert files == ["vllm/v1/core/sched/scheduler.py"]
    assert resolves(files, "Scheduler.schedule") and not resolves(files, "Scheduler.plan")
    assert not resolves(files, "KVCacheManager.schedule")  # a method needs its own class
    directory = mirrored_files("Mirrors vllm/v1/sample/logits_processor/.")
    assert "vllm/v1/sample/logits_processor/builtin.py" in directory
    tree = ast.parse(
        "def f(): ...\ndef _g(): ...\n"
        "class A:\n    def m(self): ...\n    def _n(self): ...\n"
        "class _B:\n    def m(self): ...\n"
    )
    assert public_names(tree) == ["f", "A.m"]

