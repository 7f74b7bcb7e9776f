"""CLIP's vision tower: image patches in, one embedding per patch out.

Mirrors vllm/model_executor/models/clip.py (`CLIPVisionModel` and its parts) (chapter 11).

Why it exists: LLaVA sees an image through CLIP's vision transformer. The image is cut
into `patch_size x patch_size` patches (a stride-`patch_size` convolution), a class
token is prepended, learned position embeddings are added, and a stack of pre-norm
encoder layers with bidirectional attention (every patch sees every other, no causal
mask, no KV cache) transforms them. Every image of one step runs as one batch
`[num_images, 1 + num_patches, hidden_size]`, and each image is encoded once, whole.

vLLM's `CLIPVisionModel` wraps a `CLIPVisionTransformer` (`vision_model`); here, as in
transformers 5, the model holds its parts directly. Like vLLM it builds only the layers
up to the one LLaVA reads its features from, and never the final `post_layernorm`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import CLIPVisionConfig

from nano_v1.model_executor.layers.activation import get_act_fn
from nano_v1.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear


class CLIPVisionEmbeddings(nn.Module):
    """`[num_images, 3, H, W] -> [num_images, 1 + num_patches, hidden_size]`: patches, class token, positions."""

    def __init__(self, config: CLIPVisionConfig) -> None:
        super().__init__()
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, config.patch_size, stride=config.patch_size, bias=False
        )
        self.num_patches = (config.image_size // config.patch_size) ** 2
        self.position_embedding = nn.Embedding(self.num_patches + 1, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # Images are image_size x image_size: the frontend's processor checked (llava.py).
        num_images = pixel_values.shape[0]
        patch_embeds = self.patch_embedding(pixel_values)  # [num_images, hidden, grid, grid]
        patch_embeds = patch_embeds.flatten(2).transpose(1, 2)  # [num_images, num_patches, hidden]
        class_embeds = self.class_embedding.expand(num_images, 1, -1)
        return torch.cat([class_embeds, patch_embeds], dim=1) + self.position_embedding.weight


class CLIPAttention(nn.Module):
    """Multi-head self-attention over one image's tokens, without a mask."""

    def __init__(self, config: CLIPVisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, self.num_heads, self.num_heads, bias=True
        )
        self.out_proj = RowParallelLinear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        num_images, seq_len, hidden_size = hidden_states.shape
        qkv = self.qkv_proj(hidden_states)  # [num_images, seq_len, 3 * hidden_size]
        # -> 3 x [num_images, num_heads, seq_len, head_dim]
        q, k, v = qkv.view(num_images, seq_len, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(1, 2).reshape(num_images, seq_len, hidden_size))


class CLIPMLP(nn.Module):
    def __init__(self, config: CLIPVisionConfig) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=True)
        self.activation_fn = get_act_fn(config.hidden_act)
        self.fc2 = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=True)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation_fn(self.fc1(hidden_states)))


class CLIPEncoderLayer(nn.Module):
    """Pre-norm block: `h += attn(norm(h)); h += mlp(norm(h))`."""

    def __init__(self, config: CLIPVisionConfig) -> None:
        super().__init__()
        self.self_attn = CLIPAttention(config)
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = CLIPMLP(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(self.layer_norm1(hidden_states))
        return hidden_states + self.mlp(self.layer_norm2(hidden_states))


class CLIPEncoder(nn.Module):
    def __init__(self, config: CLIPVisionConfig, num_hidden_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(config) for _ in range(num_hidden_layers))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return hidden_states


class CLIPVisionModel(nn.Module):
    """`pixel_values [num_images, 3, H, W]` -> the output of layer `num_hidden_layers`,
    `[num_images, 1 + num_patches, hidden_size]` (the class token first)."""

    def __init__(self, config: CLIPVisionConfig, num_hidden_layers: int) -> None:
        super().__init__()
        self.num_hidden_layers = num_hidden_layers
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)  # sic: CLIP's name
        self.encoder = CLIPEncoder(config, num_hidden_layers)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.pre_layrnorm(self.embeddings(pixel_values)))

    def is_unused_weight(self, name: str) -> bool:
        """Checkpoint tensors (names relative to this model) of parts it does not build."""
        if name.startswith("post_layernorm."):
            return True
        if name.startswith("encoder.layers."):
            return int(name.split(".")[2]) >= self.num_hidden_layers
        return False
