"""Which processor turns a model's images into placeholder tokens and encoder inputs.

Mirrors vllm/multimodal/registry.py (`MultiModalRegistry`) and vllm/multimodal/__init__.py
(`MULTIMODAL_REGISTRY`) (chapter 11).

Why it exists: the engine is model-agnostic, but how many positions an image takes and
how its pixels are prepared depend on the model. Each multimodal model class registers a
processing info (shapes, read from its config alone, which the scheduler needs for its
encoder budget) and a processor (the frontend's work on each request) with the decorator
`MULTIMODAL_REGISTRY.register_processor`; the engine asks the registry, by model config.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nano_v1.config import ModelConfig
    from nano_v1.multimodal.processing import BaseMultiModalProcessor, BaseProcessingInfo


class MultiModalRegistry:
    def __init__(self) -> None:
        # model class -> (processor class, processing info class)
        self._processor_factories: dict[
            type, tuple[type[BaseMultiModalProcessor], type[BaseProcessingInfo]]
        ] = {}

    def register_processor(
        self, processor: type[BaseMultiModalProcessor], *, info: type[BaseProcessingInfo]
    ) -> Callable[[type], type]:
        """Class decorator: `model_cls`'s requests are processed by `processor`, shaped by `info`."""

        def wrapper(model_cls: type) -> type:
            self._processor_factories[model_cls] = (processor, info)
            return model_cls

        return wrapper

    def supports_multimodal_inputs(self, model_config: ModelConfig) -> bool:
        return model_config.is_multimodal_model

    def _get_factories(
        self, model_config: ModelConfig
    ) -> tuple[type[BaseMultiModalProcessor], type[BaseProcessingInfo]]:
        from nano_v1.model_executor.models import resolve_model_cls

        model_cls = resolve_model_cls(model_config.hf_config.architectures)  # importing it registers it
        return self._processor_factories[model_cls]

    def _create_processing_info(self, model_config: ModelConfig) -> BaseProcessingInfo:
        _, info_cls = self._get_factories(model_config)
        return info_cls(model_config)

    def create_processor(self, model_config: ModelConfig) -> BaseMultiModalProcessor:
        processor_cls, info_cls = self._get_factories(model_config)
        return processor_cls(info_cls(model_config))

    def get_max_tokens_per_item_by_modality(self, model_config: ModelConfig) -> dict[str, int]:
        """The most placeholder positions one item of each modality can take: {"image": 576}."""
        return self._create_processing_info(model_config).get_mm_max_tokens_per_item()


MULTIMODAL_REGISTRY = MultiModalRegistry()
