"""Linear layers split over tensor-parallel ranks, whose weights load (and shard) from checkpoint tensors.

Mirrors vllm/model_executor/layers/linear.py (chapters 01 and 13).

Why it exists, part 1 (chapter 01): a checkpoint stores `q_proj`, `k_proj`, `v_proj` (and
`gate_proj`, `up_proj`) as separate matrices, but they all read the same input, so one
matmul against their concatenation does the same work with fewer, larger kernels. Each
fused layer owns one parameter and a `weight_loader(param, loaded_weight, shard_id)`
that copies a checkpoint tensor into its slice of it.

Part 2 (chapter 13): with `tp` ranks, each rank holds a shard of every matrix, and the
two kinds of split pair up so that a whole block needs one all-reduce (Megatron-LM's
layout, which vLLM follows):

    ColumnParallelLinear   W [out, in] split by output rows: rank r computes out/tp of the
                           outputs (its attention heads, its slice of the MLP) from the whole input.
    RowParallelLinear      W [out, in] split by input columns: rank r multiplies its slice of
                           the input (the outputs of the column layer before it) and the ranks'
                           partial sums are added by an all-reduce.

So `o_proj(attention(qkv_proj(x)))` and `down_proj(act(gate_up_proj(x)))` each cost one
all-reduce of `[num_tokens, hidden_size]`. Checkpoints are whole: every weight loader
takes the full tensor and copies only this rank's rows or columns. Shapes are checked
against the full tensor the checkpoint must hold, so a wrong checkpoint fails the same
way at any `tp`. One difference: vLLM's layers return `(output, output_bias)`; ours
return the output alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nano_v1.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from nano_v1.distributed.utils import divide
from nano_v1.model_executor.model_loader import check_shape


class LinearBase(nn.Module):
    """`y = x W^T + b` with this rank's `W: [output_size_per_partition, input_size_per_partition]`.

    Created in the default dtype and device; reads its rank and the number of ranks from
    the process's tensor-parallel group (`nano_v1/distributed/parallel_state.py`).
    """

    def __init__(
        self, input_size: int, output_size: int, bias: bool, input_size_per_partition: int,
        output_size_per_partition: int,
    ) -> None:  # fmt: skip
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.input_size_per_partition = input_size_per_partition
        self.output_size_per_partition = output_size_per_partition
        self.weight = nn.Parameter(
            torch.empty(output_size_per_partition, input_size_per_partition), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size_per_partition), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size_per_partition}, out={self.output_size_per_partition}, "
            f"bias={self.bias is not None}, tp_size={self.tp_size}"
        )


class ColumnParallelLinear(LinearBase):
    """Output rows split over the ranks: `x [n, in] -> [n, out / tp]`, this rank's slice, no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        super().__init__(input_size, output_size, bias, input_size, divide(output_size, tp_size))

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        """Copy rows `[rank * out / tp, (rank + 1) * out / tp)` of the checkpoint's `[out, in]` (or `[out]`)."""
        assert shard_id is None, f"{type(self).__name__} has no shards"
        check_shape((self.output_size, *param.shape[1:]), loaded_weight)
        shard_size = self.output_size_per_partition
        param.data.copy_(loaded_weight.narrow(0, self.tp_rank * shard_size, shard_size))


class _ShardedColumnLinear(ColumnParallelLinear):
    """A column-parallel layer that is the concatenation of named output shards, each split over the ranks.

    On rank r the parameter is `[shard_0 of rank r, shard_1 of rank r, ...]`: each
    checkpoint tensor contributes its own slice for this rank, at this rank's offset.
    """

    def __init__(self, input_size: int, shard_sizes: dict[int | str, int], bias: bool) -> None:
        super().__init__(input_size, sum(shard_sizes.values()), bias)
        self.shard_sizes = shard_sizes  # shard id -> its rows summed over the ranks

    def shard_offset_and_size(self, shard_id: int | str) -> tuple[int, int]:
        """Where shard `shard_id` lies in this rank's parameter: (first row, rows)."""
        offset = 0
        for other_id, size in self.shard_sizes.items():
            if other_id == shard_id:
                return offset, size // self.tp_size
            offset += size // self.tp_size
        raise KeyError(f"{type(self).__name__} has no shard {shard_id!r}")

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        """Copy rank r's row block of the checkpoint's shard `shard_id` into its place in the parameter."""
        self.check_shard_id(shard_id)
        check_shape(
            (self.shard_sizes[shard_id], *param.shape[1:]),
            loaded_weight,
            f"shard {shard_id!r} of the parameter",
        )
        offset, size = self.shard_offset_and_size(shard_id)
        param.data.narrow(0, offset, size).copy_(loaded_weight.narrow(0, self.tp_rank * size, size))

    def check_shard_id(self, shard_id: int | str | None) -> None:
        if shard_id is None:
            raise ValueError(
                f"the checkpoint stores this {type(self).__name__} as one tensor; nano_v1 loads its parts "
                f"{list(self.shard_sizes)} (q_proj, k_proj, v_proj or gate_proj, up_proj) one by one."
            )


