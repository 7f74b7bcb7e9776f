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

A second table runs the same workload through the scheduler alone, side by side, in four
variants (`VARIANTS`): one KV cache group of full attention (`UnitaryKVCacheCoordinator`,
every model before chapter 12) or two, full attention and a sliding window
(`HybridKVCacheCoordinator`, chapter 12); under `Scheduler`, or under `AsyncScheduler`
driven as `EngineCore.step_with_batch_queue` drives it with a batch queue of two
(step N + 1 is scheduled before step N's output is taken, chapter 14). There a stand-in
runner (`scheduler_peer_vllm.FixedTokenRunner`, which `--peer-vllm` gives vLLM's own
scheduler too) answers each step with the fixed token for every request whose step
reaches its last known token, so the times are the scheduler's own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nano_v1.benchmarks.scheduler_peer_vllm import FIXED_TOKEN_ID, drive
from nano_v1.benchmarks.utils import (
    BenchRequest,
    length_range,
    print_table,
    run_on_model,
    sample_random_requests,
    write_json,
)
from nano_v1.config import VllmConfig
from nano_v1.core.kv_cache_utils import RequestBlockHasher, get_request_block_hasher
from nano_v1.core.sched.async_scheduler import AsyncScheduler
from nano_v1.core.sched.scheduler import Scheduler
from nano_v1.engine.arg_utils import EngineArgs
from nano_v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from nano_v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from nano_v1.request import Request
from nano_v1.sample.sampler import SamplerOutput
from nano_v1.sampling_params import SamplingParams
from nano_v1.worker.gpu_model_runner import GPUModelRunner

NAME = "scheduler"
USES_ENGINE_ARGS = True
PARTS = ("schedule", "prepare_inputs", "bookkeeping", "update_from_output")
# The goal: schedule + update_from_output at most 0.5 µs per scheduled token on the default workload.
GOAL_SCHEDULER_US_PER_TOKEN = 0.5
# The scheduler-only comparison: (KV cache groups, scheduler class) per variant.
VARIANTS: dict[str, tuple[str, type[Scheduler]]] = {
    "single-group": ("full", Scheduler),
    "hybrid": ("full+sliding", Scheduler),
    "single-group async": ("full", AsyncScheduler),
    "hybrid async": ("full+sliding", AsyncScheduler),
}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--input-len-range", type=int, nargs=2, metavar=("LO", "HI"), default=(100, 1024),
                        help="prompt lengths uniform in [LO, HI]")
    parser.add_argument("--output-len-range", type=int, nargs=2, metavar=("LO", "HI"), default=(100, 1024),
                        help="output lengths uniform in [LO, HI]")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    parser.add_argument("--sliding-window", type=int, default=1024,
                        help="the window of the hybrid variants' second KV cache group (Gemma 3's: 1024)")
    parser.add_argument("--peer-vllm", type=str, default=None, metavar="PYTHON",
                        help="also run vLLM v0.11.0's scheduler on the workload, under this Python (one with "
                             "vLLM v0.11.0 installed), in a subprocess: scheduler_peer_vllm.py")
    parser.add_argument("--output-json", type=str, default=None, help="write the results here")


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark from parsed CLI flags; print the tables, write JSON, return the results."""
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
    block_hasher = get_request_block_hasher(block_size) if cache_config.enable_prefix_caching else None
    # No model is loaded, so no layer reports its spec: one full-attention KV cache group, as
    # every layer of the models this benchmark is meant for (a window would be ignored here).
    kv_cache_config = make_kv_cache_config(vllm_config, workload, "full", args.sliding_window)
    cache_config.num_gpu_blocks = kv_cache_config.num_blocks

    scheduler = Scheduler(vllm_config, kv_cache_config)
    # On a GPU the runner's host-to-device copies are part of its per-step cost.
    runner = GPUModelRunner(vllm_config, torch.device(vllm_config.device_config.device))
    add_requests(scheduler, workload, block_hasher)

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
        sliding_window=args.sliding_window,
        variants={
            name: run_variant(vllm_config, workload, block_hasher, groups, scheduler_cls, args)
            for name, (groups, scheduler_cls) in VARIANTS.items()
        },
    )
    if args.peer_vllm:
        peer = run_peer_vllm(args.peer_vllm, vllm_config, workload, args.max_steps)
        peer["ratio_to_single_group"] = (
            peer["scheduler_cpu_us_per_token"] / report["variants"]["single-group"]["scheduler_cpu_us_per_token"]
        )
        report["peer_vllm"] = peer
    print_report(report)
    if args.output_json:
        write_json(args.output_json, report)
    return report


def run_peer_vllm(
    python: str, vllm_config: VllmConfig, workload: list[BenchRequest], max_steps: int | None
) -> dict[str, Any]:
    """The single-group synchronous variant's workload through vLLM's own scheduler, run by
    scheduler_peer_vllm.py under `python`; its JSON answer (CPU times, as the variants')."""
    cache_config, scheduler_config = vllm_config.cache_config, vllm_config.scheduler_config
    peer_workload = {
        "requests": [[r.prompt_token_ids, r.output_len] for r in workload],
        "vocab_size": vllm_config.model_config.get_vocab_size(),
        "block_size": cache_config.block_size,
        "max_num_batched_tokens": scheduler_config.max_num_batched_tokens,
        "max_num_seqs": scheduler_config.max_num_seqs,
        "max_model_len": vllm_config.model_config.max_model_len,
        "num_blocks": make_kv_cache_config(vllm_config, workload, "full", 0).num_blocks,
        "enable_prefix_caching": cache_config.enable_prefix_caching,
        "max_steps": max_steps,
    }
    # -I: the peer's own environment only (no PYTHONPATH, no script directory on sys.path).
    result = subprocess.run(
        [python, "-I", str(Path(__file__).with_name("scheduler_peer_vllm.py"))],
        input=json.dumps(peer_workload), capture_output=True, text=True, check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"the vLLM peer failed under {python}:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.splitlines()[-1])  # vLLM logs to stdout too: the answer is the last line


def make_kv_cache_config(
    vllm_config: VllmConfig, workload: list[BenchRequest], groups: str, sliding_window: int
) -> KVCacheConfig:
    """One full-attention group ("full"), or that and a sliding-window group ("full+sliding"),
    with enough blocks for every request at its full length in every group, plus the null
    block: no request is ever preempted."""
    model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
    block_size = cache_config.block_size
    heads = {"num_kv_heads": model_config.get_num_kv_heads(), "head_size": model_config.get_head_size(),
             "dtype": model_config.dtype}
    kv_cache_groups = [KVCacheGroupSpec(["full attention"], FullAttentionSpec(block_size=block_size, **heads))]
    if groups == "full+sliding":
        spec = SlidingWindowSpec(block_size=block_size, sliding_window=sliding_window, **heads)
        kv_cache_groups.append(KVCacheGroupSpec(["sliding window"], spec))
    num_blocks = cache_config.num_gpu_blocks_override or 1 + len(kv_cache_groups) * sum(
        -(-(r.prompt_len + r.output_len) // block_size) for r in workload
    )
    return KVCacheConfig(num_blocks, [], kv_cache_groups)


def add_requests(scheduler: Scheduler, workload: list[BenchRequest], block_hasher: RequestBlockHasher | None) -> None:
    for i, r in enumerate(workload):
        params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
        scheduler.add_request(Request(str(i), r.prompt_token_ids, params, eos_token_id=None, block_hasher=block_hasher))


def run_variant(
    vllm_config: VllmConfig,
    workload: list[BenchRequest],
    block_hasher: RequestBlockHasher | None,
    groups: str,
    scheduler_cls: type[Scheduler],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The workload through `scheduler_cls` over `groups`, driven as the engine core drives
    it (`drive`): with a batch queue of two under `AsyncScheduler`, of one otherwise."""
    kv_cache_config = make_kv_cache_config(vllm_config, workload, groups, args.sliding_window)
    scheduler = scheduler_cls(vllm_config, kv_cache_config)
    add_requests(scheduler, workload, block_hasher)
    batch_queue_size = 2 if scheduler_cls is AsyncScheduler else 1
    return {
        "kv_cache_groups": groups,
        "scheduler": scheduler_cls.__name__,
        "batch_queue_size": batch_queue_size,
        **drive(scheduler, ModelRunnerOutput, batch_queue_size, args.max_steps),
    }


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
    print()
    variants = report["variants"]
    metrics = [("schedule CPU µs (median)", "schedule_cpu_median_us", ".1f"),
               ("update_from_output CPU µs (median)", "update_from_output_cpu_median_us", ".1f"),
               ("CPU µs per scheduled token", "scheduler_cpu_us_per_token", ".3f"),
               ("steps", "num_steps", "d"),
               ("scheduled tokens", "num_scheduled_tokens", "d")]
    notes = [(f"single-group: one full-attention KV cache group; hybrid: full attention + a "
              f"{report['sliding_window']}-token sliding window; async: AsyncScheduler, batch queue of 2")]
    if "peer_vllm" in report:
        peer = report["peer_vllm"]
        variants = {**variants, f"vLLM {peer['vllm']}": peer}
        notes.append(f"vLLM {peer['vllm']}'s Scheduler, single group, synchronous: "
                     f"{peer['ratio_to_single_group']:.2f}x nano_v1's CPU µs per scheduled token")
    print_table(
        [("", "metric", "")] + [(name, name, "") for name in variants],
        [{"metric": label, **{name: format(v[key], spec) for name, v in variants.items()}}
         for label, key, spec in metrics],
        title="The scheduler alone (schedule + update_from_output, no runner), per variant:",
        notes=notes,
    )
