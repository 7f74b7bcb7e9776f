"""Every GPU measurement in one run of a few minutes: ceilings, decode latency, throughput, async scheduling.

Mirrors the role of vllm/benchmarks/ (latency, throughput) for a device we hold for
minutes, not days (chapter 00).
Needs a source checkout (`pip install .` installs only nano_v1): run from its root,
`python -m benchmarks.gpu_suite`.

Why it exists: a GPU is lent to this project rarely and briefly (15 minutes, start-up
included), so everything we want to know from it must already be written, tested on a
CPU, and run in one command that cannot stall:

    python -m benchmarks.gpu_suite --out OUT            # on a CUDA machine, 5 minutes
    python -m benchmarks.gpu_suite --out OUT --smoke    # anywhere: tiny sizes, about 30 s

It writes OUT/gpu_suite.json (rewritten after every measurement, so a run cut short still
leaves its results) and OUT/gpu_suite.log. Measurements are a registry: a function
`fn(ctx) -> dict` registered under a name with a time cap,

    @register("cascade_attention", cap_s=35, cpu_stub="the reference backend instead of Triton's")
    def cascade_attention(ctx: SuiteContext) -> dict: ...

and run in registration order. One that raises is recorded with its traceback; one that
passes its cap is interrupted (SIGALRM) and recorded as timed out, with whatever it put
in `ctx.partial`; either way the suite goes on. On a CPU (smoke sizes only) every
measurement runs, its CUDA-only parts replaced by what `cpu_stub` says, which the record
repeats (`stubbed_on_cpu`).
Models are built from the configs in `benchmarks/configs/` with dummy weights
(`load_format="dummy"`): real shapes, random values, no checkpoint to download. Every
engine keeps its core in this process (`SuiteContext.llm`): the measurements time its
worker, and the GPU image has no pyzmq or msgspec for an engine-core process. (With async
scheduling the worker has a process of its own, reached through shared memory.)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch

from benchmarks import NEEDS_CHECKOUT
from benchmarks.attention_kernels import run_attention_kernels
from benchmarks.cascade import run_grid
from benchmarks.context import SuiteContext, max_warm_up_steps, time_decode_steps
from benchmarks.cuda_graphs import measure_cuda_graphs
from benchmarks.spec_decode_verify import verify_cost_sweep
from nano_v1.benchmarks.roofline import H200_DATASHEET, ModelShape, decode_step_cost, step_cost, workload_cost
from nano_v1.benchmarks.throughput import dummy_hf_model, run_generate_batch, time_llm_generate
from nano_v1.benchmarks.utils import (
    BenchRequest,
    release_engines,
    sample_random_requests,
    step_timing,
    write_json,
)
from nano_v1.config import ModelConfig

NAME = "gpu_suite"
# The whole suite on an H200: every cap below adds up to this (the device script's part of
# its 9 minutes, `tools/device_run.py`).
DEFAULT_TIME_BUDGET_S = 310.0
SMOKE_TIME_BUDGET_S = 120.0
# nano-vllm's benchmark, which the H200 goals are stated on: 256 requests, prompt and output
# lengths uniform in [100, 1024]. On it, with the Qwen3-0.6B shape, nano_v1 must reach at least
# 20,000 output tokens/s, 3x transformers' `generate_batch` with CUDA graphs, and half of the
# roofline (about 47,000 tokens/s at the H200's 4.8 TB/s).
NUM_PROMPTS = 256
LEN_RANGE = (100, 1024)
GOAL = {"output_tokens_per_s": 20_000, "ratio_vs_generate_batch": 3.0, "fraction_of_roofline": 0.5}


class MeasurementTimeout(Exception):
    """Raised inside a measurement when its time cap runs out."""


@dataclass(slots=True)
class Measurement:
    name: str
    fn: Callable[[SuiteContext], dict[str, Any]]
    cap_s: float
    cpu_stub: str | None  # what a CPU run does instead of the CUDA-only parts, if any
    description: str


MEASUREMENTS: dict[str, Measurement] = {}


def register(name: str, cap_s: float, cpu_stub: str | None = None):
    """Decorator: add `fn(ctx) -> dict` to the suite under `name`, interrupted after `cap_s` seconds.

    `cpu_stub` says what `fn` does on a CPU instead of the parts only CUDA has.
    """
    if cap_s <= 0:
        raise ValueError(f"cap_s must be positive, got {cap_s}.")

    def decorate(fn: Callable[[SuiteContext], dict[str, Any]]) -> Callable[[SuiteContext], dict[str, Any]]:
        if name in MEASUREMENTS:
            raise ValueError(f"a measurement named {name!r} is already registered.")
        description = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        MEASUREMENTS[name] = Measurement(name, fn, cap_s, cpu_stub, description)
        return fn

    return decorate


# ---------------------------------------------------------------------------- measurements
@register("ceilings", cap_s=10)
def ceilings(ctx: SuiteContext) -> dict[str, Any]:
    """Memory bandwidth (device-to-device copy) and matmul rate (bf16 on a GPU), measured."""
    measured = ctx.ceilings()
    out = measured.to_dict()
    if ctx.on_cuda:
        out["fraction_of_h200_datasheet"] = {
            "memory_bandwidth": measured.memory_bandwidth / H200_DATASHEET.memory_bandwidth,
            "matmul_flops": measured.matmul_flops / H200_DATASHEET.matmul_flops,
        }
    return out


def decode_latency_sweep(ctx: SuiteContext, config_name: str) -> dict[str, Any]:
    """Engine-step latency of pure decode steps against batch size at a fixed context, beside its roofline floor.

    For each batch size B, B requests with random prompts of `context_len` tokens are
    prefilled, then `num_steps` decode steps are timed: the whole `LLMEngine.step()`
    (schedule, model, update, output processing) and, inside it, the model runner's
    `execute_model` alone. A batch size that would not finish before the cap is skipped.
    """
    batch_sizes = [1, 2, 4] if ctx.smoke else [1, 2, 4, 8, 16, 32, 64, 128, 256]
    context_len, num_steps = (32, 2) if ctx.smoke else (512, 20)
    model_dir = ctx.model_dir(config_name)
    shape = ModelShape.from_pretrained(model_dir)
    max_warm_up = max_warm_up_steps(max(batch_sizes), context_len, ctx.max_num_batched_tokens)
    # Graphs for the measured batch sizes only: the default ladder (67 sizes up to 512, each
    # for every piece of the split model) would take much of the cap before the first row.
    llm = ctx.llm(model_dir, max_model_len=context_len + max_warm_up + num_steps + 2,
                  max_num_seqs=max(batch_sizes), enable_prefix_caching=False,
                  compilation_config={"cudagraph_capture_sizes": batch_sizes})
    engine = llm.llm_engine
    dtype_bytes = engine.vllm_config.model_config.dtype.itemsize
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = ctx.partial.setdefault("rows", [])
    ceilings = ctx.ceilings()

    for batch_size in batch_sizes:
        # Cheap insurance: the previous batch size's time, doubled, must still fit.
        if rows and ctx.time_left() < 2 * rows[-1]["wall_s"]:
            ctx.partial["truncated"] = f"stopped before batch size {batch_size}: the time cap was near"
            break
        start = time.perf_counter()
        prompts = rng.integers(0, shape.vocab_size, (batch_size, context_len)).tolist()
        step_s, timings = time_decode_steps(engine, prompts, num_steps)
        runner_s = [t.execute_model_s for t in timings]
        # Mid-way through the timed steps a context is about context_len + 2 warm-up tokens + num_steps / 2.
        floor_s = decode_step_cost(shape, batch_size, context_len + 2 + num_steps // 2, dtype_bytes).time_floor(ceilings)
        step_ms, runner_ms = 1e3 * float(np.median(step_s)), 1e3 * float(np.median(runner_s))
        rows.append({
            "batch_size": batch_size,
            "step_ms": step_ms,
            "execute_model_ms": runner_ms,
            "engine_overhead_ms": step_ms - runner_ms,
            "roofline_floor_ms": 1e3 * floor_s,
            "fraction_of_roofline": 1e3 * floor_s / step_ms,
            "output_tokens_per_s": batch_size / (step_ms / 1e3),
            "wall_s": time.perf_counter() - start,
        })
        print(f"  decode B={batch_size:>3}: step {step_ms:8.3f} ms (model runner {runner_ms:8.3f} ms), "
              f"floor {1e3 * floor_s:7.3f} ms, {rows[-1]['fraction_of_roofline']:.1%} of roofline")
    return {
        "model": config_name if not ctx.smoke else "tiny Qwen3 (smoke)",
        "context_len": context_len,
        "num_timed_steps": num_steps,
        "dtype": str(engine.vllm_config.model_config.dtype).removeprefix("torch."),
        "ceilings": ceilings.to_dict(),
        **ctx.partial,
    }


@register("decode_latency", cap_s=30)
def decode_latency(ctx: SuiteContext) -> dict[str, Any]:
    """Decode-step latency vs batch size (1-256), Qwen3-0.6B shape, context 512, against the roofline."""
    return decode_latency_sweep(ctx, "qwen3-0.6b")


@register("decode_latency_qwen3_4b", cap_s=25)
def decode_latency_qwen3_4b(ctx: SuiteContext) -> dict[str, Any]:
    """The same sweep at the Qwen3-4B shape (8 GB of weights per step: a second point on the roofline)."""
    return decode_latency_sweep(ctx, "qwen3-4b")


@register("attention_kernels", cap_s=20, cpu_stub="the Triton kernel checked in Triton's interpreter, not timed")
def attention_kernels(ctx: SuiteContext) -> dict[str, Any]:
    """Triton paged attention vs gather+SDPA, prefill/decode/mixed batches, Qwen3-0.6B attention shape."""
    return run_attention_kernels(ctx.device, ctx.ceilings(), smoke=ctx.smoke)


def throughput_workload(ctx: SuiteContext, shape: ModelShape) -> tuple[list[BenchRequest], dict[str, Any]]:
    """nano-vllm's workload (random prompts, lengths uniform in [100, 1024]); tiny in smoke mode.

    The number of requests is `--num-prompts` (256), unless an earlier measurement in this
    run already fixed it (both engines must run the same workload), or unless the decode
    latencies measured in this run predict that nano_v1 would not finish within its cap,
    in which case it is scaled down and the JSON says so.
    """
    if ctx.smoke:
        lens, out_lens = (8, 32), (4, 8)
    else:
        lens = out_lens = LEN_RANGE
    sizing: dict[str, Any] = {"num_prompts_requested": ctx.num_prompts}
    earlier = ctx.results.get("throughput_qwen3_0.6b", {}).get("result", {}).get("workload")
    num_prompts = earlier["num_prompts"] if earlier else ctx.num_prompts
    decode = ctx.results.get("decode_latency", {}).get("result")
    if earlier is None and decode and not ctx.smoke:
        # Engine start-up and warm-up take about 20 s of the cap.
        budget = 0.8 * (ctx.time_left() - 20.0)
        while num_prompts > 16 and _predicted_seconds(ctx, shape, num_prompts, lens, out_lens, decode) > budget:
            num_prompts -= 16
        if num_prompts < ctx.num_prompts:
            sizing["scaled_down"] = (
                f"{ctx.num_prompts} requests were predicted (from decode_latency) to take longer than the "
                f"{budget:.0f} s left: ran {num_prompts}"
            )
    requests = sample_random_requests(num_prompts, lens, out_lens, shape.vocab_size, seed=0)
    return requests, {"num_prompts": num_prompts, "input_len_range": list(lens),
                      "output_len_range": list(out_lens), "seed": 0, **sizing}


def _predicted_seconds(ctx: SuiteContext, shape: ModelShape, num_prompts: int, lens: tuple[int, int],
                       out_lens: tuple[int, int], decode: dict[str, Any]) -> float:
    """A pessimistic time for nano_v1 on the workload, from the decode sweep's fractions of the roofline.

    All requests run at once; decode step k has a batch of the requests with more than k
    output tokens. A step of b tokens is charged its roofline floor over the fraction of
    the roofline the sweep measured at batch size b (interpolated; past either end of the
    sweep, the fraction at that end): prefill steps of `max_num_batched_tokens` at the
    fraction of the largest batch measured, which a one-row sweep makes pessimistic, not
    absurd. Plus 25% for contexts longer than the sweep's.
    """
    # Only the lengths matter here, and the same seed draws the same lengths at any vocabulary size.
    requests = sample_random_requests(num_prompts, lens, out_lens, vocab_size=2, seed=0)
    output_lens = np.array([r.output_len for r in requests])
    rows = decode["rows"]
    dtype_bytes = getattr(torch, decode["dtype"]).itemsize
    ceilings = ctx.ceilings()

    def fraction(num_tokens: int) -> float:
        return float(np.interp(num_tokens, [r["batch_size"] for r in rows], [r["fraction_of_roofline"] for r in rows]))

    batch_per_step = (output_lens[None, :] > np.arange(1, output_lens.max())[:, None]).sum(axis=1)
    batches, num_steps = np.unique(batch_per_step, return_counts=True)
    decode_s = sum(
        n * decode_step_cost(shape, int(b), decode["context_len"], dtype_bytes).time_floor(ceilings) / fraction(int(b))
        for b, n in zip(batches, num_steps)
    )
    prompt_lens = [r.prompt_len for r in requests]
    prefill_floor_s = step_cost(shape, prompt_lens, prompt_lens, dtype_bytes).time_floor(ceilings)
    prefill_s = prefill_floor_s / fraction(ctx.max_num_batched_tokens)
    return 1.25 * float(decode_s + prefill_s)


def _throughput_report(ctx: SuiteContext, engine: str, result, workload: dict[str, Any],
                       requests: list[BenchRequest], model_config: ModelConfig) -> dict[str, Any]:
    """An engine's throughput with the workload's roofline: the fastest any engine could run it here."""
    cost = workload_cost(ModelShape.from_config(model_config), [r.prompt_len for r in requests],
                         [r.output_len for r in requests], ctx.max_num_batched_tokens, model_config.dtype.itemsize)
    floor_s = cost.time_floor(ctx.ceilings())
    summary = result.summary(cost.total_flops)
    return {
        "engine": engine,
        "workload": workload,
        **summary,
        "roofline": {**cost.summary(ctx.ceilings()), "output_tokens_per_s": summary["num_output_tokens"] / floor_s},
        "fraction_of_roofline": floor_s / summary["elapsed_s"],
    }


@register("throughput_qwen3_0.6b", cap_s=50)
def throughput_nano_v1(ctx: SuiteContext) -> dict[str, Any]:
    """nano_v1 `LLM.generate` on nano-vllm's workload, Qwen3-0.6B shape, dummy weights, ignore_eos."""
    model_dir = ctx.model_dir("qwen3-0.6b")
    requests, workload = throughput_workload(ctx, ModelShape.from_pretrained(model_dir))
    ctx.partial["workload"] = workload
    llm = ctx.llm(model_dir, max_model_len=workload["input_len_range"][1] + workload["output_len_range"][1])
    result = time_llm_generate(llm, requests)
    return _throughput_report(ctx, "nano_v1", result, workload, requests, llm.llm_engine.vllm_config.model_config)


