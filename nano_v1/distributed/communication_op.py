"""The collectives a sharded layer calls, on this process's tensor-parallel group.

Mirrors vllm/distributed/communication_op.py (chapter 13).

Why it exists: model code says what it needs (`tensor_model_parallel_all_reduce(x)`) and
never which group or backend; the group is the process's (`get_tp_group()`), and with one
rank both calls return their input untouched.
"""

from __future__ import annotations

import torch

from nano_v1.distributed.parallel_state import get_tp_group


def tensor_model_parallel_all_reduce(input_: torch.Tensor) -> torch.Tensor:
    """Sum `input_` over the tensor-parallel ranks; every rank gets the sum (same shape)."""
    return get_tp_group().all_reduce(input_)


def tensor_model_parallel_all_gather(input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `input_` along `dim`, in rank order; every rank gets the whole."""
    return get_tp_group().all_gather(input_, dim)
