"""Counts of what compilation did: graphs traced, pieces split off, graphs captured.

Mirrors vllm/compilation/counter.py (chapter 08).

Why it exists: "Dynamo traced the model once" and "a graph was captured per size" are
claims about events inside torch.compile and the CUDA graph wrappers; tests and the
notebook check them by reading these counters before and after.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CompilationCounter:
    num_graphs_seen: int = 0  # FX graphs handed to the piecewise backend (one per Dynamo trace)
    num_piecewise_graphs_seen: int = 0  # pieces after splitting, attention pieces included
    num_piecewise_capturable_graphs_seen: int = 0  # the dense pieces, which may become CUDA graphs
    num_cudagraph_captured: int = 0

    def clone(self) -> CompilationCounter:
        return dataclasses.replace(self)


compilation_counter = CompilationCounter()
