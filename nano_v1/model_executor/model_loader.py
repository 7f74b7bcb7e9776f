"""Build a model from its Hugging Face config and fill it with weights.

Mirrors vllm/model_executor/model_loader/ (default_loader.py, dummy_loader.py,
weight_utils.py) (chapter 01).

Why it exists: a checkpoint directory is a `config.json` plus `*.safetensors` files of named
tensors. The model is built empty, directly on the device and in the serving dtype (no
float32 copy on the CPU first), and then the tensors are streamed in one at a time, each
handed to its parameter's `weight_loader`, which knows where the tensor goes (a fused
projection takes several checkpoint tensors). Peak host memory stays at one tensor, not one
model. The dummy format skips the checkpoint entirely, for benchmarks of shapes only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from nano_v1.config import set_current_vllm_config

if TYPE_CHECKING:
    from nano_v1.config import VllmConfig


def check_shape(target: torch.Tensor, loaded_weight: torch.Tensor, where: str = "the parameter") -> None:
    """Raise a ValueError naming both shapes if a checkpoint tensor does not fit its destination."""
    if target.shape != loaded_weight.shape:
        raise ValueError(
            f"shape mismatch: the checkpoint tensor has shape {tuple(loaded_weight.shape)} "
            f"but {where} has shape {tuple(target.shape)}"
        )


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy a checkpoint tensor into a parameter of the same shape (on its device, in its dtype)."""
    check_shape(param, loaded_weight)
    param.data.copy_(loaded_weight)


def load_stacked_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params_mapping: Sequence[tuple[str, str, int | str]],
    skip: Callable[[str], bool],
) -> set[str]:
    """Copy checkpoint tensors into `model`'s parameters; return the names of the parameters loaded.

    `stacked_params_mapping` holds `(fused parameter name, checkpoint name, shard id)` for
    tensors that go into a slice of a fused parameter (`.q_proj` -> shard "q" of
    `.qkv_proj`); `skip(name)` is true for tensors the model deliberately has no parameter
    for. Every other tensor must match a parameter, which loads it with its
    `weight_loader` (plain `nn.LayerNorm`, `nn.Conv2d` and `nn.Embedding` parameters of a
    vision tower have none and are copied as they are).
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, loaded_weight in weights:
        if skip(name):
            continue
        param_name, shard_id = name, None
        for fused_name, checkpoint_name, fused_shard in stacked_params_mapping:
            if checkpoint_name in name:
                param_name, shard_id = name.replace(checkpoint_name, fused_name), fused_shard
                break
        if param_name not in params:
            raise ValueError(
                f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__}; "
                "is the checkpoint's config.json the one it was saved with?"
            )
        param = params[param_name]
        weight_loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            if shard_id is None:
                weight_loader(param, loaded_weight)
            else:
                weight_loader(param, loaded_weight, shard_id)
        except ValueError as e:
            raise ValueError(f"cannot load checkpoint tensor {name!r} into {param_name!r}: {e}") from None
        loaded.add(param_name)
    return loaded


def safetensors_weights_iterator(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` for every tensor of every `*.safetensors` file, one at a time."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"no *.safetensors files in {model_dir!r}; nano_v1 loads only safetensors checkpoints "
            "(or use load_format='dummy' for random weights)."
        )
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    yield name, f.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for bad headers and short files
            raise ValueError(f"cannot read safetensors file {str(file)!r}: {e}") from e


def initialize_dummy_weights(model: nn.Module, seed: int, low: float = -1e-3, high: float = 1e-3) -> None:
    """Fill every parameter with small uniform noise, as vLLM's dummy loader does.

    Values this small keep activations finite in any dtype, which is all a benchmark of
    shapes needs; no checkpoint file is opened.
    """
    generator = None
    for param in model.parameters():
        if generator is None:
            generator = torch.Generator(device=param.device).manual_seed(seed)
        param.data.uniform_(low, high, generator=generator)


@contextmanager
def _default_dtype_and_device(dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    """Create every tensor in `dtype` on `device` while the model's modules are built."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def get_model(vllm_config: VllmConfig, device: torch.device) -> nn.Module:
    """Build the model class that the checkpoint's `architectures` name and load its weights.

    The modules are built under `set_current_vllm_config`, which is how each `Attention`
    layer finds the backend the config chose.
    """
    from nano_v1.model_executor.models import resolve_model_cls

    model_config = vllm_config.model_config
    hf_config = model_config.hf_config
    model_cls = resolve_model_cls(list(getattr(hf_config, "architectures", None) or []))
    with set_current_vllm_config(vllm_config), _default_dtype_and_device(model_config.dtype, torch.device(device)):
        model = model_cls(hf_config)
    if model_config.load_format == "dummy":
        initialize_dummy_weights(model, seed=model_config.seed)
    else:
        loaded = model.load_weights(safetensors_weights_iterator(model_config.model))
        missing = sorted(name for name, _ in model.named_parameters() if name not in loaded)
        if missing:
            raise ValueError(
                f"checkpoint {model_config.model!r} lacks {len(missing)} weight(s) the model needs, "
                f"e.g. {missing[:5]}."
            )
    return model.eval()
