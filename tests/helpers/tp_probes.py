"""Functions the tensor-parallel tests run inside every worker process, through `collective_rpc`.

Each is called as `fn(worker, *args)` in each rank's process, and must be importable by
name there (functions travel by reference), so they live in this plain module rather than
in a test file. `build_layer` is also what the tests call in their own process, where it
builds the unsharded layer (a process that never joined any ranks is a world of one).
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from nano_v1.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from nano_v1.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from nano_v1.model_executor.layers.logits_processor import LogitsProcessor
from nano_v1.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

LAYER_0 = "model.layers.0"


def build_layer(name: str, model_dir: str) -> torch.nn.Module:
    """Layer `name` of checkpoint `model_dir`, built for this process's rank and loaded through its
    weight loaders from the checkpoint's (whole) tensors."""
    checkpoint = load_file(str(Path(model_dir) / "model.safetensors"))
    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    attn, mlp = f"{LAYER_0}.self_attn", f"{LAYER_0}.mlp"

    def tensors(prefix: str) -> dict[str, torch.Tensor]:
        return {k[len(prefix) + 1 :]: v for k, v in checkpoint.items() if k.startswith(prefix + ".")}

    if name == "qkv_proj":
        q, k, v = tensors(f"{attn}.q_proj"), tensors(f"{attn}.k_proj"), tensors(f"{attn}.v_proj")
        layer = QKVParallelLinear(hidden, head_dim, heads, kv_heads, bias="bias" in q)
        for shard_id, part in (("q", q), ("k", k), ("v", v)):
            for param_name, tensor in part.items():
                layer.weight_loader(getattr(layer, param_name), tensor, shard_id)
    elif name == "gate_up_proj":
        gate, up = tensors(f"{mlp}.gate_proj"), tensors(f"{mlp}.up_proj")
        layer = MergedColumnParallelLinear(hidden, [inter, inter], bias="bias" in gate)
        for shard_id, part in ((0, gate), (1, up)):
            for param_name, tensor in part.items():
                layer.weight_loader(getattr(layer, param_name), tensor, shard_id)
    elif name in ("up_proj", "o_proj", "down_proj"):
        cls, prefix, shape = {
            "up_proj": (ColumnParallelLinear, f"{mlp}.up_proj", (hidden, inter)),
            "o_proj": (RowParallelLinear, f"{attn}.o_proj", (heads * head_dim, hidden)),
            "down_proj": (RowParallelLinear, f"{mlp}.down_proj", (inter, hidden)),
        }[name]
        part = tensors(prefix)
        layer = cls(*shape, bias="bias" in part)
        for param_name, tensor in part.items():
            layer.weight_loader(getattr(layer, param_name), tensor)
    elif name in ("embed_tokens", "lm_head"):
        cls, key = {"embed_tokens": (VocabParallelEmbedding, "model.embed_tokens.weight"),
                    "lm_head": (ParallelLMHead, "lm_head.weight")}[name]  # fmt: skip
        layer = cls(vocab, hidden)
        layer.weight_loader(layer.weight, checkpoint.get(key, checkpoint["model.embed_tokens.weight"]))
    else:
        raise ValueError(f"no layer {name!r}")
    return layer.eval()


def apply_layer(layer: torch.nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    """The layer's output on `x`: the whole input for column layers and embeddings; a row layer
    gets this rank's slice of the whole input, as its column-parallel predecessor would give it;
    the head goes through `LogitsProcessor` (so its all-gather is included)."""
    with torch.inference_mode():
        if name == "lm_head":
            return LogitsProcessor(layer.num_embeddings)(layer, x)
        if isinstance(layer, RowParallelLinear):
            shard = layer.input_size_per_partition
            x = x[:, layer.tp_rank * shard : (layer.tp_rank + 1) * shard]
        return layer(x)


def run_layer(worker, name: str, x: torch.Tensor, planted_bug: str | None = None) -> torch.Tensor:
    """In a worker: layer `name` of the engine's checkpoint on `x`, optionally with a planted bug."""
    layer = build_layer(name, worker.vllm_config.model_config.model)
    with planted(planted_bug):
        return apply_layer(layer, name, x)


def _forward_bias_on_every_rank(self, x: torch.Tensor) -> torch.Tensor:
    return tensor_model_parallel_all_reduce(F.linear(x, self.weight, self.bias))


def _forward_without_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, self.weight, self.bias if self.tp_rank == 0 else None)


# Subtly wrong `RowParallelLinear.forward`s that the tests must catch.
PLANTED_ROW_BUGS = {
    "bias_on_every_rank": _forward_bias_on_every_rank,
    "no_all_reduce": _forward_without_all_reduce,
}


@contextmanager
def planted(planted_bug: str | None):
    """Swap in a planted `RowParallelLinear.forward` for the block (and always put the real one back)."""
    if planted_bug is None:
        yield
        return
    real = RowParallelLinear.forward
    RowParallelLinear.forward = PLANTED_ROW_BUGS[planted_bug]
    try:
        yield
    finally:
        RowParallelLinear.forward = real


def rank_layout(worker) -> dict:
    """What this rank holds: its place in the group, its slice of layer 0 and of the vocabulary, its KV cache."""
    model = worker.model_runner.model
    attn = model.model.layers[0].self_attn
    return {
        "pid": os.getpid(),
        "tp_rank": get_tensor_model_parallel_rank(),
        "tp_size": get_tensor_model_parallel_world_size(),
        "num_heads": attn.num_heads,
        "num_kv_heads": attn.num_kv_heads,
        "qkv_weight": tuple(attn.qkv_proj.weight.shape),
        "o_proj_weight": tuple(attn.o_proj.weight.shape),
        "embed_rows": (model.model.embed_tokens.vocab_start_index, model.model.embed_tokens.vocab_end_index),
        "kv_cache": tuple(attn.attn.kv_cache.shape),
        "torch_threads": torch.get_num_threads(),
    }


def _collectives_of(x: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        "all_reduce": tensor_model_parallel_all_reduce(x),
        "all_gather_0": tensor_model_parallel_all_gather(x, dim=0),
        "all_gather_last": tensor_model_parallel_all_gather(x),
    }


def collectives(worker, compiled: bool) -> dict[str, torch.Tensor]:
    """The two collectives on `[2, 3]` filled with rank + 1, eagerly or traced by Dynamo as one
    graph (`fullgraph`: no graph break allowed, as torch.compile of the model needs)."""
    x = torch.full((2, 3), float(get_tensor_model_parallel_rank() + 1))
    fn = torch.compile(_collectives_of, backend="eager", fullgraph=True) if compiled else _collectives_of
    return fn(x)