@register("throughput_qwen3_0.6b.generate_batch", cap_s=45)
def throughput_generate_batch(ctx: SuiteContext) -> dict[str, Any]:
    """transformers' continuous batching (`generate_batch`'s manager) on the same workload and shape."""
    model_dir = ctx.model_dir("qwen3-0.6b")
    requests, workload = throughput_workload(ctx, ModelShape.from_pretrained(model_dir))
    ctx.partial["workload"] = workload
    model_config = ctx.engine_args(model_dir).create_engine_config().model_config
    model = dummy_hf_model(model_dir, model_config.dtype, ctx.device)
    result = run_generate_batch(model, requests, ctx.max_num_batched_tokens,
                                use_cuda_graph=True if ctx.on_cuda else None, progress=ctx.partial)
    return _throughput_report(ctx, "transformers generate_batch", result, workload, requests, model_config)


@register("cuda_graphs", cap_s=50, cpu_stub="no graphs: each mode's model runs uncaptured (the reference "
                                           "attention), no kernel launches counted")
def cuda_graphs(ctx: SuiteContext) -> dict[str, Any]:
    """Decode-step latency, kernel launches and host time per step: eager vs piecewise vs full CUDA graphs."""
    return measure_cuda_graphs(ctx)


@register("spec_decode_verify_cost", cap_s=25)
def spec_decode_verify_cost(ctx: SuiteContext) -> dict[str, Any]:
    """Step time verifying 1 + k tokens per request vs a plain decode step (0.6B shape), and the break-even acceptance rate."""
    return verify_cost_sweep(ctx)


