"""What the GPU suite's measurements share: the run's context, the shipped shapes, and timed decode steps.

Mirrors no vLLM file: vLLM's benchmarks each build their own engine (chapter 00).
Needs a source checkout (`pip install .` installs only nano_v1): imported from its root.

Why it exists: the suite's measurements build engines of real model shapes with dummy
weights, on whatever device the run has, at smoke or full sizes, within a time cap;
`SuiteContext` carries all of that (notebook 10 makes one too, and most notebooks read
the shipped shapes in `CONFIGS_DIR`). It sits outside the package with the suite:
`nano-v1 bench` never builds one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nano_v1.benchmarks.roofline import DeviceCeilings, measure_device_ceilings
from nano_v1.benchmarks.utils import step_timing, write_tiny_qwen3
from nano_v1.engine.arg_utils import EngineArgs
from nano_v1.outputs import StepTiming

if TYPE_CHECKING:
    from nano_v1.engine.llm_engine import LLMEngine
    from nano_v1.entrypoints.llm import LLM

# Shipped model shapes (config.json only), built with `load_format="dummy"`: real shapes, random values.
CONFIGS_DIR = Path(__file__).parent / "configs"
# Tokens per step of the GPU measurements: nano-vllm's benchmark, which the H200 goals are stated on.
MAX_NUM_BATCHED_TOKENS = 8192
# KV cache blocks of every smoke engine: 16k tokens, 64 MiB for the tiny Qwen3 in float32.
SMOKE_NUM_GPU_BLOCKS = 1024


@dataclass
class SuiteContext:
    """What a measurement may use: the device, the sizes (smoke or real), the clock, and earlier results.

    The GPU suite makes one per run; the CUDA graph and speculative decoding measurements,
    and notebook 10 on a CPU, take one too.
    """

    device: torch.device
    smoke: bool
    work_dir: Path  # scratch space (the smoke model's config.json)
    num_prompts: int
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS
    results: dict[str, dict[str, Any]] = field(default_factory=dict)  # finished measurements, by name
    partial: dict[str, Any] = field(default_factory=dict)  # the running measurement's results so far
    deadline: float = math.inf  # time.perf_counter() at which the running measurement is cut off
    _ceilings: DeviceCeilings | None = None

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def time_left(self) -> float:
        return self.deadline - time.perf_counter()

    def ceilings(self) -> DeviceCeilings:
        """The device's measured bandwidth and matmul rate, measured once per run."""
        if self._ceilings is None:
            self._ceilings = measure_device_ceilings(self.device, smoke=self.smoke)
        return self._ceilings

    def model_dir(self, config_name: str) -> str:
        """A directory with the `config.json` of a shipped shape; in smoke mode, a tiny Qwen3 for every name."""
        if not self.smoke:
            return str(CONFIGS_DIR / config_name)
        tiny = self.work_dir / "tiny-qwen3"
        if not (tiny / "config.json").exists():
            write_tiny_qwen3(tiny, weights=False)
        return str(tiny)

    def engine_args(self, model_dir: str, **overrides: Any) -> EngineArgs:
        """nano_v1's engine arguments for a dummy-weight model on this device."""
        kwargs: dict[str, Any] = {
            "model": model_dir, "load_format": "dummy", "device": str(self.device), "seed": 0,
            "max_num_batched_tokens": self.max_num_batched_tokens,
        }
        if self.smoke:
            # A fixed, tiny cache on any device: on CUDA the cache is otherwise sized to fill
            # gpu_memory_utilization of the GPU (millions of blocks for a tiny model).
            kwargs["num_gpu_blocks_override"] = SMOKE_NUM_GPU_BLOCKS
        kwargs.update(overrides)
        return EngineArgs(**kwargs)

    def llm(self, model_dir: str, **overrides: Any) -> LLM:
        """An `LLM` of `engine_args(model_dir, **overrides)` with its engine core in this process.

        In this process because measurements time its worker through `collective_rpc` (some
        with functions, which cannot cross to another process), and because the GPU image
        has no pyzmq or msgspec for an engine-core process (chapter 09).
        """
        from nano_v1 import LLM

        return LLM.from_engine_args(self.engine_args(model_dir, **overrides), enable_multiprocessing=False)


def max_warm_up_steps(batch_size: int, context_len: int, max_num_batched_tokens: int) -> int:
    """Steps until a batch is all decoding, at most: each step's budget prefills at least
    `budget - batch_size` prompt tokens (running requests' decodes are scheduled first), and
    two pure decode steps in a row confirm that prefill is over."""
    return math.ceil(batch_size * context_len / (max_num_batched_tokens - batch_size)) + 2


def time_decode_steps(
    engine: LLMEngine,
    prompts: list[list[int]],
    num_steps: int,
    *,
    num_spec_tokens: int = 0,
    after_timed_steps: Callable[[], None] | None = None,
) -> tuple[list[float], list[StepTiming]]:
    """Add one request per prompt to an `LLMEngine`, step until all decode, then time `num_steps` steps.

    Returns the seconds of each whole `LLMEngine.step()` and the worker's `StepTiming` of
    each (`execute_model` inside it, and the forward call inside that); the requests are
    aborted afterwards. Raises if a timed step was not a pure decode step of the whole
    batch, each request verifying `num_spec_tokens` drafts (speculative decoding, chapter
    10) when that is not 0. `after_timed_steps` runs right after the timed steps, while
    the batch still decodes (it may take one more step, e.g. under a profiler). The engine
    core must be in this process (as `SuiteContext.llm` builds it), whose worker hands its
    `StepTiming`s back as they are.
    """
    from nano_v1 import SamplingParams

    batch_size = len(prompts)
    budget = engine.vllm_config.scheduler_config.max_num_batched_tokens
    max_warm_up = max_warm_up_steps(batch_size, len(prompts[0]), budget)
    tokens_per_step = batch_size * (1 + num_spec_tokens)
    # A request prefilled in the first step decodes through every later step, gaining up
    # to 1 + num_spec_tokens tokens in each: enough tokens for all of them, and for one
    # more step after the timed ones.
    max_tokens = (max_warm_up + num_steps + 1) * (1 + num_spec_tokens) + 1
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    request_ids = [f"decode-{batch_size}-{i}" for i in range(batch_size)]
    for request_id, prompt in zip(request_ids, prompts):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    step_s: list[float] = []
    try:
        warm_up_tokens: list[int] = []  # scheduled per step; two pure decode steps in a row end the warm-up
        for _ in range(max_warm_up):
            with step_timing(engine) as warm_up:
                engine.step()
            warm_up_tokens += [t.num_scheduled_tokens for t in warm_up]
            if warm_up_tokens[-2:] == [tokens_per_step, tokens_per_step]:
                break
        with step_timing(engine) as timings:
            for _ in range(num_steps):
                t0 = time.perf_counter()
                engine.step()
                step_s.append(time.perf_counter() - t0)
        if after_timed_steps is not None:
            after_timed_steps()
    finally:
        engine.abort_request(request_ids)
    scheduled_tokens = [t.num_scheduled_tokens for t in timings]
    if scheduled_tokens != [tokens_per_step] * num_steps:
        raise RuntimeError(
            f"batch size {batch_size}: the timed steps scheduled {scheduled_tokens} tokens, not {tokens_per_step} "
            "each: they were not all pure decode steps of the whole batch."
        )
    return step_s, timings
