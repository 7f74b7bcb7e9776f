"""Record vLLM v0.11.0's own scheduler, step by step, as JSON traces for nano_v1 to replay.

Why it exists: nano_v1's scheduler claims to mirror vllm/v1/core/sched/scheduler.py. The
strongest evidence is vLLM itself: this script drives v0.11.0's `Scheduler` and
`KVCacheManager` through fixed workloads on a fake model and writes, for every step, what
the scheduler decided and the state it left behind. tests/test_vllm_traces.py replays the
same workloads through nano_v1 and compares every field, block ids included.

It runs ONLY in a virtual environment of its own, with vLLM 0.11.0 installed without its
dependencies (the scheduler is pure Python; no GPU, no compiled extension). To rebuild
that environment and re-record, from the repository root:

    python3 -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install torch==2.13.0    # a CPU build, pinned first: see below
    /work/vllm-venv/bin/pip install --no-deps vllm==0.11.0
    /work/vllm-venv/bin/pip install numpy 'transformers>=4.57,<4.58' pydantic msgspec \
        cloudpickle psutil cachetools cbor2 setproctitle pyzmq aiohttp blake3 pillow \
        prometheus_client fastapi openai openai_harmony pybase64 diskcache py-cpuinfo gguf
    /work/vllm-venv/bin/python tests/helpers/record_traces.py tests/vllm_v0_11_0/traces

Torch comes first so that the `--no-deps` install cannot pull in the CUDA build that
vLLM's wheel asks for (its scheduler does not care which). The packages after vllm are
what the scheduler's import chain and `ModelConfig`'s architecture check import; the list
was found by iterating on ImportErrors. Recording is deterministic: a second run writes
byte-identical files.

What it takes to run v0.11.0's scheduler on a CPU, from vLLM's CUDA wheel:
  * v0.11.0 detects the CPU platform only from a CPU build's version string, so
    `vllm.platforms.builtin_platform_plugins["cpu"]` is made to return the CPU platform's
    qualified name before any config is built (`VLLM_TARGET_DEVICE=cpu` is set too);
  * `ModelConfig` reads a local config.json (a one-layer Llama written to a temporary
    directory) with `skip_tokenizer_init=True`; the scheduler never sees weights.
The CPU platform accepts only block_size 16, so every workload uses 16.

The fake model: next token = f(the request's tokens so far), so a replay can feed the
recorded outputs back. A step computes a request's sample only when the scheduled tokens
reach its last known token (a prefill chunk short of it samples nothing, as in vLLM's
model runner). With speculative decoding the scheduled drafts are verified exactly
(kept while equal to f), and after the step a deterministic proposer offers up to k
drafts, some right and some wrong, for every request that sampled; like v0.11.0's n-gram
proposer (vllm/v1/spec_decode/ngram_proposer.py) it never proposes past max_model_len.

Async scheduling (chapter 14): the workloads without speculative decoding are recorded
again, to traces/async/, under v0.11.0's own `EngineCore.step_with_batch_queue` with a
queue of two and its `AsyncScheduler` (`record_async`). The engine core is built without
a model or workers; a fake executor runs each step when it is sent, on its own copy of
the tokens as a model runner keeps them, and returns an output that is never done before
the loop waits for it, so every step is scheduled while the one before it runs.
tests/test_async_scheduling.py replays them through nano_v1's loop.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import zlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

os.environ["VLLM_TARGET_DEVICE"] = "cpu"

import vllm.platforms

# v0.11.0 detects the CPU platform from a CPU build's version string only.
vllm.platforms.builtin_platform_plugins["cpu"] = lambda: "vllm.platforms.cpu.CpuPlatform"

import torch
from trace_fields import PendingOutput, output_fields, placeholder_fields, schedule_fields, state_fields
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

VLLM_VERSION = "0.11.0"
VOCAB = 1000
BLOCK_SIZE = 16
# An EOS id the fake model never produces (its tokens are < VOCAB): requests end by length.
NEVER_EOS = VOCAB

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 1,
    "vocab_size": VOCAB + 1,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",  # else ModelConfig looks for safetensors on the Hub
}


def next_token(tokens: list[int]) -> int:
    """The fake model: a deterministic function of the whole history."""
    return (sum(tokens) * 31 + len(tokens) * 7 + tokens[-1]) % VOCAB


def coin(*key: object) -> int:
    """A deterministic pseudo-random number for the proposer's choices."""
    return zlib.crc32(repr(key).encode())


