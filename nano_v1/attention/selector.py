"""Attention backend name -> backend class.

Mirrors vllm/attention/selector.py (`get_attn_backend`) (chapter 06).

Why it exists: the model code never names a backend; each `Attention` layer asks for the
one the config chose (`attention_backend`, or $VLLM_ATTENTION_BACKEND as in vLLM v0.11.0),
and the model runner asks for the same one to build its metadata builder. Backends are
imported only when chosen.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from nano_v1.config import ATTENTION_BACKENDS

if TYPE_CHECKING:
    from nano_v1.attention.backends.flash_attn import FlashAttentionBackend

_BACKEND_CLASSES = {
    "FLASH_ATTN": "nano_v1.attention.backends.flash_attn:FlashAttentionBackend",
    "TRITON_ATTN": "nano_v1.attention.backends.triton_attn:TritonAttentionBackend",
    "TORCH_REFERENCE": "nano_v1.attention.backends.torch_reference:TorchReferenceBackend",
}
assert set(_BACKEND_CLASSES) == set(ATTENTION_BACKENDS)


def get_attn_backend(name: str) -> type[FlashAttentionBackend]:
    """The backend class registered under `name` (one of ATTENTION_BACKENDS)."""
    if name not in _BACKEND_CLASSES:
        raise ValueError(f"attention_backend must be one of {list(ATTENTION_BACKENDS)}, got {name!r}.")
    module_name, class_name = _BACKEND_CLASSES[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)
