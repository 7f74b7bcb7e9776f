"""Engine configuration: one small dataclass per part of the engine, and `VllmConfig`, the whole.

Mirrors vllm/config/ (chapter 01): `ModelConfig` (model.py), `CacheConfig` (cache.py),
`SchedulerConfig` (scheduler.py), `DeviceConfig` (device.py), `ParallelConfig`
(parallel.py), `CompilationConfig` (compilation.py), `SpeculativeConfig` (speculative.py),
`KVTransferConfig` (kv_transfer.py, chapter 16).

Why a class per part: each part of the engine reads only its own slice (the scheduler its
budget, the worker its cache size), and each slice checks its own fields when built. What
depends on more than one slice (the default token budget depends on the model's context;
the compilation level on the device and `enforce_eager`; the encoder budget on the
model's largest image) is settled once, in `VllmConfig.__post_init__`. Users never build
these by hand: `LLM(**kwargs)` and the CLI speak in flat engine arguments
(`nano_v1/engine/arg_utils.py::EngineArgs`), whose defaults are the fields' defaults here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from nano_v1 import envs
from nano_v1.config.cache import CacheConfig
from nano_v1.config.compilation import (
    ATTENTION_SPLITTING_OPS,
    CompilationConfig,
    CompilationLevel,
    CUDAGraphMode,
)
from nano_v1.config.device import DeviceConfig
from nano_v1.config.kv_transfer import KVTransferConfig
from nano_v1.config.model import ATTENTION_BACKENDS, ModelConfig
from nano_v1.config.parallel import ParallelConfig
from nano_v1.config.scheduler import SchedulerConfig
from nano_v1.config.speculative import SpeculativeConfig
from nano_v1.multimodal import MULTIMODAL_REGISTRY

logger = logging.getLogger(__name__)

__all__ = [
    "ATTENTION_BACKENDS",
    "ATTENTION_SPLITTING_OPS",
    "CacheConfig",
    "CompilationConfig",
    "CompilationLevel",
    "CUDAGraphMode",
    "DeviceConfig",
    "KVTransferConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "VllmConfig",
    "get_current_vllm_config",
    "set_current_vllm_config",
]


@dataclass
class VllmConfig:
    """Everything the engine needs, one slice per part."""

    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    speculative_config: SpeculativeConfig | None = None
    # A KV connector (chapter 16): disaggregated prefill, KV offloading; None: no KV transfer.
    kv_transfer_config: KVTransferConfig | None = None

    def __post_init__(self) -> None:
        """Settle what depends on several slices (vLLM: VllmConfig.__post_init__)."""
        model_config = self.model_config
        self.scheduler_config.resolve(model_config.max_model_len)
        self.scheduler_config.resolve_encoder_budget(self._max_tokens_per_mm_item())
        if model_config.attention_backend is None:
            model_config.attention_backend = envs.attention_backend() or (
                "FLASH_ATTN" if self.device_config.device.startswith("cuda") else "TORCH_REFERENCE"
            )
            if model_config.attention_backend not in ATTENTION_BACKENDS:
                raise ValueError(
                    f"VLLM_ATTENTION_BACKEND must be one of {list(ATTENTION_BACKENDS)}, "
                    f"got {model_config.attention_backend!r}."
                )
        model_config.verify_with_parallel_config(self.parallel_config)
        self._verify_devices_for_ranks()
        if self.parallel_config.world_size > 1 and self.device_config.device.startswith("cuda"):
            # vLLM captures its own NCCL calls (pynccl, custom all-reduce) into graphs; torch's
            # NCCL process group is not safe to capture, so the ranks run their steps ungraphed.
            logger.warning("tensor_parallel_size > 1: no CUDA graphs (cudagraph_mode NONE)")
            self.compilation_config.cudagraph_mode = CUDAGraphMode.NONE
        self.compilation_config.resolve(
            self.device_config.device,
            model_config.enforce_eager,
            self.scheduler_config.max_num_seqs,
            self.scheduler_config.max_num_batched_tokens,
        )
        if self.kv_transfer_config is not None and self.compilation_config.cudagraph_mode.has_full_cudagraphs():
            # The connector's hooks run in Python around each attention call (chapter 16); a
            # FULL graph replays attention without them.
            raise ValueError(
                f"kv_transfer_config cannot run with cudagraph_mode={self.compilation_config.cudagraph_mode.name}: "
                "a FULL CUDA graph replays attention without the KV connector's per-layer hooks; use "
                "cudagraph_mode='PIECEWISE' (the default) or enforce_eager=True."
            )

    def _max_tokens_per_mm_item(self) -> int | None:
        """The most positions one image can take (the model's processor says), None for a text-only model."""
        if not MULTIMODAL_REGISTRY.supports_multimodal_inputs(self.model_config):
            return None
        return max(MULTIMODAL_REGISTRY.get_max_tokens_per_item_by_modality(self.model_config).values())

    def _verify_devices_for_ranks(self) -> None:
        """With several ranks on CUDA, rank r uses cuda:r of this machine (vLLM: local_rank)."""
        device, tp = self.device_config.device, self.parallel_config.world_size
        if tp == 1 or not device.startswith("cuda"):
            return
        if device != "cuda":
            raise ValueError(
                f"with tensor_parallel_size={tp} every rank uses its own GPU (rank r on cuda:r); "
                f"pass device='cuda', not {device!r} (CUDA_VISIBLE_DEVICES chooses which GPUs)."
            )
        if self.parallel_config.distributed_executor_backend == "mp" and tp > torch.cuda.device_count():
            raise ValueError(
                f"tensor_parallel_size={tp} needs {tp} GPUs on this machine, but {torch.cuda.device_count()} "
                "are visible."
            )


# The config of the engine being built, for code that runs while the model's modules are
# constructed and has no other way to see it (the Attention layer picks its backend here).
# vLLM keeps the same global in vllm/config/__init__.py.
_current_vllm_config: VllmConfig | None = None


@contextmanager
def set_current_vllm_config(vllm_config: VllmConfig) -> Iterator[None]:
    """Make `vllm_config` the current config for the duration of the block (model construction)."""
    global _current_vllm_config
    previous = _current_vllm_config
    _current_vllm_config = vllm_config
    try:
        yield
    finally:
        _current_vllm_config = previous


def get_current_vllm_config() -> VllmConfig:
    if _current_vllm_config is None:
        raise RuntimeError(
            "no current VllmConfig: build models with nano_v1.model_executor.model_loader.get_model(vllm_config)."
        )
    return _current_vllm_config
