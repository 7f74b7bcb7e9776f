"""Batched logits edits the sampler applies from `SamplingMetadata` (penalties, bad words).

Mirrors vllm/v1/sample/ops/ (chapter 01).
"""
