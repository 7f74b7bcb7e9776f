"""Decode steps without and with CUDA graphs (eager, piecewise, full): latency, launches, host time.

Mirrors the measurement behind vLLM's CUDA graph numbers (vllm/benchmarks/latency.py) (chapter 08).
Needs a source checkout (`pip install .` installs only nano_v1): imported from its root.

Why it exists: chapter 08 claims that a small model's decode step is bound by the host
launching kernels, not by the GPU running them, and that graphing everything between the
attention calls (PIECEWISE) recovers most of what graphing the whole step (FULL) does. So
for each mode, one engine on the same shape and weights measures, per batch size:
  - the decode-step latency (`LLMEngine.step()`, and the model runner inside it);
  - the host time of the forward call alone (`StepTiming.forward_s`): launching, without
    waiting for the GPU, since nothing in a forward pass waits for it;
  - at one batch size, under torch.profiler, the kernels the host launched one by one,
    the graphs it replayed, and the kernels the GPU ran;
and the end-to-end throughput of a small `LLM.generate` workload. Ratios compare modes
measured in the same run: eager/piecewise is what the graphs buy, piecewise/full what
running attention eagerly costs. On a CPU there are no graphs; `CPU_MODES` compares the
eager model with the split-and-compiled one (the host cost of the split path itself).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from benchmarks.context import SuiteContext, max_warm_up_steps, time_decode_steps
from nano_v1.benchmarks.throughput import time_llm_generate
from nano_v1.benchmarks.utils import release_engines, sample_random_requests

BATCH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
# Engine arguments of each mode. FULL_AND_PIECEWISE: a pure decode step is one full graph.
MODES: dict[str, dict[str, Any]] = {
    "eager": {"enforce_eager": True},
    "piecewise": {"compilation_config": {"level": 3, "cudagraph_mode": "PIECEWISE"}},
    "full": {"compilation_config": {"level": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"}},
}
# Without graphs, on any device: the eager model, and the split-and-compiled one uncaptured.
CPU_MODES: dict[str, dict[str, Any]] = {
    "eager": {"enforce_eager": True},
    "split": {"compilation_config": {"level": 3, "cudagraph_mode": "NONE"}},
}
# The host calls that launch one kernel each, and the one that launches a whole graph.
KERNEL_LAUNCH_APIS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
GRAPH_LAUNCH_API = "cudaGraphLaunch"
# The goals, for a decode step of the Qwen3-0.6B shape at batch sizes up to 16: piecewise
# graphs at least 2x faster than eager, and a full graph at most 1.3x faster than piecewise.
GOAL_BATCH_SIZE = 16
GOAL = {"min_eager_over_piecewise_at_small_batch": 2.0, "max_piecewise_over_full_at_small_batch": 1.3}


def count_launches(step: Callable[[], Any]) -> dict[str, int]:
    """Kernels launched one by one, graphs launched, and kernels run on the GPU, in one `step()`."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.events()
    names = Counter(e.name for e in events)
    return {
        "kernel_launches": sum(names[api] for api in KERNEL_LAUNCH_APIS),
        "graph_launches": names[GRAPH_LAUNCH_API],
        "gpu_kernels": sum(1 for e in events if e.device_type == DeviceType.CUDA),
    }


def measure_mode(
    llm: Any,
    batch_sizes: list[int],
    context_len: int,
    num_steps: int,
    profile_batch_size: int | None = None,
    throughput_requests: list | None = None,
    time_left: Callable[[], float] = lambda: float("inf"),
) -> dict[str, Any]:
    """One engine (an `LLM`, its engine core in this process) in its mode: decode-step rows per batch size,
    launches, throughput."""
    engine = llm.llm_engine
    vocab_size = engine.vllm_config.model_config.get_vocab_size()
    rng = np.random.default_rng(0)
    result: dict[str, Any] = {
        "cudagraph_mode": engine.vllm_config.compilation_config.cudagraph_mode.name,
        "compilation_level": engine.vllm_config.compilation_config.level,
        "rows": [],
    }
    for batch_size in batch_sizes:
        rows = result["rows"]
        if rows and time_left() < 3 * rows[-1]["wall_s"]:
            result["truncated"] = f"stopped before batch size {batch_size}: the time cap was near"
            break
        row_start = time.perf_counter()
        prompts = rng.integers(0, vocab_size, (batch_size, context_len)).tolist()

        def after_timed_steps(batch_size: int = batch_size) -> None:
            if batch_size == profile_batch_size:
                result["launches"] = {"batch_size": batch_size, **count_launches(engine.step)}

        step_s, timings = time_decode_steps(engine, prompts, num_steps, after_timed_steps=after_timed_steps)
        rows.append(
            {
                "batch_size": batch_size,
                "step_ms": 1e3 * statistics.median(step_s),
                "execute_model_ms": 1e3 * statistics.median(t.execute_model_s for t in timings),
                "forward_host_ms": 1e3 * statistics.median(t.forward_s for t in timings),
                "wall_s": time.perf_counter() - row_start,
            }
        )
    if throughput_requests:
        run = time_llm_generate(llm, throughput_requests)
        result["throughput"] = {
            "elapsed_s": run.elapsed_s,
            "output_tokens_per_s": run.num_output_tokens / run.elapsed_s,
        }
    return result


