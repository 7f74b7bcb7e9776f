"""Llama, and the decoder that Qwen2 and Qwen3 reuse.

Mirrors vllm/model_executor/models/llama.py (chapter 01).

Why it exists: Llama, Qwen2 and Qwen3 are the same pre-norm decoder (RMSNorm, grouped-query
attention with RoPE, a gated SiLU MLP); they differ only in which projections have a bias
and whether queries and keys are normalised per head. So this module holds the decoder
once, and `qwen2.py`/`qwen3.py` swap in their attention class.

Unlike Hugging Face's models, `forward` takes a flat batch: `input_ids` and `positions` are
`[num_tokens]`, the tokens of all scheduled requests concatenated, with no batch dimension
and no padding. Which token belongs to which request only matters inside attention, and the
`Attention` layer reads that from the forward context.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from nano_v1.attention.layer import Attention
from nano_v1.model_executor.layers.activation import SiluAndMul
from nano_v1.model_executor.layers.layernorm import RMSNorm
from nano_v1.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from nano_v1.model_executor.layers.logits_processor import LogitsProcessor
from nano_v1.model_executor.layers.rotary_embedding import get_rope
from nano_v1.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from nano_v1.model_executor.model_loader import load_stacked_weights


def get_rope_config(config: PretrainedConfig) -> tuple[float, dict | None]:
    """`(rope_theta, rope_scaling)` from a config of transformers 4.x or 5.x.

    transformers 5 keeps both in `config.rope_parameters`; 4.x has `config.rope_theta` and
    an optional `config.rope_scaling` dict.
    """
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    theta = (params or {}).get("rope_theta", getattr(config, "rope_theta", 10000.0))
    return float(theta), params


class LlamaMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))`, with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate_size]
        return self.down_proj(self.act_fn(gate_up))


class LlamaAttention(nn.Module):
    """Fused QKV projection, RoPE, paged attention, output projection."""

    def __init__(self, config: PretrainedConfig, prefix: str) -> None:
        super().__init__()
        hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        qkv_bias, o_bias = self.projection_biases(config)
        self.qkv_proj = QKVParallelLinear(
            hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, qkv_bias
        )
        self.o_proj = RowParallelLinear(self.q_size, hidden_size, bias=o_bias)
        rope_theta, rope_scaling = get_rope_config(config)
        self.rotary_emb = get_rope(
            self.head_dim,
            rotary_dim=self.head_dim,
            max_position=config.max_position_embeddings,
            base=rope_theta,
            rope_scaling=rope_scaling,
        )
        self.attn = Attention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, prefix=f"{prefix}.attn"
        )

    @staticmethod
    def projection_biases(config: PretrainedConfig) -> tuple[bool, bool]:
        """Whether the QKV and the output projections have a bias."""
        bias = getattr(config, "attention_bias", False)
        return bias, bias

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook before RoPE: Llama and Qwen2 leave queries and keys as projected."""
        return q, k

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.normalize_qk(q, k)
        q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v)  # [num_tokens, q_size]
        return self.o_proj(attn_output)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: `h += attn(norm(h)); h += mlp(norm(h))`, the adds fused into the norms."""

    def __init__(self, config: PretrainedConfig, attention_cls: type[LlamaAttention], prefix: str) -> None:
        super().__init__()
        self.self_attn = attention_cls(config, prefix=f"{prefix}.self_attn")
        self.mlp = LlamaMLP(
            config.hidden_size, config.intermediate_size, bias=getattr(config, "mlp_bias", False)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream travels beside the hidden states; each norm first adds the
        # previous sublayer's output to it (the first layer has nothing to add yet).
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm: `[num_tokens] -> [num_tokens, hidden_size]`."""

    def __init__(self, config: PretrainedConfig, attention_cls: type[LlamaAttention], prefix: str) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, attention_cls, prefix=f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        # [num_tokens, hidden_size]. A multimodal model's runner passes the embeddings, with
        # the images' merged in (chapter 11).
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """The decoder plus the language-model head; the interface the model runner uses."""

    attention_cls: type[LlamaAttention] = LlamaAttention

    # Checkpoint tensors that go into a slice of a fused parameter:
    # (fused parameter name, checkpoint name, shard id).
    stacked_params_mapping = (
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    )

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.attention_cls, prefix="model")
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`input_ids`, `positions`: `[num_tokens]` (or, instead of the ids, `inputs_embeds`:
        `[num_tokens, hidden_size]`) -> hidden states `[num_tokens, hidden_size]`."""
        return self.model(input_ids, positions, inputs_embeds)

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`[num_tokens] -> [num_tokens, hidden_size]`: the token embeddings `forward` would start from."""
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`[num_rows, hidden_size]` -> float32 logits `[num_rows, vocab_size]`."""
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into parameters; return the names of the parameters loaded."""
        tied = getattr(self.config, "tie_word_embeddings", False)

        def skip(name: str) -> bool:
            # Hugging Face may save RoPE's inverse frequencies; ours are recomputed. A tied
            # head has no parameter of its own.
            return "rotary_emb.inv_freq" in name or (tied and name.startswith("lm_head."))

        return load_stacked_weights(self, weights, self.stacked_params_mapping, skip)
