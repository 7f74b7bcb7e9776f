"""Asynchronous scheduling measured: a simulated device, the demo model, and the host beside an H200's forward.

Mirrors the measurement behind vLLM's async scheduling numbers (vllm/benchmarks/throughput.py) (chapter 14).
Needs a source checkout (`pip install .` installs only nano_v1): imported from its root.

Why it exists: chapter 14 claims that with `async_scheduling` a decode step costs
max(host, device) instead of host + device. Three measurements, each with its peer
(synchronous scheduling) in the same run, the two engines alive at once and taking turns:
  - `simulated_device`: the real host path (the engine core and its scheduler in this
    process, the worker in its own process behind the multiprocess executor, the runner's
    input preparation, sampling and bookkeeping) with the device replaced by one that takes
    T ms per forward and that the host waits for only where it reads the step's tokens
    (`SimulatedDevice`, `DeviceResult`, installed in the worker through `collective_rpc`).
    Step time against T at one decode batch; the host time is the synchronous step at T=0.
  - `demo_model`: output tokens/s of `LLM.generate` on the bundled demo model, engine core
    and worker each in their own process, synchronous against asynchronous.
  - `host_vs_roofline`: the synchronous step at T=0 (the host's time per decode step)
    against the batch size, beside the roofline time of a Qwen3-0.6B forward on an H200
    at the same batch: the predicted step, host + device or max(host, device), and the
    throughput each gives.
Every cell is repeated; a repeat's value is the median over its steps. On a shared machine
other jobs only ever add time, so a step time is the fastest repeat's (the median and the
slowest repeat beside it), and a throughput the median of the repeats (with the fastest
and slowest).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from benchmarks import NEEDS_CHECKOUT
from benchmarks.context import CONFIGS_DIR, MAX_NUM_BATCHED_TOKENS
from nano_v1.benchmarks.roofline import H200_DATASHEET, ModelShape, decode_step_cost
from nano_v1.benchmarks.throughput import time_llm_generate
from nano_v1.benchmarks.utils import print_table, sample_random_requests, spread, write_json, write_tiny_qwen3
from nano_v1.core.sched.output import SchedulerOutput
from nano_v1.demo_model import DEMO_MODEL_PATH
from nano_v1.engine import EngineCoreRequest
from nano_v1.engine.arg_utils import EngineArgs
from nano_v1.engine.core import EngineCore
from nano_v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
from nano_v1.sampling_params import SamplingParams
from nano_v1.worker.gpu_worker import Worker

MODES = ("sync", "async")
DEVICE_MS = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0)
SIM_BATCH_SIZE = 64
HOST_BATCH_SIZES = (1, 8, 32, 64, 128, 256)
PROMPT_LEN = 128  # tokens per simulated request; also the context of the H200 roofline
NUM_STEPS = 40  # timed decode steps per request and repeat
BLOCK_SIZE = 16
REPEATS = 5
# The demo model's workload: prompts uniform in the range, every request `DEMO_OUTPUT_LEN` tokens.
DEMO_NUM_PROMPTS = 64
DEMO_INPUT_LEN_RANGE = (32, 128)
DEMO_OUTPUT_LEN = 64
DEMO_REPEATS = 3
# The goal: the asynchronous step within 10% of max(host, device) at every T.
GOAL = {"max_async_over_max_host_device": 1.10}
SMOKE = {
    "device_ms": (0.0, 2.0),
    "sim_batch_size": 4,
    "host_batch_sizes": (1, 4),
    "prompt_len": 16,
    "num_steps": 4,
    "repeats": 1,
    "demo_num_prompts": 4,
    "demo_input_len_range": (8, 16),
    "demo_output_len": 4,
    "demo_repeats": 1,
}


class SimulatedDevice(nn.Module):
    """A model on a device of known speed: a forward queues `step_s` of work and returns zero hidden states.

    Like a GPU's stream, the device runs one step after the other: a forward launched
    while the previous one still runs starts when it ends (`busy_until`). The host does not
    wait here but where it reads the step's tokens (`DeviceResult`). Everything around the
    forward stays real: the runner prepares inputs, samples from the zero logits, keeps the tokens.
    """

    def __init__(self, hidden_size: int, vocab_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.hidden_size, self.vocab_size, self.dtype = hidden_size, vocab_size, dtype
        self.step_s = 0.0
        self.busy_until = 0.0  # time.perf_counter() at which the last queued step ends
        self.waited_s: list[float] = []  # per step: how long the host waited for it (0: it was done)

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, *rest: torch.Tensor
    ) -> torch.Tensor:
        self.busy_until = max(time.perf_counter(), self.busy_until) + self.step_s
        return torch.zeros(positions.shape[0], self.hidden_size, dtype=self.dtype, device=positions.device)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.zeros(
            hidden_states.shape[0], self.vocab_size, dtype=self.dtype, device=hidden_states.device
        )


class DeviceResult(AsyncModelRunnerOutput):
    """A step's output whose tokens the simulated device has not finished: `get_output` waits
    for the device, as v0.11.0's waits for the sampled tokens' copy to the host
    (`AsyncGPUModelRunnerOutput.get_output`) before the worker sends them.

    The worker calls `get_output` where it sends the answer (`WorkerProc.enqueue_output`):
    synchronous scheduling sends from the worker's busy loop, which thus waits for the device
    before it takes the next step; asynchronous scheduling sends from the output thread
    (`WorkerProc.async_output_busy_loop`), and the busy loop prepares the next step meanwhile.
    """

    def __init__(self, output: ModelRunnerOutput | AsyncModelRunnerOutput, device: SimulatedDevice) -> None:
        self.output, self.device, self.ready_at = output, device, device.busy_until

    def get_output(self) -> ModelRunnerOutput:
        start = time.perf_counter()
        if self.ready_at > start:
            time.sleep(self.ready_at - start)
        self.device.waited_s.append(time.perf_counter() - start)
        output = self.output
        return output.get_output() if isinstance(output, AsyncModelRunnerOutput) else output


def _execute_on_device(
    execute_model: Callable[[SchedulerOutput], ModelRunnerOutput | AsyncModelRunnerOutput],
    device: SimulatedDevice, scheduler_output: SchedulerOutput,
) -> ModelRunnerOutput | AsyncModelRunnerOutput:  # fmt: skip
    output = execute_model(scheduler_output)
    return DeviceResult(output, device) if scheduler_output.total_num_scheduled_tokens else output


def simulate_device(worker: Worker, step_s: float) -> None:
    """Run in the worker (`collective_rpc`): put its model on a `SimulatedDevice` taking `step_s` per forward.

    After the engine started: the KV cache was sized and bound, and the model warmed up, on
    the real model, which nothing calls afterwards. The runner's `execute_model` is wrapped
    (an instance attribute) so that its outputs wait for the device (`DeviceResult`).
    """
    runner = worker.model_runner
    if not isinstance(runner.model, SimulatedDevice):
        config = runner.vllm_config.model_config
        runner.model = SimulatedDevice(config.get_hidden_size(), config.get_vocab_size(), config.dtype)
        runner.execute_model = functools.partial(_execute_on_device, runner.execute_model, runner.model)
    runner.model.step_s = step_s
    runner.model.waited_s.clear()


def device_waits(worker: Worker) -> list[float]:
    """Run in the worker (`collective_rpc`): per step since `simulate_device`, how long the host waited."""
    return list(worker.model_runner.model.waited_s)


def simulated_engine_core(async_scheduling: bool, max_num_seqs: int, max_model_len: int) -> EngineCore:
    """An engine core in this process, its worker in another (the multiprocess executor in both
    modes), on a random tiny Qwen3 whose forward `simulate_device` then replaces; on the CPU."""
    model_dir = write_tiny_qwen3(tempfile.mkdtemp(prefix="nano_v1_async_"), weights=False)
    engine_args = EngineArgs(
        model=model_dir, load_format="dummy", device="cpu", seed=0, dtype="float32",
        distributed_executor_backend="mp", async_scheduling=async_scheduling,
        max_num_seqs=max_num_seqs, max_model_len=max_model_len, enable_prefix_caching=False,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, block_size=BLOCK_SIZE,
        num_gpu_blocks_override=max_num_seqs * -(-max_model_len // BLOCK_SIZE) + 1,
    )  # fmt: skip
    core = EngineCore(engine_args.create_engine_config())
    core.collective_rpc(simulate_device, args=(0.0,))
    return core


def time_decode_steps(
    core: EngineCore, batch_size: int, prompt_len: int, num_steps: int, seed: int
) -> dict[str, float]:
    """Run `batch_size` requests of `prompt_len` random tokens to completion; time the steps that
    gave every request a token (pure decode steps of the whole batch), at least `num_steps` of them.

    A step's time is the interval between two such outputs of `EngineCore.step_fn` (with
    async scheduling, one returns per call once two steps are in flight). Returns the
    median and mean interval in seconds and how many there were.
    """
    vllm_config = core.vllm_config
    vocab_size = vllm_config.model_config.get_vocab_size()
    rng = np.random.default_rng(seed)
    # A request prefilled in the first step gains a token in every later one: it must still be
    # running after the last request's prefill step and `num_steps` whole-batch steps more.
    prefill_steps = -(-batch_size * prompt_len // vllm_config.scheduler_config.max_num_batched_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=prefill_steps + num_steps + 1, ignore_eos=True)
    for i in range(batch_size):
        prompt = rng.integers(0, vocab_size, prompt_len).tolist()
        core.add_request(
            EngineCoreRequest(
                f"s{seed}-{i}", prompt, params, eos_token_id=None, arrival_time=time.monotonic()
            )
        )
    full_steps_at: list[float] = []
    while core.scheduler.has_unfinished_requests() or core.batch_queue:
        outputs = core.step_fn()
        if outputs is not None and len(outputs.outputs) == batch_size:
            full_steps_at.append(time.perf_counter())
    intervals = np.diff(full_steps_at)
    if len(intervals) < num_steps:
        raise RuntimeError(f"only {len(intervals) + 1} decode steps gave all {batch_size} requests a token.")
    return {
        "median_s": float(np.median(intervals)),
        "mean_s": float(np.mean(intervals)),
        "num_intervals": len(intervals),
    }



def measure_simulated_device(
    cores: dict[str, EngineCore], device_ms: tuple[float, ...], batch_size: int, prompt_len: int, num_steps: int,
    repeats: int,
) -> dict[str, Any]:  # fmt: skip
    """Step time over the simulated device's T, sync against async; the modes alternate within every cell."""
    runs = []
    for repeat in range(repeats):
        for t_ms in device_ms:
            # The order alternates, so that neither mode always runs right after the other.
            for mode in MODES if (repeat + device_ms.index(t_ms)) % 2 == 0 else MODES[::-1]:
                core = cores[mode]
                core.collective_rpc(simulate_device, args=(t_ms / 1e3,))
                step = time_decode_steps(core, batch_size, prompt_len, num_steps, seed=repeat)
                waited = core.collective_rpc(device_waits)[0]
                runs.append({
                    "repeat": repeat, "mode": mode, "device_ms": t_ms, **step,
                    "device_wait_median_s": float(np.median(waited)),
                })  # fmt: skip
    rows = []
    # The host: the synchronous step with nothing to wait for (its fastest repeat).
    host_s = min(r["median_s"] for r in runs if r["mode"] == "sync" and r["device_ms"] == 0)
    for t_ms in device_ms:
        cell = {mode: [r for r in runs if r["mode"] == mode and r["device_ms"] == t_ms] for mode in MODES}
        device_s = t_ms / 1e3
        row: dict[str, Any] = {"device_ms": t_ms}
        for mode in MODES:
            s = spread([1e3 * r["median_s"] for r in cell[mode]])
            row.update({f"{mode}_ms": s["min"], f"{mode}_ms_median": s["median"], f"{mode}_ms_max": s["max"]})
            row[f"{mode}_device_wait_ms"] = 1e3 * statistics.median(
                r["device_wait_median_s"] for r in cell[mode]
            )
        row["host_plus_device_ms"] = 1e3 * (host_s + device_s)
        row["max_host_device_ms"] = 1e3 * max(host_s, device_s)
        row["sync_over_sum"] = row["sync_ms"] / row["host_plus_device_ms"]
        row["async_over_max"] = row["async_ms"] / row["max_host_device_ms"]
        row["sync_over_async"] = row["sync_ms"] / row["async_ms"]
        rows.append(row)
    return {
        "batch_size": batch_size, "prompt_len": prompt_len, "num_steps": num_steps, "repeats": repeats,
        "host_ms": 1e3 * host_s,
        "crossover_device_ms": 1e3 * host_s,  # where the device takes as long as the host
        "rows": rows,
        "max_async_over_max": max(r["async_over_max"] for r in rows),
        "goal": dict(GOAL),
        "every_run": runs,
    }  # fmt: skip


