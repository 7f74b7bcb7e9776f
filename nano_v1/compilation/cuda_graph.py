"""CUDAGraphWrapper: capture a callable as a CUDA graph per batch size, replay it afterwards.

Mirrors vllm/compilation/cuda_graph.py (chapter 08).

Why it exists: a decode step of a small model is hundreds of short kernels, and launching
each from Python costs more than running it. A CUDA graph records the launches once and
replays them with one call, but it freezes everything: the kernels, their grid sizes, and
the addresses of every tensor they read and write. So a graph is captured per padded
token count (the key, a `BatchDescriptor`), inputs must come from buffers that stay put
(the model runner's persistent buffers, or the previous graph's outputs), and anything
that decides on the host what to launch (attention over a ragged batch) stays outside.

The wrapper is told what to do by the forward context, set by the model runner each step:
if the step's `cudagraph_runtime_mode` is this wrapper's mode, the step's batch
descriptor selects a graph, captured on first use and replayed afterwards; otherwise
(NONE, a profiling run, or another wrapper's mode) it calls the wrapped callable as is.
That lets a FULL wrapper around the whole model and PIECEWISE wrappers around its pieces
coexist: each acts only when the step is meant for it.

Memory: every graph of a runner allocates from one shared pool (`GraphPool`), and only
weak references to a graph's outputs are kept, so the memory of a piece's outputs is
reused by the next piece and by the graphs of other sizes, as it would be in an eager
forward pass. That is safe because graphs replay in the order they were captured, never
interleaved within one step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from nano_v1.compilation.counter import compilation_counter
from nano_v1.config import CUDAGraphMode
from nano_v1.forward_context import BatchDescriptor, get_forward_context


@dataclass(slots=True)
class GraphPool:
    """The memory pool and the side stream that every graph of one model runner is captured with.

    Capture cannot happen on the default stream; and the caching allocator keeps blocks per
    stream, so one stream for all captures is what lets graphs reuse each other's memory.
    """

    handle: Any
    stream: torch.cuda.Stream

    @classmethod
    def create(cls, device: torch.device) -> GraphPool:
        return cls(handle=torch.cuda.graph_pool_handle(), stream=torch.cuda.Stream(device))


@dataclass(slots=True)
class CUDAGraphEntry:
    """One captured size: the graph, weak views of its outputs, and its inputs' addresses."""

    batch_descriptor: BatchDescriptor
    graph: Any = None  # torch.cuda.CUDAGraph
    output: Any = None
    input_addresses: list[int] = field(default_factory=list)


def weak_ref_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A view of `tensor`'s memory that does not keep that memory allocated.

    A replayed graph writes its outputs to the addresses it was captured with; the wrapper
    hands out these views of them. Holding the tensors themselves would pin a pool block per
    piece and per size, and the pool could never recycle them.
    """
    storage = tensor.untyped_storage()
    borrowed = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), tensor.device, storage.nbytes()
    )
    view = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return view.set_(borrowed, tensor.storage_offset(), tensor.size(), tensor.stride())


def weak_ref_tensors(output: Any) -> Any:
    """`weak_ref_tensor` over a tensor, or a tuple or list of them (other values pass through)."""
    if isinstance(output, torch.Tensor):
        return weak_ref_tensor(output)
    if isinstance(output, (tuple, list)):
        return type(output)(weak_ref_tensors(o) for o in output)
    return output


def tensor_addresses(args: tuple) -> list[int]:
    return [a.data_ptr() for a in args if isinstance(a, torch.Tensor)]


class CUDAGraphWrapper:
    """Runs `runnable` through CUDA graphs when the step's runtime mode is `runtime_mode`.

    Graphs are captured lazily, at the first call with a new batch descriptor; the model
    runner makes those first calls at start-up (`capture_model`), largest size first, so
    that smaller graphs fit into the memory the largest one already took from the pool.
    """

    def __init__(
        self, runnable: Callable[..., Any], runtime_mode: CUDAGraphMode, graph_pool: GraphPool | None
    ) -> None:
        assert runtime_mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL)
        self.runnable = runnable
        self.runtime_mode = runtime_mode
        self.graph_pool = graph_pool
        self.entries: dict[BatchDescriptor, CUDAGraphEntry] = {}

    def __getattr__(self, name: str) -> Any:
        # Reached only for names the wrapper lacks: the wrapped model's own (compute_logits).
        if name == "runnable":
            raise AttributeError(name)
        return getattr(self.runnable, name)

    def __call__(self, *args: Any) -> Any:
        """Run `runnable(*args)`: through a graph when the step's `cudagraph_runtime_mode` is
        this wrapper's and the step has a batch descriptor, eagerly otherwise.

        The first call with a descriptor captures its graph (`self.capture`; each capture
        counted in `compilation_counter.num_cudagraph_captured`) and returns the capture's
        output. Later calls replay it (`self.replay`) and return the captured output tensors,
        which the replay has just overwritten. A replay whose tensor inputs are not at the
        addresses it was captured with raises an AssertionError saying the inputs moved: the
        graph would read stale inputs.
        """
        # BEGIN TASK ch08_t2: in this wrapper's mode, capture a batch size's graph once, then replay it
        forward_context = get_forward_context()
        descriptor = forward_context.batch_descriptor
        if forward_context.cudagraph_runtime_mode != self.runtime_mode or descriptor is None:
            return self.runnable(*args)
        entry = self.entries.get(descriptor)
        if entry is None:
            entry = self.entries[descriptor] = CUDAGraphEntry(
                descriptor, input_addresses=tensor_addresses(args)
            )
            output = self.capture(entry, args)
            compilation_counter.num_cudagraph_captured += 1
            # The capture's own tensors go back to the caller, who is still in the pool's
            # allocation order; the entry keeps only views.
            entry.output = weak_ref_tensors(output)
            return output
        # A graph reads its inputs from the addresses it was captured with: anything else
        # would silently compute on stale data. Cheap enough to check on every replay.
        assert tensor_addresses(args) == entry.input_addresses, (
            f"{self.runtime_mode.name} graph for {descriptor}: inputs moved since capture"
        )
        self.replay(entry)
        return entry.output
        # END TASK

    def capture(self, entry: CUDAGraphEntry, args: tuple) -> Any:
        """Record `runnable(*args)` into a new graph; return its outputs (not yet computed)."""
        pool = self.graph_pool
        graph = torch.cuda.CUDAGraph()
        # The side stream must see every input the default stream produced.
        torch.cuda.synchronize()
        with torch.cuda.stream(pool.stream):
            graph.capture_begin(pool=pool.handle)
            try:
                output = self.runnable(*args)
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(pool.stream)
        entry.graph = graph
        return output

    def replay(self, entry: CUDAGraphEntry) -> None:
        entry.graph.replay()
