"""The worker: one device, its model runner, and the sizing of the KV cache.

Mirrors vllm/v1/worker/gpu_worker.py (chapters 02 and 16).

Why it exists: the engine core speaks to "a worker" and never to a device. The worker
owns device setup (which GPU, the seed), answers how much memory is left for the KV
cache once the model and its largest step fit, and forwards each step to the model
runner. With tensor parallelism (chapter 13) there is one worker per rank, each in its
own process, behind the same interface: `init_device` joins the ranks through
torch.distributed before the model is built, so that each layer can take its shard.
With a KV connector (chapter 16) it also builds the process's worker-role connector there,
and shuts it down with the engine.

What differs from v0.11.0: benchmarks time each step through the worker
(`start_step_timing`, `stop_step_timing`, reached by `collective_rpc`), which installs a
`StepTimer` on the model runner only while timing is on; vLLM has no such hook.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

import torch
from torch import nn

from nano_v1.config import VllmConfig
from nano_v1.core.sched.output import SchedulerOutput
from nano_v1.distributed.kv_transfer import ensure_kv_transfer_initialized, ensure_kv_transfer_shutdown
from nano_v1.distributed.parallel_state import (
    destroy_distributed_environment,
    destroy_model_parallel,
    ensure_model_parallel_initialized,
    init_distributed_environment,
)
from nano_v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
from nano_v1.outputs import AsyncModelRunnerOutput, DraftTokenIds, ModelRunnerOutput, StepTiming
from nano_v1.worker.gpu_model_runner import AsyncGPUModelRunnerOutput, GPUModelRunner

logger = logging.getLogger(__name__)

GiB = 1 << 30


class Worker:
    """Call order: init_device, load_model, get_kv_cache_spec / determine_available_memory,
    initialize_from_config, compile_or_warm_up_model, then execute_model once per step."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        local_rank: int = 0,
        rank: int = 0,
        distributed_init_method: str | None = None,
    ) -> None:
        """`rank` among all workers, `local_rank` its device index on this machine;
        `distributed_init_method` is where the ranks meet (None with a single rank)."""
        self.vllm_config = vllm_config
        self.cache_config = vllm_config.cache_config
        self.local_rank = local_rank
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.device: torch.device | None = None
        self.model_runner: GPUModelRunner | None = None
        self.init_free_memory = 0  # bytes free on the GPU before the model was loaded
        # Bytes torch had allocated and reserved then: other engines' of this process, not this one's.
        self.init_torch_allocated = 0
        self.init_torch_reserved = 0
        self.step_timer: StepTimer | None = None  # set between start_step_timing and stop_step_timing

    def init_device(self) -> None:
        self.device = torch.device(self.vllm_config.device_config.device)
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
            # An engine dropped earlier in this process may wait in a reference cycle (a
            # compiled model's forward refers back to the model): free it before measuring.
            gc.collect()
            torch.cuda.empty_cache()
            self.init_free_memory, total = torch.cuda.mem_get_info(self.device)
            self.init_torch_allocated = torch.cuda.memory_allocated(self.device)
            self.init_torch_reserved = torch.cuda.memory_reserved(self.device)
            requested = self.cache_config.gpu_memory_utilization * total
            if self.init_free_memory < requested:
                raise ValueError(
                    f"gpu_memory_utilization={self.cache_config.gpu_memory_utilization} asks for "
                    f"{requested / GiB:.2f} GiB of {self.device}, but only {self.init_free_memory / GiB:.2f} GiB "
                    "is free: lower gpu_memory_utilization or free the GPU."
                )
        init_worker_distributed_environment(
            self.vllm_config, self.rank, self.distributed_init_method, self.local_rank,
            backend="nccl" if self.device.type == "cuda" else "gloo",
        )  # fmt: skip
        # Every rank seeds alike: they sample the same tokens from the same gathered logits.
        torch.manual_seed(self.vllm_config.model_config.seed)
        self.model_runner = GPUModelRunner(self.vllm_config, self.device)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        """Each attention layer's KV cache format (chapter 12)."""
        return self.model_runner.get_kv_cache_spec()

    def determine_available_memory(self) -> int:
        """Bytes the KV cache may take.

        CPU: `cache_config.kv_cache_memory_bytes`, as there is nothing to measure against.
        CUDA: run the largest possible step without a cache (`profile_run`) and measure.
        The cache gets what is left of `gpu_memory_utilization x total` after what this
        engine added since `init_device` (vLLM: `memory_profiling` against the snapshot taken
        there): the peak torch allocated (weights + activations of that step) and what the
        process gained outside torch's allocator (CUDA context growth, cuBLAS workspaces).
        Memory that other engines of this process already held is theirs, not this one's.
        """
        if self.device.type != "cuda":
            return self.cache_config.kv_cache_memory_bytes
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.model_runner.profile_run()
        torch.cuda.synchronize(self.device)
        free_after, total = torch.cuda.mem_get_info(self.device)
        # This engine's peak: its weights and the profile step's activations.
        torch_peak = torch.cuda.max_memory_allocated(self.device) - self.init_torch_allocated
        # Growth in this process's footprint that torch's caching allocator does not account for.
        torch_growth = torch.cuda.memory_reserved(self.device) - self.init_torch_reserved
        non_torch = max(0, (self.init_free_memory - free_after) - torch_growth)
        requested = self.cache_config.gpu_memory_utilization * total
        available = int(requested - torch_peak - non_torch)
        logger.info(
            "memory: %.2f GiB requested, torch peak %.2f GiB, non-torch %.2f GiB -> KV cache %.2f GiB",
            requested / GiB,
            torch_peak / GiB,
            non_torch / GiB,
            available / GiB,
        )
        if available <= 0:
            raise ValueError(
                f"no memory left for the KV cache: the model and its largest step peak at "
                f"{torch_peak / GiB:.2f} GiB of the {requested / GiB:.2f} GiB that gpu_memory_utilization "
                "allows; raise gpu_memory_utilization or lower max_num_batched_tokens."
            )
        return available

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate the KV cache this worker's share of the config describes."""
        self.model_runner.initialize_kv_cache(kv_cache_config)

    def compile_or_warm_up_model(self) -> None:
        """Capture the CUDA graphs, once the KV cache exists (chapter 08)."""
        self.model_runner.capture_model()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """The step's output; with async scheduling its tokens may still be on their way to the
        host, and the caller that sends it on calls `get_output` (chapter 14)."""
        return self.model_runner.execute_model(scheduler_output)

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        return self.model_runner.take_draft_token_ids()

    def check_health(self) -> None:
        """Answering at all is the check (the multiprocess executor calls it with a timeout)."""

    def shutdown(self) -> None:
        """Shut the KV connector down (chapter 16) and leave the ranks' groups (a single rank joined none)."""
        if self.model_runner is not None and self.vllm_config.kv_transfer_config is not None:
            # This worker built the process's one connector in `init_device`, before its runner
            # (a start refused for another engine's connector has no runner, and leaves it be).
            ensure_kv_transfer_shutdown()
        if self.vllm_config.parallel_config.world_size > 1:
            destroy_model_parallel()
            destroy_distributed_environment()

    def start_step_timing(self) -> None:
        """Record a `StepTiming` for every step from now on (benchmarks call this by `collective_rpc`)."""
        if self.step_timer is None:
            self.step_timer = StepTimer(self.model_runner)

    def stop_step_timing(self) -> list[StepTiming]:
        """Stop recording; return the steps recorded since `start_step_timing`."""
        if self.step_timer is None:
            return []
        timings = self.step_timer.remove()
        self.step_timer = None
        return timings