def measure_host_vs_roofline(
    core: EngineCore, batch_sizes: tuple[int, ...], prompt_len: int, num_steps: int, repeats: int,
) -> dict[str, Any]:  # fmt: skip
    """The synchronous step at T=0 per batch size, beside an H200's roofline of a Qwen3-0.6B forward."""
    core.collective_rpc(simulate_device, args=(0.0,))
    host = {b: [] for b in batch_sizes}
    for repeat in range(repeats):
        for b in batch_sizes:
            host[b].append(time_decode_steps(core, b, prompt_len, num_steps, seed=100 + repeat)["median_s"])
    shape = ModelShape.from_pretrained(CONFIGS_DIR / "qwen3-0.6b")
    rows = []
    for b in batch_sizes:
        s = spread(host[b])
        device_s = decode_step_cost(shape, b, prompt_len, 2).time_floor(H200_DATASHEET)
        sync_s, async_s = s["min"] + device_s, max(s["min"], device_s)
        rows.append({
            "batch_size": b, "host_ms": 1e3 * s["min"], "host_ms_median": 1e3 * s["median"],
            "host_ms_max": 1e3 * s["max"], "h200_forward_ms": 1e3 * device_s,
            "sync_step_ms": 1e3 * sync_s, "async_step_ms": 1e3 * async_s,
            "sync_tokens_per_s": b / sync_s, "async_tokens_per_s": b / async_s,
            "async_over_sync_throughput": sync_s / async_s,
        })  # fmt: skip
    return {
        "model": "Qwen3-0.6B (benchmarks/configs/qwen3-0.6b), bfloat16",
        "device": H200_DATASHEET.device, "context_len": prompt_len, "num_steps": num_steps, "repeats": repeats,
        "rows": rows, "every_run_host_s": {str(b): v for b, v in host.items()},
    }  # fmt: skip


