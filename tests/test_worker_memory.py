"""The worker sizes a CUDA KV cache from what its own engine uses, beside other engines of the same process.

Notebooks and the GPU suite build several engines in one process, one after another or
alive together. On a CPU there is no CUDA memory to measure, so `torch.cuda`'s memory
calls are replaced by `FakeCudaMemory`, a ledger of bytes allocated and reserved by torch
and held outside it, and the model runner by one whose weights and profile step allocate
in that ledger.
"""

from __future__ import annotations

import gc

import pytest
import torch
from helpers.checkpoints import make_vllm_config

from nano_v1.worker import gpu_worker

pytestmark = pytest.mark.ch02

GiB = 1 << 30


class FakeCudaMemory:
    """The memory calls of `torch.cuda` that the worker makes, over a 100 GiB device."""

    def __init__(self) -> None:
        self.total = 100 * GiB
        self.allocated = self.reserved = self.peak = 0
        self.outside_torch = 1 * GiB  # the CUDA context

    def allocate(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.reserved = max(self.reserved, self.allocated)
        self.peak = max(self.peak, self.allocated)

    def install(self, monkeypatch) -> None:
        cuda = gpu_worker.torch.cuda
        for name, fn in {
            "set_device": lambda device: None,
            "synchronize": lambda device=None: None,
            "empty_cache": lambda: setattr(self, "reserved", self.allocated),
            "reset_peak_memory_stats": lambda device=None: setattr(self, "peak", self.allocated),
            "mem_get_info": lambda device=None: (self.total - self.reserved - self.outside_torch, self.total),
            "memory_allocated": lambda device=None: self.allocated,
            "memory_reserved": lambda device=None: self.reserved,
            "max_memory_allocated": lambda device=None: self.peak,
        }.items():
            monkeypatch.setattr(cuda, name, fn)


class FakeRunner:
    """Loads 2 GiB of weights; its profile step peaks 3 GiB above them."""

    def __init__(self, memory: FakeCudaMemory) -> None:
        self.memory = memory

    def load_model(self) -> None:
        self.memory.allocate(2 * GiB)

    def profile_run(self) -> None:
        self.memory.allocate(3 * GiB)
        self.memory.allocate(-3 * GiB)


class DroppedEngine:
    """An engine nobody refers to any more, kept alive only by a reference cycle (a compiled
    model's forward refers back to the model); it frees its memory when collected."""

    def __init__(self, memory: FakeCudaMemory, nbytes: int) -> None:
        self.memory, self.nbytes, self.cycle = memory, nbytes, self
        memory.allocate(nbytes)

    def __del__(self) -> None:
        self.memory.allocate(-self.nbytes)


@pytest.fixture
def memory(monkeypatch) -> FakeCudaMemory:
    fake = FakeCudaMemory()
    fake.install(monkeypatch)
    monkeypatch.setattr(gpu_worker, "GPUModelRunner", lambda vllm_config, device: FakeRunner(fake))
    return fake


def cuda_worker(model: str, gpu_memory_utilization: float) -> gpu_worker.Worker:
    config = make_vllm_config(model, gpu_memory_utilization=gpu_memory_utilization)
    config.device_config.device = "cuda:0"  # the config refuses CUDA on a machine without it
    return gpu_worker.Worker(config)


def test_a_second_engine_sizes_its_cache_from_its_own_memory(tiny_qwen3, memory):
    memory.allocate(40 * GiB)  # a first engine of this process, alive: weights and KV cache
    worker = cuda_worker(tiny_qwen3, gpu_memory_utilization=0.3)
    worker.init_device()
    worker.load_model()
    # 30 GiB asked for, less its own 2 GiB of weights and 3 GiB of activations.
    assert worker.determine_available_memory() == int(0.3 * memory.total - 5 * GiB)


def test_an_engine_dropped_in_a_reference_cycle_is_freed_before_the_next_one_measures(tiny_qwen3, memory):
    gc.disable()  # as if no collection had run since the last engine was dropped
    try:
        DroppedEngine(memory, 60 * GiB)
        worker = cuda_worker(tiny_qwen3, gpu_memory_utilization=0.9)
        worker.init_device()
    finally:
        gc.enable()
    worker.load_model()
    assert worker.determine_available_memory() == int(0.9 * memory.total - 5 * GiB)


def test_the_whole_device_is_asked_for_when_it_is_not_free(tiny_qwen3, memory):
    memory.allocate(50 * GiB)
    with pytest.raises(ValueError, match="lower gpu_memory_utilization"):
        cuda_worker(tiny_qwen3, gpu_memory_utilization=0.9).init_device()
    assert torch.cuda.memory_allocated() == 50 * GiB
