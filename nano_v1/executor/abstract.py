"""The executor: the engine core's one handle on its workers, however many and wherever they run.

Mirrors vllm/v1/executor/abstract.py (`Executor`, `UniProcExecutor`,
`ExecutorWithExternalLauncher`; vLLM keeps the last two in
vllm/executor/uniproc_executor.py and re-exports them there) (chapter 13).

Why it exists: the engine core schedules once per step and needs the step run on every
rank, with one `ModelRunnerOutput` back. Whether that is one `Worker` in this process,
one worker process per GPU, or one engine per process started by torchrun is the
executor's business: `EngineCore` calls `execute_model`, `get_kv_cache_specs`,
`determine_available_memory`, `initialize_from_config` and `collective_rpc` and never touches a worker.

    Executor.get_class(vllm_config), by parallel_config.distributed_executor_backend:
      "uni"               UniProcExecutor               one Worker, in this process
      "mp"                MultiprocExecutor             one worker process per rank (multiproc_executor.py)
      "external_launcher" ExecutorWithExternalLauncher  this process is one torchrun rank, with its own engine
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future
from functools import cached_property
from typing import Any

import torch
import torch.distributed

from nano_v1.config import VllmConfig
from nano_v1.core.sched.output import SchedulerOutput
from nano_v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
from nano_v1.outputs import AsyncModelRunnerOutput, DraftTokenIds, ModelRunnerOutput
from nano_v1.utils import run_method
from nano_v1.worker.gpu_worker import Worker

# Called (once, from any thread) when the executor can no longer run steps: a worker died.
FailureCallback = Callable[[], None]
# What collective_rpc runs on each worker: a Worker method's name, or a function f(worker, *args, **kwargs).
RpcMethod = str | Callable[..., Any]


class Executor:
    """What the engine core asks of its workers. Subclasses implement `_init_executor`,
    `collective_rpc`, `check_health` and `shutdown`; the rest is built on `collective_rpc`."""

    # Why the executor failed for good (which worker died, and how), once it has; only executors
    # with worker processes fail this way.
    failure_reason: str | None = None

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        self.parallel_config = vllm_config.parallel_config
        self._init_executor()

    @staticmethod
    def get_class(vllm_config: VllmConfig) -> type[Executor]:
        backend = vllm_config.parallel_config.distributed_executor_backend
        if backend == "mp":
            from nano_v1.executor.multiproc_executor import MultiprocExecutor

            return MultiprocExecutor
        if backend == "uni":
            return UniProcExecutor
        if backend == "external_launcher":
            return ExecutorWithExternalLauncher
        raise ValueError(f"unknown distributed_executor_backend {backend!r}.")

    def _init_executor(self) -> None:
        """Start the workers, initialise their devices and load the model on each."""
        raise NotImplementedError

    def collective_rpc(
        self, method: RpcMethod, timeout: float | None = None, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:  # fmt: skip
        """Run `Worker.<method>(*args, **kwargs)` (or `method(worker, *args, **kwargs)`) on every
        worker; one result per worker, in rank order."""
        raise NotImplementedError

    def determine_available_memory(self) -> list[int]:
        """Bytes each worker can give its KV cache (the engine core takes the minimum)."""
        return self.collective_rpc("determine_available_memory")

    def get_kv_cache_specs(self) -> list[dict[str, KVCacheSpec]]:
        """Each worker's KV cache spec per attention layer, in rank order (chapter 12); a rank's
        specs count only its own KV heads."""
        return self.collective_rpc("get_kv_cache_spec")

    def initialize_from_config(self, kv_cache_configs: list[KVCacheConfig]) -> None:
        """Allocate every rank's KV cache, then compile and capture.

        vLLM hands each worker its own config (pipeline-parallel ranks hold different
        layers); with tensor parallelism alone every rank holds every layer, with its share
        of the heads, so the configs are equal and each worker gets the one."""
        assert all(config == kv_cache_configs[0] for config in kv_cache_configs), "ranks disagree on the KV cache"
        self.collective_rpc("initialize_from_config", args=(kv_cache_configs[0],))
        self.collective_rpc("compile_or_warm_up_model")

    @property
    def max_concurrent_batches(self) -> int:
        """Steps the engine core may have in flight at once: its batch queue's size (chapter 14)."""
        return 1

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """Run one step on every rank; rank 0's output stands for all (they sample the same tokens).

        `non_block`: return a `Future` of the output (`EngineCore.step_with_batch_queue`).
        Here the step has run by then: the future is done, holding the output or the error.
        With async scheduling the worker returns an `AsyncModelRunnerOutput`, waited for here:
        the worker shares this process, so there is nothing to overlap the wait with.
        """
        if not non_block:
            return _get_output(self.collective_rpc("execute_model", args=(scheduler_output,))[0])
        future: Future[ModelRunnerOutput] = Future()
        try:
            future.set_result(_get_output(self.collective_rpc("execute_model", args=(scheduler_output,))[0]))
        except Exception as e:  # noqa: BLE001  (the caller meets it at future.result())
            future.set_exception(e)
        return future

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        return self.collective_rpc("take_draft_token_ids")[0]

    def register_failure_callback(self, callback: FailureCallback) -> None:
        """Ask to be called if the executor fails for good; only executors with worker processes can."""

    def check_health(self) -> None:
        """Raise if the workers can no longer serve."""
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError


