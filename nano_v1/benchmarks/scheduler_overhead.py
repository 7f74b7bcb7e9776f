"""Scheduler overhead: CPU µs per step of schedule(), input preparation and update_from_output, no model.

Mirrors the scheduler micro-benchmarks of vllm/benchmarks/ (chapters 04 and 05).

Why it exists: on a GPU a decode step of a small model takes a few milliseconds, so every
millisecond the CPU spends deciding what to run and preparing inputs is throughput lost
(vLLM v1 was rewritten largely for this). Here the model is replaced by a stand-in that
samples a fixed token for every request, so what is left is the engine's own bookkeeping:
  - `schedule`: `Scheduler.schedule()`, KV block allocation included;
  - `prepare_inputs`: the runner's `_update_states` + `_prepare_inputs` (the persistent
    batch diff, then flat input ids, positions and slot mapping);
  - `bookkeeping`: the runner writing the fixed samples back (`_bookkeeping_sync`);
  - `update_from_output`: `Scheduler.update_from_output()`, stop checks and block hashing
    of the new tokens included.
The default workload is the goal's: 256 requests, prompt and output lengths uniform in
[100, 1024], block size 16, 8192 tokens per step, a KV cache that holds every request. The
goal: the scheduler (`schedule` + `update_from_output`) costs at most 0.5 µs of CPU per
scheduled token.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

import numpy as np
import torch

from nano_v1.benchmarks.utils import (
    length_range,
    print_table,
    run_on_model,
    sample_random_requests,
    write_json,
)
from nano_v1.core.kv_cache_utils import get_request_block_hasher
from nano_v1.core.sched.scheduler import Scheduler
from nano_v1.engine.arg_utils import EngineArgs
from nano_v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from nano_v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT
from nano_v1.request import Request
from nano_v1.sample.sampler import SamplerOutput
from nano_v1.sampling_params import SamplingParams
from nano_v1.worker.gpu_model_runner import GPUModelRunner

NAME = "scheduler"
USES_ENGINE_ARGS = True
PARTS = ("schedule", "prepare_inputs", "bookkeeping", "update_from_output")
# The token every request "samples"; any id works, as every request ignores EOS.
FIXED_TOKEN_ID = 7
# The goal: schedule + update_from_output at most 0.5 µs per scheduled token on the default workload.
GOAL_SCHEDULER_US_PER_TOKEN = 0.5


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--input-len-range", type=int, nargs=2, metavar=("LO", "HI"), default=(100, 1024),
                        help="prompt lengths uniform in [LO, HI]")
    parser.add_argument("--output-len-range", type=int, nargs=2, metavar=("LO", "HI"), default=(100, 1024),
                        help="output lengths uniform in [LO, HI]")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    parser.add_argument("--output-json", type=str, default=None, help="write the results here")


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark from parsed CLI flags; print a table, write JSON, return the results."""
    return run_on_model(args, run, weights=False)


