"""RMSNorm, fused with the residual add as vLLM does, and Gemma's variant of it.

Mirrors vllm/model_executor/layers/layernorm.py (chapters 01 and 12).

Why it exists: every decoder layer adds its sublayer's output to the residual stream and
normalises the sum for the next sublayer. vLLM fuses the two (`forward(x, residual)` returns
the normalised sum and the new residual), which on a GPU saves one read and write of the
hidden states per sublayer. The arithmetic here follows Hugging Face's step for step
(add in the model dtype, normalise in float32) so that logits agree exactly.
"""

from __future__ import annotations

import torch
from torch import nn

from nano_v1.model_executor.model_loader import default_weight_loader


class RMSNorm(nn.Module):
    """`x / sqrt(mean(x^2) + eps) * weight` over the last dimension."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise `x`; with `residual`, normalise `x + residual` and also return that sum."""
        if residual is not None:
            x = x + residual
            residual = x
        x32 = x.float()
        variance = x32.pow(2).mean(dim=-1, keepdim=True)
        x = self._apply_weight(x32 * torch.rsqrt(variance + self.variance_epsilon), x.dtype)
        return x if residual is None else (x, residual)

    def _apply_weight(self, normed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Llama's order: round the float32 normalised `x` to the model dtype, then scale."""
        return normed.to(dtype) * self.weight

    def extra_repr(self) -> str:
        return f"hidden_size={self.weight.shape[0]}, eps={self.variance_epsilon}"


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: `x / rms(x) * (1 + weight)`, scaled in float32 before the cast back.

    The weight is stored as an offset from 1 (zeros mean identity), and unlike Llama's norm
    the product is taken in float32 and only then rounded to the model dtype (Hugging Face's
    Gemma does the same, which greedy parity in low precision needs).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        self.weight.data.zero_()

    def _apply_weight(self, normed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (normed * (1.0 + self.weight.float())).to(dtype)
