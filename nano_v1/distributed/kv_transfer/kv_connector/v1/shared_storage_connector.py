"""A KV connector through a shared directory: a prompt's KV saved as files, loaded back by any engine.

Mirrors vllm/distributed/kv_transfer/kv_connector/v1/shared_storage_connector.py (chapter 16).

Why it exists: it is the smallest complete connector, so it shows disaggregated prefill
with nothing but files. A prefill engine ("kv_producer") computes a prompt and, layer by
layer, saves the KV of its whole blocks under a directory named by the hash of those
tokens; a decode engine ("kv_consumer"), given the same prompt plus the prefill's sampled
token, finds the directory, counts those tokens as computed, and loads their KV into its
own blocks before the forward pass, which then computes only the rest of the prompt.

Layout: `<shared_storage_path>/<md5 of the prefix's token ids (int64 bytes) and image
hashes>/<layer name>.safetensors`, each holding one tensor, "kv_cache", of shape
[2, num_tokens, num_kv_heads, head_size] (keys, values) in the KV cache's dtype.

The arithmetic is v0.11.0's (`align_to_block_size(n)` = the whole blocks strictly before
token n): a prompt of L tokens saves its first `align_to_block_size(L)` tokens; a request
looks up its first `align_to_block_size(L - 1)` tokens, which for the decode prompt (the
prefill's prompt plus one token) is the same prefix. Its last prompt token is always
computed again: its logits give the first sampled token.

Bad storage. v0.11.0 checks only that the directory exists, and raises when a file
cannot be read. Here the scheduler side accepts a saved prefix only if the directory
holds one file per layer and each file is a complete safetensors file (its header parses,
its data fills the file exactly, so a truncated file fails) holding "kv_cache" of the
expected dtype and shape, with the sha256 of its data that the saver put in the header
(so a flipped byte fails too). Otherwise the request computes its prompt as if nothing
were stored (and saves it again, replacing the bad files). The price: the scheduler reads
each saved file once more when it admits a request that would load it. Files are written
under a temporary name and renamed once complete, so a crash mid-write leaves no partial
file. The gap: a file that goes bad between the scheduler's check and the worker's load
(within one step) makes the worker raise a clear error, as nothing can be recomputed
then: the scheduler has already counted those tokens as computed, and taking them back
needs a load-failure path from the workers to the scheduler, which v0.11.0 does not have.

What differs from v0.11.0 besides: the loads' blocks are those the scheduler allocated
(kept at `update_state_after_alloc`), and their token count is the one
`get_num_new_matched_tokens` answered (v0.11.0 recounts, and looks in another directory
when L - 1 is a multiple of the block size); a prompt is saved only in a step that
computes all of its saved blocks (v0.11.0 saves a chunked prefill's first chunk with
uncomputed slots); `tensor_parallel_size` must be 1 (ranks would write the same files).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import safetensors.torch
import torch

from nano_v1.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from nano_v1.config import VllmConfig
    from nano_v1.core.kv_cache_manager import KVCacheBlocks
    from nano_v1.core.sched.output import NewRequestData, SchedulerOutput
    from nano_v1.forward_context import ForwardContext
    from nano_v1.request import Request

logger = logging.getLogger(__name__)

# torch dtype -> its name in a safetensors header.
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


@dataclass(slots=True)
class ReqMeta:
    """One request's load or save in a step: which tokens' KV, in which cache slots."""

    token_ids: np.ndarray  # [num_tokens] int64: the saved prefix, which names its directory
    # [num_tokens]: token i's slot, block_ids[i // block_size] * block_size + i % block_size
    slot_mapping: torch.Tensor
    is_store: bool  # save from the cache (True) or load into it
    mm_hashes: list[str]

    @staticmethod
    def make_meta(
        token_ids: list[int], block_ids: list[int], block_size: int, is_store: bool, mm_hashes: list[str]
    ) -> ReqMeta:
        """The first `align_to_block_size(len(token_ids))` tokens of `token_ids`, in `block_ids`."""
        valid_num_tokens = align_to_block_size(len(token_ids), block_size)
        block_ids_tensor = torch.tensor(block_ids, dtype=torch.int64)
        slot_mapping = (
            block_ids_tensor.reshape(-1, 1) * block_size + torch.arange(block_size).reshape(1, -1)
        ).flatten()[:valid_num_tokens]  # [num_blocks * block_size] -> [valid_num_tokens]
        return ReqMeta(
            token_ids=np.asarray(token_ids[:valid_num_tokens], dtype=np.int64),
            slot_mapping=slot_mapping,
            is_store=is_store,
            mm_hashes=mm_hashes,
        )


@dataclass
class SharedStorageConnectorMetadata(KVConnectorMetadata):
    requests: list[ReqMeta] = field(default_factory=list)

    def add_request(
        self, token_ids: list[int], block_ids: list[int], block_size: int, is_store: bool, mm_hashes: list[str]
    ) -> None:
        self.requests.append(ReqMeta.make_meta(token_ids, block_ids, block_size, is_store, mm_hashes))


class SharedStorageConnector(KVConnectorBase_V1):
    """Saves and loads whole-block prompt prefixes' KV as safetensors files, synchronously."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole) -> None:
        super().__init__(vllm_config, role)
        if vllm_config.parallel_config.tensor_parallel_size != 1:
            raise ValueError(
                "SharedStorageConnector needs tensor_parallel_size=1: its ranks would write the same files."
            )
        self._block_size = vllm_config.cache_config.block_size
        model_config = vllm_config.model_config
        self._num_layers = model_config.get_num_layers()
        self._dtype = model_config.dtype
        # [num_kv_heads, head_size]: one token's keys (or values) in one layer.
        self._token_shape = [model_config.get_num_kv_heads(), model_config.get_head_size()]
        # Requests whose KV the workers load this step: id -> (request, its block ids).
        self._requests_need_load: dict[str, tuple[Request, list[int]]] = {}
        self._storage_path = vllm_config.kv_transfer_config.get_from_extra_config("shared_storage_path", "/tmp")
        try:
            os.makedirs(self._storage_path, exist_ok=True)
        except OSError as e:
            raise ValueError(
                f"kv_connector_extra_config['shared_storage_path']={self._storage_path!r} "
                f"is not a usable directory: {e}"
            ) from None
        logger.info("Shared storage path is %s", self._storage_path)

    # ------------------------------------------------------------------ worker role
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Copy each loading request's saved KV into its slots of every layer, before the forward."""
        if forward_context.attn_metadata is None:
            return  # a step without attention (no forward pass): SharedStorage loads only with one
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, SharedStorageConnectorMetadata)
        for request in metadata.requests:
            if request.is_store:
                continue
            # The step's attention layers by name, each holding its KV cache (as v0.11.0 finds them).
            for layer_name, layer in forward_context.no_compile_layers.items():
                kv_cache_layer = layer.kv_cache
                filename = self._generate_filename_debug(layer_name, request.token_ids, request.mm_hashes)
                kv_cache = self._read_kv_file(filename, kv_cache_layer, len(request.slot_mapping))
                # [2, num_blocks, block_size, num_kv_heads, head_size] -> [2, num_slots, num_kv_heads, head_size]
                slots = kv_cache_layer.view(2, -1, *kv_cache_layer.shape[3:])
                slots[:, request.slot_mapping.to(slots.device)] = kv_cache.to(slots.device)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are synchronous (all done in `start_load_kv`): nothing to wait for."""
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Write each saving request's KV of this layer, now that the step's keys and values are cached."""
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, SharedStorageConnectorMetadata)
        for request in metadata.requests:
            if not request.is_store:
                continue
            slots = kv_layer.view(2, -1, *kv_layer.shape[3:])  # [2, num_slots, num_kv_heads, head_size]
            kv_cache = slots[:, request.slot_mapping.to(slots.device)].detach().cpu()
            filename = self._generate_filename_debug(layer_name, request.token_ids, request.mm_hashes)
            # Complete or absent: readers never see a partly written file.
            # The data's digest goes in the header: the scheduler side checks it before counting on the file.
            digest = hashlib.sha256(kv_cache.contiguous().view(torch.uint8).numpy()).hexdigest()
            safetensors.torch.save_file({"kv_cache": kv_cache}, filename + ".tmp", metadata={"sha256": digest})
            os.replace(filename + ".tmp", filename)

    def wait_for_save(self) -> None:
        """Saves are synchronous: nothing to wait for."""
        return

    # ------------------------------------------------------------------ scheduler role
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """The tokens this request can load, past the `num_computed_tokens` its local prefix-cache
        hit already covers, and whether they load asynchronously (never, here: they are loaded
        in the step that computes the rest of the prompt).

        What can be loaded is the saved prefix `_found_match_for_request` checks: «the whole
        blocks before the last prompt token» (`align_to_block_size`), as the last prompt token
        is always computed again, its logits giving the first sampled token. No valid save:
        nothing to load. The local hit may reach past the saved prefix: the answer is «never
        negative».
        """
        # BEGIN TASK ch16_t2: nothing saved -> 0; else the saved whole blocks before the last prompt token, minus the local hit
        if not self._found_match_for_request(request):
            return 0, False
        logger.info("External cache hit for request %s", request.request_id)
        num_tokens_to_check = align_to_block_size(len(request.prompt_token_ids) - 1, self._block_size)
        # A local prefix-cache hit can reach past the saved prefix; v0.11.0 would answer < 0.
        return max(num_tokens_to_check - num_computed_tokens, 0), False
        # END TASK

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self._requests_need_load[request.request_id] = (request, blocks.get_block_ids()[0])

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Loads for the requests admitted with external tokens; saves for new requests whose
        prefix is not stored yet and whose saved blocks this step computes."""
        meta = SharedStorageConnectorMetadata()
        for request, block_ids in self._requests_need_load.values():
            # The tokens `get_num_new_matched_tokens` counted: the whole blocks before the last prompt token.
            meta.add_request(
                request.prompt_token_ids[:-1], block_ids, self._block_size, False,
                [f.identifier for f in request.mm_features],
            )  # fmt: skip
        for new_req in scheduler_output.scheduled_new_reqs:
            if new_req.req_id in self._requests_need_load or not self._computes_saved_prefix(
                new_req, scheduler_output.num_scheduled_tokens[new_req.req_id]
            ):
                continue
            if not self._found_match_for_request(new_req):
                meta.add_request(
                    new_req.prompt_token_ids, new_req.block_ids[0], self._block_size, True,
                    [f.identifier for f in new_req.mm_features],
                )  # fmt: skip
        self._requests_need_load.clear()
        return meta

    # ------------------------------------------------------------------ helpers
    def _computes_saved_prefix(self, new_req: NewRequestData, num_scheduled_tokens: int) -> bool:
        """Whether this step computes every token a save of `new_req` would write (at least one)."""
        num_saved_tokens = align_to_block_size(len(new_req.prompt_token_ids), self._block_size)
        return 0 < num_saved_tokens <= new_req.num_computed_tokens + num_scheduled_tokens

    def _found_match_for_request(self, request: Request | NewRequestData) -> bool:
        """Whether a complete, valid save of the request's prefix (`align_to_block_size(L - 1)` tokens) exists."""
        num_tokens_to_check = align_to_block_size(len(request.prompt_token_ids) - 1, self._block_size)
        if num_tokens_to_check <= 0:
            return False  # a prompt of at most one block and a token: nothing is saved for it
        foldername = self._generate_foldername_debug(
            np.asarray(request.prompt_token_ids[:num_tokens_to_check], dtype=np.int64),
            [f.identifier for f in request.mm_features],
        )
        if not os.path.isdir(foldername):
            return False
        filenames = [name for name in os.listdir(foldername) if name.endswith(".safetensors")]
        expected_shape = [2, num_tokens_to_check, *self._token_shape]
        valid = len(filenames) == self._num_layers and all(
            _is_valid_kv_file(os.path.join(foldername, name), self._dtype, expected_shape) for name in filenames
        )
        if not valid:
            logger.warning("Ignoring the incomplete or corrupt saved KV in %s: the prompt is recomputed", foldername)
        return valid

    def _generate_foldername_debug(
        self, token_ids: np.ndarray, mm_hashes: list[str], create_folder: bool = False
    ) -> str:
        """The directory of a prefix: named by the md5 of its token ids and image hashes."""
        token_bytes = token_ids.tobytes()
        if mm_hashes:
            # Two prompts with equal placeholder tokens but different images are different keys.
            token_bytes += "-".join(mm_hashes).encode("utf-8")
        foldername = os.path.join(self._storage_path, hashlib.md5(token_bytes, usedforsecurity=False).hexdigest())
        if create_folder:
            os.makedirs(foldername, exist_ok=True)
        return foldername

    def _generate_filename_debug(self, layer_name: str, token_ids: np.ndarray, mm_hashes: list[str]) -> str:
        foldername = self._generate_foldername_debug(token_ids, mm_hashes, create_folder=True)
        return os.path.join(foldername, f"{layer_name}.safetensors")

    @staticmethod
    def _read_kv_file(filename: str, kv_cache_layer: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """The saved [2, num_tokens, num_kv_heads, head_size] KV of one layer, checked against the cache."""
        expected_shape = (2, num_tokens, *kv_cache_layer.shape[3:])
        try:
            kv_cache = safetensors.torch.load_file(filename)["kv_cache"]
        except (OSError, KeyError, safetensors.SafetensorError) as e:
            raise RuntimeError(f"Saved KV {filename} became unreadable after the scheduler checked it: {e}") from e
        if tuple(kv_cache.shape) != expected_shape or kv_cache.dtype != kv_cache_layer.dtype:
            raise RuntimeError(
                f"Saved KV {filename} holds {kv_cache.dtype} {tuple(kv_cache.shape)}, "
                f"expected {kv_cache_layer.dtype} {expected_shape}."
            )
        return kv_cache


def _is_valid_kv_file(filename: str, dtype: torch.dtype, shape: list[int]) -> bool:
    """Whether `filename` is a complete safetensors file holding just "kv_cache" of `dtype` and
    `shape`, whose data has the digest its header records.

    The format: 8 bytes, the header's length N (little-endian); N bytes of JSON
    {"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets": [begin, end]}}
    (offsets into the data after the header); then the data, the tensor's bytes in C order.
    """
    nbytes = int(np.prod(shape)) * dtype.itemsize
    try:
        with open(filename, "rb") as f:
            header_size = int.from_bytes(f.read(8), "little")
            if header_size != os.path.getsize(filename) - 8 - nbytes:
                return False  # truncated, extended, or not this shape and dtype
            header = json.loads(f.read(header_size))
            data = f.read(nbytes)
    except (OSError, ValueError):  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        return False
    if not isinstance(header, dict) or set(header) != {"__metadata__", "kv_cache"}:
        return False
    entry, metadata = header["kv_cache"], header["__metadata__"]
    return (
        isinstance(entry, dict)
        and isinstance(metadata, dict)
        and entry.get("dtype") == _SAFETENSORS_DTYPES.get(dtype)
        and entry.get("shape") == shape
        and entry.get("data_offsets") == [0, nbytes]
        and metadata.get("sha256") == hashlib.sha256(data).hexdigest()
    )


def align_to_block_size(num_tokens: int, block_size: int) -> int:
    """The tokens in the whole blocks strictly before token `num_tokens`: (n - 1) // block_size * block_size."""
    return (num_tokens - 1) // block_size * block_size
