"""Compile a model's forward once, with the token count symbolic, through the piecewise backend.

Mirrors vllm/compilation/decorators.py (`support_torch_compile`) (chapter 08).

Why it exists: a compiled model is traced by Dynamo once, with dimension 0 of its inputs
(the tokens) a symbol, and every later step reuses that trace at any token count.

What differs from v0.11.0: vLLM's `support_torch_compile` is a class decorator: each model
class opts in, and its `__call__` compiles on the first call, with a backend built from
the process's one config. nano_v1's is a function under the same name that the model
runner applies to one model instance after loading: the backend is the runner's (its graph
pool, and the graph wrapper class tests swap for a fake), a process may build several
engines of one model class, each with its own backend, and the trace runs at once on the
runner's own step buffers. nano_v1's models stay plain `nn.Module`s.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from nano_v1.compilation.backends import VllmBackend
from nano_v1.forward_context import set_forward_context

logger = logging.getLogger(__name__)

# Compiled engines one process may build (a notebook builds one per configuration it compares).
MAX_ENGINES_PER_PROCESS = 64


@torch.inference_mode()
def support_torch_compile(
    model: nn.Module,
    backend: VllmBackend,
    inputs: tuple[torch.Tensor | None, ...],
    attn_layers: dict[str, nn.Module],
) -> None:
    """Replace `model.forward` by its compiled version and trace it once on `model(*inputs)`.

    `inputs` is `(input_ids, positions)`, or a multimodal model's `(None, positions,
    inputs_embeds)` (chapter 11). `mark_dynamic` makes dimension 0 of each tensor a
    symbol instead of a constant. Dynamo then guards the graph with facts about that
    symbol it relied on while tracing (for example "not 1", from a reshape), and would
    trace again for a 1-token step; those shape guards are dropped, as vLLM skips guards
    altogether: the graph's ops work at any token count. The inputs should be slices of
    the buffers every later step slices too.
    """
    # Dynamo keeps one compiled entry per engine (each has a backend of its own) on the model
    # class's `forward`, and by default refuses a ninth, which fullgraph=True makes an error:
    # notebooks and the GPU suite build many engines in one process (vLLM, one per process).
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, MAX_ENGINES_PER_PROCESS)
    model.forward = torch.compile(
        model.forward,
        backend=backend,
        fullgraph=True,
        dynamic=False,
        options={"guard_filter_fn": lambda guards: [g.guard_type != "SHAPE_ENV" for g in guards]},
    )
    for tensor in inputs:
        if tensor is not None:
            torch._dynamo.mark_dynamic(tensor, 0)
    start = time.perf_counter()
    with set_forward_context(None, attn_layers):
        model(*inputs)
    logger.info(
        "torch.compile: traced once and split into %d pieces in %.2f s",
        len(backend.piecewise_graphs),
        time.perf_counter() - start,
    )
