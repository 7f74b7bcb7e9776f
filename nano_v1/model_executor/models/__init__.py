"""Model registry: Hugging Face architecture name -> nano_v1 class.

Mirrors vllm/model_executor/models/registry.py (chapter 01).
"""

# Name -> "module:Class", imported lazily so that reading a config does not import torch models.
_MODELS = {
    "Qwen3ForCausalLM": "nano_v1.model_executor.models.qwen3:Qwen3ForCausalLM",
    "Qwen2ForCausalLM": "nano_v1.model_executor.models.qwen2:Qwen2ForCausalLM",
    "LlamaForCausalLM": "nano_v1.model_executor.models.llama:LlamaForCausalLM",
    "LlavaForConditionalGeneration": "nano_v1.model_executor.models.llava:LlavaForConditionalGeneration",
}
SUPPORTED_ARCHITECTURES = frozenset(_MODELS)
# Architectures that take images besides text (chapter 11).
_MULTIMODAL_MODELS = frozenset({"LlavaForConditionalGeneration"})


def is_multimodal_model(architectures: list[str]) -> bool:
    return any(arch in _MULTIMODAL_MODELS for arch in architectures)


def resolve_model_cls(architectures: list[str]) -> type:
    import importlib

    for arch in architectures:
        if arch in _MODELS:
            module_name, cls_name = _MODELS[arch].split(":")
            return getattr(importlib.import_module(module_name), cls_name)
    raise ValueError(f"architectures {architectures} are not supported; nano_v1 supports {sorted(_MODELS)}.")