def measure_demo_model(
    num_prompts: int, input_len_range: tuple[int, int], output_len: int, repeats: int,
) -> dict[str, Any]:  # fmt: skip
    """Output tokens/s of `LLM.generate` on the demo model, sync against async, repeats alternated.

    Both engines are alive at once, each with its engine core and its worker in processes
    of their own (the engine core's worker a process, in both modes, through the
    multiprocess executor); an idle one waits on a semaphore and costs no CPU.
    """
    from nano_v1 import LLM

    llms = {
        mode: LLM.from_engine_args(
            EngineArgs(model=str(DEMO_MODEL_PATH), dtype="float32", seed=0, distributed_executor_backend="mp",
                       async_scheduling=mode == "async", max_num_seqs=num_prompts),
            enable_multiprocessing=True,
        )
        for mode in MODES
    }  # fmt: skip
    vocab_size = llms["sync"].llm_engine.vllm_config.model_config.get_vocab_size()
    requests = sample_random_requests(
        num_prompts, input_len_range, (output_len, output_len), vocab_size, seed=0
    )
    runs = []
    try:
        for repeat in range(repeats):
            for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
                run = time_llm_generate(llms[mode], requests)
                runs.append({
                    "repeat": repeat, "mode": mode, "elapsed_s": run.elapsed_s,
                    "output_tokens_per_s": run.num_output_tokens / run.elapsed_s,
                })  # fmt: skip
    finally:
        for llm in llms.values():
            llm.llm_engine.shutdown()
    summary = {mode: spread([r["output_tokens_per_s"] for r in runs if r["mode"] == mode]) for mode in MODES}
    return {
        "model": "demo model (nano_v1/demo_model), float32",
        "workload": {
            "num_prompts": num_prompts,
            "input_len_range": list(input_len_range),
            "output_len": output_len,
        },
        "repeats": repeats,
        "runs": runs,
        "output_tokens_per_s": summary,
        "async_over_sync": summary["async"]["median"] / summary["sync"]["median"],
    }


