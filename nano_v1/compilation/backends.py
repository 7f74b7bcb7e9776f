"""The piecewise backend: split the model's FX graph at attention, compile and graph the rest.

Mirrors vllm/compilation/backends.py (`split_graph`, `VllmBackend`) and
vllm/compilation/cuda_piecewise_backend.py (chapter 08).

Why it exists: torch.compile hands a backend the whole forward pass as one FX graph, traced
once by Dynamo with the token count as a symbolic size. Everything in it is dense,
row-wise work whose kernels depend only on the token count (embedding, norms, projections,
RoPE, MLP), except attention, which depends on the batch's make-up (ragged query lengths,
block tables, a host-side plan) and so cannot be frozen into a CUDA graph for all batches
of one size. `split_graph` cuts the graph at every attention op (a custom op, one opaque
node: `nano_v1/attention/layer.py::unified_attention_with_output`): for L layers, L
attention pieces and L + 1 dense pieces, in order. `VllmBackend` then compiles each dense
piece (with Inductor if asked, else as traced) and, when piecewise CUDA graphs are on,
wraps it in a `CUDAGraphWrapper`. The attention pieces stay plain calls, run eagerly every
step between the replayed graphs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

from nano_v1.compilation.counter import compilation_counter
from nano_v1.compilation.cuda_graph import CUDAGraphWrapper, GraphPool
from nano_v1.config import CompilationConfig, CUDAGraphMode

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SplitItem:
    """One piece of the split graph: a submodule `submod_name` of the split module."""

    submod_name: str
    graph_id: int
    is_splitting_graph: bool  # True for a piece that is a single splitting op (attention)
    graph: fx.GraphModule


def op_name(target: Any) -> str:
    """ "namespace.name" of an op node's target, whether an OpOverloadPacket or an OpOverload."""
    if isinstance(target, torch._ops.OpOverload):
        target = target.overloadpacket
    return str(target)


def split_graph(graph: fx.GraphModule, splitting_ops: list[str]) -> tuple[fx.GraphModule, list[SplitItem]]:
    """Cut `graph` so that each call of a splitting op is a piece of its own.

    Nodes are numbered in program order: a splitting op gets a fresh id, and the nodes
    after it the next one, so pieces alternate dense / op / dense / ... . `split_module`
    turns each id into a submodule `submod_<id>` and the graph into calls of them.
    """
    splitting = set(splitting_ops)
    subgraph_id = 0
    node_to_subgraph_id: dict[fx.Node, int] = {}
    splitting_ids: set[int] = set()
    for node in graph.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and op_name(node.target) in splitting:
            subgraph_id += 1
            node_to_subgraph_id[node] = subgraph_id
            splitting_ids.add(subgraph_id)
            subgraph_id += 1
        else:
            node_to_subgraph_id[node] = subgraph_id
    split_gm = split_module(graph, None, lambda node: node_to_subgraph_id[node], keep_original_order=True)
    items = []
    for name, module in split_gm.named_children():
        graph_id = int(name.removeprefix("submod_"))
        items.append(SplitItem(name, graph_id, graph_id in splitting_ids, module))
    items.sort(key=lambda item: item.graph_id)  # program order
    return split_gm, items


class VllmBackend:
    """A torch.compile backend: `backend(graph, example_inputs)` returns what runs instead of `graph`.

    One instance per model runner: Dynamo keys its cache by backend, so two engines in one
    process never share each other's pieces or graphs.
    """

    def __init__(
        self,
        compilation_config: CompilationConfig,
        graph_pool: GraphPool | None,
        cudagraph_wrapper_cls: type[CUDAGraphWrapper] = CUDAGraphWrapper,
    ) -> None:
        self.compilation_config = compilation_config
        self.graph_pool = graph_pool
        self.cudagraph_wrapper_cls = cudagraph_wrapper_cls
        self.split_gm: fx.GraphModule | None = None
        self.piecewise_graphs: list[SplitItem] = []

    def __call__(self, graph: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        config = self.compilation_config
        compilation_counter.num_graphs_seen += 1
        split_gm, items = split_graph(graph, config.splitting_ops)
        dense = [item for item in items if not item.is_splitting_graph]
        compilation_counter.num_piecewise_graphs_seen += len(items)
        compilation_counter.num_piecewise_capturable_graphs_seen += len(dense)
        if config.use_inductor:
            compile_pieces_with_inductor(split_gm, {item.submod_name for item in dense}, example_inputs)
        if config.cudagraph_mode.requires_piecewise_compilation():
            for item in dense:
                piece = getattr(split_gm, item.submod_name)
                # Stored in __dict__: a GraphModule calls `self.submod_<i>(...)`, and a plain
                # attribute is found before nn.Module's registry of children.
                split_gm.__dict__[item.submod_name] = self.cudagraph_wrapper_cls(
                    piece, CUDAGraphMode.PIECEWISE, self.graph_pool
                )
        self.split_gm, self.piecewise_graphs = split_gm, items
        logger.info("piecewise backend: %d pieces (%d dense)", len(items), len(dense))
        return split_gm


def compile_pieces_with_inductor(
    split_gm: fx.GraphModule, names: set[str], example_inputs: list[Any]
) -> None:
    """Replace each piece in `names` by its Inductor-compiled version.

    Inductor needs each piece's own example inputs, with the same symbolic token count
    Dynamo traced with; running the split module on fake copies of the graph's inputs,
    under Dynamo's fake mode, produces exactly those at each submodule call.
    """
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import compile_fx

    fake_mode = detect_fake_mode(example_inputs)

    class PieceCompiler(fx.Interpreter):
        def call_module(self, target: str, args: tuple, kwargs: dict) -> Any:
            output = super().call_module(target, args, kwargs)
            if target in names:
                split_gm.__dict__[target] = compile_fx(getattr(split_gm, target), list(args))
            return output

    fake_inputs = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    with fake_mode:
        PieceCompiler(split_gm).run(*fake_inputs)