@register("cascade_attention", cap_s=25, cpu_stub="the reference backend instead of Triton's (FLASH_ATTN)")
def cascade_attention(ctx: SuiteContext) -> dict[str, Any]:
    """Cascade vs plain attention (Triton), Qwen3-0.6B attention, prefix 1k-32k x batch 8-256 x suffix 128/1024."""
    return run_grid(ctx.device, smoke=ctx.smoke, rows=ctx.partial.setdefault("rows", []))


@contextmanager
def _engine_core_host_times(core) -> Iterator[dict[str, list[float]]]:
    """Time the engine core's own work on pure decode steps inside the block: each `schedule()`
    and `update_from_output()` of a step that decodes one token for every scheduled request,
    and when each such update ended (the steady step period is the gap between two).

    Shadows the two methods on the scheduler instance while the block runs.
    """
    scheduler = core.scheduler
    schedule, update_from_output = scheduler.schedule, scheduler.update_from_output
    times: dict[str, list[float]] = {"schedule_s": [], "update_s": [], "update_end_s": []}

    def is_decode(scheduler_output) -> bool:
        return scheduler_output.total_num_scheduled_tokens == len(scheduler_output.num_scheduled_tokens) > 0

    def timed_schedule():
        start = time.perf_counter()
        scheduler_output = schedule()
        if is_decode(scheduler_output):
            times["schedule_s"].append(time.perf_counter() - start)
        return scheduler_output

    def timed_update(scheduler_output, model_runner_output):
        start = time.perf_counter()
        outputs = update_from_output(scheduler_output, model_runner_output)
        end = time.perf_counter()
        if is_decode(scheduler_output):
            times["update_s"].append(end - start)
            times["update_end_s"].append(end)
        return outputs

    scheduler.schedule, scheduler.update_from_output = timed_schedule, timed_update
    try:
        yield times
    finally:
        del scheduler.schedule, scheduler.update_from_output