def prompt(seed: int, length: int, prefix: list[int] | None = None) -> list[int]:
    """`length` tokens: `prefix`, then tokens drawn from a seeded LCG."""
    tokens = list(prefix or [])
    state = seed * 2654435761 + 1
    while len(tokens) < length:
        state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
        tokens.append(1 + (state >> 33) % (VOCAB - 1))
    return tokens


def req(req_id: str, prompt_token_ids: list[int], max_tokens: int, arrival_step: int = 0, **extra) -> dict:
    """One request of a workload; `extra` sets priority, eos_token_id, stop_token_ids, ignore_eos,
    min_tokens."""
    return dict(
        req_id=req_id,
        prompt_token_ids=prompt_token_ids,
        max_tokens=max_tokens,
        arrival_step=arrival_step,
        **extra,
    )


def random_requests(*rows: tuple) -> list[dict]:
    """Requests with random prompts; a row: (req_id, prompt seed, length, max_tokens[, arrival_step])."""
    return [req(req_id, prompt(seed, length), *rest) for req_id, seed, length, *rest in rows]


def outputs_of(prompt_token_ids: list[int], n: int) -> list[int]:
    """The fake model's first `n` tokens after a prompt (to pick stop ids it will produce)."""
    tokens = list(prompt_token_ids)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt_token_ids) :]


@dataclass
class Workload:
    description: str
    config: dict  # overrides of DEFAULT_CONFIG
    requests: list[dict]
    aborts: dict[int, list[str]] = field(default_factory=dict)  # step -> ids, aborted before schedule()
    # The proposer offers at most max_tokens - num_output_tokens - 1 drafts (False: as many as
    # v0.11.0's n-gram proposer would, bounded by max_model_len only).
    clip_drafts_at_max_tokens: bool = True


DEFAULT_CONFIG = {
    "block_size": BLOCK_SIZE,
    "num_gpu_blocks": 64,
    "max_num_batched_tokens": 128,
    "max_num_seqs": 8,
    "max_model_len": 256,
    "enable_chunked_prefill": True,
    "long_prefill_token_threshold": 0,
    "enable_prefix_caching": True,
    "policy": "fcfs",
    "num_spec_tokens": 0,
}

SHARED = prompt(99, 40)  # a 40-token "system prompt": two full blocks and a partial one
TWIN = prompt(25, 36)  # two requests with this prompt fill their third blocks alike
STOP_PROMPTS = [prompt(60, 20), prompt(61, 25), prompt(62, 18), prompt(63, 22)]
STOP_OUTPUTS = [outputs_of(p, 20) for p in STOP_PROMPTS]

