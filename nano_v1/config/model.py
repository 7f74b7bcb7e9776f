"""Which checkpoint, in which dtype, for how long a context, through which attention backend.

Mirrors vllm/config/model.py (`ModelConfig`) (chapter 01).

Why it exists: everything the engine needs to know about the model comes from the
checkpoint directory's `config.json`, read once here; the rest of the engine asks this
object (`get_num_kv_heads()`, `max_model_len`) instead of the Hugging Face config.

What differs from v0.11.0: `ModelConfig.registry` is the registry module
(`nano_v1/model_executor/models/__init__.py`), imported on first use; v0.11.0's returns
the `ModelRegistry` object of a lazily loaded `vllm.model_executor.models`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from nano_v1.config.parallel import ParallelConfig

if TYPE_CHECKING:
    from nano_v1.sample.logits_processor import LogitsProcessor

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}

# vLLM v0.11.0's backend names (vllm/platforms/interface.py::_Backend) for the two kernels
# nano_v1 has, plus its plain-PyTorch reference (chapter 06).
ATTENTION_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "TORCH_REFERENCE")


def default_model() -> str:
    """The bundled demo checkpoint, used when no model is given."""
    from nano_v1.demo_model import DEMO_MODEL_PATH

    return str(DEMO_MODEL_PATH)


@dataclass
class ModelConfig:
    """The model: a local Hugging Face checkpoint directory and how to run it."""

    model: str = field(default_factory=default_model)
    """A local checkpoint directory (config.json + *.safetensors); default: the bundled demo model."""
    tokenizer: str | None = None
    """Tokenizer directory; default: the model's."""
    dtype: str | torch.dtype = "auto"
    """Weights and activations: auto (the checkpoint's), float32, float16 or bfloat16."""
    seed: int = 0
    """Seed of the global RNG (sampled requests without a seed of their own)."""
    max_model_len: int | None = None
    """Longest context, prompt plus output, in tokens; default: the model's max_position_embeddings."""
    load_format: str = "auto"
    """auto or safetensors (the checkpoint's weights), or dummy (random weights of the checkpoint's shapes).
    vLLM keeps this in LoadConfig."""
    enforce_eager: bool = False
    """Run the model eagerly: no torch.compile, no CUDA graphs (chapter 08)."""
    attention_backend: str | None = None
    """FLASH_ATTN, TRITON_ATTN or TORCH_REFERENCE; default: $VLLM_ATTENTION_BACKEND, else
    FLASH_ATTN on CUDA and TORCH_REFERENCE on the CPU (chapter 06)."""
    disable_cascade_attn: bool = False
    """Never run cascade attention over a shared prefix, even where the model says it pays (chapter 07)."""
    logits_processors: list[str | type[LogitsProcessor]] | None = None
    """Custom logits processors: LogitsProcessor subclasses, or their names as 'module.path:ClassName'
    (a worker in another process imports it by name). Requests opt in through
    SamplingParams.extra_args."""
    hf_config: Any = field(init=False, repr=False)
    # The language model's part of hf_config: hf_config itself, or a multimodal model's
    # text_config (chapter 11). Every shape accessor below reads this one.
    hf_text_config: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.model = str(self.model)
        config_path = Path(self.model) / "config.json"
        if not config_path.is_file():
            raise ValueError(
                f"model {self.model!r} is not a local checkpoint directory (no config.json there). "
                "nano_v1 never downloads: pass the path of a directory written by save_pretrained."
            )
        try:
            raw = json.loads(config_path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_path} is not valid JSON: {e}") from e
        archs = raw.get("architectures") or []
        supported = self.registry.SUPPORTED_ARCHITECTURES
        if not any(a in supported for a in archs):
            raise ValueError(
                f"model {self.model!r} has architectures {archs}; nano_v1 supports {sorted(supported)}."
            )
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(
                f"load_format must be 'auto', 'safetensors' or 'dummy', got {self.load_format!r}."
            )
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {list(ATTENTION_BACKENDS)}, got {self.attention_backend!r}."
            )
        from transformers import AutoConfig

        self.hf_config = AutoConfig.from_pretrained(self.model)
        self.hf_text_config = self.hf_config.get_text_config()
        self.tokenizer = self.tokenizer or self.model
        self.dtype = self._resolve_dtype(self.dtype)
        limit = self.hf_text_config.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = limit
        elif not (isinstance(self.max_model_len, int) and 0 < self.max_model_len <= limit):
            raise ValueError(
                f"max_model_len must be a positive integer <= the model's max_position_embeddings "
                f"({limit}), got {self.max_model_len!r}."
            )

    def _resolve_dtype(self, dtype: str | torch.dtype) -> torch.dtype:
        if isinstance(dtype, torch.dtype):
            return dtype
        if dtype == "auto":
            # Like vLLM: the checkpoint's dtype, but float32 checkpoints stay float32.
            name = str(getattr(self.hf_config, "dtype", None) or "float32")
            return _DTYPES.get(name.replace("torch.", ""), torch.float32)
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}.")
        return _DTYPES[dtype]

    @property
    def registry(self) -> ModuleType:
        """The model registry, imported on first use so that importing the config loads no model code."""
        from nano_v1.model_executor import models

        return models

    @property
    def is_multimodal_model(self) -> bool:
        """Whether the architecture takes images besides text (chapter 11)."""
        return self.registry.is_multimodal_model(self.hf_config.architectures)

    def verify_with_parallel_config(self, parallel_config: ParallelConfig) -> None:
        """Check that the model can be cut into `tensor_parallel_size` equal shards (chapter 13).

        Query heads and the MLP's intermediate size are split evenly; KV heads are split
        when there are at least as many as ranks, else each is replicated on
        `tp / num_kv_heads` ranks, so one count must divide the other. The vocabulary is
        padded to a multiple of the ranks, so it needs no check.
        """
        tp = parallel_config.tensor_parallel_size
        num_heads, num_kv_heads = self.get_num_attention_heads(), self.get_num_kv_heads()
        intermediate_size = self.hf_text_config.intermediate_size
        if num_heads % tp:
            raise ValueError(
                f"the model's {num_heads} attention heads cannot be split over tensor_parallel_size={tp} ranks: "
                "tensor_parallel_size must divide num_attention_heads."
            )
        if num_kv_heads % tp and tp % num_kv_heads:
            raise ValueError(
                f"the model's {num_kv_heads} KV heads cannot be split over (or replicated on) {tp} ranks: "
                "one of num_key_value_heads and tensor_parallel_size must divide the other."
            )
        if intermediate_size % tp:
            raise ValueError(
                f"the model's intermediate_size {intermediate_size} is not divisible by tensor_parallel_size={tp}."
            )

    # Shape accessors of the language model, named as in vLLM's ModelConfig.
    def get_vocab_size(self) -> int:
        return self.hf_text_config.vocab_size

    def get_hidden_size(self) -> int:
        return self.hf_text_config.hidden_size

    def get_num_layers(self) -> int:
        return self.hf_text_config.num_hidden_layers

    def get_num_attention_heads(self) -> int:
        return self.hf_text_config.num_attention_heads

    def get_num_kv_heads(self) -> int:
        config = self.hf_text_config
        return getattr(config, "num_key_value_heads", None) or config.num_attention_heads

    def get_head_size(self) -> int:
        config = self.hf_text_config
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
