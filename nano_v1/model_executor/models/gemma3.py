"""Gemma 3 (text): a decoder whose layers alternate sliding-window and full attention.

Mirrors vllm/model_executor/models/gemma3.py (chapter 12).

Why it exists: it is the hybrid model of chapter 12. Five of every six layers attend to
a window of their last `sliding_window` tokens (512 in gemma-3-1b, 1024 in 4b-27b), every
sixth to the whole context; `config.layer_types` names each layer's kind. Each layer
declares its window to its `Attention` layer, so the model runner gives it a
`SlidingWindowSpec` and the KV cache manager keeps only its window's blocks. Apart from
that Gemma 3 is a pre-norm decoder with its own details, each matching Hugging Face's:
  * embeddings scaled by sqrt(hidden_size) (in the model dtype);
  * RMSNorm with weight (1 + w) applied in float32 (`GemmaRMSNorm`), and four norms per
    layer: around attention and around the MLP ("sandwich" norms);
  * RMSNorm on each query and key head before RoPE, and attention scaled by
    `query_pre_attn_scalar ** -0.5` rather than `head_dim ** -0.5`;
  * RoPE with its own base per layer kind (10,000 local, 1,000,000 global, the global
    layers of 4b+ also linearly scaled);
  * a gated GELU MLP (tanh approximation) and tied embeddings.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from nano_v1.attention.layer import Attention
from nano_v1.model_executor.layers.activation import GeluAndMul
from nano_v1.model_executor.layers.layernorm import GemmaRMSNorm
from nano_v1.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from nano_v1.model_executor.layers.logits_processor import LogitsProcessor
from nano_v1.model_executor.layers.rotary_embedding import get_rope
from nano_v1.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from nano_v1.model_executor.models.llama import LlamaForCausalLM

SLIDING_ATTENTION = "sliding_attention"


def get_gemma3_rope_config(config: PretrainedConfig, layer_type: str) -> tuple[float, dict | None]:
    """`(rope_theta, rope_scaling)` of one layer kind, from a config of transformers 5 or 4.x.

    transformers 5 keeps one dict per layer kind in `rope_parameters`; 4.x has
    `rope_local_base_freq` for sliding layers and `rope_theta` / `rope_scaling` for global ones.
    """
    params = getattr(config, "rope_parameters", None)
    if params and layer_type in params:
        return float(params[layer_type]["rope_theta"]), params[layer_type]
    if layer_type == SLIDING_ATTENTION:
        return float(config.rope_local_base_freq), None
    return float(config.rope_theta), getattr(config, "rope_scaling", None)


class Gemma3MLP(nn.Module):
    """`down(gelu_tanh(gate(x)) * up(x))`, gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_activation: str) -> None:
        super().__init__()
        if hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(
                f"Gemma 3 uses hidden_activation 'gelu_pytorch_tanh', got {hidden_activation!r}."
            )
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)
        self.act_fn = GeluAndMul(approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Gemma3Attention(nn.Module):
    """Fused QKV, per-head q/k norms, RoPE of this layer's kind, attention (windowed or not), output."""

    def __init__(self, config: PretrainedConfig, layer_idx: int, prefix: str) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, config.attention_bias
        )
        self.o_proj = RowParallelLinear(self.q_size, config.hidden_size, bias=config.attention_bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        layer_type = config.layer_types[layer_idx]
        self.is_sliding = layer_type == SLIDING_ATTENTION
        # (head size, rotary dim, max position, base, scaling): RoPE of this layer's kind, whole heads.
        theta, scaling = get_gemma3_rope_config(config, layer_type)
        self.rotary_emb = get_rope(
            self.head_dim, self.head_dim, config.max_position_embeddings, theta, scaling
        )
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            config.query_pre_attn_scalar**-0.5,
            self.num_kv_heads,
            prefix=f"{prefix}.attn",
            per_layer_sliding_window=config.sliding_window if self.is_sliding else None,
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # Normalise each head over head_dim: [num_tokens, num_(kv_)heads, head_dim].
        q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim)).view(num_tokens, self.q_size)
        k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim)).view(
            num_tokens, self.kv_size
        )
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class Gemma3DecoderLayer(nn.Module):
    """`h += post_norm(attn(pre_norm(h))); h += post_ff_norm(mlp(pre_ff_norm(h)))`: "sandwich" norms."""

    def __init__(self, config: PretrainedConfig, layer_idx: int, prefix: str) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(config, layer_idx, prefix=f"{prefix}.self_attn")
        self.mlp = Gemma3MLP(config.hidden_size, config.intermediate_size, config.hidden_activation)
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps=eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps=eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps=eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream travels beside the hidden states: each sublayer's (post-normed)
        # output is added to it before the next pre-norm; the first layer's input is the stream.
        residual = hidden_states if residual is None else hidden_states + residual
        hidden_states = self.post_attention_layernorm(
            self.self_attn(positions, self.input_layernorm(residual))
        )
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        hidden_states = self.post_feedforward_layernorm(self.mlp(hidden_states))
        return hidden_states, residual


class Gemma3Model(nn.Module):
    """Scaled embedding, decoder layers, final norm: `[num_tokens] -> [num_tokens, hidden_size]`."""

    def __init__(self, config: PretrainedConfig, prefix: str) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, prefix=f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # sqrt(hidden_size), rounded to the model dtype as Hugging Face rounds it.
        self.register_buffer("normalizer", torch.tensor(config.hidden_size**0.5), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # [num_tokens, hidden_size]; the residual stream starts with the first layer.
        hidden_states, residual = self.embed_tokens(input_ids) * self.normalizer, None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        return self.norm(hidden_states, residual)[0]


class Gemma3ForCausalLM(nn.Module):
    """The decoder plus the tied language-model head; the interface the model runner uses."""

    # The checkpoint layout is Llama's (separate q/k/v and gate/up tensors, a tied head).
    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping
    load_weights = LlamaForCausalLM.load_weights

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(config, name, None) is not None:
                raise ValueError(
                    f"Gemma 3 with {name} set is not supported by nano_v1 (released Gemma 3 has none)."
                )
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3 with use_bidirectional_attention is not supported by nano_v1.")
        if not config.tie_word_embeddings:
            raise ValueError("Gemma 3 ties its embeddings; this config says tie_word_embeddings=false.")
        self.config = config
        self.model = Gemma3Model(config, prefix="model")
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`input_ids`, `positions`: `[num_tokens]` -> hidden states `[num_tokens, hidden_size]`."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`[num_rows, hidden_size] -> [num_rows, vocab_size]` float32, through the embedding matrix."""
        return self.logits_processor(self.model.embed_tokens, hidden_states)
