"""Penalty state per decode step against batch size: token bins kept by diff, or rebuilt every step.

Mirrors no single vLLM file: the measurement behind the penalty bins that nano_v1 keeps in
vllm/v1/worker/gpu_input_batch.py's `InputBatch` for vllm/v1/sample/ops/penalties.py (chapters 01 and 05).
Needs a source checkout (`pip install .` installs only nano_v1): run from its root,
`python -m benchmarks.penalties`.

Why it exists: repetition, frequency and presence penalties need, for every request and
every token of the vocabulary, whether the prompt holds it and how often the request
sampled it: two [batch, vocab] tables. Rebuilt from each request's prompt and output
token lists every step (as vLLM v0.11.0's sampler does, and any engine without persistent
state must), a step costs O(batch x (prompt + output + vocab)). Kept in the persistent
batch (chapter 05) and updated from the scheduler's diff, a step costs one count per
sampled token, plus a prompt's bins when a request joins. Both paths then apply the same
penalties (`apply_all_penalties`, O(batch x vocab)): timed on the last step of each repeat
and reported beside them, as it is the same for both.

    python -m benchmarks.penalties --out penalties.json          # 151,936-token vocab, ~1 min on a CPU
    python -m benchmarks.penalties --out penalties.json --smoke  # tiny sizes, seconds

Notebook 05 runs it and plots figures/05_penalties.png from figures/data/05_penalties.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from benchmarks import NEEDS_CHECKOUT
from nano_v1.benchmarks.utils import write_json
from nano_v1.sample.ops.penalties import apply_all_penalties
from nano_v1.sampling_params import SamplingParams
from nano_v1.worker.gpu_input_batch import CachedRequestState, InputBatch

NAME = "penalties"


@dataclass(frozen=True, slots=True)
class PenaltyWorkload:
    """Decode steps of `batch_size` penalised requests; each finishes after `output_len` tokens
    and a new one takes its place, staggered so that `batch_size / output_len` join per step."""

    vocab_size: int
    prompt_len: int
    output_len: int
    num_steps: int  # timed steps per repeat (the application of the penalties: the last one)
    num_repeats: int
    num_warmup_steps: int


# Qwen3's vocabulary, prompts of 1k tokens, answers of 256: a request joins every step at batch 256.
FULL = PenaltyWorkload(
    vocab_size=151_936, prompt_len=1024, output_len=256, num_steps=20, num_repeats=5, num_warmup_steps=2
)
SMOKE = PenaltyWorkload(
    vocab_size=4096, prompt_len=64, output_len=8, num_steps=3, num_repeats=2, num_warmup_steps=1
)
BATCH_SIZES = (1, 8, 64, 256)
SMOKE_BATCH_SIZES = (1, 8)
PARAMS = SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)


def padded_token_ids(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[rows, longest] int64 on `device`: each row's tokens, padded with `vocab_size` (no token)."""
    width = max(1, max(len(tokens) for tokens in token_lists))
    return torch.tensor(
        [tokens + [vocab_size] * (width - len(tokens)) for tokens in token_lists], dtype=torch.int64
    ).to(device)


def bins_from_padded(
    prompts: torch.Tensor, outputs: torch.Tensor, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt_mask, output_bin_counts) [rows, vocab] from padded token ids, in fresh tables.

    As vLLM v0.11.0's `get_token_bin_counts_and_mask`: a scatter-add into `vocab_size + 1`
    bins, the padding bin dropped.
    """

    def bin_counts(padded: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros(len(padded), vocab_size + 1, dtype=torch.int32, device=padded.device)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.int32))
        return counts[:, :vocab_size]

    return bin_counts(prompts) > 0, bin_counts(outputs)


def rebuild_bins(
    prompts: list[list[int]], outputs: list[list[int]], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt_mask, output_bin_counts) [batch, vocab] from every row's token lists, from scratch."""
    return bins_from_padded(
        padded_token_ids(prompts, vocab_size, device), padded_token_ids(outputs, vocab_size, device), vocab_size
    )


