"""Rotary position embeddings (RoPE), with a cos/sin table computed once per model.

Mirrors vllm/model_executor/layers/rotary_embedding/ (chapter 01).

Why it exists: RoPE rotates each query and key by an angle proportional to its position, so
attention scores depend on relative distance. Because the model sees a flat batch of tokens
from many requests, each token carries its own position (`positions[i]`), and the rotation
is a row gather from a `[max_position, rotary_dim]` table: no per-request state, no batch
dimension. Scaled variants (linear, Llama 3) differ only in their inverse frequencies.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (the two halves of each head are the rotated pairs), as Llama and Qwen use."""

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        # Built in float32, as Hugging Face does, then stored in the model dtype.
        cache = self._compute_cos_sin_cache().to(torch.get_default_dtype())
        self.register_buffer("cos_sin_cache", cache, persistent=False)  # [max_position, rotary_dim]

    def _compute_inv_freq(self) -> torch.Tensor:
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float() / self.rotary_dim
        return 1.0 / (self.base**exponents)  # [rotary_dim // 2]

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        inv_freq = self._compute_inv_freq()
        t = torch.arange(self.max_position_embeddings, dtype=torch.float32)
        freqs = t[:, None] * inv_freq[None, :]  # [max_position, rotary_dim // 2]
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [max_position, rotary_dim]

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        query: torch.Tensor,  # [num_tokens, num_heads * head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads * head_size]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)  # each [num_tokens, rotary_dim // 2]
        cos = torch.cat((cos, cos), dim=-1).unsqueeze(1)  # [num_tokens, 1, rotary_dim]
        sin = torch.cat((sin, sin), dim=-1).unsqueeze(1)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        x = x.view(num_tokens, -1, self.head_size)  # [num_tokens, num_heads, head_size]
        x_rot, x_pass = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated_half = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
        x_rot = x_rot * cos + rotated_half * sin
        return torch.cat((x_rot, x_pass), dim=-1).view(num_tokens, -1)  # [num_tokens, num_heads * head_size]

    def extra_repr(self) -> str:
        return f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, base={self.base}"


class LinearScalingRotaryEmbedding(RotaryEmbedding):
    """Position interpolation: every frequency divided by `scaling_factor`."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        scaling_factor: float,
    ) -> None:
        self.scaling_factor = scaling_factor
        super().__init__(head_size, rotary_dim, max_position_embeddings, base)

    def _compute_inv_freq(self) -> torch.Tensor:
        return super()._compute_inv_freq() / self.scaling_factor


class Llama3RotaryEmbedding(RotaryEmbedding):
    """Llama 3.1's scaling: long wavelengths divided by `scaling_factor`, short ones kept,
    the band between blended smoothly."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        scaling_factor: float,
        low_freq_factor: float,
        high_freq_factor: float,
        orig_max_position: int,
    ) -> None:
        self.scaling_factor = scaling_factor
        self.low_freq_factor = low_freq_factor
        self.high_freq_factor = high_freq_factor
        self.orig_max_position = orig_max_position
        super().__init__(head_size, rotary_dim, max_position_embeddings, base)

    def _compute_inv_freq(self) -> torch.Tensor:
        inv_freq = super()._compute_inv_freq()
        low_freq_wavelen = self.orig_max_position / self.low_freq_factor
        high_freq_wavelen = self.orig_max_position / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.scaling_factor, inv_freq)
        smooth = (self.orig_max_position / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.scaling_factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)


def get_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict | None = None,
) -> RotaryEmbedding:
    """The RoPE module a Hugging Face `rope_scaling` (or `rope_parameters`) dict asks for."""
    scaling = rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return RotaryEmbedding(head_size, rotary_dim, max_position, base)
    if rope_type == "linear":
        return LinearScalingRotaryEmbedding(head_size, rotary_dim, max_position, base, scaling["factor"])
    if rope_type == "llama3":
        return Llama3RotaryEmbedding(
            head_size,
            rotary_dim,
            max_position,
            base,
            scaling["factor"],
            scaling["low_freq_factor"],
            scaling["high_freq_factor"],
            scaling["original_max_position_embeddings"],
        )
    raise ValueError(
        f"rope type {rope_type!r} is not supported; nano_v1 supports 'default', 'linear' and 'llama3'."
    )
