"""The gated activation of the MLP.

Mirrors vllm/model_executor/layers/activation.py (chapter 01).

Why it exists: with `gate_proj` and `up_proj` fused into one matmul, the MLP's activation
receives both halves in one tensor; `SiluAndMul` splits it and computes `silu(gate) * up`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """`[..., 2 * d] -> [..., d]`: silu of the first half times the second half."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