WORKLOADS = {
    "plain": Workload(
        "Four requests, a roomy cache and budget: prefill in one step, then decode.",
        {"max_num_batched_tokens": 256},
        random_requests(("a", 1, 20, 8), ("b", 2, 35, 12), ("c", 3, 17, 5, 2), ("d", 4, 48, 9, 3)),
    ),
    "chunked_prefill": Workload(
        "A 32-token budget: long prompts are chunked and share each step with decodes.",
        {"max_num_batched_tokens": 32},
        random_requests(("a", 5, 70, 6), ("b", 6, 45, 6), ("c", 7, 90, 4, 1), ("d", 8, 10, 7, 4)),
    ),
    "long_prefill_threshold": Workload(
        "long_prefill_token_threshold=24: no request takes more than 24 tokens of a step, "
        "even when it runs alone.",
        {"max_num_batched_tokens": 64, "long_prefill_token_threshold": 24},
        random_requests(("a", 9, 80, 4), ("b", 10, 30, 5, 3), ("c", 11, 26, 3, 3)),
    ),
    "chunked_prefill_off": Workload(
        "Chunked prefill off: a prompt is scheduled whole or not at all; the queue waits for a roomier step.",
        {"max_num_batched_tokens": 128, "max_model_len": 128, "enable_chunked_prefill": False},
        random_requests(("a", 12, 100, 4), ("b", 13, 60, 4), ("c", 14, 90, 3, 1)),
    ),
    "chunked_prefill_off_skip": Workload(
        "Chunked prefill off, and a prompt that does not fit the step's remaining budget is "
        "followed by one that does.",
        {"max_num_batched_tokens": 128, "max_model_len": 128, "enable_chunked_prefill": False},
        random_requests(("a", 15, 100, 4), ("b", 16, 60, 4), ("c", 17, 20, 3)),
    ),
    "preemption": Workload(
        "Seven usable blocks for four growing requests: the last running request preempts "
        "itself, and an earlier one preempts the last.",
        {"num_gpu_blocks": 8, "max_num_batched_tokens": 64, "enable_prefix_caching": False},
        random_requests(("a", 18, 29, 20), ("b", 19, 25, 24), ("c", 20, 20, 16), ("d", 21, 16, 12, 2)),
    ),
    "prefix_caching": Workload(
        "Requests sharing a 40-token prefix arrive over several steps; one repeats a whole prompt. "
        "Then twins: equal prompts decode equal tokens, so each caches its own copy of the block "
        "they fill, and a later request hits the copy cached first.",
        {"max_num_batched_tokens": 128},
        [
            req("a", SHARED + prompt(22, 10), 6),
            req("b", prompt(23, 60, SHARED), 6, 2),
            req("c", SHARED + prompt(22, 10), 5, 4),
            req("d", SHARED[:32], 4, 5),
            req("e", prompt(24, 70, SHARED[:16]), 4, 6),
            req("f", TWIN, 14, 10),
            req("g", TWIN, 14, 10),
            req("h", TWIN + outputs_of(TWIN, 14), 3, 23),
        ],
    ),
    "preemption_prefix_caching": Workload(
        "A tiny cache with prefix caching on: a preempted request resumes with cache hits on "
        "a block it shares and on a block of its own that it freed when it was preempted.",
        {"num_gpu_blocks": 9, "max_num_batched_tokens": 48},
        [
            req("a", prompt(25, 34), 16),
            req("b", prompt(26, 33, SHARED[:16]), 30),
            req("c", SHARED[:20] + prompt(27, 10), 20, 1),
        ],
    ),
    "max_model_len": Workload(
        "max_model_len=48: requests stop at the context limit before their max_tokens.",
        {"max_model_len": 48, "max_num_batched_tokens": 64},
        random_requests(("a", 28, 30, 100), ("b", 29, 40, 100), ("c", 30, 47, 5, 2)),
    ),
    "priority": Workload(
        "Priority scheduling: urgent late arrivals go first; the first running request preempts "
        "the least urgent one, which is not the last; later the last one preempts itself.",
        {
            "policy": "priority",
            "num_gpu_blocks": 8,
            "max_num_batched_tokens": 64,
            "enable_prefix_caching": False,
        },
        [
            req("a", prompt(31, 29), 20, priority=0),
            req("b", prompt(32, 31), 20, priority=5),
            req("c", prompt(33, 28), 10, 2, priority=-1),
            req("d", prompt(34, 15), 8, 3, priority=1),
        ],
    ),
    "priority_preempt_scheduled": Workload(
        "Priority scheduling where the least urgent running request was already scheduled "
        "this step when a more urgent one needs its blocks.",
        {
            "policy": "priority",
            "num_gpu_blocks": 6,
            "max_num_batched_tokens": 64,
            "enable_prefix_caching": False,
        },
        [req("a", prompt(35, 30), 30, priority=5), req("b", prompt(36, 31), 30, 1, priority=0)],
    ),
    "aborts": Workload(
        "Aborts mid-run: a request mid-prefill, a waiting request, a decoding request, an "
        "unknown id and an id that already finished.",
        {"max_num_batched_tokens": 40, "max_num_seqs": 3},
        random_requests(
            ("a", 37, 30, 10), ("b", 38, 70, 10), ("c", 39, 20, 3), ("d", 40, 25, 8), ("e", 41, 12, 6, 1)
        ),
        {2: ["b"], 3: ["e"], 4: ["a", "nope"], 6: ["c"]},
    ),
    "spec_decode": Workload(
        "Speculative decoding, k=3: {r: 1 + drafts} with accepted, partly and wholly rejected "
        "drafts, drafts trimmed or dropped by a 5-token budget, and a chunked prefill sharing "
        "the step. The proposer never proposes past max_tokens.",
        {"num_spec_tokens": 3, "max_num_batched_tokens": 5, "max_num_seqs": 4},
        random_requests(("a", 42, 9, 16), ("b", 43, 6, 14), ("c", 44, 30, 10, 3), ("d", 45, 5, 12, 4)),
    ),
    "spec_decode_preemption": Workload(
        "Speculative decoding, k=3, in a tiny cache: requests with drafts are preempted and resume.",
        {
            "num_spec_tokens": 3,
            "num_gpu_blocks": 7,
            "max_num_batched_tokens": 32,
            "enable_prefix_caching": False,
        },
        random_requests(("a", 64, 30, 30), ("b", 65, 28, 30), ("c", 66, 20, 20, 1)),
    ),
    "spec_decode_max_model_len": Workload(
        "Speculative decoding, k=3, up against max_model_len=40: the proposer offers drafts up "
        "to the limit, and the step's positions must stay below it.",
        {"num_spec_tokens": 3, "max_model_len": 40, "max_num_batched_tokens": 64},
        random_requests(("a", 67, 27, 100), ("b", 68, 31, 100)),
    ),
    "spec_decode_past_max_tokens": Workload(
        "Speculative decoding, k=3, with a proposer that (like v0.11.0's n-gram proposer) "
        "ignores max_tokens.",
        {"num_spec_tokens": 3, "max_num_batched_tokens": 64},
        random_requests(("a", 46, 9, 5), ("b", 47, 6, 7)),
        clip_drafts_at_max_tokens=False,
    ),
    "max_num_seqs": Workload(
        "max_num_seqs=2 with six requests: the waiting queue is admitted two at a time.",
        {"max_num_seqs": 2, "max_num_batched_tokens": 128},
        [req(f"r{i}", prompt(50 + i, 10 + 7 * i), 3 + i % 3, i // 2) for i in range(6)],
    ),
    "stops": Workload(
        "Stop conditions: EOS, a stop token id, EOS with ignore_eos, and EOS arriving on the "
        "max_tokens-th token (length wins).",
        {"max_num_batched_tokens": 128},
        [
            req("eos", STOP_PROMPTS[0], 20, eos_token_id=STOP_OUTPUTS[0][5]),  # EOS, its 6th token
            req("stop_id", STOP_PROMPTS[1], 20, stop_token_ids=[STOP_OUTPUTS[1][3]]),  # a stop id, its 4th
            req("ignore_eos", STOP_PROMPTS[2], 9, eos_token_id=STOP_OUTPUTS[2][2], ignore_eos=True),
            req("eos_at_max", STOP_PROMPTS[3], 7, eos_token_id=STOP_OUTPUTS[3][6]),  # EOS is the 7th: length
        ],
    ),
    "stops_min_tokens": Workload(
        "min_tokens=8 and an EOS sampled as the 3rd token, which vLLM's sampler would have masked.",
        {"max_num_batched_tokens": 128},
        [req("early_eos", STOP_PROMPTS[0], 12, eos_token_id=STOP_OUTPUTS[0][2], min_tokens=8)],
    ),
}


class FakeModel:
    """What the model runner would return for a `SchedulerOutput`, from the scheduler's requests."""

    def __init__(self, scheduler: Scheduler, num_spec_tokens: int, clip_drafts_at_max_tokens: bool) -> None:
        self.scheduler = scheduler
        self.num_spec_tokens = num_spec_tokens
        self.clip_drafts_at_max_tokens = clip_drafts_at_max_tokens

    def execute(self, so) -> dict[str, list[int]]:
        """{req_id: tokens gained}: [] short of the last known token, else 1 + accepted drafts."""
        sampled = {}
        for req_id in so.num_scheduled_tokens:
            request = self.scheduler.requests[req_id]
            drafts = so.scheduled_spec_decode_tokens.get(req_id, [])
            # schedule() already advanced num_computed_tokens past this step's tokens.
            if request.num_computed_tokens - len(drafts) < request.num_tokens:
                sampled[req_id] = []  # a prefill chunk short of the last known token
                continue
            tokens = list(request.all_token_ids)
            new = []
            for draft in [*drafts, None]:
                new.append(next_token(tokens))
                tokens.append(new[-1])
                if new[-1] != draft:
                    break
            sampled[req_id] = new
        return sampled

    def propose(self, step: int, sampled: dict[str, list[int]]) -> dict[str, list[int]]:
        """{req_id: drafts for the next step}; [] for a request that sampled nothing or finished."""
        drafts = {}
        max_model_len = self.scheduler.max_model_len
        for req_id, new in sampled.items():
            request = self.scheduler.requests.get(req_id)
            if not new or request is None or request.num_tokens >= max_model_len:
                drafts[req_id] = []
                continue
            limit = min(self.num_spec_tokens, max_model_len - request.num_tokens)
            if self.clip_drafts_at_max_tokens:
                limit = min(limit, request.max_tokens - request.num_output_tokens - 1)
            num = min(max(limit, 0), coin("n", req_id, step) % (self.num_spec_tokens + 1))
            tokens = list(request.all_token_ids)
            proposal = []
            for i in range(num):
                token = next_token(tokens)
                if coin("wrong", req_id, step, i) % 4 == 0:
                    token = (token + 1) % VOCAB
                proposal.append(token)
                tokens.append(token)
            drafts[req_id] = proposal
        return drafts


def build_scheduler(config: dict, model_dir: str, async_scheduling: bool = False) -> Scheduler:
    speculative_config = None
    if config["num_spec_tokens"]:
        speculative_config = SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=config["num_spec_tokens"],
            prompt_lookup_min=1,
            prompt_lookup_max=3,
        )
    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=model_dir, skip_tokenizer_init=True, max_model_len=config["max_model_len"], dtype="float32"
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=config["max_num_seqs"],
            max_num_batched_tokens=config["max_num_batched_tokens"],
            max_model_len=config["max_model_len"],
            enable_chunked_prefill=config["enable_chunked_prefill"],
            long_prefill_token_threshold=config["long_prefill_token_threshold"],
            policy=config["policy"],
            async_scheduling=async_scheduling,
        ),
        cache_config=CacheConfig(
            block_size=config["block_size"], enable_prefix_caching=config["enable_prefix_caching"]
        ),
        device_config=DeviceConfig("cpu"),
        speculative_config=speculative_config,
    )
    vllm_config.cache_config.num_gpu_blocks = config["num_gpu_blocks"]
    kv_cache_config = KVCacheConfig(
        num_blocks=config["num_gpu_blocks"],
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["layer"], FullAttentionSpec(config["block_size"], 1, 1, torch.float32, False))
        ],
    )
    scheduler = (AsyncScheduler if async_scheduling else Scheduler)(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        log_stats=False,
    )
    # What the scheduler actually runs with, after vLLM's config resolution.
    sc = vllm_config.scheduler_config
    assert (sc.max_num_batched_tokens, sc.max_num_seqs, sc.max_model_len) == (
        config["max_num_batched_tokens"],
        config["max_num_seqs"],
        config["max_model_len"],
    )
    assert sc.chunked_prefill_enabled == config["enable_chunked_prefill"]
    assert sc.long_prefill_token_threshold == config["long_prefill_token_threshold"]
    assert (
        scheduler.block_size == config["block_size"]
        and scheduler.num_spec_tokens == config["num_spec_tokens"]
    )
    assert (
        scheduler.num_lookahead_tokens == 0
        and scheduler.kv_cache_manager.enable_caching == config["enable_prefix_caching"]
    )
    return scheduler