def _get_output(output: ModelRunnerOutput | AsyncModelRunnerOutput) -> ModelRunnerOutput:
    """The output itself, its tokens on the host (async scheduling's wait is here)."""
    return output.get_output() if isinstance(output, AsyncModelRunnerOutput) else output


class UniProcExecutor(Executor):
    """One `Worker` in the engine core's own process: a call is a method call."""

    def _init_executor(self) -> None:
        self.driver_worker = Worker(self.vllm_config, *self._distributed_args())
        self.collective_rpc("init_device")
        self.collective_rpc("load_model")

    def _distributed_args(self) -> tuple[int, int, str | None]:
        """`(local_rank, rank, distributed_init_method)` of the one worker: rank 0 of 1, nothing to join."""
        return 0, 0, None

    def collective_rpc(
        self, method: RpcMethod, timeout: float | None = None, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:  # fmt: skip
        return [run_method(self.driver_worker, method, args, kwargs or {})]

    @cached_property
    def max_concurrent_batches(self) -> int:
        """2 with async scheduling, as in v0.11.0, though each step has run when `execute_model`
        returns: the worker shares this process, so nothing overlaps (chapter 14)."""
        return 2 if self.vllm_config.scheduler_config.async_scheduling else 1

    def check_health(self) -> None:
        """Always healthy: the worker lives and dies with this process."""

    def shutdown(self) -> None:
        self.driver_worker.shutdown()


class ExecutorWithExternalLauncher(UniProcExecutor):
    """One rank of a tensor-parallel world that torchrun (or any launcher that sets its
    variables) started: every rank runs a whole engine, this executor its one worker.

    No step is ever sent between ranks: each rank's scheduler sees the same requests
    in the same order and decides the same steps, each rank samples the same tokens from
    the same gathered logits, so the engines stay in lockstep and only the layers'
    collectives cross processes (and machines: the launcher's MASTER_ADDR can be another
    host). That needs each rank's engine core in the rank's own process, stepping only
    when its frontend calls: an engine core in a child process would start a step as
    soon as some of the requests arrived, and the ranks could disagree on what a step
    holds (`LLMEngine` keeps it in-process; `EngineCoreProc` refuses it).
    """

    def _distributed_args(self) -> tuple[int, int, str | None]:
        """torchrun's LOCAL_RANK and RANK, and `env://`, which reads MASTER_ADDR and MASTER_PORT."""
        required = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        missing = [name for name in required if name not in os.environ]
        if missing:
            raise ValueError(
                f"distributed_executor_backend='external_launcher' needs the launcher's {', '.join(missing)}: "
                "start every rank with torchrun --nproc-per-node N (N = tensor_parallel_size)."
            )
        world_size = int(os.environ["WORLD_SIZE"])
        if world_size != self.parallel_config.world_size:
            raise ValueError(
                f"torchrun started {world_size} ranks but tensor_parallel_size is "
                f"{self.parallel_config.tensor_parallel_size}; they must be equal."
            )
        return int(os.environ["LOCAL_RANK"]), int(os.environ["RANK"]), "env://"

    def determine_available_memory(self) -> list[int]:
        """The minimum over all ranks, so that every rank's engine sizes the same cache (each
        sizes its own, and their schedulers must agree)."""
        from nano_v1.distributed.parallel_state import get_world_group

        memory = torch.tensor(super().determine_available_memory(), dtype=torch.int64)
        torch.distributed.all_reduce(
            memory, op=torch.distributed.ReduceOp.MIN, group=get_world_group().cpu_group
        )
        return memory.tolist()