class MergedColumnParallelLinear(_ShardedColumnLinear):
    """Several column-parallel layers on the same input, fused; shard ids 0, 1, ...

    The MLP's `gate_up_proj` is `gate_proj` (shard 0) and `up_proj` (shard 1); rank r holds
    rows `[r * i / tp, (r + 1) * i / tp)` of each, so `SiluAndMul` pairs the right halves.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, dict(enumerate(output_sizes)), bias)
        self.output_sizes = output_sizes


class QKVParallelLinear(_ShardedColumnLinear):
    """The query, key and value projections fused; shard ids "q", "k", "v", split by attention head.

    Rank r holds `num_heads = total_num_heads / tp` query heads and `num_kv_heads` key and
    value heads: `total_num_kv_heads / tp` when there are at least as many KV heads as
    ranks, else one, replicated on `num_kv_head_replicas = tp / total_num_kv_heads` ranks
    (vLLM does the same, so that grouped-query attention with 2 KV heads runs on 8 GPUs).
    On rank r the output is `[q heads of r | k heads of r | v heads of r]`.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
    ) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size)
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, total_num_kv_heads)
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size)
            self.num_kv_head_replicas = 1
        # Rows as the ranks hold them, summed over ranks: replicated KV heads count once per rank.
        q_size = self.num_heads * head_size * tp_size
        kv_size = self.num_kv_heads * head_size * tp_size
        super().__init__(hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        """Copy this rank's heads of the checkpoint's q, k or v tensor (`shard_id`), weight or
        bias, into the shard's place in the fused parameter.

        Rank r holds query heads `[r * num_heads, (r + 1) * num_heads)` and KV heads
        `[s * num_kv_heads, (s + 1) * num_kv_heads)` with `s = r // num_kv_head_replicas`
        (ranks that share a replicated KV head hold the same one).
        """
        self.check_shard_id(shard_id)
        num_heads = self.total_num_heads if shard_id == "q" else self.total_num_kv_heads
        check_shape(
            (num_heads * self.head_size, *param.shape[1:]),
            loaded_weight,
            f"shard {shard_id!r} of the parameter",
        )
        if self.tp_size == 1:  # one rank holds every head: the tensor goes whole into its shard's place
            offset, size = self.shard_offset_and_size(shard_id)
            param.data.narrow(0, offset, size).copy_(loaded_weight)
            return
        # BEGIN TASK ch13_t1: copy this rank's heads of the q/k/v tensor into its place in the fused parameter (K/V: rank // num_kv_head_replicas)
        offset, size = self.shard_offset_and_size(shard_id)
        shard_rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.num_kv_head_replicas
        param.data.narrow(0, offset, size).copy_(loaded_weight.narrow(0, shard_rank * size, size))
        # END TASK


class RowParallelLinear(LinearBase):
    """Input columns split over the ranks: `x [n, in / tp]` (this rank's slice) `-> [n, out]`, summed over ranks.

    Used for the projections back to the residual stream (`o_proj`, `down_proj`), whose
    inputs are the sharded outputs of a column-parallel layer. The bias is whole on every
    rank and added once.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        super().__init__(input_size, output_size, bias, divide(input_size, tp_size), output_size)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        """Columns `[rank * in / tp, (rank + 1) * in / tp)` of the checkpoint's `[out, in]`; a bias `[out]` whole."""
        assert shard_id is None, f"{type(self).__name__} has no shards"
        if param.dim() == 1:
            check_shape(param.shape, loaded_weight)
            param.data.copy_(loaded_weight)
            return
        check_shape((self.output_size, self.input_size), loaded_weight)
        shard_size = self.input_size_per_partition
        param.data.copy_(loaded_weight.narrow(1, self.tp_rank * shard_size, shard_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` [n, in / tp] (this rank's slice) -> [n, out]: this rank's partial product, with
        the bias added on one rank only (rank 0), then summed over the ranks by one all-reduce."""
        if self.tp_size == 1:  # one rank: its product is the whole, nothing to sum
            return F.linear(x, self.weight, self.bias)
        # BEGIN TASK ch13_t2: this rank's partial product (the bias on one rank only), then the sum over ranks
        bias = self.bias if self.tp_rank == 0 else None
        output_parallel = F.linear(x, self.weight, bias)  # [num_tokens, output_size], this rank's share
        return tensor_model_parallel_all_reduce(output_parallel)
        # END TASK