def make_request(spec: dict, block_hasher) -> Request:
    params = SamplingParams(
        max_tokens=spec["max_tokens"],
        min_tokens=spec["min_tokens"],
        ignore_eos=spec["ignore_eos"],
        stop_token_ids=spec["stop_token_ids"],
    )
    return Request(
        request_id=spec["req_id"],
        prompt_token_ids=list(spec["prompt_token_ids"]),
        sampling_params=params,
        pooling_params=None,
        eos_token_id=spec["eos_token_id"],
        arrival_time=spec["arrival_time"],
        priority=spec["priority"],
        block_hasher=block_hasher,
    )


def request_specs(workload) -> list[dict]:
    """The workload's requests with every field a trace records, defaults filled in."""
    defaults = dict(eos_token_id=NEVER_EOS, stop_token_ids=[], ignore_eos=False, min_tokens=0, priority=0)
    return [dict(defaults, **spec, arrival_time=float(i)) for i, spec in enumerate(workload.requests)]


def runner_output_of(sampled: dict[str, list[int]]) -> ModelRunnerOutput:
    """vLLM's `ModelRunnerOutput` for a step whose requests sampled `sampled` (request id -> tokens)."""
    req_ids = list(sampled)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=[list(sampled[rid]) for rid in req_ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )


def record(name: str, model_dir: str) -> dict:
    workload = WORKLOADS[name]
    config = dict(DEFAULT_CONFIG, **workload.config)
    requests = request_specs(workload)
    aborts = workload.aborts
    scheduler = build_scheduler(config, model_dir)
    block_hasher = get_request_block_hasher(BLOCK_SIZE, sha256) if config["enable_prefix_caching"] else None
    model = FakeModel(scheduler, config["num_spec_tokens"], workload.clip_drafts_at_max_tokens)

    pending = sorted(requests, key=lambda r: r["arrival_step"])
    steps = []
    step = 0
    while pending or scheduler.get_num_unfinished_requests():
        assert step < 500, f"{name}: no progress"
        arrivals = [spec["req_id"] for spec in pending if spec["arrival_step"] == step]
        for spec in [s for s in pending if s["arrival_step"] == step]:
            scheduler.add_request(make_request(spec, block_hasher))
        pending = [s for s in pending if s["arrival_step"] != step]
        for req_id in aborts.get(step, []):  # one at a time: vLLM frees a batch in set order
            scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

        was_running = [r.request_id for r in scheduler.running]
        so = scheduler.schedule()
        entry = {
            "step": step,
            "arrivals": arrivals,
            "aborts": list(aborts.get(step, [])),
            **schedule_fields(scheduler, so, was_running),
        }
        sampled = model.execute(so)
        entry["model_output"] = {rid: list(t) for rid, t in sampled.items()}
        runner_output = runner_output_of(sampled)
        engine_outputs = scheduler.update_from_output(so, runner_output)
        entry["outputs"] = output_fields(out for eco in engine_outputs.values() for out in eco.outputs)
        if config["num_spec_tokens"] and so.total_num_scheduled_tokens > 0:
            drafts = model.propose(step, sampled)
            entry["draft_token_ids"] = drafts
            scheduler.update_draft_token_ids(DraftTokenIds(list(drafts), [list(d) for d in drafts.values()]))
        entry["after"] = state_fields(scheduler)
        steps.append(entry)
        step += 1

    return {
        "vllm_version": VLLM_VERSION,
        "workload": name,
        "description": workload.description,
        "recorder": "tests/helpers/record_traces.py",
        "config": config,
        "requests": requests,
        "steps": steps,
    }


