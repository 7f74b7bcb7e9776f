"""LLaVA: a CLIP vision tower, a two-layer projector, and a Llama, Qwen2 or Qwen3 language model.

Mirrors vllm/model_executor/models/llava.py (`LlavaForConditionalGeneration`,
`LlavaMultiModalProjector`, `LlavaProcessingInfo`, `LlavaMultiModalProcessor`) (chapter 11).

Why it is built this way: the language model is nano_v1's own decoder, unchanged, except
that a multimodal step starts from embeddings instead of token ids. The frontend's
processor turns each `<image>` token of a prompt into `num_image_tokens` copies of it
(576 for LLaVA-1.5: a 24 x 24 grid of 14-pixel patches over a 336-pixel image), so that
positions, KV blocks and the scheduler's token budget count an image like the text it
replaces. The model runner encodes each image once (`get_multimodal_embeddings`: CLIP,
then the projector into the language model's hidden size), keeps the result in its
encoder cache, and each step overwrites the token embeddings at exactly the image
positions of its chunk with the matching rows (`get_input_embeddings`). The decoder
never learns that a position came from an image.

Checkpoints: the layout transformers 5 saves (`vision_tower.`, `multi_modal_projector.`,
`language_model.model.`, `language_model.lm_head.`), the `model.`-prefixed one of
transformers 4.52+, and llava-hf's (`vision_tower.vision_model.`) all load.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.auto.image_processing_auto import AutoImageProcessor

from nano_v1.model_executor.layers.activation import get_act_fn
from nano_v1.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from nano_v1.model_executor.model_loader import load_stacked_weights
from nano_v1.model_executor.models import resolve_model_cls
from nano_v1.model_executor.models.clip import CLIPVisionModel
from nano_v1.multimodal import MULTIMODAL_REGISTRY
from nano_v1.multimodal.inputs import MultiModalKwargsItem
from nano_v1.multimodal.processing import BaseMultiModalProcessor, BaseProcessingInfo

# The language model, by the model_type of the checkpoint's text_config.
_TEXT_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# Checkpoint name prefixes -> ours, applied in order (each at most once).
_CHECKPOINT_PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
    ("vision_tower.vision_model.", "vision_tower."),
)


def _get_num_hidden_layers(hf_config: PretrainedConfig) -> int:
    """Vision layers to build: up to the one whose output LLaVA reads (`vision_feature_layer`).

    Counted like Hugging Face's `hidden_states` (index 0 is the embeddings): layer -2 of 24,
    LLaVA-1.5's choice, needs 23 layers, and the 24th is never built.
    """
    feature_layer = hf_config.vision_feature_layer
    if not isinstance(feature_layer, int):
        raise ValueError(f"vision_feature_layer must be one layer index, got {feature_layer!r}.")
    num_hidden_layers = hf_config.vision_config.num_hidden_layers
    return num_hidden_layers + feature_layer + 1 if feature_layer < 0 else feature_layer


class LlavaProcessingInfo(BaseProcessingInfo):
    """LLaVA's image size in placeholder positions, from its config alone."""

    def _apply_feature_select_strategy(self, strategy: str, encoder_num_image_tokens: int) -> int:
        if strategy == "default":  # the class token's feature is dropped
            return encoder_num_image_tokens - 1
        if strategy == "full":
            return encoder_num_image_tokens
        raise ValueError(f"vision_feature_select_strategy must be 'default' or 'full', got {strategy!r}.")

    def get_num_image_tokens(self) -> int:
        hf_config = self.get_hf_config()
        vision_config = hf_config.vision_config
        num_patches = (vision_config.image_size // vision_config.patch_size) ** 2
        return self._apply_feature_select_strategy(hf_config.vision_feature_select_strategy, num_patches + 1)

    def get_mm_max_tokens_per_item(self) -> dict[str, int]:
        return {"image": self.get_num_image_tokens()}


class LlavaMultiModalProcessor(BaseMultiModalProcessor):
    """Pixels through the checkpoint's own transformers image processor (resize, crop, normalise)."""

    def __init__(self, info: LlavaProcessingInfo) -> None:
        super().__init__(info)
        model_dir = str(info.model_config.model)
        # transformers' own loading reads every layout it writes: `preprocessor_config.json`,
        # or (a processor saved whole, as `processor.save_pretrained` does since transformers 5)
        # the `image_processor` entry of `processor_config.json`. Without torchvision it picks the
        # PIL implementation (CLIPImageProcessorPil). Imported from its module because transformers
        # 5.17 exports a placeholder under `transformers.AutoImageProcessor` that demands torchvision.
        try:
            self.image_processor = AutoImageProcessor.from_pretrained(model_dir, local_files_only=True)
        except OSError as e:
            raise ValueError(
                f"model {model_dir!r} is multimodal but has no image processor (a preprocessor_config.json, "
                "or a processor_config.json with an image_processor): nano_v1 needs the checkpoint's "
                f"image processor to prepare images. transformers says: {e}"
            ) from None

    def get_placeholder_token_id(self, modality: str) -> int:
        return self.info.get_hf_config().image_token_index

    def _call_hf_processor(self, modality: str, items: list[Any]) -> list[MultiModalKwargsItem]:
        try:
            pixel_values = self.image_processor(images=items, return_tensors="pt")["pixel_values"]
        except (ValueError, TypeError, OSError) as e:
            raise ValueError(f"the image processor rejected an image: {e}") from e
        image_size = self.info.get_hf_config().vision_config.image_size
        if tuple(pixel_values.shape[-2:]) != (image_size, image_size):
            raise ValueError(
                f"the checkpoint's image processor makes {tuple(pixel_values.shape[-2:])} images, but its "
                f"vision tower takes {image_size}x{image_size}: its image processor does not fit config.json."
            )
        return [{"pixel_values": image} for image in pixel_values]  # each [3, image_size, image_size]


class LlavaMultiModalProjector(nn.Module):
    """`[..., vision_hidden_size] -> [..., text_hidden_size]`: linear, activation, linear."""

    def __init__(
        self, vision_hidden_size: int, text_hidden_size: int, projector_hidden_act: str, bias: bool
    ) -> None:
        super().__init__()
        self.linear_1 = ColumnParallelLinear(vision_hidden_size, text_hidden_size, bias=bias)
        self.act = get_act_fn(projector_hidden_act)
        self.linear_2 = RowParallelLinear(text_hidden_size, text_hidden_size, bias=bias)

    def forward(self, image_features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(image_features)))


