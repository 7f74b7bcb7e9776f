"""Qwen2 (and Qwen2.5): Llama's decoder with a bias on the query, key and value projections.

Mirrors vllm/model_executor/models/qwen2.py (chapter 01).

Why it exists: Qwen2 differs from Llama only in its attention biases, so it reuses
`LlamaForCausalLM` whole and overrides `LlamaAttention.projection_biases`.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from nano_v1.model_executor.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    @staticmethod
    def projection_biases(config: PretrainedConfig) -> tuple[bool, bool]:
        return True, False  # biased q/k/v, unbiased o_proj


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen2Attention

    def __init__(self, config: PretrainedConfig) -> None:
        if getattr(config, "use_sliding_window", False):
            raise ValueError("Qwen2 checkpoints with use_sliding_window=true are not supported by nano_v1.")
        super().__init__(config)
