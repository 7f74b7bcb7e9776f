"""Where a multimodal item sits in a prompt, and what travels with it to the engine core.

Mirrors vllm/multimodal/inputs.py (`PlaceholderRange`, `MultiModalFeatureSpec`) (chapter 11).

Why it exists: after processing, an image is two things. To the scheduler it is a run of
placeholder positions in the prompt (`PlaceholderRange`): the decoder computes those
positions like any others, from the encoder's output instead of token embeddings. To the
model runner it is the encoder's input (the processed pixel values) plus a content hash
(`identifier`, the `mm_hash`), under which the encoder's output is cached and shared by
every request that shows the same image.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The encoder's inputs for one item, by keyword argument name: {"pixel_values": [3, H, W]}.
# vLLM wraps each field in a MultiModalKwargsItem that knows how to batch it; every field
# here is one tensor per item, batched by stacking.
MultiModalKwargsItem = dict[str, torch.Tensor]


@dataclass(slots=True)
class PlaceholderRange:
    """The prompt positions `[offset, offset + length)` that one item's embeddings fill.

    Prompt `A A A A B B B B what is in these images?` has, for images A and B,
    `PlaceholderRange(offset=0, length=4)` and `PlaceholderRange(offset=4, length=4)`.
    """

    offset: int
    length: int


@dataclass(slots=True)
class MultiModalFeatureSpec:
    """One multimodal item of a request: its encoder inputs, its hash and its place."""

    data: MultiModalKwargsItem
    modality: str  # "image"
    identifier: str  # the mm_hash: equal for equal content, whatever the request
    mm_position: PlaceholderRange