@MULTIMODAL_REGISTRY.register_processor(LlavaMultiModalProcessor, info=LlavaProcessingInfo)
class LlavaForConditionalGeneration(nn.Module):
    """The interface the model runner uses: the language model's, plus the two multimodal steps."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        vision_config, text_config = config.vision_config, config.text_config
        if vision_config.model_type != "clip_vision_model":
            raise ValueError(f"LLaVA's vision tower must be CLIP, got {vision_config.model_type!r}.")
        if text_config.model_type not in _TEXT_ARCHITECTURES:
            raise ValueError(
                f"LLaVA's language model must be one of {sorted(_TEXT_ARCHITECTURES)}, got {text_config.model_type!r}."
            )
        self.vision_tower = CLIPVisionModel(vision_config, _get_num_hidden_layers(config))
        self.multi_modal_projector = LlavaMultiModalProjector(
            vision_config.hidden_size,
            text_config.hidden_size,
            config.projector_hidden_act,
            config.multimodal_projector_bias,
        )
        self.language_model = resolve_model_cls([_TEXT_ARCHITECTURES[text_config.model_type]])(text_config)

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str:
        """How a chat message's `i`-th image is written in the prompt text: one `<image>` token."""
        if modality != "image":
            raise ValueError(f"LLaVA takes images only, not {modality!r}.")
        return "<image>"

    def _select_image_features(self, image_features: torch.Tensor, *, strategy: str) -> torch.Tensor:
        return image_features[:, 1:] if strategy == "default" else image_features

    def get_multimodal_embeddings(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """`[num_images, 3, H, W]` -> `[num_images, num_image_tokens, text_hidden_size]`."""
        image_features = self.vision_tower(pixel_values)  # [num_images, 1 + num_patches, vision_hidden]
        image_features = self._select_image_features(
            image_features, strategy=self.config.vision_feature_select_strategy
        )
        return self.multi_modal_projector(image_features)

    def get_input_embeddings(
        self,
        input_ids: torch.Tensor,
        multimodal_embeddings: list[torch.Tensor] | None = None,
        is_multimodal: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token embeddings `[num_tokens, hidden_size]` with the image rows written in.

        `is_multimodal` (`[num_tokens]`, bool) marks the image positions of this step, in
        order; `multimodal_embeddings` holds their rows, `[n_i, hidden_size]` each, in the same order.
        """
        inputs_embeds = self.language_model.get_input_embeddings(input_ids)
        if multimodal_embeddings:
            inputs_embeds[is_multimodal] = torch.cat(multimodal_embeddings).to(inputs_embeds.dtype)
        return inputs_embeds

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The language model's forward; in a multimodal step `input_ids` is None and
        `inputs_embeds` comes from `get_input_embeddings`."""
        return self.language_model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Rename checkpoint tensors to ours, skip what is not built, load the rest."""
        tied = getattr(self.config.text_config, "tie_word_embeddings", False)

        def skip(name: str) -> bool:
            if "rotary_emb.inv_freq" in name or (tied and name.startswith("language_model.lm_head.")):
                return True
            return name.startswith("vision_tower.") and self.vision_tower.is_unused_weight(
                name.removeprefix("vision_tower.")
            )

        renamed = ((_map_checkpoint_name(name), tensor) for name, tensor in weights)
        # The language model's q/k/v -> qkv_proj mapping serves CLIP's attention as well.
        return load_stacked_weights(self, renamed, self.language_model.stacked_params_mapping, skip)


def _map_checkpoint_name(name: str) -> str:
    for old, new in _CHECKPOINT_PREFIXES:
        if name.startswith(old):
            name = new + name.removeprefix(old)
    return name
