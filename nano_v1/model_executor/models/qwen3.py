"""Qwen3: Llama's decoder with per-head RMSNorm on queries and keys, and no QKV bias.

Mirrors vllm/model_executor/models/qwen3.py (chapter 01).

Why it exists: Qwen3 normalises each query and key head (over its `head_dim`) before RoPE,
which keeps attention logits in range; everything else is `LlamaForCausalLM`. Its biases
follow `config.attention_bias` (false in released checkpoints), as Llama's do.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from nano_v1.model_executor.layers.layernorm import RMSNorm
from nano_v1.model_executor.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: PretrainedConfig, prefix: str) -> None:
        super().__init__(config, prefix)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens = q.shape[0]
        # Normalise over head_dim, one head at a time: [num_tokens, num_(kv_)heads, head_dim].
        q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
        return q.view(num_tokens, self.q_size), k.view(num_tokens, self.kv_size)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