class StepTimer:
    """Records a `StepTiming` per step of a model runner, from outside the runner.

    Installing it shadows three attributes of the runner instance with timed versions:
    `execute_model` (the whole step), `_execute_mm_encoder` (the vision encoder) and
    `model` (its call is the forward pass; every other attribute passes through to the
    model). `remove` takes them away again, so that a runner not being timed runs no
    timing code at all. Times are the host's: the step's one device -> host sync ends
    `execute_model`, while a forward or encoder call may return before its kernels finish.
    """

    def __init__(self, runner: GPUModelRunner) -> None:
        self.runner = runner
        self.timings: list[StepTiming] = []
        self._execute_model = runner.execute_model
        self._execute_mm_encoder = runner._execute_mm_encoder
        self._model = runner.model
        # The current step's.
        self.forward_s = self.encoder_s = 0.0
        self.num_encoder_tokens = 0
        runner.execute_model = self.execute_model
        runner._execute_mm_encoder = self.execute_mm_encoder
        runner.model = _TimedForward(self._model, self)

    def remove(self) -> list[StepTiming]:
        """Give the runner back its own attributes; return the steps recorded."""
        del self.runner.execute_model, self.runner._execute_mm_encoder
        self.runner.model = self._model
        return self.timings

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        self.forward_s = self.encoder_s = 0.0
        self.num_encoder_tokens = 0
        start = time.perf_counter()
        output = self._execute_model(scheduler_output)
        execute_model_s = time.perf_counter() - start
        # With async scheduling the rows that keep a token hold a placeholder for it already.
        kept = output._model_runner_output if isinstance(output, AsyncGPUModelRunnerOutput) else output
        if scheduler_output.total_num_scheduled_tokens > 0:  # else the step ran no model
            self.timings.append(
                StepTiming(
                    num_scheduled_tokens=scheduler_output.total_num_scheduled_tokens,
                    num_sampled_reqs=sum(1 for tokens in kept.sampled_token_ids if tokens),
                    execute_model_s=execute_model_s,
                    forward_s=self.forward_s,
                    encoder_s=self.encoder_s,
                    num_encoder_tokens=self.num_encoder_tokens,
                )
            )
        return output

    def execute_mm_encoder(self, scheduler_output: SchedulerOutput) -> None:
        start = time.perf_counter()
        self._execute_mm_encoder(scheduler_output)
        self.encoder_s += time.perf_counter() - start
        requests = self.runner.requests
        self.num_encoder_tokens += sum(
            requests[req_id].mm_features[input_id].mm_position.length
            for req_id, input_ids in scheduler_output.scheduled_encoder_inputs.items()
            for input_id in input_ids
        )