def run(smoke: bool = False, parts: tuple[str, ...] = ("simulated_device", "host_vs_roofline", "demo_model"),
        progress: Callable[[str], None] = print) -> dict[str, Any]:  # fmt: skip
    """Every part asked for, at full or smoke size; the results as one dict (printed as tables)."""
    size = SMOKE if smoke else {
        "device_ms": DEVICE_MS, "sim_batch_size": SIM_BATCH_SIZE, "host_batch_sizes": HOST_BATCH_SIZES,
        "prompt_len": PROMPT_LEN, "num_steps": NUM_STEPS, "repeats": REPEATS, "demo_num_prompts": DEMO_NUM_PROMPTS,
        "demo_input_len_range": DEMO_INPUT_LEN_RANGE, "demo_output_len": DEMO_OUTPUT_LEN, "demo_repeats": DEMO_REPEATS,
    }  # fmt: skip
    report: dict[str, Any] = {
        "benchmark": "async_scheduling",
        "smoke": smoke,
        "torch_num_threads": torch.get_num_threads(),
    }
    if {"simulated_device", "host_vs_roofline"} & set(parts):
        max_num_seqs = max(size["sim_batch_size"], *size["host_batch_sizes"])
        # The longest request: its prompt, then a token in every step until the last one prefilled, then the timed steps.
        prefill_steps = -(-max_num_seqs * size["prompt_len"] // MAX_NUM_BATCHED_TOKENS)
        max_model_len = size["prompt_len"] + prefill_steps + size["num_steps"] + 1
        cores = {mode: simulated_engine_core(mode == "async", max_num_seqs, max_model_len) for mode in MODES}
        try:
            if "simulated_device" in parts:
                progress("simulated device: step time over T, sync vs async")
                report["simulated_device"] = measure_simulated_device(
                    cores, tuple(size["device_ms"]), size["sim_batch_size"], size["prompt_len"], size["num_steps"],
                    size["repeats"],
                )  # fmt: skip
            if "host_vs_roofline" in parts:
                progress("host time per decode step over the batch size")
                report["host_vs_roofline"] = measure_host_vs_roofline(
                    cores["sync"], tuple(size["host_batch_sizes"]), size["prompt_len"], size["num_steps"],
                    size["repeats"],
                )  # fmt: skip
        finally:
            for core in cores.values():
                core.shutdown()
    if "demo_model" in parts:
        progress("demo model: output tokens/s, sync vs async")
        report["demo_model"] = measure_demo_model(
            size["demo_num_prompts"],
            tuple(size["demo_input_len_range"]),
            size["demo_output_len"],
            size["demo_repeats"],
        )
    print_report(report)
    return report


def print_report(report: dict[str, Any]) -> None:
    if "simulated_device" in report:
        sim = report["simulated_device"]
        print_table(
            [("T (ms)", "device_ms", ".1f"), ("sync (ms)", "sync_ms", ".3f"),
             ("async (ms)", "async_ms", ".3f"), ("sync wait (ms)", "sync_device_wait_ms", ".3f"),
             ("async wait (ms)", "async_device_wait_ms", ".3f"), ("host+T (ms)", "host_plus_device_ms", ".3f"),
             ("max(host,T) (ms)", "max_host_device_ms", ".3f"), ("sync/(host+T)", "sync_over_sum", ".3f"),
             ("async/max", "async_over_max", ".3f"), ("sync/async", "sync_over_async", ".2f")],
            sim["rows"],
            title=f"simulated device, decode batch {sim['batch_size']}: host {sim['host_ms']:.3f} ms per step "
                  f"(sync at T=0); fastest of {sim['repeats']} repeat(s)",
            notes=[(f"worst async/max(host, T): {sim['max_async_over_max']:.3f} "
                    f"(goal <= {GOAL['max_async_over_max_host_device']:.2f})")],
        )  # fmt: skip
    if "host_vs_roofline" in report:
        hr = report["host_vs_roofline"]
        print_table(
            [("batch", "batch_size", "d"), ("host (ms)", "host_ms", ".3f"), ("H200 fwd (ms)", "h200_forward_ms", ".3f"),
             ("sync step (ms)", "sync_step_ms", ".3f"), ("async step (ms)", "async_step_ms", ".3f"),
             ("sync tok/s", "sync_tokens_per_s", ".0f"), ("async tok/s", "async_tokens_per_s", ".0f"),
             ("async/sync", "async_over_sync_throughput", ".2f")],
            hr["rows"],
            title=f"host per decode step (this machine) beside {hr['model']} on {hr['device']} "
                  f"(roofline, context {hr['context_len']}): predicted; host: fastest of {hr['repeats']} repeat(s)",
        )  # fmt: skip
    if "demo_model" in report:
        demo = report["demo_model"]
        print_table(
            [("mode", "mode", ""), ("median tok/s", "median", ".1f"), ("min", "min", ".1f"), ("max", "max", ".1f")],
            [{"mode": mode, **s} for mode, s in demo["output_tokens_per_s"].items()],
            title=f"{demo['model']}: output tokens/s over {demo['repeats']} alternated repeat(s), "
                  f"workload {demo['workload']}",
            notes=[f"async/sync (medians): {demo['async_over_sync']:.3f}"],
        )  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.async_scheduling",
        description=__doc__.splitlines()[0],
        epilog=NEEDS_CHECKOUT,
    )
    parser.add_argument("--out", required=True, help="write the results (JSON) here")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat: runs in seconds")
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=("simulated_device", "host_vs_roofline", "demo_model"),
        default=["simulated_device", "host_vs_roofline", "demo_model"],
        help="what to measure",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (each engine's worker takes as many)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    report = run(smoke=args.smoke, parts=tuple(args.parts))
    write_json(args.out, report)
    return report


if __name__ == "__main__":
    # The worker imports `simulate_device` by its module's name, which under `python -m` is
    # "__main__" here and the child's own main there: run the imported module's `main` instead.
    from benchmarks.async_scheduling import main as imported_main

    imported_main()
