"""Multimodal inputs: placeholders, content hashes, processors and the registry that picks them.

Mirrors vllm/multimodal/__init__.py (chapter 11).

Why it exists: the one name the engine needs from here is `MULTIMODAL_REGISTRY`, which the
frontend, the scheduler and the model runner all ask whether a model takes images and how
large one is; importing it pulls in neither torch nor any model.
"""

from nano_v1.multimodal.registry import MULTIMODAL_REGISTRY, MultiModalRegistry

__all__ = ["MULTIMODAL_REGISTRY", "MultiModalRegistry"]