class _TimedForward:
    """A model whose calls (forward passes) add their seconds to a `StepTimer`'s `forward_s`."""

    def __init__(self, model: nn.Module, timer: StepTimer) -> None:
        self.model = model
        self.timer = timer

    def __getattr__(self, name: str) -> Any:
        # Reached only for names this wrapper lacks: the model's own (compute_logits, ...).
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)

    def __call__(self, *args: Any) -> Any:
        start = time.perf_counter()
        output = self.model(*args)
        self.timer.forward_s += time.perf_counter() - start
        return output


def init_worker_distributed_environment(
    vllm_config: VllmConfig, rank: int, distributed_init_method: str | None, local_rank: int, backend: str
) -> None:
    """Join the tensor-parallel ranks (vLLM's function of the same name), then build the
    worker's KV connector if the config names one (chapter 16).

    A single rank joins nothing: the default world of one stands (see
    nano_v1/distributed/parallel_state.py).
    """
    parallel_config = vllm_config.parallel_config
    if parallel_config.world_size > 1:
        init_distributed_environment(
            parallel_config.world_size, rank, distributed_init_method, local_rank, backend
        )
        ensure_model_parallel_initialized(parallel_config.tensor_parallel_size, backend)
    ensure_kv_transfer_initialized(vllm_config)
