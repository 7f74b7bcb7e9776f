"""Logits processors: per-request edits of the logits that follow the persistent batch.

Mirrors vllm/v1/sample/logits_processor/ (chapter 05).
"""

from nano_v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)
from nano_v1.sample.logits_processor.interface import BatchUpdate, LogitsProcessor

__all__ = [
    "BatchUpdate",
    "LogitBiasLogitsProcessor",
    "LogitsProcessor",
    "MinPLogitsProcessor",
    "MinTokensLogitsProcessor",
]
