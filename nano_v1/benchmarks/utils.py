"""What every `nano-v1 bench` benchmark shares: workload, models, step timing, table, JSON record.

Mirrors vllm/benchmarks/datasets.py (RandomDataset) and vllm/benchmarks/lib/utils.py (chapter 00).

Why one module: every benchmark draws the same kind of workload (random token ids,
lengths uniform in a range, one seed), times engine steps the same way, prints the same
kind of table and writes the same JSON record (date, device and library versions, so
that each number is reproducible and traceable). Keeping all of it here, in a module
that imports no benchmark, means a benchmark depends on this one and on what it
measures, never on another benchmark. The GPU suite and the kernel studies outside the
package (`benchmarks/` of the source checkout) use it too; nothing here imports them.
"""

from __future__ import annotations

import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from nano_v1.engine.arg_utils import EngineArgs
from nano_v1.outputs import StepTiming

if TYPE_CHECKING:
    from nano_v1.engine.llm_engine import LLMEngine
    from nano_v1.entrypoints.llm import LLM

# The benchmarks' model on a CPU: a 4-layer Qwen3 with hidden size 256, 5.2M parameters (2.1M
# of them in the untied 4096 x 256 embedding and LM head). Small enough that a step on a
# 2-core CPU is dominated by per-step overhead, which is exactly what an engine controls.
# The CPU throughput goal is stated on it: 48 requests of 48 tokens, prompts of 32-256,
# nano_v1 at least 10x transformers' continuous batching (`generate_batch`).
TINY_QWEN3_SHAPE = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
}



@dataclass(slots=True)
class BenchRequest:
    """One request of a synthetic workload."""

    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def length_range(length: int | None, range_ratio: float, explicit: tuple[int, int] | None) -> tuple[int, int]:
    """Inclusive [low, high] of a length, from vLLM's `--*-len` and `--random-range-ratio`.

    vLLM draws uniformly from [length * (1 - ratio), length * (1 + ratio)] (floor, ceil);
    an explicit `(low, high)` (our `--*-len-range`) overrides that, because a symmetric ratio
    shared by input and output cannot say "prompts 32-256, outputs exactly 48".
    """
    if explicit is not None:
        low, high = explicit
    else:
        if length is None:
            raise ValueError("give a length or an explicit length range.")
        if not 0.0 <= range_ratio < 1.0:
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}.")
        low, high = math.floor(length * (1 - range_ratio)), math.ceil(length * (1 + range_ratio))
    if not 1 <= low <= high:
        raise ValueError(f"length range must satisfy 1 <= low <= high, got [{low}, {high}].")
    return low, high


def sample_random_requests(
    num_requests: int,
    input_len_range: tuple[int, int],
    output_len_range: tuple[int, int],
    vocab_size: int,
    seed: int,
) -> list[BenchRequest]:
    """`num_requests` prompts of uniformly random token ids, lengths uniform in the inclusive ranges.

    Random tokens defeat the prefix cache (every block hash is new), so the benchmark
    measures the engine, not cache hits.
    """
    if num_requests <= 0:
        raise ValueError(f"the number of requests must be positive, got {num_requests}.")
    rng = np.random.default_rng(seed)
    input_lens = rng.integers(input_len_range[0], input_len_range[1] + 1, size=num_requests)
    output_lens = rng.integers(output_len_range[0], output_len_range[1] + 1, size=num_requests)
    return [
        BenchRequest(rng.integers(0, vocab_size, size=int(n)).tolist(), int(m))
        for n, m in zip(input_lens, output_lens)
    ]


def write_tiny_qwen3(path: str | os.PathLike, seed: int = 0, weights: bool = True) -> str:
    """Write a random Qwen3 of `TINY_QWEN3_SHAPE` (float32) to `path`; return the path.

    With `weights=False` only `config.json` is written: enough for the scheduler benchmark,
    which never runs a model.
    """
    import transformers

    config = transformers.Qwen3Config(**TINY_QWEN3_SHAPE, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config.architectures = ["Qwen3ForCausalLM"]
    if not weights:
        config.save_pretrained(path)
        return str(path)
    torch.manual_seed(seed)
    transformers.Qwen3ForCausalLM(config).to(torch.float32).save_pretrained(path)
    return str(path)


def run_on_model(
    args: Any, run: Callable[[Any, EngineArgs], dict[str, Any]], weights: bool = True
) -> dict[str, Any]:
    """`run(args, engine_args)` on `--model`, or, without one, on a temporary tiny Qwen3."""

    engine_args = EngineArgs.from_cli_args(args)
    if args.model is not None:
        return run(args, engine_args)
    with tempfile.TemporaryDirectory(prefix="nano_v1_bench_") as model_dir:
        engine_args.model = write_tiny_qwen3(model_dir, seed=engine_args.seed, weights=weights)
        return run(args, engine_args)


def release_engines() -> None:
    """Free the engines that went out of scope, before the next one is built or a peer allocates.

    A compiled engine waits in a reference cycle (its model's compiled forward refers back
    to the model) until a collection, and Dynamo's cache outlives it and holds its
    backend, with the CUDA graphs in it. Call it only when no compiled engine is alive:
    resetting Dynamo drops every engine's compiled code.
    """
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextmanager
def step_timing(engine: LLM | LLMEngine) -> Iterator[list[StepTiming]]:
    """Record every `execute_model` of the steps inside the block; the list is filled when it ends.

    The worker's `start_step_timing` and `stop_step_timing`, reached through
    `collective_rpc` (one worker: its list).
    """
    timings: list[StepTiming] = []
    engine.collective_rpc("start_step_timing")
    try:
        yield timings
    finally:
        timings.extend(engine.collective_rpc("stop_step_timing")[0])


def print_table(
    columns: Sequence[tuple[str, str, str]],
    rows: Iterable[Mapping[str, Any]],
    title: str | None = None,
    notes: Iterable[str] = (),
) -> None:
    """Print `title`, a table, then each of `notes` on its own line: every benchmark's table.

    `columns` are (header, row key, format spec), e.g. `("tok/s", "output_throughput", ".0f")`;
    a row without the key shows "-". The first column is aligned left, the others right,
    each as wide as its widest cell.
    """
    lines = [[header for header, _, _ in columns]]
    lines += [["-" if row.get(key) is None else format(row[key], spec) for _, key, spec in columns]
              for row in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(columns))]
    if title:
        print(title)
    for line in lines:
        cells = [line[0].ljust(widths[0])] + [cell.rjust(w) for cell, w in zip(line[1:], widths[1:])]
        print("  ".join(cells))
    for note in notes:
        print(note)


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, smallest and largest value of a cell's repeats: on a shared machine one number hides the noise."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def environment() -> dict[str, Any]:
    """Where and with what a number was measured."""
    import transformers

    import nano_v1

    if torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    else:
        device = platform.processor() or platform.machine()
        cpuinfo = Path("/proc/cpuinfo")
        if cpuinfo.exists():
            names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if "model name" in line]
            device = names[0] if names else device
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "cpu_count": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "nano_v1": nano_v1.__version__,
        "argv": sys.argv,
    }


def write_json(path: str | os.PathLike, results: dict[str, Any]) -> None:
    """Write `results` with the environment record under `"environment"`."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"environment": environment(), **results}, f, indent=2)
        f.write("\n")