def compare(results: dict[str, dict[str, Any]], peer: str, base: str) -> dict[str, float]:
    """`base` step latency / `peer` step latency, per batch size both measured (> 1: peer is faster)."""
    base_ms = {r["batch_size"]: r["step_ms"] for r in results[base]["rows"]}
    return {
        str(r["batch_size"]): base_ms[r["batch_size"]] / r["step_ms"]
        for r in results[peer]["rows"]
        if r["batch_size"] in base_ms
    }


def measure_cuda_graphs(ctx: SuiteContext) -> dict[str, Any]:
    """The GPU suite's `cuda_graphs` measurement: the three modes on the Qwen3-0.6B shape (bf16, dummy weights).

    Graphs are captured only at the measured batch sizes, to keep start-up short; every
    mode uses the Triton attention kernel (FULL needs it, and the comparison must not
    change kernels between modes). On a CPU (the suite's smoke check) the same engines
    are built without graphs (`cudagraph_mode` NONE: each mode's model, split or not, runs
    uncaptured), with the reference attention, and no launches are counted.
    """
    batch_sizes = [1, 2, 4] if ctx.smoke else BATCH_SIZES
    context_len, num_steps = (32, 2) if ctx.smoke else (128, 10)
    model_dir = ctx.model_dir("qwen3-0.6b")
    base: dict[str, Any] = {
        "max_model_len": 1024,
        "max_num_seqs": max(batch_sizes),
        "enable_prefix_caching": False,
        # The Triton kernel in every mode (FULL graphs need it); TRITON_ATTN so no mode cascades.
        "attention_backend": "TRITON_ATTN" if ctx.on_cuda else "TORCH_REFERENCE",
    }
    assert (
        context_len + max_warm_up_steps(max(batch_sizes), context_len, ctx.max_num_batched_tokens) + num_steps + 2
        <= base["max_model_len"]
    )
    vocab_size = ctx.engine_args(model_dir).create_engine_config().model_config.get_vocab_size()
    lens = (8, 16) if ctx.smoke else (100, 256)
    requests = sample_random_requests(8 if ctx.smoke else 64, lens, lens, vocab_size, seed=0)
    results = ctx.partial.setdefault("modes", {})
    for mode, overrides in MODES.items():
        overrides = dict(overrides)
        if "compilation_config" in overrides:
            graphs = {"cudagraph_capture_sizes": batch_sizes} if ctx.on_cuda else {"cudagraph_mode": "NONE"}
            overrides["compilation_config"] = {**overrides["compilation_config"], **graphs}
        start = time.perf_counter()
        llm = ctx.llm(model_dir, **base, **overrides)
        startup_s = time.perf_counter() - start  # Dynamo's trace and the graph captures included
        results[mode] = {
            "startup_s": startup_s,
            **measure_mode(
                llm,
                batch_sizes,
                context_len,
                num_steps,
                profile_batch_size=min(8, max(batch_sizes)) if ctx.on_cuda else None,
                throughput_requests=requests,
                time_left=ctx.time_left,
            ),
        }
        del llm
        release_engines()
        rows = results[mode]["rows"]
        print(
            f"  {mode:>9} ({results[mode]['cudagraph_mode']}): "
            + ", ".join(
                f"B={r['batch_size']} {r['step_ms']:.2f} ms (host {r['forward_host_ms']:.2f})" for r in rows
            )
        )
    ratios = {
        "eager/piecewise": compare(results, "piecewise", "eager"),
        "piecewise/full": compare(results, "full", "piecewise"),
        "eager/full": compare(results, "full", "eager"),
    }
    small = [str(b) for b in batch_sizes if b <= GOAL_BATCH_SIZE]
    summary = {
        "goals": dict(GOAL),
        "min_eager_over_piecewise_at_small_batch": min(
            ratios["eager/piecewise"].get(b, np.nan) for b in small
        ),
        "max_piecewise_over_full_at_small_batch": max(ratios["piecewise/full"].get(b, np.nan) for b in small),
        "throughput_piecewise_over_eager": (
            results["piecewise"]["throughput"]["output_tokens_per_s"]
            / results["eager"]["throughput"]["output_tokens_per_s"]
        ),
    }
    return {
        "model": "tiny Qwen3 (smoke)" if ctx.smoke else "qwen3-0.6b",
        "context_len": context_len,
        "num_timed_steps": num_steps,
        "throughput_workload": {
            "num_prompts": len(requests),
            "input_len_range": list(lens),
            "output_len_range": list(lens),
        },
        "modes": results,
        "ratios": ratios,
        "summary": summary,
    }
