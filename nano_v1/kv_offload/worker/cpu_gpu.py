"""Copies KV blocks between the device's paged KV cache and the CPU tier's tensors.

Mirrors vllm/v1/kv_offload/worker/cpu_gpu.py (chapter 16).

Why it exists: it is the only code that touches KV memory for offloading. The CPU tier
holds, per layer, a tensor shaped like the layer's KV cache, [2, num_cpu_blocks *
block_size_factor, block_size, num_kv_heads, head_size], so that one offloaded block
(`block_size_factor` device blocks' worth of tokens) is `block_size_factor` consecutive
rows. A transfer is one index copy per layer: device rows `gpu_ids` <-> CPU rows
`cpu_ids`, keys and values together.

A CPU block may be entered partway: a request whose device prefix hit ends inside an
offloaded block loads only that block's tail rows (and a store may start inside one); the
skipped rows are always the first CPU block's first ones.

What differs from v0.11.0: the copies are synchronous index copies, on whatever device
the cache lives (ordered after the forward pass on the current stream when it is CUDA);
v0.11.0 runs its `swap_blocks` kernel on two CUDA streams (one per direction) into pinned
memory, records an event per job and reports a job when its event completes, and only
runs on CUDA. Here a job finishes inside `transfer_async`, but it is still reported only
through `get_finished`, so the connector and the scheduler see exactly v0.11.0's
protocol. The KV cache layout is always nano_v1's [2, num_blocks, ...] (v0.11.0 probes
each attention backend's layout), and `expand_block_ids` returns its array rather than
filling one.
"""

from __future__ import annotations

import numpy as np
import torch

from nano_v1.kv_offload.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from nano_v1.kv_offload.worker.worker import OffloadingHandler, TransferResult, TransferSpec


def expand_block_ids(block_ids: np.ndarray, block_size_factor: int, skip_count: int = 0) -> np.ndarray:
    """Offloaded block ids -> the device-sized rows they span, less the first `skip_count`.

    block_ids [0, 1, 3], factor 4 -> [0 1 2 3 4 5 6 7 12 13 14 15]; skip_count 1 drops the 0.
    """
    assert 0 <= skip_count < block_size_factor
    # [num_blocks, block_size_factor] -> [num_blocks * block_size_factor]
    rows = (block_ids[:, None] * block_size_factor + np.arange(block_size_factor)).reshape(-1)
    return rows[skip_count:]


class CpuGpuOffloadingHandler(OffloadingHandler):
    """Owns the CPU tier's tensors and copies blocks device -> CPU (stores) and CPU -> device (loads)."""

    def __init__(
        self, gpu_block_size: int, cpu_block_size: int, num_cpu_blocks: int, gpu_caches: dict[str, torch.Tensor]
    ) -> None:
        assert cpu_block_size % gpu_block_size == 0
        self.block_size_factor = cpu_block_size // gpu_block_size
        self.gpu_tensors: list[torch.Tensor] = list(gpu_caches.values())
        self.cpu_tensors: list[torch.Tensor] = []
        for gpu_tensor in self.gpu_tensors:
            assert gpu_tensor.shape[0] == 2, "nano_v1's KV cache layout: [2, num_blocks, block_size, heads, head_size]"
            cpu_shape = (2, num_cpu_blocks * self.block_size_factor, *gpu_tensor.shape[2:])
            self.cpu_tensors.append(torch.zeros(cpu_shape, dtype=gpu_tensor.dtype, device="cpu"))
        self._finished: list[TransferResult] = []

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        src_spec, dst_spec = spec
        store = isinstance(src_spec, GPULoadStoreSpec)
        gpu_spec, cpu_spec = (src_spec, dst_spec) if store else (dst_spec, src_spec)
        assert isinstance(gpu_spec, GPULoadStoreSpec) and isinstance(cpu_spec, CPULoadStoreSpec)
        num_skipped = cpu_spec.block_ids.size * self.block_size_factor - gpu_spec.block_ids.size
        gpu_ids = torch.from_numpy(gpu_spec.block_ids)  # [num_rows]
        cpu_ids = torch.from_numpy(expand_block_ids(cpu_spec.block_ids, self.block_size_factor, num_skipped))
        with torch.no_grad():
            for gpu_tensor, cpu_tensor in zip(self.gpu_tensors, self.cpu_tensors):
                device_ids = gpu_ids.to(gpu_tensor.device)
                if store:
                    cpu_tensor[:, cpu_ids] = gpu_tensor[:, device_ids].cpu()  # [2, num_rows, block_size, heads, head_size]
                else:
                    gpu_tensor[:, device_ids] = cpu_tensor[:, cpu_ids].to(gpu_tensor.device)
        self._finished.append((job_id, True))
        return True

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished
