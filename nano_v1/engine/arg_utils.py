"""The flat engine arguments of `LLM(...)` and the CLI, and how they become a `VllmConfig`.

Mirrors vllm/engine/arg_utils.py (`EngineArgs`, `add_cli_args`, `from_cli_args`,
`create_engine_config`) (chapter 01).

Why two layers: users speak in flat keyword arguments with vLLM's names
(`LLM(model, block_size=16, max_num_seqs=64)`, `--max-num-seqs 64`); the engine's parts
each want only their own slice. Each argument is written once: `get_field` gives it the
config field's default and records which config class and field it sets, and from that
`create_engine_config` builds the slices and `add_cli_args` groups the flags by config,
each flag's help being that field's docstring. Nothing here restates a config.

What differs from v0.11.0: vLLM's `get_field` carries only the default; its
`add_cli_args` names every flag again under a hand-written group per config, and
`create_engine_config` passes every field by hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import typing
from dataclasses import dataclass, field
from typing import Any

from nano_v1.config import (
    CacheConfig,
    CompilationConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from nano_v1.config.utils import CONFIG, CONFIG_FIELD, config_from_dict, get_attr_docs, get_field
from nano_v1.sample.logits_processor import LogitsProcessor

logger = logging.getLogger(__name__)


@dataclass
class EngineArgs:
    """The arguments of `LLM(...)` and of the CLI's engine flags, with vLLM's names."""

    model: str = get_field(ModelConfig, "model")
    tokenizer: str | None = get_field(ModelConfig, "tokenizer")
    dtype: str = get_field(ModelConfig, "dtype")
    seed: int = get_field(ModelConfig, "seed")
    max_model_len: int | None = get_field(ModelConfig, "max_model_len")
    load_format: str = get_field(ModelConfig, "load_format")
    enforce_eager: bool = get_field(ModelConfig, "enforce_eager")
    attention_backend: str | None = get_field(ModelConfig, "attention_backend")
    disable_cascade_attn: bool = get_field(ModelConfig, "disable_cascade_attn")
    logits_processors: list[str | type[LogitsProcessor]] | None = get_field(ModelConfig, "logits_processors")
    device: str = get_field(DeviceConfig, "device")
    tensor_parallel_size: int = get_field(ParallelConfig, "tensor_parallel_size")
    distributed_executor_backend: str | None = get_field(ParallelConfig, "distributed_executor_backend")
    block_size: int = get_field(CacheConfig, "block_size")
    gpu_memory_utilization: float = get_field(CacheConfig, "gpu_memory_utilization")
    num_gpu_blocks_override: int | None = get_field(CacheConfig, "num_gpu_blocks_override")
    kv_cache_memory_bytes: int = get_field(CacheConfig, "kv_cache_memory_bytes")
    enable_prefix_caching: bool = get_field(CacheConfig, "enable_prefix_caching")
    max_num_batched_tokens: int | None = get_field(SchedulerConfig, "max_num_batched_tokens")
    max_num_seqs: int = get_field(SchedulerConfig, "max_num_seqs")
    enable_chunked_prefill: bool = get_field(SchedulerConfig, "enable_chunked_prefill")
    long_prefill_token_threshold: int = get_field(SchedulerConfig, "long_prefill_token_threshold")
    scheduling_policy: str = get_field(SchedulerConfig, "policy")  # vLLM's argument name
    disable_hybrid_kv_cache_manager: bool = get_field(SchedulerConfig, "disable_hybrid_kv_cache_manager")
    scheduler_reserve_full_isl: bool = get_field(SchedulerConfig, "scheduler_reserve_full_isl")
    max_num_encoder_input_tokens: int | None = get_field(SchedulerConfig, "max_num_encoder_input_tokens")
    encoder_cache_size: int | None = get_field(SchedulerConfig, "encoder_cache_size")
    disable_chunked_mm_input: bool = get_field(SchedulerConfig, "disable_chunked_mm_input")
    async_scheduling: bool = get_field(SchedulerConfig, "async_scheduling")
    # Whole configs, each given at once (a dict, or JSON on the CLI); the help is the flag's own.
    compilation_config: CompilationConfig | dict | int | str | None = field(
        default=None,
        metadata={
            CONFIG: CompilationConfig,
            "help": 'CompilationConfig as JSON, e.g. \'{"level": 3, "cudagraph_capture_sizes": [1, 2, 4]}\', '
            "or an int level (chapter 08).",
        },
    )
    speculative_config: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            CONFIG: SpeculativeConfig,
            "help": 'SpeculativeConfig as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\' '
            "(chapter 10).",
        },
    )
    kv_transfer_config: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            CONFIG: KVTransferConfig,
            "help": 'KVTransferConfig as JSON: \'{"kv_connector": NAME, "kv_role": "kv_producer" | '
            '"kv_consumer" | "kv_both", "kv_connector_extra_config": {...}}\' (chapter 16).',
        },
    )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """`LLM(**kwargs)`: an unknown name is a TypeError, as for any Python call."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; nano_v1 accepts {sorted(known)}.")
        return cls(**kwargs)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """One `--flag` per field, in one group per config class, help from that config's docstrings.

        Every flag defaults to None, so `from_cli_args` can tell a flag the user gave from
        one left alone (which then keeps the dataclass default).
        """
        hints = typing.get_type_hints(EngineArgs)
        groups: dict[type, Any] = {}  # config class -> its argument group, in the order of the fields
        for f in dataclasses.fields(EngineArgs):
            config_cls = f.metadata[CONFIG]
            if config_cls not in groups:
                groups[config_cls] = parser.add_argument_group(config_cls.__name__)
            group = groups[config_cls]
            if CONFIG_FIELD in f.metadata:
                help_text = get_attr_docs(config_cls)[f.metadata[CONFIG_FIELD]]
            else:
                help_text = f.metadata["help"]
            flag = "--" + f.name.replace("_", "-")
            hint = hints[f.name]
            if hint is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
            elif f.name == "logits_processors":  # names only: a class cannot come from the command line
                group.add_argument(flag, nargs="+", type=str, default=None, help=help_text)
            else:
                base = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
                kind = base if base in (int, float) else str
                group.add_argument(flag, type=kind, default=None, help=help_text)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """EngineArgs from the flags the user actually gave (the others keep their defaults)."""
        given = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in given.items() if value is not None})

    def config_kwargs(self, config_cls: type) -> dict[str, Any]:
        """The fields of `config_cls` these arguments set, by the config's field names."""
        return {
            f.metadata[CONFIG_FIELD]: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.metadata[CONFIG] is config_cls and CONFIG_FIELD in f.metadata
        }

    def create_engine_config(self) -> VllmConfig:
        """Build and check every slice; `VllmConfig` settles what depends on several of them.

        Async scheduling (chapter 14) makes the multiprocess executor the default backend,
        and refuses speculative decoding, as v0.11.0 does here.
        """
        parallel_kwargs = self.config_kwargs(ParallelConfig)
        if self.async_scheduling:
            if self.distributed_executor_backend is None:
                # With the worker in this process, a step would run inside execute_model.
                parallel_kwargs["distributed_executor_backend"] = "mp"
                logger.info("Defaulting to mp-based distributed executor backend for async scheduling.")
            if self.speculative_config is not None:
                raise ValueError("Currently, speculative decoding is not supported with async scheduling.")
        return VllmConfig(
            model_config=ModelConfig(**self.config_kwargs(ModelConfig)),
            cache_config=CacheConfig(**self.config_kwargs(CacheConfig)),
            scheduler_config=SchedulerConfig(**self.config_kwargs(SchedulerConfig)),
            device_config=DeviceConfig(**self.config_kwargs(DeviceConfig)),
            parallel_config=ParallelConfig(**parallel_kwargs),
            compilation_config=CompilationConfig.from_arg(self.compilation_config),
            speculative_config=None
            if self.speculative_config is None
            else SpeculativeConfig.from_dict(self.speculative_config),
            kv_transfer_config=None
            if self.kv_transfer_config is None
            else config_from_dict(KVTransferConfig, "kv_transfer_config", self.kv_transfer_config),
        )
