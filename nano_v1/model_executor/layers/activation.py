"""The gated activation of the MLP, and the plain activations of vision towers.

Mirrors vllm/model_executor/layers/activation.py (chapters 01 and 11).

Why it exists: with `gate_proj` and `up_proj` fused into one matmul, the MLP's activation
receives both halves in one tensor; `SiluAndMul` splits it and computes `silu(gate) * up`.
CLIP's vision tower and LLaVA's projector use ungated activations, picked by the name in
their config (`get_act_fn`).
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


class QuickGELU(nn.Module):
    """`x * sigmoid(1.702 x)`, CLIP's cheap approximation of GELU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


def get_act_fn(act_fn_name: str) -> nn.Module:
    """The activation a Hugging Face config names (`hidden_act`, `projector_hidden_act`)."""
    activations = {"gelu": nn.GELU, "quick_gelu": QuickGELU}
    if act_fn_name not in activations:
        raise ValueError(f"activation {act_fn_name!r} is not supported; nano_v1 has {sorted(activations)}.")
    return activations[act_fn_name]()
