"""Tiny, randomly initialised Hugging Face checkpoints, and the config an engine over one runs with.

Every parity test loads these through the same path a real checkpoint takes
(`config.json` + `model.safetensors` in a directory); nothing is downloaded.
`TINY_SHAPES` are the text models' sizes, `TINY_GEMMA3` Gemma 3's layer pattern at tiny
size; `make_vllm_config` is what `LLM(model, device="cpu", ...)` would run with.

Imports of nano_v1 and transformers are inside the functions: conftest imports this
module before any test module, and it must not import a kernel module before conftest
has chosen Triton's interpreter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from nano_v1.config import VllmConfig

TINY_SHAPES = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


# Gemma 3's pattern at tiny size (chapter 12): 3 sliding-window layers and 2 full-attention
# ones, which group as (sw.0, sw.3), (sw.1, padding), (full.2, full.4); a window shorter
# than the prompts and outputs the tests use.
TINY_GEMMA3 = dict(
    head_dim=32,
    num_hidden_layers=5,
    layer_types=[
        "sliding_attention",
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "full_attention",
    ],
    sliding_window=24,
)


def make_tiny_checkpoint(path, arch: str = "qwen3", seed: int = 0, **overrides) -> str:
    """Write a random tiny `arch` checkpoint (qwen3 | qwen2 | llama | gemma3) to `path`; return it."""
    import transformers

    cfg_cls, model_cls = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[arch]
    kwargs = dict(TINY_SHAPES, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "qwen3":
        kwargs["head_dim"] = 32
    if arch == "gemma3":
        kwargs.update(TINY_GEMMA3)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kwargs)).to(torch.float32).eval()
    # Random init is near-uniform: widen the weights so greedy decoding is not a tie-break lottery.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    return str(path)


def make_vllm_config(model: str, device: str = "cpu", **engine_args) -> VllmConfig:
    """The config `LLM(model, device=device, **engine_args)` would run with (on the CPU by default)."""
    from nano_v1.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, device=device, **engine_args).create_engine_config()

