"""`nano-v1 bench processes`: the engine core in this process vs in its own, side by side.

No vLLM counterpart file; it measures the design of vllm/v1/engine/core_client.py (chapter 09).

What it measures, per batch size, for `InprocClient` and `SyncMPClient` on the same
workload: offline throughput, and the CPU time per engine step on each side. In-process,
the core's share is the CPU spent inside `engine_core.get_output()` (schedule, model,
update) and the frontend's is the rest of `LLMEngine.step()` (detokenize, build
outputs). With the core in a child process, the frontend's CPU is this process's and the
core's is the child's (read from /proc), and the two run at the same time: the step
takes about max(core, frontend + messages) instead of their sum.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from nano_v1.benchmarks.utils import print_table, sample_random_requests, write_json
from nano_v1.engine.arg_utils import EngineArgs

NAME = "processes"
USES_ENGINE_ARGS = True


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--output-json", default=None, help="write the results here")


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark from parsed CLI flags; print a table, write JSON, return the results."""
    report = run(args.batch_sizes, args.input_len, args.output_len, EngineArgs.from_cli_args(args))
    print_report(report)
    if args.output_json:
        write_json(args.output_json, report)
    return report


def run(batch_sizes: list[int], input_len: int, output_len: int, engine_args: EngineArgs) -> dict[str, Any]:
    """Both clients on the same requests at every batch size; rows in the order measured."""
    from nano_v1.engine.llm_engine import LLMEngine

    if engine_args.max_model_len is None:
        engine_args.max_model_len = input_len + output_len
    engine_args.max_num_seqs = max(engine_args.max_num_seqs, max(batch_sizes))
    rows = []
    for multiprocess in (False, True):
        engine = LLMEngine.from_engine_args(engine_args, enable_multiprocessing=multiprocess)
        try:
            vocab_size = engine.vllm_config.model_config.get_vocab_size()
            _measure(
                engine, sample_random_requests(1, (input_len, input_len), (2, 2), vocab_size, 1)
            )  # warm up
            for batch_size in batch_sizes:
                requests = sample_random_requests(
                    batch_size, (input_len, input_len), (output_len, output_len), vocab_size, batch_size
                )
                rows.append(
                    {
                        "client": "SyncMPClient" if multiprocess else "InprocClient",
                        "batch_size": batch_size,
                        **_measure(engine, requests),
                    }
                )
        finally:
            engine.shutdown()
    return {"benchmark": NAME, "input_len": input_len, "output_len": output_len, "rows": rows}


def _measure(engine, requests) -> dict[str, float]:
    """Run `requests` to completion through `engine.step()`; return throughput and CPU per step."""
    from nano_v1.engine.core_client import SyncMPClient
    from nano_v1.sampling_params import SamplingParams

    client = engine.engine_core
    child_pid = client.resources.proc.pid if isinstance(client, SyncMPClient) else None
    inside_get_output = [0.0]  # this process's CPU seconds spent inside get_output()
    num_steps = [0]
    get_output = client.get_output

    def timed_get_output():
        cpu = time.process_time()
        outputs = get_output()
        inside_get_output[0] += time.process_time() - cpu
        num_steps[0] += bool(outputs.outputs)
        return outputs

    client.get_output = timed_get_output
    try:
        for i, r in enumerate(requests):
            params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
            engine.add_request(f"bench-{i}", {"prompt_token_ids": r.prompt_token_ids}, params)
        child_cpu, cpu, wall = _process_cpu_s(child_pid), time.process_time(), time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        child_cpu = _process_cpu_s(child_pid) - child_cpu
    finally:
        del client.get_output  # back to the class's method
    steps = max(num_steps[0], 1)
    frontend_cpu = cpu - inside_get_output[0]
    core_cpu = child_cpu if child_pid is not None else inside_get_output[0]
    return {
        "wall_s": wall,
        "num_steps": num_steps[0],
        "output_throughput": sum(r.output_len for r in requests) / wall,
        "wall_ms_per_step": 1e3 * wall / steps,
        "frontend_cpu_ms_per_step": 1e3 * frontend_cpu / steps,
        "core_cpu_ms_per_step": 1e3 * core_cpu / steps,
    }


def _process_cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of process `pid`, all its threads (Linux /proc); 0 for None."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def print_report(report: dict[str, Any]) -> None:
    columns = [("client", "client", ""), ("batch", "batch_size", "d"), ("tok/s", "output_throughput", ".0f"),
               ("wall/step", "wall_ms_per_step", ".2f"), ("frontend", "frontend_cpu_ms_per_step", ".2f"),
               ("core", "core_cpu_ms_per_step", ".2f")]
    by_key = {(r["client"], r["batch_size"]): r for r in report["rows"]}
    notes = [
        f"batch {batch_size}: multiprocess / in-process throughput = "
        f"{r['output_throughput'] / by_key['InprocClient', batch_size]['output_throughput']:.2f}x"
        for (client, batch_size), r in by_key.items()
        if client == "SyncMPClient" and ("InprocClient", batch_size) in by_key
    ]
    print_table(columns, report["rows"], title="ms per step: wall, and the CPU of the frontend and of the core",
                notes=notes)
