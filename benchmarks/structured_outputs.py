"""Structured outputs measured: the bitmask's cost per step, grammar compile time, throughput, whitespace.

Mirrors the measurements of vLLM's top-level benchmarks/benchmark_serving_structured_output.py
(chapter 15). Needs a source checkout (`pip install .` installs only nano_v1): imported from its root.

Why it exists: chapter 15 claims that a grammar costs a decode step little, because xgrammar
decides most tokens when it compiles and a step only looks up one packed row per request.
Four measurements test that, each repeated (min / median / max of the repeats):
  - `measure_bitmask_cost`: per step, the scheduler's side (`StructuredOutputManager.grammar_bitmask`,
    one row per request) and the runner's (`apply_grammar_bitmask`, -inf where a bit is clear),
    against the batch size and the vocabulary: the demo model's 4096 tokens and synthetic
    byte-level vocabularies of 32,768 and 151,936 (Qwen's size) built by `synthetic_vocab`.
    Every request walks a valid JSON document, token by token, so the rows come from the
    states a real output passes through.
  - `measure_compile_time`: a grammar compiled by a fresh compiler (cold) and the same key again (cached).
  - `measure_throughput`: output tokens/s of the demo model with and without a constraint; the
    unconstrained peer also runs with each request's output length set to the constrained one's.
  - `measure_whitespace`: under a JSON grammar that allows any whitespace, how often a code
    model fills `max_tokens` with indentation; against `disable_any_whitespace` and a
    `whitespace_pattern`.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from nano_v1 import LLM
from nano_v1.benchmarks.utils import spread
from nano_v1.core.sched.output import CachedRequestData, SchedulerOutput
from nano_v1.demo_model import DEMO_MODEL_PATH
from nano_v1.engine.arg_utils import EngineArgs
from nano_v1.engine.processor import load_tokenizer
from nano_v1.request import Request
from nano_v1.sampling_params import SamplingParams, StructuredOutputsParams
from nano_v1.structured_output import StructuredOutputManager
from nano_v1.structured_output.backend_types import StructuredOutputOptions
from nano_v1.structured_output.backend_xgrammar import XGRAMMAR_CACHE_MB, XgrammarBackend
from nano_v1.structured_output.utils import apply_grammar_bitmask, choice_as_grammar

DEMO_VOCAB_SIZE = 4096
# A nested object whose every string is bounded: under it an output must end (or hit max_tokens).
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
        },
        "kind": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "tags", "address", "kind"],
}
# Python-like assignment lines, 4 to 8 of them: long enough that decode steps, not the prefill, dominate.
REGEX = r"([a-z_]{2,10} = [0-9]{1,4}\n){4,8}"
CHOICES = ["positive", "negative", "neutral", "mixed"]
# What each kind compiles from (`compile_grammar`'s arguments); a choice reaches the backend as a grammar.
COMPILE_KINDS: dict[str, tuple[StructuredOutputOptions, str]] = {
    "json (nested schema)": (StructuredOutputOptions.JSON, json.dumps(PERSON)),
    "regex": (StructuredOutputOptions.REGEX, REGEX),
    "choice (4 words)": (StructuredOutputOptions.GRAMMAR, choice_as_grammar(CHOICES)),
    "json_object": (StructuredOutputOptions.JSON_OBJECT, ""),
}
# Valid documents of PERSON, in the layout of a default (any-whitespace) output: the bitmask walk's paths.
DOCUMENTS = [
    {"name": "Ada", "age": 36, "tags": ["math"], "address": {"city": "London", "zip": "10001"}, "kind": "cat"},
    {"name": "Linus T", "age": 54, "tags": [], "address": {"city": "Helsinki", "zip": "00100"}, "kind": "dog"},
    {"name": "x", "age": 0, "tags": ["a", "bb", "ccc"], "address": {"city": "", "zip": "99999"}, "kind": "dog"},
]
PROMPTS = ["def parse(line):", "class Config:", "import json\n", "def main():\n", "# a user record\n",
           "data = ", "async def fetch(url):", "from typing import Any\n"]  # fmt: skip
# Characters of a synthetic token beyond its first byte: mostly letters, then spaces, digits, code punctuation.
_SYNTHETIC_ALPHABET = (
    b"abcdefghijklmnopqrstuvwxyz" * 4 + b"ABCDEFGHIJKLMNOPQRSTUVWXYZ" + b"0123456789" + b" " * 16
    + b"_.,:;()[]{}\"'=+-*/#\n\t"
)  # fmt: skip
SYNTHETIC_EOS = b"<|endoftext|>"

BATCH_SIZES = (1, 4, 16, 64)
VOCAB_SIZES = (DEMO_VOCAB_SIZE, 32768, 151936)
NUM_STEPS = 96  # timed steps per cell and repeat: more than a document's tokens, so every state is met
REPEATS = 3
COMPILE_REPEATS = 5
THROUGHPUT_NUM_PROMPTS = 64
THROUGHPUT_REPEATS = 5
THROUGHPUT_MAX_TOKENS = 128
WHITESPACE_NUM_REQUESTS = 64
WHITESPACE_MAX_TOKENS = 128
WHITESPACE_REPEATS = 2  # each with its own seeds
# The goal: constrained output tokens/s at least 80% of unconstrained.
GOAL = {"min_constrained_over_unconstrained": 0.80}
SMOKE = {
    "batch_sizes": (1, 4), "vocab_sizes": (1024, DEMO_VOCAB_SIZE), "num_steps": 3, "repeats": 1,
    "compile_repeats": 1, "throughput_repeats": 1, "throughput_num_prompts": 4, "throughput_max_tokens": 8,
    "whitespace_num_requests": 4, "whitespace_max_tokens": 16, "whitespace_repeats": 1,
}  # fmt: skip
FULL = {
    "batch_sizes": BATCH_SIZES, "vocab_sizes": VOCAB_SIZES, "num_steps": NUM_STEPS, "repeats": REPEATS,
    "compile_repeats": COMPILE_REPEATS, "throughput_repeats": THROUGHPUT_REPEATS,
    "throughput_num_prompts": THROUGHPUT_NUM_PROMPTS,
    "throughput_max_tokens": THROUGHPUT_MAX_TOKENS, "whitespace_num_requests": WHITESPACE_NUM_REQUESTS,
    "whitespace_max_tokens": WHITESPACE_MAX_TOKENS, "whitespace_repeats": WHITESPACE_REPEATS,
}  # fmt: skip



def machine_state() -> dict[str, Any]:
    """What else was running: torch's threads and the load average (1, 5, 15 min)."""
    return {"torch_num_threads": torch.get_num_threads(), "load_average": list(os.getloadavg())}