# Async scheduling refuses speculative decoding: every other workload is recorded again
# under v0.11.0's batch-queue loop, to traces/async/, but priority_preempt_scheduled, whose
# v0.11.0 step runs a request it preempted (tests/test_vllm_traces.py says why) and so
# has no model output this recorder could give.
ASYNC_WORKLOADS = [
    name
    for name, workload in WORKLOADS.items()
    if not workload.config.get("num_spec_tokens", 0) and name != "priority_preempt_scheduled"
]


class FakeExecutor:
    """The worker of an async engine: runs each step when it is sent, in order, on its own
    copy of each request's tokens, as a model runner keeps them. A step scheduled before
    the previous step's token is back still has that token to feed."""

    max_concurrent_batches = 2

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.sampled: dict[str, list[int]] | None = None  # the last step's, for the trace

    def execute_model(self, so, non_block: bool = False) -> PendingOutput:
        assert non_block
        for new in so.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.prompt_token_ids)
        cached = so.scheduled_cached_reqs
        computed = {
            **{new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs},
            **dict(zip(cached.req_ids, cached.num_computed_tokens)),
        }
        sampled = {}
        for req_id, num_tokens in so.num_scheduled_tokens.items():
            tokens = self.tokens[req_id]
            if computed[req_id] + num_tokens < len(tokens):
                sampled[req_id] = []  # a prefill chunk short of the last known token
                continue
            tokens.append(next_token(tokens))
            sampled[req_id] = [tokens[-1]]
        self.sampled = sampled
        return PendingOutput(runner_output_of(sampled))