@register("async_scheduling", cap_s=30)
def async_scheduling(ctx: SuiteContext) -> dict[str, Any]:
    """The demo model decoding, sync vs async scheduling: the engine core's host time per decode step, and tokens/s."""
    from nano_v1 import SamplingParams
    from nano_v1.demo_model import DEMO_MODEL_PATH

    batch_sizes = [1, 4] if ctx.smoke else [1, 32, 256]
    prompt_len, output_len = (8, 8) if ctx.smoke else (64, 64)
    max_model_len = prompt_len + output_len + 2
    block_size = 16
    # Both engines at once, each with the cache the largest batch needs and at most 40% of the
    # GPU: the sync one with its worker in this process, the async one with its worker in a
    # process of its own (the default with async scheduling).
    engine_kwargs = {
        "load_format": "auto", "max_num_seqs": max(batch_sizes), "max_model_len": max_model_len,
        "enable_prefix_caching": False, "gpu_memory_utilization": 0.4, "block_size": block_size,
        "num_gpu_blocks_override": max(batch_sizes) * -(-max_model_len // block_size) + 1,
        "compilation_config": {"cudagraph_capture_sizes": batch_sizes},
    }  # fmt: skip
    llms = {
        "sync": ctx.llm(str(DEMO_MODEL_PATH), **engine_kwargs),
        "async": ctx.llm(str(DEMO_MODEL_PATH), **engine_kwargs, async_scheduling=True),
    }
    rng = np.random.default_rng(0)
    vocab_size = ModelShape.from_pretrained(str(DEMO_MODEL_PATH)).vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    rows: list[dict[str, Any]] = ctx.partial.setdefault("rows", [])
    try:
        for name, llm in llms.items():  # warm-up: the first steps of an engine pay for lazy work
            llm.generate([{"prompt_token_ids": [1] * prompt_len}] * 2, params, use_tqdm=False)
        for batch_size in batch_sizes:
            if rows and ctx.time_left() < 4 * rows[-1]["wall_s"]:
                ctx.partial["truncated"] = f"stopped before batch size {batch_size}: the time cap was near"
                break
            prompts = [{"prompt_token_ids": p} for p in rng.integers(0, vocab_size, (batch_size, prompt_len)).tolist()]
            for name, llm in llms.items():
                rows.append(_decode_sync_or_async(llm, name, prompts, params))
                r = rows[-1]
                print(f"  {name:>5} B={batch_size:>3}: step {r['step_ms']:7.3f} ms, engine core host "
                      f"{r['engine_core_host_ms']:6.3f} ms, worker execute_model {r['execute_model_ms']:6.3f} ms, "
                      f"{r['decode_tokens_per_s']:9.0f} decode tokens/s")
    finally:
        llms["async"].llm_engine.shutdown()
    by_size: dict[int, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_size.setdefault(r["batch_size"], {})[r["scheduling"]] = r
    speedup = {
        b: pair["async"]["decode_tokens_per_s"] / pair["sync"]["decode_tokens_per_s"]
        for b, pair in by_size.items() if len(pair) == 2
    }  # fmt: skip
    return {
        "model": "the bundled demo model" + (" (smoke)" if ctx.smoke else ""),
        "prompt_len": prompt_len,
        "output_len": output_len,
        "executors": {name: type(llm.llm_engine.engine_core.engine_core.model_executor).__name__
                      for name, llm in llms.items()},
        "async_decode_speedup": speedup,
        **ctx.partial,
    }


def _decode_sync_or_async(llm, scheduling: str, prompts: list[dict], params) -> dict[str, Any]:
    """One batch through one engine: medians over its pure decode steps."""
    start = time.perf_counter()
    engine = llm.llm_engine
    with _engine_core_host_times(engine.engine_core.engine_core) as times, step_timing(engine) as timings:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    decode = [t.execute_model_s for t in timings if t.num_scheduled_tokens == len(prompts)]
    schedule_ms, update_ms = 1e3 * float(np.median(times["schedule_s"])), 1e3 * float(np.median(times["update_s"]))
    step_ms = 1e3 * float(np.median(np.diff(times["update_end_s"])))
    return {
        "scheduling": scheduling,
        "batch_size": len(prompts),
        "num_decode_steps": len(times["update_s"]),
        "step_ms": step_ms,
        "schedule_ms": schedule_ms,
        "update_ms": update_ms,
        "engine_core_host_ms": schedule_ms + update_ms,
        "execute_model_ms": 1e3 * float(np.median(decode)),
        "decode_tokens_per_s": len(prompts) / (step_ms / 1e3),
        "output_tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed,
        "wall_s": elapsed,
    }


# ---------------------------------------------------------------------------- the runner
@contextmanager
def _hard_time_cap(seconds: float) -> Iterator[None]:
    """Raise MeasurementTimeout in this (main) thread after `seconds`; elsewhere rely on the elapsed-time check."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(signum, frame):
        raise MeasurementTimeout(f"exceeded its time cap of {seconds:.1f} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_measurement(measurement: Measurement, ctx: SuiteContext, cap_s: float) -> dict[str, Any]:
    """Run one measurement under its cap; return its record (status ok | error | timed_out)."""
    record: dict[str, Any] = {"description": measurement.description, "cap_s": cap_s}
    if measurement.cpu_stub and not ctx.on_cuda:
        record["stubbed_on_cpu"] = measurement.cpu_stub
    print(f"[{measurement.name}] {measurement.description} (cap {cap_s:.1f} s)")
    ctx.partial = {}
    if ctx.on_cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    start = time.perf_counter()
    ctx.deadline = start + cap_s
    try:
        with _hard_time_cap(cap_s):
            result = measurement.fn(ctx)
        status = "ok"
    except MeasurementTimeout as e:
        result, status = None, "timed_out"
        record["error"] = str(e)
    except Exception as e:  # noqa: BLE001 -- recorded, and the suite goes on to the next measurement
        result, status = None, "error"
        record.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
    wall_s = time.perf_counter() - start
    if status == "ok" and wall_s > cap_s:
        # The cap could not interrupt it (a long call outside Python): keep the result, flag the overrun.
        status, record["error"] = "timed_out", f"finished in {wall_s:.1f} s, over its cap of {cap_s:.1f} s"
    record.update(status=status, wall_s=wall_s)
    if result is not None:
        record["result"] = result
    elif ctx.partial:
        record["partial"] = ctx.partial
    if ctx.on_cuda:
        record["peak_memory_GiB"] = torch.cuda.max_memory_allocated(ctx.device) / 2**30
    # Free this measurement's models and caches before the next one builds its own.
    release_engines()
    return record


def summarize(records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The headline figures against the H200 goals (`GOAL`), from whichever measurements succeeded."""
    ours = records.get("throughput_qwen3_0.6b", {})
    peer = records.get("throughput_qwen3_0.6b.generate_batch", {})
    summary: dict[str, Any] = {"goals": dict(GOAL)}
    if ours.get("status") == "ok":
        r = ours["result"]
        summary.update(nano_v1_output_tokens_per_s=r["output_tokens_per_s"],
                       nano_v1_fraction_of_roofline=r["fraction_of_roofline"],
                       roofline_output_tokens_per_s=r["roofline"]["output_tokens_per_s"])
        if peer.get("status") == "ok":
            summary["ratio_vs_generate_batch"] = r["output_tokens_per_s"] / peer["result"]["output_tokens_per_s"]
        elif peer.get("status") == "timed_out" and "timed_s" in peer.get("partial", {}):
            # The peer's timed pass (model build and warm-ups left out) ran longer than this
            # before its cap cut it, on the same tokens: the ratio is at least this.
            summary["ratio_vs_generate_batch_at_least"] = peer["partial"]["timed_s"] / r["elapsed_s"]
    decode = records.get("decode_latency", {}).get("result")
    if decode:
        summary["decode_fraction_of_roofline"] = {row["batch_size"]: row["fraction_of_roofline"] for row in decode["rows"]}
    overlap = records.get("async_scheduling", {}).get("result")
    if overlap:
        summary["async_decode_speedup"] = overlap["async_decode_speedup"]
    return summary


def device_info(device: torch.device) -> dict[str, Any]:
    """The device and the versions of the software stack that drives it."""
    info: dict[str, Any] = {"type": device.type, "torch_cuda": torch.version.cuda}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, capability=f"{props.major}.{props.minor}",
                    total_memory_GiB=props.total_memory / 2**30, multiprocessors=props.multi_processor_count)
    else:
        info["name"] = platform.processor() or platform.machine()
    return info


class _Tee:
    """A text stream that writes to a terminal stream and to the log file."""

    def __init__(self, stream: TextIO, log: TextIO) -> None:
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        self.log.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.log.flush()
        self.stream.flush()

    def isatty(self) -> bool:
        return False


@contextmanager
def _tee_output(log_path: Path) -> Iterator[None]:
    """Copy everything printed to stdout and stderr into `log_path`."""
    with open(log_path, "w") as log:
        stdout, stderr = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(stdout, log), _Tee(stderr, log)
        try:
            yield
        finally:
            sys.stdout, sys.stderr = stdout, stderr


def select(names: list[str] | None) -> list[Measurement]:
    """The measurements to run: all, or those named (a name also selects `name.*`), in registration order."""
    if not names:
        return list(MEASUREMENTS.values())
    unknown = [n for n in names if not any(m == n or m.startswith(n + ".") for m in MEASUREMENTS)]
    if unknown:
        raise ValueError(f"unknown measurement(s) {unknown}; registered: {list(MEASUREMENTS)}.")
    return [m for m in MEASUREMENTS.values() if any(m.name == n or m.name.startswith(n + ".") for n in names)]


def run_suite(out_dir: str | Path, smoke: bool = False, only: list[str] | None = None,
              time_budget_s: float | None = None, num_prompts: int | None = None) -> dict[str, Any]:
    """Run the selected measurements one after another; write and return the report."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not smoke:
        raise ValueError("no CUDA device: the real sizes need a GPU. Run with --smoke for the CPU check.")
    if device.type == "cpu":
        # The Triton kernels run in Triton's interpreter on a CPU. Triton reads the variable when
        # it is first imported (`device_info` imports it), so it is set before anything else runs.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    measurements = select(only)
    budget = time_budget_s or (SMOKE_TIME_BUDGET_S if smoke else DEFAULT_TIME_BUDGET_S)
    report: dict[str, Any] = {
        "benchmark": NAME, "smoke": smoke, "device": device_info(device), "time_budget_s": budget,
        "python": platform.python_version(), "measurements": {},
    }
    json_path = out_dir / f"{NAME}.json"
    num_threads = torch.get_num_threads()
    if smoke and device.type == "cpu":
        # Smoke numbers are not measurements; one thread keeps the check fast on a shared CPU,
        # where intra-op threads that wait on each other can make a step 20x slower.
        torch.set_num_threads(1)
    try:
        with _tee_output(out_dir / f"{NAME}.log"), tempfile.TemporaryDirectory(prefix="nano_v1_gpu_") as work:
            ctx = SuiteContext(device=device, smoke=smoke, work_dir=Path(work),
                               num_prompts=num_prompts or (4 if smoke else NUM_PROMPTS))
            print(f"gpu_suite on {report['device']['name']} ({device}), smoke={smoke}, budget {budget:.0f} s: "
                  f"{[m.name for m in measurements]}")
            _run_all(measurements, ctx, budget, report, json_path)
    finally:
        torch.set_num_threads(num_threads)
    return report


def _run_all(measurements: list[Measurement], ctx: SuiteContext, budget: float, report: dict[str, Any],
             json_path: Path) -> None:
    """Each measurement under min(its cap, what is left of the budget); the JSON rewritten after each."""
    suite_start = time.perf_counter()
    for m in measurements:
        left = budget - (time.perf_counter() - suite_start)
        if left < 1.0:
            record = {"description": m.description, "cap_s": m.cap_s, "status": "skipped",
                      "reason": "skipped: the suite's time budget is spent"}
        else:
            record = run_measurement(m, ctx, min(m.cap_s, left))
        ctx.results[m.name] = record
        report["measurements"][m.name] = record
        done = record.get("reason") or f"{record['status']} in {record['wall_s']:.1f} s"
        print(f"[{m.name}] {done}" + (f": {record['error']}" if "error" in record else ""))
        report["summary"] = summarize(report["measurements"])
        report["total_wall_s"] = time.perf_counter() - suite_start
        write_json(json_path, report)  # after every measurement: a run cut short keeps what it did
    print(json.dumps(report.get("summary"), indent=2))
    print(f"wrote {json_path} in {report.get('total_wall_s', 0.0):.1f} s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_suite",
                                     description=__doc__.splitlines()[0], epilog=NEEDS_CHECKOUT)
    parser.add_argument("--out", help="directory for gpu_suite.json and gpu_suite.log (required unless --list)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, runs anywhere in under a minute")
    parser.add_argument("--only", nargs="+", metavar="NAME", default=None,
                        help="run only these measurements (NAME also selects NAME.*)")
    parser.add_argument("--time-cap-s", type=float, default=None,
                        help=f"time budget of the whole suite (default {DEFAULT_TIME_BUDGET_S:.0f} s, "
                             f"{SMOKE_TIME_BUDGET_S:.0f} s with --smoke); each measurement also has its own cap")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help=f"requests of the throughput workload (default {NUM_PROMPTS}; 4 with --smoke)")
    parser.add_argument("--list", action="store_true", help="list the measurements and exit")
    args = parser.parse_args(argv)
    if args.list:
        for m in MEASUREMENTS.values():
            print(f"{m.name:<40} cap {m.cap_s:>4.0f} s  {m.description}"
                  + (f" (on a CPU: {m.cpu_stub})" if m.cpu_stub else ""))
        return
    if args.out is None:
        parser.error("--out is required")
    try:
        run_suite(args.out, args.smoke, args.only, args.time_cap_s, args.num_prompts)
    except ValueError as e:
        print(f"gpu_suite: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
