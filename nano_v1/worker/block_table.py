"""Block tables: which KV cache blocks hold each request of the persistent batch, per KV cache group.

Mirrors vllm/v1/worker/block_table.py (chapters 05 and 12), and `CpuGpuBuffer` from vllm/v1/utils.py.

Why it exists: the attention kernel finds a request's keys and values through a row of
block ids (`block_table[i, j]` is the block holding tokens `j*block_size ..
(j+1)*block_size - 1` of request i), and writes this step's new keys and values to the
slots named by `slot_mapping`. Both are kept in preallocated CPU buffers that the
runner edits in place with the scheduler's diff (a few new block ids per step) and
copies to the device once per step; nothing is rebuilt from Python lists. A hybrid model
(chapter 12) has one `BlockTable` per KV cache group, each with its own slot mapping:
the same token sits in different blocks in different groups (`MultiGroupBlockTable`).
"""

from __future__ import annotations

import numpy as np
import torch


class CpuGpuBuffer:
    """A preallocated CPU tensor, its numpy view, and a same-shaped device tensor.

    The CPU side is where per-step arithmetic happens (numpy, no kernel launches);
    `copy_to_gpu(n)` ships the first n rows in one non-blocking copy. With pinned CPU
    memory that copy is a DMA that overlaps with the CPU work that follows. When the
    device is the CPU, both sides are the same tensor and the copy is skipped.
    """

    def __init__(self, *size: int, dtype: torch.dtype, device: torch.device, pin_memory: bool) -> None:
        self.cpu = torch.zeros(*size, dtype=dtype, device="cpu", pin_memory=pin_memory)
        self.np: np.ndarray = self.cpu.numpy()
        self.gpu = self.cpu.to(device)  # the same tensor when device is the CPU

    def copy_to_gpu(self, n: int | None = None) -> torch.Tensor:
        """Copy the first n rows (all when None) to the device; return the device slice."""
        if n is None:
            n = self.cpu.shape[0]
        if self.gpu is not self.cpu:
            self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.gpu[:n]


class BlockTable:
    """Block ids of up to `max_num_reqs` requests, one row per persistent-batch slot.

    Only the first `num_blocks_per_row[i]` entries of row i are meaningful; entries past
    them are stale and never read (a request's context never reaches past its blocks).
    """

    def __init__(
        self,
        block_size: int,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        max_num_batched_tokens: int,
        pin_memory: bool,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.max_num_reqs = max_num_reqs
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.block_table = CpuGpuBuffer(
            max_num_reqs, max_num_blocks_per_req, dtype=torch.int32, device=device, pin_memory=pin_memory
        )
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)
        # Cache slot of every token scheduled this step (int64, as CommonAttentionMetadata wants).
        self.slot_mapping = CpuGpuBuffer(
            max_num_batched_tokens, dtype=torch.int64, device=device, pin_memory=pin_memory
        )

    def append_row(self, block_ids: list[int], row_idx: int) -> None:
        """Append newly allocated blocks to the end of row `row_idx`."""
        if not block_ids:
            return
        start = self.num_blocks_per_row[row_idx]
        end = start + len(block_ids)
        self.block_table.np[row_idx, start:end] = block_ids
        self.num_blocks_per_row[row_idx] = end

    def add_row(self, block_ids: list[int], row_idx: int) -> None:
        """Make row `row_idx` hold exactly `block_ids` (a request entering the batch)."""
        self.num_blocks_per_row[row_idx] = 0
        self.append_row(block_ids, row_idx)

    def move_row(self, src: int, tgt: int) -> None:
        """Copy row `src` into row `tgt` (condense fills a hole with the last row)."""
        num_blocks = self.num_blocks_per_row[src]
        self.block_table.np[tgt, :num_blocks] = self.block_table.np[src, :num_blocks]
        self.num_blocks_per_row[tgt] = num_blocks

    def compute_slot_mapping(self, req_indices: np.ndarray, positions: np.ndarray) -> None:
        """Cache slot of each scheduled token: block_table[req, pos // B] * B + pos % B.

        `req_indices[t]` is the batch row of token t and `positions[t]` its position in
        its request. Reading the table through `ravel()` turns the 2-D lookup into one
        gather at `req * max_num_blocks_per_req + pos // B`.
        """
        # BEGIN TASK ch05_t1: each token's slot in the paged cache, via its request's block-table row; no loop
        num_tokens = req_indices.shape[0]
        flat_indices = req_indices * self.max_num_blocks_per_req + positions // self.block_size
        block_numbers = self.block_table.np.ravel()[flat_indices]  # [num_tokens]
        np.add(
            block_numbers * self.block_size,
            positions % self.block_size,
            out=self.slot_mapping.np[:num_tokens],
        )
        # END TASK

    def commit_block_table(self, num_reqs: int) -> torch.Tensor:
        """Copy the first `num_reqs` rows to the device; return them there."""
        return self.block_table.copy_to_gpu(num_reqs)

    def commit_slot_mapping(self, num_tokens: int) -> torch.Tensor:
        """Copy the first `num_tokens` slots to the device; return them there."""
        return self.slot_mapping.copy_to_gpu(num_tokens)


class MultiGroupBlockTable:
    """One `BlockTable` per KV cache group, all moved together (a batch row is a request in every group).

    Rows are edited per group with that group's block ids (`block_ids[g]`). A sliding
    window's dropped blocks are never removed here: the scheduler sends only new blocks,
    so a row keeps stale ids before the window, which no kernel reads.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        pin_memory: bool,
        device: torch.device,
        block_sizes: list[int],
    ) -> None:
        self.block_tables = [
            BlockTable(
                block_size,
                max_num_reqs,
                -(-max_model_len // block_size),
                max_num_batched_tokens,
                pin_memory,
                device,
            )
            for block_size in block_sizes
        ]

    def append_row(self, block_ids: tuple[list[int], ...], row_idx: int) -> None:
        for block_table, ids in zip(self.block_tables, block_ids):
            block_table.append_row(ids, row_idx)

    def add_row(self, block_ids: tuple[list[int], ...], row_idx: int) -> None:
        for block_table, ids in zip(self.block_tables, block_ids):
            block_table.add_row(ids, row_idx)

    def move_row(self, src: int, tgt: int) -> None:
        for block_table in self.block_tables:
            block_table.move_row(src, tgt)

    def compute_slot_mapping(self, req_indices: np.ndarray, positions: np.ndarray) -> None:
        for block_table in self.block_tables:
            block_table.compute_slot_mapping(req_indices, positions)

    def __getitem__(self, kv_cache_group_id: int) -> BlockTable:
        return self.block_tables[kv_cache_group_id]
