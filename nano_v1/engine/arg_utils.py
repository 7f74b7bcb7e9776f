"""The flat engine arguments of `LLM(...)` and the CLI, and how they become a `VllmConfig`.

Mirrors vllm/engine/arg_utils.py (`EngineArgs`, `add_cli_args`, `from_cli_args`,
`create_engine_config`) (chapter 01).

Why two layers: users speak in flat keyword arguments with vLLM's names
(`LLM(model, block_size=16, max_num_seqs=64)`, `--max-num-seqs 64`); the engine's parts
each want only their own slice. Every default is the config field's own (`get_field`),
and every flag's help is that field's docstring, so nothing here restates a config.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from nano_v1.config import (
    CacheConfig,
    CompilationConfig,
    DeviceConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from nano_v1.config.utils import get_attr_docs, get_field


@dataclass
class EngineArgs:
    """The arguments of `LLM(...)` and of the CLI's engine flags, with vLLM's names."""

    # ModelConfig
    model: str = get_field(ModelConfig, "model")
    tokenizer: str | None = ModelConfig.tokenizer
    dtype: str = ModelConfig.dtype
    seed: int = ModelConfig.seed
    max_model_len: int | None = ModelConfig.max_model_len
    load_format: str = ModelConfig.load_format
    enforce_eager: bool = ModelConfig.enforce_eager
    attention_backend: str | None = ModelConfig.attention_backend
    disable_cascade_attn: bool = ModelConfig.disable_cascade_attn
    # DeviceConfig
    device: str = DeviceConfig.device
    # CacheConfig
    block_size: int = CacheConfig.block_size
    gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization
    num_gpu_blocks_override: int | None = CacheConfig.num_gpu_blocks_override
    kv_cache_memory_bytes: int = CacheConfig.kv_cache_memory_bytes
    enable_prefix_caching: bool = CacheConfig.enable_prefix_caching
    # SchedulerConfig
    max_num_batched_tokens: int | None = SchedulerConfig.max_num_batched_tokens
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    enable_chunked_prefill: bool = SchedulerConfig.enable_chunked_prefill
    long_prefill_token_threshold: int = SchedulerConfig.long_prefill_token_threshold
    scheduling_policy: str = SchedulerConfig.policy
    scheduler_reserve_full_isl: bool = SchedulerConfig.scheduler_reserve_full_isl
    max_num_encoder_input_tokens: int | None = SchedulerConfig.max_num_encoder_input_tokens
    encoder_cache_size: int | None = SchedulerConfig.encoder_cache_size
    disable_chunked_mm_input: bool = SchedulerConfig.disable_chunked_mm_input
    # CompilationConfig and SpeculativeConfig, each given whole (a dict, or JSON on the CLI)
    compilation_config: CompilationConfig | dict | int | str | None = None
    speculative_config: dict[str, Any] | str | None = None

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
        """One `--flag` per field, grouped by the config it builds, help from that config's docstrings.

        Every flag defaults to None, so `from_cli_args` can tell a flag the user gave from
        one left alone (which then keeps the dataclass default).
        """
        hints = typing.get_type_hints(EngineArgs)
        for title, config_cls, names in _CLI_GROUPS:
            group = parser.add_argument_group(title)
            docs = get_attr_docs(config_cls)
            for name in names:
                flag = "--" + name.replace("_", "-")
                help_text = docs.get(_CONFIG_FIELD.get(name, name), _WHOLE_CONFIG_HELP.get(name))
                hint = hints[name]
                if hint is bool:
                    group.add_argument(
                        flag, action=argparse.BooleanOptionalAction, default=None, help=help_text
                    )
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

    def create_engine_config(self) -> VllmConfig:
        """Build and check every slice; `VllmConfig` settles what depends on several of them."""
        return VllmConfig(
            model_config=ModelConfig(
                model=self.model,
                tokenizer=self.tokenizer,
                dtype=self.dtype,
                seed=self.seed,
                max_model_len=self.max_model_len,
                load_format=self.load_format,
                enforce_eager=self.enforce_eager,
                attention_backend=self.attention_backend,
                disable_cascade_attn=self.disable_cascade_attn,
            ),
            cache_config=CacheConfig(
                block_size=self.block_size,
                gpu_memory_utilization=self.gpu_memory_utilization,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                enable_prefix_caching=self.enable_prefix_caching,
            ),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                enable_chunked_prefill=self.enable_chunked_prefill,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                policy=self.scheduling_policy,
                scheduler_reserve_full_isl=self.scheduler_reserve_full_isl,
                max_num_encoder_input_tokens=self.max_num_encoder_input_tokens,
                encoder_cache_size=self.encoder_cache_size,
                disable_chunked_mm_input=self.disable_chunked_mm_input,
            ),
            device_config=DeviceConfig(self.device),
            compilation_config=CompilationConfig.from_arg(self.compilation_config),
            speculative_config=None
            if self.speculative_config is None
            else SpeculativeConfig.from_dict(self.speculative_config),
        )


# The CLI's groups: (title, the config whose docstrings give the help, EngineArgs fields).
_CLI_GROUPS: list[tuple[str, type, list[str]]] = [
    (
        "model (ModelConfig)",
        ModelConfig,
        [
            "model",
            "tokenizer",
            "dtype",
            "seed",
            "max_model_len",
            "load_format",
            "enforce_eager",
            "attention_backend",
            "disable_cascade_attn",
        ],
    ),
    ("device (DeviceConfig)", DeviceConfig, ["device"]),
    (
        "KV cache (CacheConfig)",
        CacheConfig,
        [
            "block_size",
            "gpu_memory_utilization",
            "num_gpu_blocks_override",
            "kv_cache_memory_bytes",
            "enable_prefix_caching",
        ],
    ),
    (
        "scheduler (SchedulerConfig)",
        SchedulerConfig,
        [
            "max_num_batched_tokens",
            "max_num_seqs",
            "enable_chunked_prefill",
            "long_prefill_token_threshold",
            "scheduling_policy",
            "scheduler_reserve_full_isl",
            "max_num_encoder_input_tokens",
            "encoder_cache_size",
            "disable_chunked_mm_input",
        ],
    ),
    ("compilation and speculative decoding", EngineArgs, ["compilation_config", "speculative_config"]),
]
# Engine-argument names that differ from their config field (vLLM's too).
_CONFIG_FIELD = {"scheduling_policy": "policy"}
_WHOLE_CONFIG_HELP = {
    "compilation_config": 'CompilationConfig as JSON, e.g. \'{"level": 3, "cudagraph_capture_sizes": [1, 2, 4]}\', '
    "or an int level (chapter 08).",
    "speculative_config": 'SpeculativeConfig as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\' '
    "(chapter 10).",
}
