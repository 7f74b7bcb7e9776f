"""vLLM v0.11.0's own scheduler on `nano-v1 bench scheduler`'s workload, and the stand-in runner both use.

Mirrors vllm/v1/core/sched/scheduler.py (chapter 04), by running it: `run` runs under a
Python that has vLLM v0.11.0 (`--peer-vllm PYTHON`), never under nano_v1's.

Why it exists: a per-token cost means little without a peer. `scheduler_overhead` runs
this file as a script under that Python and sends the workload as JSON on stdin
(prompts, output lengths, block size, budget, blocks); `run` builds v0.11.0's `Scheduler`
over one full-attention KV cache group on the CPU platform (as
tests/helpers/record_traces.py does), drives it synchronously, and the script prints the
CPU (thread) times as JSON, the last line on stdout. Both schedulers are answered by the
same `FixedTokenRunner`, which reads only the fields nano_v1's and vLLM's
`SchedulerOutput` share; the module imports nothing but the standard library until
`run` imports vLLM, so that `scheduler_overhead` can import the runner.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections import deque
from typing import Any

# The token every request "samples"; any id works, as every request ignores EOS.
FIXED_TOKEN_ID = 7


class FixedTokenRunner:
    """What a scheduler needs of a model runner: which requests sample, and the fixed token.

    A request samples when its step reaches the end of every token the runner knows for
    it (its prompt, then one more per sample); a prefill chunk short of that samples
    nothing. The runner runs each step when it is scheduled, in order, as a worker does,
    so under async scheduling it knows a step's token before the next step runs.
    """

    def __init__(self) -> None:
        self.num_tokens: dict[str, int] = {}

    def sample(self, scheduler_output: Any) -> tuple[list[str], list[list[int]]]:
        """(the step's request ids, each one's sampled tokens: [FIXED_TOKEN_ID] or [])."""
        for req_id in scheduler_output.finished_req_ids:
            self.num_tokens.pop(req_id, None)
        start = {}
        for new_req in scheduler_output.scheduled_new_reqs:
            self.num_tokens[new_req.req_id] = len(new_req.prompt_token_ids)
            start[new_req.req_id] = new_req.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        start.update(zip(cached.req_ids, cached.num_computed_tokens))
        req_ids = list(scheduler_output.num_scheduled_tokens)
        sampled_token_ids = []
        for req_id in req_ids:
            if start[req_id] + scheduler_output.num_scheduled_tokens[req_id] >= self.num_tokens[req_id]:
                self.num_tokens[req_id] += 1
                sampled_token_ids.append([FIXED_TOKEN_ID])
            else:
                sampled_token_ids.append([])
        return req_ids, sampled_token_ids


def drive(
    scheduler: Any, model_runner_output_cls: Any, batch_queue_size: int, max_steps: int | None
) -> dict[str, Any]:
    """Run `scheduler`'s requests to the end (or `max_steps` outputs taken) as an engine core
    does, a `FixedTokenRunner` answering; CPU (thread) times of `schedule` and `update_from_output`.

    A batch queue of one is `EngineCore.step` (schedule, run, update); of two (async
    scheduling) it is `step_with_batch_queue` with a device that is never done first:
    step N + 1 is scheduled before step N's output is taken. `model_runner_output_cls` is
    nano_v1's or vLLM's `ModelRunnerOutput`.
    """
    runner = FixedTokenRunner()
    batch_queue: deque[tuple[Any, Any]] = deque()
    schedule_ns: list[int] = []
    update_ns: list[int] = []
    num_scheduled_tokens = 0
    # max_steps counts updates: every run then takes at least one step's output.
    while (scheduler.has_requests() or batch_queue) and (max_steps is None or len(update_ns) < max_steps):
        if scheduler.has_requests():
            start = time.thread_time_ns()
            scheduler_output = scheduler.schedule()
            schedule_ns.append(time.thread_time_ns() - start)
            num_scheduled_tokens += scheduler_output.total_num_scheduled_tokens
            req_ids, sampled_token_ids = runner.sample(scheduler_output)
            model_runner_output = model_runner_output_cls(
                req_ids=req_ids,
                req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
                sampled_token_ids=sampled_token_ids,
                logprobs=None,
            )
            batch_queue.appendleft((model_runner_output, scheduler_output))
            if scheduler_output.total_num_scheduled_tokens > 0 and len(batch_queue) < batch_queue_size:
                continue
        model_runner_output, scheduler_output = batch_queue.pop()
        start = time.thread_time_ns()
        scheduler.update_from_output(scheduler_output, model_runner_output)
        update_ns.append(time.thread_time_ns() - start)
    if num_scheduled_tokens == 0:
        raise ValueError("no step scheduled any token: give the benchmark at least one request and step.")
    return {
        "num_steps": len(schedule_ns),
        "num_scheduled_tokens": num_scheduled_tokens,
        "finished": not scheduler.has_unfinished_requests(),
        "schedule_cpu_median_us": statistics.median(schedule_ns) / 1e3,
        "update_from_output_cpu_median_us": statistics.median(update_ns) / 1e3,
        "scheduler_cpu_us_per_token": (sum(schedule_ns) + sum(update_ns)) / 1e3 / num_scheduled_tokens,
    }


def run(workload: dict[str, Any]) -> dict[str, Any]:
    """The workload through v0.11.0's `Scheduler`, synchronously; CPU times as `scheduler_overhead` reports them."""
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

    llama = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_hidden_layers": 1, "vocab_size": workload["vocab_size"], "rms_norm_eps": 1e-5,
        "max_position_embeddings": workload["max_model_len"], "torch_dtype": "float32",
    }
    with tempfile.TemporaryDirectory(prefix="nano_v1_peer_") as model_dir:
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
    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=KVCacheConfig(workload["num_blocks"], [], [KVCacheGroupSpec(["layer"], spec)]),
        structured_output_manager=StructuredOutputManager(vllm_config),
        log_stats=True,  # nano_v1's scheduler always makes its statistics
    )
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

    # vLLM's ModelRunnerOutput has two more fields without defaults.
    model_runner_output_cls = functools.partial(ModelRunnerOutput, prompt_logprobs_dict={}, pooler_output=[])
    return {"vllm": vllm.__version__, **drive(scheduler, model_runner_output_cls, 1, workload["max_steps"])}


if __name__ == "__main__":
    print(json.dumps(run(json.load(sys.stdin))))  # the last line of stdout (vLLM logs there too)
