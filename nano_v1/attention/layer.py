"""The `Attention` layer a model holds: heads and a scale in, attention over the paged cache out.

Mirrors vllm/attention/layer.py (chapters 01, 06, 12 and 16).

Why it exists: the model code says only "attend" (`self.attn(q, k, v)`), exactly as in a
Hugging Face model. Everything that depends on the step — which cache slots to write,
which blocks each request's context lives in — comes from the forward context that the
model runner sets around the forward call, and the KV cache tensor is bound to the layer
by the runner after it sizes the cache. So the model's `forward(input_ids, positions)`
needs no extra arguments, and the backend can change without touching any model: the
layer asks the selector for the backend the config names, as vLLM's does. A layer may
have a sliding window (chapter 12): its queries then see only their last
`sliding_window` keys, and the runner gives it its KV cache group's metadata (the
forward context maps layer names to metadata).

Chapter 08: to torch.compile, attention is one custom op, `unified_attention_with_output`
(registered with torch.library), so that Dynamo records it as a single opaque node instead
of tracing into the kernels and their per-step, data-dependent planning. The piecewise
backend splits the model's graph at these nodes. The op takes the layer's name, not the
layer (an op's arguments are tensors and plain values) and finds the layer in the forward
context. Run eagerly, `Attention.forward` calls the backend directly, skipping the op's
dispatch cost.

Chapter 16: with a KV connector, each layer waits for its KV to be loaded before it
attends (`wait_for_kv_layer_from_connector`) and hands its KV cache to the connector to
save after (`maybe_save_kv_layer_to_connector`), so that a connector can overlap layer
i's transfer with layer i + 1's compute. Both run in `attend_into`, which the attention op
calls: outside the piecewise CUDA graphs, as the op is where the graph is split. A FULL
graph would capture attention and replay it without the hooks, so a connector refuses
FULL graphs (nano_v1/config/__init__.py). Without a connector they cost one check per
layer per step.
"""

from __future__ import annotations

import torch
from torch import nn

from nano_v1.attention.selector import get_attn_backend
from nano_v1.config import get_current_vllm_config
from nano_v1.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
from nano_v1.forward_context import get_forward_context


def wait_for_kv_layer_from_connector(layer_name: str) -> None:
    """Block until the connector has loaded `layer_name`'s KV for this step; a no-op without a
    connector, and in runs with no attention metadata (profiling, warm-up)."""
    if not has_kv_transfer_group():
        return
    if get_forward_context().attn_metadata is None:
        return
    get_kv_transfer_group().wait_for_layer_load(layer_name)


def maybe_save_kv_layer_to_connector(layer_name: str, kv_cache_layer: torch.Tensor) -> None:
    """Let the connector save what it wants of `layer_name`'s KV cache, now that this step's keys
    and values are in it; a no-op without a connector or attention metadata."""
    if not has_kv_transfer_group():
        return
    attn_metadata = get_forward_context().attn_metadata
    if attn_metadata is None:
        return
    if isinstance(attn_metadata, dict):
        attn_metadata = attn_metadata[layer_name]
    get_kv_transfer_group().save_kv_layer(layer_name, kv_cache_layer, attn_metadata)


@torch.library.custom_op("nano_v1::unified_attention_with_output", mutates_args=("output",))
def unified_attention_with_output(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor, layer_name: str
) -> None:
    """Attention of layer `layer_name` for this step, written into `output` (vLLM's op of the same name)."""
    forward_context = get_forward_context()
    forward_context.no_compile_layers[layer_name].attend_into(query, key, value, output)


@unified_attention_with_output.register_fake
def _(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor, layer_name: str
) -> None:
    """What tracing needs to know: nothing is returned, and `output` is written in place."""
    return


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads over the paged KV cache of one layer."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        prefix: str,
        per_layer_sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.layer_name = prefix  # e.g. "model.layers.0.self_attn.attn": the runner binds caches by it
        # Keys a query sees, its own included; None: the whole context. The runner's KV cache
        # spec for this layer follows it (a SlidingWindowSpec when set).
        self.sliding_window = per_layer_sliding_window
        # The backend the engine's config chose (the model is built under set_current_vllm_config).
        self.attn_backend = get_attn_backend(get_current_vllm_config().model_config.attention_backend)
        impl_cls = self.attn_backend.get_impl_cls()
        self.impl = impl_cls(num_heads, head_size, scale, num_kv_heads, self.sliding_window)
        # [2, num_blocks, block_size, num_kv_heads, head_size], bound by the model runner.
        # A plain attribute, not a buffer: the cache is not part of the model's state dict.
        self.kv_cache = torch.tensor([])

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads * head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads * head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads * head_size]
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_size]
        output = torch.empty_like(query)
        if torch.compiler.is_compiling():
            # Dynamo is tracing: one opaque node, where the piecewise backend splits the graph.
            torch.ops.nano_v1.unified_attention_with_output(query, key, value, output, self.layer_name)
        else:
            self.attend_into(query, key, value, output)
        return output

    def attend_into(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor
    ) -> None:
        """Cache this step's keys and values and write the attention into `output`."""
        kv_transfer = has_kv_transfer_group()  # the connector hooks' one check when there is none
        if kv_transfer:
            wait_for_kv_layer_from_connector(self.layer_name)
        attn_metadata = get_forward_context().attn_metadata
        if isinstance(attn_metadata, dict):
            attn_metadata = attn_metadata[self.layer_name]  # the runner's: one per KV cache group
        self.impl.forward(
            self,
            query.view(-1, self.num_heads, self.head_size),  # [num_tokens, num_heads, head_size]
            key.view(-1, self.num_kv_heads, self.head_size),  # [num_tokens, num_kv_heads, head_size]
            value.view(-1, self.num_kv_heads, self.head_size),
            self.kv_cache,
            attn_metadata,
            output.view(-1, self.num_heads, self.head_size),
        )
        if kv_transfer:
            maybe_save_kv_layer_to_connector(self.layer_name, self.kv_cache)

    def extra_repr(self) -> str:
        return (
            f"layer_name={self.layer_name!r}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_size={self.head_size}, sliding_window={self.sliding_window}"
        )
