"""nano_v1: an annotated, educational reference implementation of the vLLM v1 engine.

Mirrors vllm/__init__.py, which exports these names too (among many more), also lazily.

The public names are imported lazily, so `import nano_v1.core.block_pool` does not pull
in the model runner, torch models and transformers.
"""

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

_LAZY = {
    "LLM": "nano_v1.entrypoints.llm",
    "SamplingParams": "nano_v1.sampling_params",
    "RequestOutput": "nano_v1.outputs",
    "CompletionOutput": "nano_v1.outputs",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'nano_v1' has no attribute {name!r}")
