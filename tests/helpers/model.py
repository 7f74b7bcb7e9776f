"""A model without an engine (chapter 01): loaded as the engine loads it, run over a hand-made paged KV cache.

`load_model` builds a checkpoint's model with `get_model` on the CPU. `PagedRunner` is a
minimal stand-in for the model runner: a KV cache of NaN (an unwritten slot read would
poison the logits), shuffled non-contiguous block tables, and attention metadata built by
hand, so one step can mix prefills and decodes of several requests.
"""

from __future__ import annotations

import numpy as np
import torch

from nano_v1.attention.backends.utils import CommonAttentionMetadata
from nano_v1.attention.layer import Attention
from nano_v1.config import DeviceConfig, ModelConfig, VllmConfig
from nano_v1.forward_context import set_forward_context
from nano_v1.model_executor.model_loader import get_model

BLOCK_SIZE = 4
NUM_BLOCKS = 96


def load_model(model: str, **model_config):
    """The model of a checkpoint, built and loaded as the engine does (get_model), on the CPU."""
    config = VllmConfig(ModelConfig(model, **model_config), device_config=DeviceConfig("cpu"))
    return get_model(config, torch.device("cpu"))


class PagedRunner:
    """A minimal stand-in for the model runner: a KV cache, block tables, hand-built metadata."""

    def __init__(self, model: torch.nn.Module, num_reqs: int, seed: int = 0) -> None:
        self.model = model
        rng = np.random.default_rng(seed)
        max_blocks = NUM_BLOCKS // num_reqs
        # Each request owns a shuffled, non-contiguous set of blocks.
        ids = rng.permutation(NUM_BLOCKS)[: num_reqs * max_blocks].reshape(num_reqs, max_blocks)
        self.block_table = torch.tensor(ids, dtype=torch.int32)
        dtype = next(model.parameters()).dtype
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        for layer in layers:
            shape = layer.attn_backend.get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, layer.num_kv_heads, layer.head_size)
            # Unwritten slots are NaN: reading any of them would poison the logits.
            layer.kv_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.builder = layers[0].attn_backend.get_builder_cls()(torch.device("cpu"))

    def step(self, reqs: list[int], new_tokens: list[list[int]], num_computed: list[int]) -> torch.Tensor:
        """Run one step; request reqs[i] adds new_tokens[i] after num_computed[i] tokens."""
        query_lens = torch.tensor([len(t) for t in new_tokens], dtype=torch.int32)
        computed = torch.tensor(num_computed, dtype=torch.int32)
        seq_lens = computed + query_lens
        positions = torch.cat([torch.arange(c, s) for c, s in zip(num_computed, seq_lens.tolist())])
        req_of_token = torch.repeat_interleave(torch.tensor(reqs), query_lens.long())
        block_table = self.block_table[reqs]
        slot_mapping = (
            self.block_table[req_of_token, positions // BLOCK_SIZE].long() * BLOCK_SIZE
            + positions % BLOCK_SIZE
        )
        query_start_loc = torch.zeros(len(reqs) + 1, dtype=torch.int32)
        query_start_loc[1:] = torch.cumsum(query_lens, 0)
        common = CommonAttentionMetadata(
            query_start_loc=query_start_loc,
            query_start_loc_cpu=query_start_loc.clone(),
            seq_lens=seq_lens,
            seq_lens_cpu=seq_lens.clone(),
            num_computed_tokens_cpu=computed,
            num_reqs=len(reqs),
            num_actual_tokens=int(query_lens.sum()),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            block_table_tensor=block_table,
            slot_mapping=slot_mapping,
        )
        input_ids = torch.tensor([t for toks in new_tokens for t in toks])
        with torch.no_grad(), set_forward_context(self.builder.build(0, common)):
            hidden = self.model(input_ids, positions)
        return self.model.compute_logits(hidden)  # [num_tokens, vocab]