def record_async(name: str, model_dir: str) -> dict:
    """The workload under v0.11.0's own `EngineCore.step_with_batch_queue` (queue of 2) and
    `AsyncScheduler`; one trace step per call of the loop, which may schedule a step, update
    one, or both."""
    workload = WORKLOADS[name]
    config = dict(DEFAULT_CONFIG, **workload.config)
    requests = request_specs(workload)
    aborts = workload.aborts
    scheduler = build_scheduler(config, model_dir, async_scheduling=True)
    block_hasher = get_request_block_hasher(BLOCK_SIZE, sha256) if config["enable_prefix_caching"] else None
    executor = FakeExecutor()
    core = EngineCore.__new__(EngineCore)  # the loop's state only: no model, no processes
    core.scheduler, core.model_executor = scheduler, executor
    core.batch_queue_size = executor.max_concurrent_batches
    core.batch_queue = deque(maxlen=core.batch_queue_size)
    scheduled: list[dict] = []
    schedule = scheduler.schedule

    def recording_schedule():
        was_running = [r.request_id for r in scheduler.running]
        so = schedule()
        scheduled.append(schedule_fields(scheduler, so, was_running))
        return so

    scheduler.schedule = recording_schedule
    pending = sorted(requests, key=lambda r: r["arrival_step"])
    steps = []
    step = 0
    while pending or scheduler.has_requests() or core.batch_queue:
        assert step < 500, f"{name}: no progress"
        arrivals = [spec["req_id"] for spec in pending if spec["arrival_step"] == step]
        for spec in [s for s in pending if s["arrival_step"] == step]:
            scheduler.add_request(make_request(spec, block_hasher))
        pending = [s for s in pending if s["arrival_step"] != step]
        for req_id in aborts.get(step, []):
            scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
        scheduled.clear()
        executor.sampled = None
        engine_outputs, _ = core.step_with_batch_queue()
        steps.append(
            {
                "step": step,
                "arrivals": arrivals,
                "aborts": list(aborts.get(step, [])),
                "schedule": scheduled[0] if scheduled else None,
                "model_output": executor.sampled,
                "outputs": None
                if engine_outputs is None
                else output_fields(out for eco in engine_outputs.values() for out in eco.outputs),
                "after": dict(state_fields(scheduler), **placeholder_fields(scheduler)),
            }
        )
        step += 1

    return {
        "vllm_version": VLLM_VERSION,
        "workload": name,
        "description": workload.description + " Under async scheduling.",
        "recorder": "tests/helpers/record_traces.py",
        "config": config,
        "requests": requests,
        "steps": steps,
    }


def write_trace(trace: dict, path: Path) -> None:
    """One step per line: small diffs when a trace is re-recorded."""
    head = {k: v for k, v in trace.items() if k != "steps"}
    lines = [json.dumps(head, sort_keys=False)[:-1] + ', "steps": [']
    lines += [
        json.dumps(step) + ("," if i < len(trace["steps"]) - 1 else "")
        for i, step in enumerate(trace["steps"])
    ]
    lines.append("]}")
    path.write_text("\n".join(lines) + "\n")


def main(out_dir: str) -> None:
    import vllm

    assert vllm.__version__ == VLLM_VERSION, f"this records vLLM {VLLM_VERSION}, found {vllm.__version__}"
    init_none_hash(sha256)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(LLAMA_CONFIG))
        for name in WORKLOADS:
            trace = record(name, model_dir)
            write_trace(trace, out / f"{name}.json")
            print(f"{name}: {len(trace['steps'])} steps")
        (out / "async").mkdir(exist_ok=True)
        for name in ASYNC_WORKLOADS:
            trace = record_async(name, model_dir)
            write_trace(trace, out / "async" / f"{name}.json")
            print(f"async/{name}: {len(trace['steps'])} steps")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).parents[1] / "vllm_v0_11_0" / "traces"))
