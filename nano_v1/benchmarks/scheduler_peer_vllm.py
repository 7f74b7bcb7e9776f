"""vLLM v0.11.0's own scheduler on `nano-v1 bench scheduler`'s workload: the peer it is measured against.

Mirrors vllm/v1/core/sched/scheduler.py (chapter 04), by running it: the script runs under
a Python that has vLLM v0.11.0 (`--peer-vllm PYTHON`), never under nano_v1's, and imports
nothing of nano_v1.

Why it exists: a per-token cost means little without a peer. `scheduler_overhead` sends
the workload as JSON on stdin (prompts, output lengths, block size, budget, blocks);
this script builds v0.11.0's `Scheduler` over one full-attention KV cache group on the
CPU platform (as tests/helpers/record_traces.py does), drives it synchronously with the
same stand-in runner (every request whose step reaches its last known token samples one
fixed token), and prints the CPU (thread) times as JSON, the last line on stdout.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

os.environ["VLLM_TARGET_DEVICE"] = "cpu"

import vllm.platforms

# v0.11.0 detects the CPU platform from a CPU build's version string only.
vllm.platforms.builtin_platform_plugins["cpu"] = lambda: "vllm.platforms.cpu.CpuPlatform"

import torch
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

FIXED_TOKEN_ID = 7


def build_scheduler(workload: dict, model_dir: str) -> Scheduler:
    """v0.11.0's scheduler over one full-attention group, configured as the workload says."""
    llama = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_hidden_layers": 1, "vocab_size": workload["vocab_size"], "rms_norm_eps": 1e-5,
        "max_position_embeddings": workload["max_model_len"], "torch_dtype": "float32",
    }
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(llama, f)
    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=model_dir, skip_tokenizer_init=True, max_model_len=workload["max_model_len"], dtype="float32"
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=workload["max_num_seqs"],
            max_num_batched_tokens=workload["max_num_batched_tokens"],
            max_model_len=workload["max_model_len"],
            enable_chunked_prefill=True,
        ),
        cache_config=CacheConfig(
            block_size=workload["block_size"], enable_prefix_caching=workload["enable_prefix_caching"]
        ),
        device_config=DeviceConfig("cpu"),
    )
    vllm_config.cache_config.num_gpu_blocks = workload["num_blocks"]
    spec = FullAttentionSpec(workload["block_size"], 1, 1, torch.float32, False)
    kv_cache_config = KVCacheConfig(workload["num_blocks"], [], [KVCacheGroupSpec(["layer"], spec)])
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        log_stats=True,  # nano_v1's scheduler always makes its statistics
    )


def run(workload: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="nano_v1_peer_") as model_dir:
        scheduler = build_scheduler(workload, model_dir)
    init_none_hash(sha256)
    block_hasher = get_request_block_hasher(workload["block_size"], sha256) if workload["enable_prefix_caching"] else None
    for i, (prompt_token_ids, output_len) in enumerate(workload["requests"]):
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        scheduler.add_request(
            Request(
                request_id=str(i),
                prompt_token_ids=prompt_token_ids,
                sampling_params=params,
                pooling_params=None,
                eos_token_id=None,
                block_hasher=block_hasher,
            )
        )

    num_tokens: dict[str, int] = {}  # the runner's view: tokens known per request
    schedule_ns: list[int] = []
    update_ns: list[int] = []
    num_scheduled_tokens = 0
    max_steps = workload["max_steps"]
    while scheduler.has_requests() and (max_steps is None or len(update_ns) < max_steps):
        start = time.thread_time_ns()
        scheduler_output = scheduler.schedule()
        schedule_ns.append(time.thread_time_ns() - start)
        num_scheduled_tokens += scheduler_output.total_num_scheduled_tokens
        for req_id in scheduler_output.finished_req_ids:
            num_tokens.pop(req_id, None)
        first = {}
        for new_req in scheduler_output.scheduled_new_reqs:
            num_tokens[new_req.req_id] = len(new_req.prompt_token_ids)
            first[new_req.req_id] = new_req.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        first.update(zip(cached.req_ids, cached.num_computed_tokens))
        req_ids = list(scheduler_output.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            if first[req_id] + scheduler_output.num_scheduled_tokens[req_id] >= num_tokens[req_id]:
                num_tokens[req_id] += 1
                sampled.append([FIXED_TOKEN_ID])
            else:
                sampled.append([])
        model_runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
        )
        start = time.thread_time_ns()
        scheduler.update_from_output(scheduler_output, model_runner_output)
        update_ns.append(time.thread_time_ns() - start)
    return {
        "vllm": vllm.__version__,
        "num_steps": len(schedule_ns),
        "num_scheduled_tokens": num_scheduled_tokens,
        "finished": not scheduler.has_unfinished_requests(),
        "schedule_cpu_median_us": statistics.median(schedule_ns) / 1e3,
        "update_from_output_cpu_median_us": statistics.median(update_ns) / 1e3,
        "scheduler_cpu_us_per_token": (sum(schedule_ns) + sum(update_ns)) / 1e3 / num_scheduled_tokens,
    }


if __name__ == "__main__":
    print(json.dumps(run(json.load(sys.stdin))))  # the last line of stdout (vLLM logs there too)
