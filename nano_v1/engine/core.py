"""The engine core: scheduler + worker, and the step that joins them.

Mirrors vllm/v1/engine/core.py (chapters 02, 04 and 09).

Why it is this small: everything clever lives in the scheduler (what to run) and the
model runner (how to run it). One `step()` is schedule -> execute -> update, and data
only flows forward: `SchedulerOutput` -> `ModelRunnerOutput` -> `EngineCoreOutputs`.
Chapter 09 wraps this class in a process with a busy loop (`EngineCoreProc`).
"""

from __future__ import annotations

import logging
import time

from nano_v1.config import EngineConfig
from nano_v1.core.kv_cache_utils import get_request_block_hasher
from nano_v1.core.sched.scheduler import Scheduler
from nano_v1.engine import EngineCoreOutputs, EngineCoreRequest
from nano_v1.request import Request, RequestStatus
from nano_v1.worker.gpu_worker import Worker

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, engine_config: EngineConfig) -> None:
        self.engine_config = engine_config
        self.model_executor = Worker(engine_config)
        self.model_executor.init_device()
        self.model_executor.load_model()
        self._initialize_kv_caches()
        self.model_executor.compile_or_warm_up_model()
        self.scheduler = Scheduler(engine_config)
        cache_config = engine_config.cache_config
        self.request_block_hasher = (
            get_request_block_hasher(cache_config.block_size) if cache_config.enable_prefix_caching else None
        )

    def _initialize_kv_caches(self) -> None:
        """Size the paged KV cache from the memory left after the model (chapter 02)."""
        cache_config = self.engine_config.cache_config
        max_model_len = self.engine_config.model_config.max_model_len
        start = time.perf_counter()
        page_size = self.model_executor.get_kv_cache_page_size()  # bytes per block, all layers
        if cache_config.num_gpu_blocks_override is not None:
            num_blocks = cache_config.num_gpu_blocks_override
        else:
            num_blocks = self.model_executor.determine_available_memory() // page_size
        # Block 0 is the null block, never handed out: one request of max_model_len must fit in the rest.
        capacity = (num_blocks - 1) * cache_config.block_size
        if capacity < max_model_len:
            raise ValueError(
                f"the KV cache holds {max(capacity, 0)} tokens ({num_blocks} blocks of {cache_config.block_size}), "
                f"fewer than max_model_len={max_model_len}: lower max_model_len or give the cache more memory "
                "(gpu_memory_utilization, kv_cache_memory_bytes, num_gpu_blocks_override)."
            )
        cache_config.num_gpu_blocks = num_blocks
        self.model_executor.initialize_kv_cache(num_blocks)
        logger.info(
            "KV cache: %d blocks x %d tokens (%.1f MiB) in %.2f s",
            num_blocks, cache_config.block_size, num_blocks * page_size / 2**20, time.perf_counter() - start,
        )

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"request id {request.request_id!r} is already running.")
        self.scheduler.add_request(
            Request(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=request.sampling_params,
                eos_token_id=request.eos_token_id,
                arrival_time=request.arrival_time,
                priority=request.priority,
                block_hasher=self.request_block_hasher,
            )
        )

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> EngineCoreOutputs:
        """Schedule, execute, update: one iteration of the engine."""
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs()
        scheduler_output = self.scheduler.schedule()
        model_output = self.model_executor.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, model_output)

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()