def bitmask_bytes(num_rows: int, vocab_size: int) -> int:
    """A step's bitmask: one int32 word per 32 tokens, one row per structured request."""
    return num_rows * -(-vocab_size // 32) * 4


# ---------------------------------------------------------------------------- vocabularies
@functools.cache
def synthetic_vocab(vocab_size: int, seed: int = 0) -> tuple[bytes, ...]:
    """`vocab_size` distinct byte strings: the 256 single bytes (so every text has a tokenization),
    random strings of 2-10 bytes from a code-like alphabet, and the EOS token last. Built once per size."""
    rng = np.random.default_rng(seed)
    tokens = [bytes([b]) for b in range(256)]
    seen = set(tokens)
    alphabet = np.frombuffer(_SYNTHETIC_ALPHABET, dtype=np.uint8)
    while len(tokens) < vocab_size - 1:
        lengths = rng.integers(2, 11, size=vocab_size)
        chars = alphabet[rng.integers(0, len(alphabet), size=(vocab_size, 10))]
        for row, length in zip(chars, lengths):
            token = row[:length].tobytes()
            if token not in seen and token != SYNTHETIC_EOS:
                seen.add(token)
                tokens.append(token)
                if len(tokens) == vocab_size - 1:
                    break
    return (*tokens, SYNTHETIC_EOS)


def greedy_encode(text: str, vocab: tuple[bytes, ...]) -> list[int]:
    """Longest-match tokenization of `text`'s UTF-8 bytes against `vocab` (every single byte is a token)."""
    index = {token: i for i, token in enumerate(vocab)}
    max_len = max(map(len, vocab))
    data, ids, pos = text.encode(), [], 0
    while pos < len(data):
        for length in range(min(max_len, len(data) - pos), 0, -1):
            token_id = index.get(data[pos : pos + length])
            if token_id is not None:
                ids.append(token_id)
                pos += length
                break
    return ids


@dataclass
class SyntheticVocabBackend(XgrammarBackend):
    """The xgrammar backend on a synthetic vocabulary: `tokenizer` is the list of its tokens'
    bytes (no Hugging Face tokenizer exists for it), the last one the EOS."""

    def __post_init__(self) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo(
            list(self.tokenizer), xgr.VocabType.RAW, vocab_size=self.vocab_size, stop_token_ids=[self.vocab_size - 1]
        )
        self.compiler = xgr.GrammarCompiler(
            info, max_threads=8, cache_enabled=True, cache_limit_bytes=XGRAMMAR_CACHE_MB * 2**20
        )


@dataclass
class Vocabulary:
    """A vocabulary to measure on: how to build a fresh backend on it, and how to tokenize text."""

    name: str
    vocab_size: int
    new_backend: Callable[[], XgrammarBackend]
    encode: Callable[[str], list[int]]
    eos_token_id: int


def demo_engine_config(max_num_seqs: int):
    return EngineArgs(model=str(DEMO_MODEL_PATH), max_num_seqs=max_num_seqs).create_engine_config()


def vocabulary(vocab_size: int, vllm_config) -> Vocabulary:
    """The demo model's tokenizer at 4096 tokens, a synthetic byte-level vocabulary otherwise."""
    if vocab_size == DEMO_VOCAB_SIZE:
        tokenizer = load_tokenizer(vllm_config.model_config)
        return Vocabulary(
            "demo tokenizer", vocab_size,
            lambda: XgrammarBackend(vllm_config, tokenizer=tokenizer, vocab_size=vocab_size),
            lambda text: tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id,
        )  # fmt: skip
    vocab = synthetic_vocab(vocab_size)
    return Vocabulary(
        "synthetic byte-level", vocab_size,
        lambda: SyntheticVocabBackend(vllm_config, tokenizer=vocab, vocab_size=vocab_size),
        lambda text: greedy_encode(text, vocab), vocab_size - 1,
    )  # fmt: skip


def document_paths(vocab: Vocabulary) -> list[list[int]]:
    """Each of `DOCUMENTS` as the tokens a default (any-whitespace) JSON output of PERSON would be, EOS last."""
    return [vocab.encode(json.dumps(doc)) + [vocab.eos_token_id] for doc in DOCUMENTS]


# ---------------------------------------------------------------------------- 1. the bitmask per step
def check_bitmask(vocab: Vocabulary) -> dict[str, Any]:
    """Before timing, what the walk relies on: every document is valid (jsonschema), its tokens decode
    back to it (synthetic vocabularies: by their bytes), xgrammar's matcher accepts them and ends at
    the EOS; and at every position, `apply_grammar_bitmask` leaves finite exactly the logits whose
    bit is set, a token xgrammar's matcher accepts among them (the document's next)."""
    import xgrammar as xgr

    backend = vocab.new_backend()
    ctx = backend.compiler.compile_json_schema(json.dumps(PERSON), any_whitespace=True)
    num_positions = 0
    for doc, path in zip(DOCUMENTS, document_paths(vocab)):
        assert is_valid(json.dumps(doc)), doc
        if isinstance(backend, SyntheticVocabBackend):
            assert b"".join(backend.tokenizer[t] for t in path[:-1]) == json.dumps(doc).encode()
        matcher = xgr.GrammarMatcher(ctx)
        bitmask = xgr.allocate_token_bitmask(1, vocab.vocab_size)
        for token in path:
            matcher.fill_next_token_bitmask(bitmask, 0)
            logits = torch.zeros(1, vocab.vocab_size)
            apply_grammar_bitmask(decode_step_output(bitmask.numpy(), {"r": 0}),
                                  types.SimpleNamespace(req_ids=["r"], req_id_to_index={"r": 0}), logits,
                                  torch.device("cpu"))  # fmt: skip
            bits = (bitmask.numpy().astype(np.int64)[0][:, None] >> np.arange(32)) & 1
            assert np.array_equal(torch.isfinite(logits[0]).numpy(), bits.reshape(-1)[: vocab.vocab_size] == 1)
            assert torch.isfinite(logits[0, token]) and matcher.accept_token(token)
            num_positions += 1
        assert matcher.is_terminated()
    backend.destroy()
    return {"vocab_size": vocab.vocab_size, "num_documents": len(DOCUMENTS), "num_positions_checked": num_positions}


def decode_step_output(grammar_bitmask: np.ndarray, structured_output_request_ids: dict[str, int]) -> SchedulerOutput:
    """A pure decode step of the structured requests (one token each, no drafts) with its bitmask."""
    req_ids = list(structured_output_request_ids)
    n = len(req_ids)
    return SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData(req_ids, [False] * n, [None] * n, [0] * n),
        num_scheduled_tokens=dict.fromkeys(req_ids, 1), total_num_scheduled_tokens=n,
        scheduled_spec_decode_tokens={}, num_common_prefix_blocks=[0], finished_req_ids=set(),
        structured_output_request_ids=structured_output_request_ids, grammar_bitmask=grammar_bitmask,
    )  # fmt: skip