class DecodeDriver:
    """Plays the scheduler and the runner for one persistent batch: finished requests leave,
    new ones take their rows, every request samples one token per step."""

    def __init__(self, workload: PenaltyWorkload, batch_size: int, device: torch.device) -> None:
        self.workload = workload
        self.device = device
        self.rng = np.random.default_rng(batch_size)
        self.batch = InputBatch(
            max_num_reqs=batch_size,
            max_model_len=workload.prompt_len + workload.output_len + 1,
            max_num_batched_tokens=batch_size,
            device=device,
            pin_memory=device.type == "cuda",
            vocab_size=workload.vocab_size,
            block_sizes=[16],
        )
        self.requests: dict[str, CachedRequestState] = {}
        self.num_joined = 0
        for i in range(batch_size):
            # Staggered: request i is i / batch_size of the way through its answer.
            self.batch.add_request(self.new_request(i * workload.output_len // batch_size))
        self.batch.refresh_metadata()

    def new_request(self, num_output_tokens: int = 0) -> CachedRequestState:
        w = self.workload
        state = CachedRequestState(
            req_id=f"req-{self.num_joined}",
            prompt_token_ids=self.rng.integers(0, w.vocab_size, w.prompt_len).tolist(),
            sampling_params=PARAMS,
            generator=None,
            block_ids=([0],),
            num_computed_tokens=w.prompt_len,
            output_token_ids=self.rng.integers(0, w.vocab_size, num_output_tokens).tolist(),
        )
        self.num_joined += 1
        self.requests[state.req_id] = state
        return state

    def step_inputs(self) -> tuple[list[str], list[CachedRequestState], list[int]]:
        """This step's diff, made outside the timed region: who finished, who joins, what each samples."""
        finished = [r for r, s in self.requests.items() if len(s.output_token_ids) >= self.workload.output_len]
        joining = [self.new_request() for _ in finished]
        sampled = self.rng.integers(0, self.workload.vocab_size, len(self.requests) - len(finished)).tolist()
        return finished, joining, sampled

    def apply_diff(self, finished: list[str], joining: list[CachedRequestState], sampled: list[int]) -> None:
        """The persistent batch's path: remove, add into the holes, condense, append, refresh."""
        holes = sorted((self.batch.remove_request(req_id) for req_id in finished), reverse=True)
        for state in joining:
            self.batch.add_request(state, holes.pop() if holes else None)
        self.batch.condense(holes)
        for req_id, token in zip(self.batch.req_ids, sampled):
            self.requests[req_id].output_token_ids.append(token)
        self.batch.refresh_metadata()
        for req_id in finished:
            del self.requests[req_id]

    def token_lists(self) -> tuple[list[list[int]], list[list[int]]]:
        """Every row's prompt and output, in the batch's row order."""
        states = [self.requests[req_id] for req_id in self.batch.req_ids]
        return [s.prompt_token_ids for s in states], [s.output_token_ids for s in states]


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """fn's result and its wall-clock seconds, the device's queue drained before and after."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    result = fn()
    sync()
    return result, time.perf_counter() - start


def measure(workload: PenaltyWorkload, batch_size: int, device: torch.device) -> dict[str, Any]:
    """Milliseconds per step of each path at one batch size: per repeat, the mean over its steps
    (the penalties' application: its last step).

    Every step, outside the timed regions, the diff-updated bins must equal the rebuilt ones.
    """
    driver = DecodeDriver(workload, batch_size, device)
    vocab = workload.vocab_size
    logits = torch.randn(batch_size, vocab, device=device)
    # The rebuild in two parts: the token lists made tensors, then the tables counted from them.
    ms: dict[str, list[float]] = {"diff": [], "rebuild": [], "rebuild_lists": [], "rebuild_tables": [], "apply": []}
    num_joined_timed = 0
    for repeat in range(-1, workload.num_repeats):  # repeat -1: warm-up, not recorded
        steps = workload.num_warmup_steps if repeat < 0 else workload.num_steps
        seconds = {path: 0.0 for path in ms}
        for _ in range(steps):
            finished, joining, sampled = driver.step_inputs()
            _, diff_s = timed(lambda: driver.apply_diff(finished, joining, sampled), device)
            prompts, outputs = driver.token_lists()
            (padded_prompts, padded_outputs), lists_s = timed(
                lambda: (padded_token_ids(prompts, vocab, device), padded_token_ids(outputs, vocab, device)), device
            )
            (prompt_mask, output_bin_counts), tables_s = timed(
                lambda: bins_from_padded(padded_prompts, padded_outputs, vocab), device
            )
            md = driver.batch.sampling_metadata
            if not (
                torch.equal(md.prompt_mask, prompt_mask) and torch.equal(md.output_bin_counts, output_bin_counts)
            ):
                raise AssertionError(f"batch {batch_size}: the diff-updated bins differ from the rebuilt ones")
            seconds["diff"] += diff_s
            seconds["rebuild_lists"] += lists_s
            seconds["rebuild_tables"] += tables_s
            seconds["rebuild"] += lists_s + tables_s
            num_joined_timed += len(joining) if repeat >= 0 else 0
        work = logits.clone()
        _, seconds["apply"] = timed(
            lambda: apply_all_penalties(
                work,
                md.prompt_mask,
                md.output_bin_counts,
                md.presence_penalties,
                md.frequency_penalties,
                md.repetition_penalties,
            ),
            device,
        )
        if repeat >= 0:
            for path in ms:
                ms[path].append(1e3 * seconds[path] / (1 if path == "apply" else steps))
    row: dict[str, Any] = {"batch_size": batch_size}
    for path, values in ms.items():
        row[f"{path}_ms"] = statistics.median(values)
        row[f"{path}_ms_min"] = min(values)
        row[f"{path}_ms_max"] = max(values)
        row[f"{path}_ms_repeats"] = values
    row["rebuild_over_diff"] = row["rebuild_ms"] / row["diff_ms"]
    row["joined_per_step"] = num_joined_timed / (workload.num_steps * workload.num_repeats)
    # Bytes of the two tables, which the persistent batch holds for `max_num_seqs` rows.
    row["bins_bytes"] = batch_size * vocab * (1 + 4)
    print(
        f"  batch {batch_size:>4}: state diff {row['diff_ms']:8.3f} ms, rebuilt {row['rebuild_ms']:8.3f} ms "
        f"({row['rebuild_over_diff']:6.1f}x; lists {row['rebuild_lists_ms']:.3f}, tables "
        f"{row['rebuild_tables_ms']:.3f}); apply {row['apply_ms']:8.3f} ms "
        f"(spread over {workload.num_repeats} repeats: diff {row['diff_ms_min']:.3f}-{row['diff_ms_max']:.3f}, "
        f"rebuilt {row['rebuild_ms_min']:.3f}-{row['rebuild_ms_max']:.3f})"
    )
    return row


def run(device: torch.device, smoke: bool = False) -> dict[str, Any]:
    """Every batch size of the workload (smoke or full) on `device`; the rows and the run's setting."""
    workload = SMOKE if smoke else FULL
    batch_sizes = SMOKE_BATCH_SIZES if smoke else BATCH_SIZES
    rows = [measure(workload, batch_size, device) for batch_size in batch_sizes]
    return {
        "benchmark": NAME,
        "device_type": device.type,
        "torch_num_threads": torch.get_num_threads(),
        "workload": asdict(workload),
        "sampling_params": {
            "presence_penalty": PARAMS.presence_penalty,
            "frequency_penalty": PARAMS.frequency_penalty,
            "repetition_penalty": PARAMS.repetition_penalty,
        },
        "rows": rows,
        "smoke": smoke,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.penalties", description=__doc__.splitlines()[0], epilog=NEEDS_CHECKOUT
    )
    parser.add_argument("--out", required=True, help="write the results (JSON) here")
    parser.add_argument("--smoke", action="store_true", help="tiny vocabulary and batches, seconds anywhere")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"penalty state per decode step on {device.type}, {torch.get_num_threads()} torch thread(s)")
    report = run(device, smoke=args.smoke)
    write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
