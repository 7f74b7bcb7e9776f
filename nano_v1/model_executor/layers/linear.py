"""Linear layers whose weights can be fused from several checkpoint tensors.

Mirrors vllm/model_executor/layers/linear.py (chapter 01).

Why it exists: a checkpoint stores `q_proj`, `k_proj`, `v_proj` (and `gate_proj`, `up_proj`)
as separate matrices, but they all read the same input, so one matmul against their
concatenation does the same work with fewer, larger kernels. Each fused layer owns one
parameter and a `weight_loader(param, loaded_weight, shard_id)` that copies a checkpoint
tensor into its slice of it.

The names are vLLM's, whose layers also split the weights across GPUs for tensor
parallelism. Here the tensor-parallel size is 1 (chapter 13 adds it): "column parallel"
and "row parallel" only name which dimension a future split would cut. One difference:
vLLM's layers return `(output, output_bias)`; ours return the output alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nano_v1.model_executor.model_loader import check_shape, default_weight_loader


class LinearBase(nn.Module):
    """`y = x W^T + b` with `W: [output_size, input_size]`, created in the default dtype and device."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        assert shard_id is None, f"{type(self).__name__} has no shards"
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class ColumnParallelLinear(LinearBase):
    """A linear layer whose output dimension tensor parallelism would split (here: whole)."""


class RowParallelLinear(LinearBase):
    """A linear layer whose input dimension tensor parallelism would split (here: whole).

    Used for the projections back to the residual stream (`o_proj`, `down_proj`).
    """


class _ShardedColumnLinear(ColumnParallelLinear):
    """A column-parallel linear layer that is the concatenation of named output shards."""

    def __init__(self, input_size: int, shard_sizes: dict[int | str, int], bias: bool) -> None:
        super().__init__(input_size, sum(shard_sizes.values()), bias)
        # shard id -> (first output row, number of rows)
        self.shard_offsets: dict[int | str, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in shard_sizes.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        if shard_id is None:  # a checkpoint that already stores the fused tensor
            default_weight_loader(param, loaded_weight)
            return
        offset, size = self.shard_offsets[shard_id]
        target = param.data.narrow(0, offset, size)  # rows of this shard (weight or bias)
        check_shape(target, loaded_weight, f"shard {shard_id!r} of the parameter")
        target.copy_(loaded_weight)


class MergedColumnParallelLinear(_ShardedColumnLinear):
    """Several column-parallel layers on the same input, fused; shard ids 0, 1, ...

    The MLP's `gate_up_proj` is `gate_proj` (shard 0) and `up_proj` (shard 1).
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, dict(enumerate(output_sizes)), bias)
        self.output_sizes = output_sizes


class QKVParallelLinear(_ShardedColumnLinear):
    """The query, key and value projections fused; shard ids "q", "k", "v".

    With grouped-query attention the key and value shards have `total_num_kv_heads` heads,
    fewer than the query's `total_num_heads`.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
    ) -> None:
        q_size = total_num_heads * head_size
        kv_size = total_num_kv_heads * head_size
        super().__init__(hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias)
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