def run(args: argparse.Namespace, engine_args: EngineArgs) -> dict[str, Any]:
    input_range = length_range(None, 0.0, tuple(args.input_len_range))
    output_range = length_range(None, 0.0, tuple(args.output_len_range))
    if engine_args.max_model_len is None:
        engine_args.max_model_len = input_range[1] + output_range[1]
    vllm_config = engine_args.create_engine_config()
    cache_config = vllm_config.cache_config
    workload = sample_random_requests(
        args.num_requests, input_range, output_range, vllm_config.model_config.get_vocab_size(), engine_args.seed
    )
    block_size = cache_config.block_size
    # Enough blocks for every request at its full length, plus the null block: no preemption.
    cache_config.num_gpu_blocks = cache_config.num_gpu_blocks_override or 1 + sum(
        -(-(r.prompt_len + r.output_len) // block_size) for r in workload
    )
    # No model is loaded, so no layer reports its spec: one full-attention KV cache group, as
    # every layer of the models this benchmark is meant for (a window would be ignored here).
    model_config = vllm_config.model_config
    spec = FullAttentionSpec(block_size, model_config.get_num_kv_heads(), model_config.get_head_size(), model_config.dtype)
    kv_cache_config = KVCacheConfig(cache_config.num_gpu_blocks, [], [KVCacheGroupSpec(["all layers"], spec)])

    scheduler = Scheduler(vllm_config, kv_cache_config)
    # On a GPU the runner's host-to-device copies are part of its per-step cost.
    runner = GPUModelRunner(vllm_config, torch.device(vllm_config.device_config.device))
    block_hasher = get_request_block_hasher(block_size) if cache_config.enable_prefix_caching else None
    for i, r in enumerate(workload):
        params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
        scheduler.add_request(Request(str(i), r.prompt_token_ids, params, eos_token_id=None, block_hasher=block_hasher))

    # Wall time, and the CPU time of this thread: on a shared machine the second leaves out
    # the moments the OS gave the core to someone else.
    wall_ns: dict[str, list[int]] = {part: [] for part in PARTS}
    cpu_ns: dict[str, list[int]] = {part: [] for part in PARTS}
    num_tokens_per_step: list[int] = []
    while scheduler.has_unfinished_requests() and (args.max_steps is None or len(num_tokens_per_step) < args.max_steps):
        stamps = [_now()]
        scheduler_output = scheduler.schedule()
        stamps.append(_now())
        runner._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens > 0:
            _, _, discard_req_indices = runner._prepare_inputs(scheduler_output)
            stamps.append(_now())
            sampled = torch.full((runner.input_batch.num_reqs, 1), FIXED_TOKEN_ID, dtype=torch.int32)
            model_runner_output = runner._bookkeeping_sync(SamplerOutput(sampled, None), discard_req_indices)
        else:
            stamps.append(_now())
            model_runner_output = EMPTY_MODEL_RUNNER_OUTPUT
        stamps.append(_now())
        scheduler.update_from_output(scheduler_output, model_runner_output)
        stamps.append(_now())
        for part, (w0, c0), (w1, c1) in zip(PARTS, stamps, stamps[1:]):
            wall_ns[part].append(w1 - w0)
            cpu_ns[part].append(c1 - c0)
        num_tokens_per_step.append(scheduler_output.total_num_scheduled_tokens)

    report = summarize(wall_ns, cpu_ns, num_tokens_per_step)
    report.update(
        benchmark=NAME,
        workload={
            "num_requests": len(workload),
            "input_len_range": list(input_range),
            "output_len_range": list(output_range),
            "seed": engine_args.seed,
            "finished": not scheduler.has_unfinished_requests(),
        },
        engine_args={k: str(v) for k, v in dataclasses.asdict(engine_args).items()},
        num_gpu_blocks=cache_config.num_gpu_blocks,
        goal={"scheduler_us_per_token": GOAL_SCHEDULER_US_PER_TOKEN},
    )
    print_report(report)
    if args.output_json:
        write_json(args.output_json, report)
    return report


def _now() -> tuple[int, int]:
    return time.perf_counter_ns(), time.thread_time_ns()


def summarize(
    wall_ns: dict[str, list[int]], cpu_ns: dict[str, list[int]], num_tokens_per_step: list[int]
) -> dict[str, Any]:
    """Per part: median, mean and p99 µs per step (wall), median CPU µs, and µs per scheduled token."""
    num_steps = len(num_tokens_per_step)
    total_tokens = sum(num_tokens_per_step)
    if num_steps == 0 or total_tokens == 0:
        raise ValueError("no step scheduled any token: give the benchmark at least one request and step.")
    per_step = {
        part: {
            "median_us": statistics.median(wall_ns[part]) / 1e3,
            "mean_us": statistics.fmean(wall_ns[part]) / 1e3,
            "p99_us": float(np.percentile(wall_ns[part], 99)) / 1e3,
            "us_per_token": sum(wall_ns[part]) / 1e3 / total_tokens,
            "cpu_median_us": statistics.median(cpu_ns[part]) / 1e3,
            "cpu_us_per_token": sum(cpu_ns[part]) / 1e3 / total_tokens,
        }
        for part in PARTS
    }

    def us_per_token(times: dict[str, list[int]], parts: tuple[str, str]) -> float:
        return sum(sum(times[p]) for p in parts) / 1e3 / total_tokens

    scheduler_parts, runner_parts = ("schedule", "update_from_output"), ("prepare_inputs", "bookkeeping")
    return {
        "num_steps": num_steps,
        "num_scheduled_tokens": total_tokens,
        "mean_tokens_per_step": total_tokens / num_steps,
        "per_step": per_step,
        # The goal's measure: schedule + update_from_output, over every scheduled token.
        "scheduler_us_per_token": us_per_token(wall_ns, scheduler_parts),
        "scheduler_cpu_us_per_token": us_per_token(cpu_ns, scheduler_parts),
        "runner_us_per_token": us_per_token(wall_ns, runner_parts),
        "runner_cpu_us_per_token": us_per_token(cpu_ns, runner_parts),
    }


def print_report(report: dict[str, Any]) -> None:
    w = report["workload"]
    title = (f"{w['num_requests']} requests, prompts {w['input_len_range'][0]}-{w['input_len_range'][1]}, "
             f"outputs {w['output_len_range'][0]}-{w['output_len_range'][1]}: {report['num_steps']} steps, "
             f"{report['mean_tokens_per_step']:.0f} tokens per step")
    columns = [("part", "part", ""), ("median µs", "median_us", ".1f"), ("mean µs", "mean_us", ".1f"),
               ("p99 µs", "p99_us", ".1f"), ("µs/token", "us_per_token", ".3f"), ("CPU µs", "cpu_median_us", ".1f"),
               ("CPU µs/tok", "cpu_us_per_token", ".3f")]
    rows = [{"part": part, **s} for part, s in report["per_step"].items()]
    notes = [
        f"scheduler (schedule + update_from_output): {report['scheduler_us_per_token']:.3f} µs per scheduled token "
        f"({report['scheduler_cpu_us_per_token']:.3f} CPU); goal on the default workload: "
        f"<= {report['goal']['scheduler_us_per_token']} µs",
        f"runner (prepare_inputs + bookkeeping):     {report['runner_us_per_token']:.3f} µs per scheduled token "
        f"({report['runner_cpu_us_per_token']:.3f} CPU)",
    ]
    print_table(columns, rows, title=title, notes=notes)
