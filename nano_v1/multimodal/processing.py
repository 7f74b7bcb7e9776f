"""From a prompt with placeholders and its images to expanded token ids and feature specs.

Mirrors vllm/multimodal/processing.py (`BaseProcessingInfo`, `BaseMultiModalProcessor`,
`BaseMultiModalProcessor.apply`) (chapter 11).

Why it exists: the engine core schedules tokens, so an image must become tokens before it
reaches the core. A prompt marks each image with one placeholder token (LLaVA's `<image>`);
`apply` checks that the images and the placeholders agree, runs the model's own image
processor (transformers'), and expands each placeholder into as many positions as the
encoder will produce embeddings for the image, recording where they are
(`PlaceholderRange`) and what the image's content hash is (`mm_hash`). The model-specific
parts (the placeholder id, the number of positions, the pixel processing) are a subclass's
(`nano_v1/model_executor/models/llava.py`); the checks and the expansion are here, once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from PIL import Image

from nano_v1.multimodal.hasher import MultiModalHasher
from nano_v1.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange

if TYPE_CHECKING:
    from nano_v1.config import ModelConfig

# The Python types each modality's items may have (vLLM also takes arrays, tensors and embeddings).
_ITEM_TYPES: dict[str, type] = {"image": Image.Image}


class BaseProcessingInfo:
    """What a model's multimodal inputs look like, read from its config alone.

    The scheduler needs only this (the size of an item, for its encoder budget), so it
    never loads an image processor.
    """

    def __init__(self, model_config: ModelConfig) -> None:
        self.model_config = model_config

    def get_hf_config(self) -> Any:
        return self.model_config.hf_config

    def get_mm_max_tokens_per_item(self) -> dict[str, int]:
        """{modality: the placeholder positions one item takes}; its keys are the modalities the model takes."""
        raise NotImplementedError


class BaseMultiModalProcessor:
    """Validates and expands one request's multimodal prompt; subclasses supply the model's specifics."""

    def __init__(self, info: BaseProcessingInfo) -> None:
        self.info = info

    def get_placeholder_token_id(self, modality: str) -> int:
        """The token that marks one item of `modality` in a prompt (and fills its positions)."""
        raise NotImplementedError

    def _call_hf_processor(self, modality: str, items: list[Any]) -> list[MultiModalKwargsItem]:
        """The encoder inputs of each item, e.g. `{"pixel_values": [3, H, W]}` per image."""
        raise NotImplementedError

    def apply(
        self, prompt_token_ids: list[int], mm_data: Any
    ) -> tuple[list[int], list[MultiModalFeatureSpec]]:
        """(token ids with every placeholder expanded, one feature spec per item, in prompt order).

        Raises a ValueError naming the problem: a modality the model does not take, an
        item of the wrong type, or items and placeholders that do not pair up.
        """
        items_by_modality = self._parse_mm_data(mm_data)
        placeholder_ids = {
            m: self.get_placeholder_token_id(m) for m in self.info.get_mm_max_tokens_per_item()
        }
        for modality, token_id in placeholder_ids.items():
            num_placeholders = prompt_token_ids.count(token_id)
            num_items = len(items_by_modality.get(modality, []))
            if num_placeholders != num_items:
                raise ValueError(
                    f"the prompt has {num_placeholders} {modality} placeholder token(s) (id {token_id}) but "
                    f"multi_modal_data has {num_items} {modality}(s); mark each {modality} with exactly one "
                    "placeholder (the engine expands it)."
                )
        # Items in the order their placeholders come; each one's encoder inputs and hash.
        pending = {
            modality: iter(zip(self._call_hf_processor(modality, items), items, strict=True))
            for modality, items in items_by_modality.items()
        }
        modality_of = {token_id: modality for modality, token_id in placeholder_ids.items()}
        # Every item of a modality takes the same number of positions (LLaVA resizes every
        # image to one size); models with variable sizes (LLaVA-NeXT, Qwen2-VL) count per item.
        num_tokens_of = self.info.get_mm_max_tokens_per_item()
        model_id = self.info.model_config.model
        expanded: list[int] = []
        mm_features: list[MultiModalFeatureSpec] = []
        for token_id in prompt_token_ids:
            modality = modality_of.get(token_id)
            if modality is None:
                expanded.append(token_id)
                continue
            kwargs, item = next(pending[modality])
            num_tokens = num_tokens_of[modality]
            mm_features.append(
                MultiModalFeatureSpec(
                    data=kwargs,
                    modality=modality,
                    identifier=MultiModalHasher.hash_kwargs(model_id=model_id, **{modality: item}),
                    mm_position=PlaceholderRange(offset=len(expanded), length=num_tokens),
                )
            )
            expanded.extend([token_id] * num_tokens)
        return expanded, mm_features

    def _parse_mm_data(self, mm_data: Any) -> dict[str, list[Any]]:
        """`{"image": item or [items]}` -> `{"image": [items]}`, every item's type checked."""
        modalities = self.info.get_mm_max_tokens_per_item()
        if not isinstance(mm_data, dict):
            raise ValueError(
                f"multi_modal_data must be a dict such as {{'image': ...}}, got {type(mm_data).__name__}."
            )
        unknown = sorted(set(mm_data) - set(modalities))
        if unknown:
            raise ValueError(
                f"multi_modal_data has modality {unknown}; this model takes {sorted(modalities)}."
            )
        parsed = {}
        for modality, value in mm_data.items():
            items = list(value) if isinstance(value, (list, tuple)) else [value]
            item_type = _ITEM_TYPES[modality]
            for i, item in enumerate(items):
                if not isinstance(item, item_type):
                    raise ValueError(
                        f"multi_modal_data[{modality!r}][{i}] must be a {item_type.__module__}.{item_type.__name__}, "
                        f"got {type(item).__name__}."
                    )
            parsed[modality] = items
        return parsed