def time_bitmask_steps(
    vocab: Vocabulary, vllm_config, batch_size: int, num_steps: int, seed: int
) -> dict[str, float]:
    """`batch_size` requests under PERSON, each walking a document of `document_paths` from its own
    offset (spread evenly over the document); per step, time the manager's bitmask and the runner's
    masking of [batch, vocab] float32 logits (and, as the memory floor of the latter, a plain copy
    of those logits). Means over the steps in µs: a row's cost depends on the parser's state (inside
    a string most tokens need a check), and the mean over a whole document is the cost per token."""
    manager = StructuredOutputManager(vllm_config)
    manager.backend = vocab.new_backend()
    paths = document_paths(vocab)
    kind = (StructuredOutputOptions.JSON, json.dumps(PERSON))  # compiled once, then from the cache
    requests: dict[str, Request] = {}
    position: dict[str, tuple[int, int]] = {}  # request -> (its document, tokens accepted)
    for i in range(batch_size):
        req_id = f"r{i}"
        params = SamplingParams(structured_outputs=StructuredOutputsParams(json=PERSON))
        request = Request(req_id, [1], params, eos_token_id=vocab.eos_token_id)
        request.structured_output_request.grammar = manager.backend.compile_grammar(*kind)
        path = paths[i % len(paths)]
        offset = (i * len(path) // batch_size + 5 * seed) % len(path)
        assert request.structured_output_request.grammar.accept_tokens(req_id, path[:offset])
        requests[req_id], position[req_id] = request, (i % len(paths), offset)
    ids = {req_id: i for i, req_id in enumerate(requests)}
    input_batch = types.SimpleNamespace(req_ids=list(requests), req_id_to_index=ids)  # what the runner reads
    base_logits = torch.randn(batch_size, vocab.vocab_size, generator=torch.Generator().manual_seed(seed))
    logits = torch.empty_like(base_logits)
    scheduler_s, runner_s, copy_s = [], [], []
    for _ in range(num_steps):
        start = time.perf_counter()
        bitmask = manager.grammar_bitmask(requests, ids, {})
        scheduler_s.append(time.perf_counter() - start)
        scheduler_output = decode_step_output(bitmask, ids)
        start = time.perf_counter()
        logits.copy_(base_logits)
        copy_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        apply_grammar_bitmask(scheduler_output, input_batch, logits, torch.device("cpu"))
        runner_s.append(time.perf_counter() - start)
        for req_id, request in requests.items():  # the "sampled" token: the document's next one
            doc, done = position[req_id]
            if done == len(paths[doc]):  # the document ended: a new output from the start
                request.structured_output_request.grammar = manager.backend.compile_grammar(*kind)
                done = 0
            assert request.structured_output_request.grammar.accept_tokens(req_id, [paths[doc][done]])
            position[req_id] = (doc, done + 1)
    manager.clear_backend()
    return {
        "scheduler_us": 1e6 * statistics.fmean(scheduler_s),
        "runner_us": 1e6 * statistics.fmean(runner_s),
        "copy_logits_us": 1e6 * statistics.fmean(copy_s),
    }


def measure_bitmask_cost(
    batch_sizes: tuple[int, ...], vocab_sizes: tuple[int, ...], num_steps: int, repeats: int
) -> dict[str, Any]:
    """Scheduler and runner µs per step over every (vocabulary, batch size); a repeat's value is the
    mean over its steps, a cell's the min / median / max of its repeats."""
    before = machine_state()
    vllm_config = demo_engine_config(max(batch_sizes))
    rows = []
    for vocab_size in vocab_sizes:
        vocab = vocabulary(vocab_size, vllm_config)
        for batch_size in batch_sizes:
            runs = [time_bitmask_steps(vocab, vllm_config, batch_size, num_steps, seed=r) for r in range(repeats)]
            row: dict[str, Any] = {
                "vocab_size": vocab_size, "vocabulary": vocab.name, "batch_size": batch_size,
                "bitmask_bytes": bitmask_bytes(batch_size, vocab_size),
                "logits_bytes": batch_size * vocab_size * 4,  # float32, read and written once by the mask
            }  # fmt: skip
            for key in ("scheduler_us", "runner_us", "copy_logits_us"):
                s = spread([run[key] for run in runs])
                row.update({key: s["median"], f"{key}_min": s["min"], f"{key}_max": s["max"]})
            row["scheduler_us_per_row"] = row["scheduler_us"] / batch_size
            rows.append(row)
    return {
        "schema": PERSON, "num_steps": num_steps, "repeats": repeats, "rows": rows,
        "before": before, "after": machine_state(),
    }  # fmt: skip


# ---------------------------------------------------------------------------- 2. compile time
def measure_compile_time(vocab_sizes: tuple[int, ...], repeats: int) -> dict[str, Any]:
    """Per kind and vocabulary: `compile_grammar` on a fresh backend (cold: a new compiler, empty
    cache), then the same key again (cached). ms, min / median / max over the repeats."""
    before = machine_state()
    vllm_config = demo_engine_config(1)
    rows = []
    for vocab_size in vocab_sizes:
        vocab = vocabulary(vocab_size, vllm_config)
        # The process's first compile pays one-time set-up: done once, untimed.
        vocab.new_backend().compile_grammar(*COMPILE_KINDS["regex"])
        times: dict[str, dict[str, list[float]]] = {k: {"cold": [], "cached": []} for k in COMPILE_KINDS}
        for _ in range(repeats):
            for kind, (request_type, spec) in COMPILE_KINDS.items():
                backend = vocab.new_backend()
                for phase in ("cold", "cached"):
                    start = time.perf_counter()
                    backend.compile_grammar(request_type, spec)
                    times[kind][phase].append(1e3 * (time.perf_counter() - start))
                backend.destroy()
        for kind in COMPILE_KINDS:
            row: dict[str, Any] = {"vocab_size": vocab_size, "vocabulary": vocab.name, "kind": kind}
            for phase in ("cold", "cached"):
                s = spread(times[kind][phase])
                row.update({f"{phase}_ms": s["median"], f"{phase}_ms_min": s["min"], f"{phase}_ms_max": s["max"]})
            rows.append(row)
    return {"repeats": repeats, "rows": rows, "before": before, "after": machine_state()}


# ---------------------------------------------------------------------------- 3. and 4. the demo model
def demo_llm() -> LLM:
    """The demo model, engine core in this process (so the timings see one process)."""
    return LLM.from_engine_args(EngineArgs(model=str(DEMO_MODEL_PATH), seed=0), enable_multiprocessing=False)


def sampling_params(
    num_requests: int, max_tokens: int | list[int], seed: int = 0, **constraint: Any
) -> list[SamplingParams]:
    """Temperature 0.8, one seed per request (the same outputs in every repeat); `constraint` as
    `StructuredOutputsParams`' arguments, none for an unconstrained request; a list of
    `max_tokens` means "exactly that many tokens" (`ignore_eos`), the length-matched peer."""
    structured = StructuredOutputsParams(**constraint) if constraint else None
    exact = isinstance(max_tokens, list)
    return [
        SamplingParams(
            temperature=0.8, seed=seed + i, max_tokens=max_tokens[i] if exact else max_tokens,
            ignore_eos=exact, structured_outputs=structured,
        )
        for i in range(num_requests)
    ]  # fmt: skip


def timed_generate(llm: LLM, params: list[SamplingParams]) -> dict[str, Any]:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    return {
        "elapsed_s": elapsed, "num_output_tokens": sum(lengths), "output_tokens_per_s": sum(lengths) / elapsed,
        "lengths": lengths, "outputs": outputs,
    }  # fmt: skip


CONSTRAINTS = {
    "json": {"json": PERSON, "disable_any_whitespace": True},
    "regex": {"regex": REGEX},
}


def measure_throughput(llm: LLM, num_prompts: int, max_tokens: int, repeats: int) -> dict[str, Any]:
    """Output tokens/s, the same prompts and seeds under each constraint and without one.

    Modes: "unconstrained" (same max_tokens; its outputs run longer), each constraint, and for
    each constraint "unconstrained, <c>'s lengths": every request generates exactly as many
    tokens as its constrained output had, so the two differ by the grammar alone. Each mode
    runs once untimed first (it compiles and caches the grammar, and gives the lengths); the
    repeats then alternate the order of the modes.
    """
    before = machine_state()
    modes: dict[str, list[SamplingParams]] = {"unconstrained": sampling_params(num_prompts, max_tokens)}
    for name, constraint in CONSTRAINTS.items():
        modes[name] = sampling_params(num_prompts, max_tokens, **constraint)
        lengths = timed_generate(llm, modes[name])["lengths"]
        modes[f"unconstrained, {name}'s lengths"] = sampling_params(num_prompts, lengths)
    timed_generate(llm, modes["unconstrained"])
    runs = []
    order = list(modes)
    for repeat in range(repeats):
        for mode in order if repeat % 2 == 0 else order[::-1]:
            run = timed_generate(llm, modes[mode])
            runs.append({
                "repeat": repeat, "mode": mode, "elapsed_s": run["elapsed_s"],
                "num_output_tokens": run["num_output_tokens"], "output_tokens_per_s": run["output_tokens_per_s"],
                "num_finished_by_length": sum(o.outputs[0].finish_reason == "length" for o in run["outputs"]),
            })  # fmt: skip
    summary = {mode: spread([r["output_tokens_per_s"] for r in runs if r["mode"] == mode]) for mode in modes}
    tokens = {mode: statistics.median(r["num_output_tokens"] for r in runs if r["mode"] == mode) for mode in modes}
    ratios = {}
    for name in CONSTRAINTS:
        ratios[f"{name} / unconstrained"] = summary[name]["median"] / summary["unconstrained"]["median"]
        peer = f"unconstrained, {name}'s lengths"
        ratios[f"{name} / {peer}"] = summary[name]["median"] / summary[peer]["median"]
    return {
        "model": "demo model (nano_v1/demo_model), float32, engine core in-process",
        "workload": {"num_prompts": num_prompts, "max_tokens": max_tokens, "temperature": 0.8,
                     "constraints": {k: {**v, "json": "PERSON"} if "json" in v else v for k, v in CONSTRAINTS.items()}},
        "repeats": repeats, "runs": runs, "output_tokens_per_s": summary, "num_output_tokens": tokens,
        "ratios": ratios, "goal": dict(GOAL), "before": before, "after": machine_state(),
    }  # fmt: skip


WHITESPACE_MODES = {
    "any whitespace (default)": {"json": PERSON},
    "disable_any_whitespace": {"json": PERSON, "disable_any_whitespace": True},
    'whitespace_pattern "[ ]?"': {"json": PERSON, "whitespace_pattern": r"[ ]?"},
}


def is_valid(text: str) -> bool:
    """Whether `text` parses as JSON and validates against PERSON (jsonschema)."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), PERSON)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def measure_whitespace(llm: LLM, num_requests: int, max_tokens: int, repeats: int) -> dict[str, Any]:
    """Per whitespace mode: the fraction of outputs cut by max_tokens, the fraction that parse and
    validate, and the share of output tokens that decode to whitespace only (EOS not counted)."""
    before = machine_state()
    tokenizer = llm.get_tokenizer()
    whitespace_ids = {
        i for i in range(DEMO_VOCAB_SIZE) if (text := tokenizer.decode([i])) and not text.strip()
    }
    rows = []
    for repeat in range(repeats):
        for mode, constraint in WHITESPACE_MODES.items():
            params = sampling_params(num_requests, max_tokens, seed=1000 * repeat, **constraint)
            run = timed_generate(llm, params)
            completions = [o.outputs[0] for o in run["outputs"]]
            num_tokens = sum(len(c.token_ids) for c in completions)
            num_whitespace = sum(t in whitespace_ids for c in completions for t in c.token_ids)
            rows.append({
                "repeat": repeat, "mode": mode, "num_requests": num_requests,
                "fraction_length": sum(c.finish_reason == "length" for c in completions) / num_requests,
                "fraction_valid": sum(is_valid(c.text) for c in completions) / num_requests,
                "whitespace_token_share": num_whitespace / num_tokens,
                "mean_output_tokens": num_tokens / num_requests,
                "example": completions[0].text,
            })  # fmt: skip
    summary = {}
    for mode in WHITESPACE_MODES:
        cells = [r for r in rows if r["mode"] == mode]
        summary[mode] = {
            key: spread([r[key] for r in cells])
            for key in ("fraction_length", "fraction_valid", "whitespace_token_share", "mean_output_tokens")
        }
    return {
        "workload": {"num_requests": num_requests, "max_tokens": max_tokens, "temperature": 0.8, "schema": PERSON},
        "num_whitespace_tokens_in_vocab": len(whitespace_ids),
        "repeats": repeats, "rows": rows, "summary": summary, "before": before, "after": machine_state(),
    }  # fmt: skip
