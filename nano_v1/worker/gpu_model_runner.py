"""The model runner: scheduler output in, one forward pass and one sample per request out.

Mirrors vllm/v1/worker/gpu_model_runner.py (chapters 05, 07, 08, 10, 11, 12, 14 and 16).

Why it is shaped this way: a step's inputs are a flat, ragged batch (every scheduled
token of every request, back to back), and nearly all of it is already known from the
previous step. So the runner (1) applies the scheduler's diff to the persistent batch
(`_update_states`), (2) derives the flat input ids, positions, cache slots and attention
metadata from it with a few vectorised numpy ops (`_prepare_inputs`), (3) runs the model
and samples at each request's last scheduled token (`execute_model`), and (4) writes the
sampled tokens back into the persistent batch itself (`_bookkeeping_sync`), so they never
travel through the scheduler again.

Each KV cache group (chapter 12) has its own block table and slot mapping, so a step has
one attention metadata per group, which the forward context maps to the group's layers.
A multimodal model (chapter 11) takes embeddings instead of token ids on every step,
with the step's image rows merged in, so that one compiled graph serves every step.

At start-up the runner also runs itself over batches that serve no request, in its own
step buffers (`_dummy_run`): the largest step without a KV cache, so that the worker can
size the cache from the peak (`profile_run`, chapter 05), and one run per CUDA graph the
`CudagraphDispatcher` has a key for (`capture_model`, chapter 08). Each step then asks
the dispatcher which graph to replay and how far to pad, and tells the graph wrappers
through the forward context. The padding rows compute garbage that nothing reads:
attention caches and attends only the real tokens, and logits take real rows only.

With async scheduling (chapter 14) a step never waits for its sampled tokens: the
persistent batch and each request's state get a placeholder (-1) per token, the tokens
stay on the device as `input_batch.prev_sampled_token_ids`, and `execute_model` returns an
`AsyncGPUModelRunnerOutput` that copies them to the host behind the step (a side stream
on CUDA; on the CPU the tokens are the host's already and nothing waits). The next step
gathers them on the device into its input ids (`_prepare_input_ids`), and writes them over
the host's placeholders once its own forward is queued, or earlier when the host needs
them (`_fill_sampled_token_placeholders`). `synchronize_input_prep` keeps a step from
overwriting pinned buffers that the step before is still copying from.

With a KV connector (chapter 16) the runner hands the connector its KV cache tensors
once they exist (`register_kv_caches`) and runs each forward pass inside the connector's
step (`KVConnectorModelRunnerMixin`): the step's metadata bound and loads started before,
saves waited for and finished transfers collected after, into the output's
`kv_connector_output`.

The methods follow v0.11.0's order. What differs from v0.11.0: one attention metadata
builder for every KV cache group; `initialize_cudagraph_capture` runs at construction,
not in `capture_model`, as `load_model` already wraps the model for the resolved mode;
one capture loop over the dispatcher's keys instead of a `_capture_cudagraphs` call per
mode, and no garbage-collector freeze, data-parallel padding or micro-batches;
`_pad_for_full_graph` is nano_v1's own (vLLM pads the same buffers in `_prepare_inputs`
on every step); `_bookkeeping_sync` returns the `ModelRunnerOutput` rather than its
parts, as nano_v1 has no NaN counts or pooling to add to it, and `execute_model` adds
the prompt logprobs to it; they are copied to the host synchronously, where v0.11.0
overlaps the copies and synchronises once. With async scheduling, v0.11.0 leaves the
placeholders in the host's token table and request states for good (with pipeline
parallelism the scheduler sends the tokens back); nano_v1 writes the real tokens over them
during the next step (`_fill_sampled_token_placeholders`), as a request resumed after
preemption is rewritten from its state, and penalties and bad words read the output tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

from nano_v1.attention.backends.flash_attn import FlashAttentionMetadata, get_num_sms
from nano_v1.attention.backends.utils import AttentionCGSupport, CommonAttentionMetadata
from nano_v1.attention.layer import Attention
from nano_v1.attention.selector import get_attn_backend
from nano_v1.compilation.backends import VllmBackend
from nano_v1.compilation.cuda_graph import CUDAGraphWrapper, GraphPool
from nano_v1.compilation.decorators import support_torch_compile
from nano_v1.config import CompilationLevel, CUDAGraphMode, VllmConfig
from nano_v1.core.sched.output import SchedulerOutput
from nano_v1.cudagraph_dispatcher import CudagraphDispatcher
from nano_v1.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
from nano_v1.forward_context import BatchDescriptor, set_forward_context
from nano_v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec, SlidingWindowSpec
from nano_v1.model_executor.model_loader import get_model
from nano_v1.multimodal import MULTIMODAL_REGISTRY
from nano_v1.outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    AsyncModelRunnerOutput,
    DraftTokenIds,
    LogprobsTensors,
    ModelRunnerOutput,
)
from nano_v1.sample.logits_processor import build_logitsprocs
from nano_v1.sample.metadata import SamplingMetadata
from nano_v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler
from nano_v1.sample.sampler import Sampler, SamplerOutput
from nano_v1.spec_decode.metadata import SpecDecodeMetadata, calc_spec_decode_metadata, segment_arange
from nano_v1.spec_decode.ngram_proposer import NgramProposer
from nano_v1.structured_output.utils import apply_grammar_bitmask
from nano_v1.worker.block_table import CpuGpuBuffer
from nano_v1.worker.gpu_input_batch import CachedRequestState, InputBatch
from nano_v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin
from nano_v1.worker.utils import bind_kv_cache

logger = logging.getLogger(__name__)

# Where the padding rows of a FULL graph write their keys and values: slot 0 of block 0,
# the null block, which the block pool never hands to a request.
NULL_BLOCK_SLOT = 0


class AsyncGPUModelRunnerOutput(AsyncModelRunnerOutput):
    """A step's output whose sampled tokens are copied to the host behind the step (chapter 14).

    On CUDA the copy is queued on a side stream, after everything the step queued on the
    current one, and an event marks its end: the runner returns at once and goes on to the
    next step, and `get_output` (in the worker's output thread) waits for the event. On the
    CPU there is no stream and nothing to wait for: the tokens are on the host when the
    step returns, and `get_output` only builds the output.
    """

    def __init__(
        self,
        model_runner_output: ModelRunnerOutput,
        sampled_token_ids: torch.Tensor,
        invalid_req_indices: list[int],
        async_output_copy_stream: torch.cuda.Stream | None,
    ) -> None:
        """`sampled_token_ids`: [num_reqs, 1] on the device; rows in `invalid_req_indices` keep no token."""
        self._model_runner_output = model_runner_output
        self._invalid_req_indices = invalid_req_indices
        self._async_copy_ready_event: torch.cuda.Event | None = None
        if async_output_copy_stream is None:  # the CPU: the tensor is the host's already
            self._sampled_token_ids_cpu = sampled_token_ids.cpu()
            return
        # The device tensor must outlive the copy: held until get_output.
        self._sampled_token_ids = sampled_token_ids
        self._async_copy_ready_event = torch.cuda.Event()
        default_stream = torch.cuda.current_stream()
        with torch.cuda.stream(async_output_copy_stream):
            async_output_copy_stream.wait_stream(default_stream)
            self._sampled_token_ids_cpu = sampled_token_ids.to("cpu", non_blocking=True)
            self._async_copy_ready_event.record()

    def _host_sampled_token_ids(self) -> torch.Tensor:
        """The step's sampled tokens on the host, [num_reqs, 1], once the copy is done (blocks until
        then). Thread-safe: the output thread and the runner's next step both wait here."""
        if self._async_copy_ready_event is not None:
            self._async_copy_ready_event.synchronize()
        return self._sampled_token_ids_cpu

    def get_output(self) -> ModelRunnerOutput:
        valid_sampled_token_ids = self._host_sampled_token_ids().tolist()
        self._sampled_token_ids = None  # the copy is done: the device tensor may go
        for i in self._invalid_req_indices:
            valid_sampled_token_ids[i].clear()
        output = self._model_runner_output
        output.sampled_token_ids = valid_sampled_token_ids
        return output


class GPUModelRunner(KVConnectorModelRunnerMixin):
    """Owns the model, its KV cache tensors, the persistent batch and the per-step buffers.

    Constructing it loads nothing; `load_model()` and `initialize_kv_cache()` do, so the
    input preparation can be exercised (and tested) without weights.
    """

    # Tests swap in a recording fake to exercise capture and replay without a GPU.
    cudagraph_wrapper_cls: type[CUDAGraphWrapper] = CUDAGraphWrapper

    def __init__(self, vllm_config: VllmConfig, device: torch.device) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.cache_config = vllm_config.cache_config
        self.scheduler_config = vllm_config.scheduler_config
        self.compilation_config = vllm_config.compilation_config
        self.device = device
        self.dtype = self.model_config.dtype
        self.pin_memory = device.type == "cuda"
        self.max_model_len = self.model_config.max_model_len
        self.max_num_tokens = self.scheduler_config.max_num_batched_tokens
        self.max_num_reqs = self.scheduler_config.max_num_seqs
        self.block_size = self.cache_config.block_size
        # This rank's query heads (chapter 13): a tp-th of them. Its KV heads are in each
        # layer's KV cache spec (a tp-th too, or one when there are fewer than ranks).
        self.num_query_heads = (
            self.model_config.get_num_attention_heads() // vllm_config.parallel_config.tensor_parallel_size
        )

        self.model: nn.Module | None = None
        self.attn_layers: dict[str, Attention] = {}
        # Set by initialize_kv_cache: the KV cache groups (which layers share a block table).
        self.kv_cache_config: KVCacheConfig | None = None
        # The backend every Attention layer of the model also picks (attention/selector.py).
        # One builder serves every KV cache group: it keeps no per-group state (vLLM has one
        # per group and backend), and is called once per group each step.
        self.attn_backend = get_attn_backend(self.model_config.attention_backend)
        self.attn_metadata_builder = self.attn_backend.get_builder_cls()(device)
        self.cascade_attn_enabled = not self.model_config.disable_cascade_attn
        self.num_sms = get_num_sms(device)
        self.sampler = Sampler()
        self.cudagraph_dispatcher = CudagraphDispatcher(vllm_config)
        self.initialize_cudagraph_capture()
        self.graph_pool: GraphPool | None = None  # shared by every CUDA graph this runner captures
        self.compile_backend: VllmBackend | None = None  # set when the model is compiled (level 3)
        # Speculative decoding (chapter 10): drafts proposed after each step, verified in the next.
        speculative_config = vllm_config.speculative_config
        self.drafter = NgramProposer(speculative_config) if speculative_config is not None else None
        self.rejection_sampler = RejectionSampler()
        self._draft_token_ids: list[list[int]] | None = None

        # Every request the runner knows, in the batch or preempted; dropped when finished.
        self.requests: dict[str, CachedRequestState] = {}
        # One KV cache group until initialize_kv_cache says otherwise.
        self.input_batch = self._make_input_batch([self.block_size])

        # Per-step buffers, allocated once at their largest size and sliced each step.
        def buffer(size: int, dtype: torch.dtype) -> CpuGpuBuffer:
            return CpuGpuBuffer(size, dtype=dtype, device=device, pin_memory=self.pin_memory)

        self.input_ids = buffer(self.max_num_tokens, torch.int64)
        self.positions = buffer(self.max_num_tokens, torch.int64)
        # Multimodal models (chapter 11): the step's input embeddings, [max_num_tokens, hidden_size],
        # and the encoder outputs, mm_hash -> [num_image_tokens, hidden_size], until the scheduler frees them.
        self.supports_mm_inputs = MULTIMODAL_REGISTRY.supports_multimodal_inputs(self.model_config)
        self.inputs_embeds = (
            torch.zeros(
                self.max_num_tokens, self.model_config.get_hidden_size(), dtype=self.dtype, device=device
            )
            if self.supports_mm_inputs
            else None
        )
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.query_start_loc = buffer(self.max_num_reqs + 1, torch.int32)
        self.seq_lens = buffer(self.max_num_reqs, torch.int32)
        # 0, 1, 2, ... once, so that per-step aranges are slices rather than allocations.
        self.arange_np = np.arange(max(self.max_num_reqs + 1, self.max_model_len, self.max_num_tokens))

        # Async scheduling (chapter 14): a step returns without waiting for its sampled tokens.
        # On CUDA they go to the host on a side stream; on the CPU there is no stream, and
        # every copy is done when it returns.
        self.use_async_scheduling = self.scheduler_config.async_scheduling
        on_cuda = device.type == "cuda"
        self.async_output_copy_stream = (
            torch.cuda.Stream(device) if self.use_async_scheduling and on_cuda else None
        )
        # The last step's output while the host holds placeholders for its tokens.
        self._prev_async_output: AsyncGPUModelRunnerOutput | None = None
        # CUDA, async: recorded after a step's host -> device copies out of the pinned step
        # buffers, which the next step must not overwrite before they are done. Starts done.
        self.prepare_inputs_event: torch.cuda.Event | None = None
        if self.async_output_copy_stream is not None:
            self.prepare_inputs_event = torch.cuda.Event()
            self.prepare_inputs_event.record(torch.cuda.current_stream(device))

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Apply the scheduler's diff to `self.requests` and to the persistent batch.

        Cost is O(requests that changed) plus one O(batch) pass for the unscheduled set;
        no request's tokens are re-copied unless it (re-)enters the batch.
        """
        input_batch = self.input_batch
        removed_req_indices: list[int] = []
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
            req_index = input_batch.remove_request(req_id)
            if req_index is not None:
                removed_req_indices.append(req_index)
        # Encoder outputs the scheduler evicted (chapter 11).
        for mm_hash in scheduler_output.free_encoder_mm_hashes:
            self.encoder_cache.pop(mm_hash, None)
        # A batch member not scheduled this step was preempted (or skipped): its row goes,
        # its CachedRequestState stays for when it is scheduled again.
        unscheduled = input_batch.req_id_to_index.keys() - scheduler_output.num_scheduled_tokens.keys()
        for req_id in unscheduled:
            removed_req_indices.append(input_batch.remove_request(req_id))

        reqs_to_add: list[CachedRequestState] = []
        for new_req in scheduler_output.scheduled_new_reqs:
            req_state = self.requests[new_req.req_id] = CachedRequestState.from_new_request(
                new_req, self.device
            )
            reqs_to_add.append(req_state)

        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            req_state = self.requests[req_id]
            num_computed_tokens = cached.num_computed_tokens[i]
            new_block_ids = cached.new_block_ids[i]  # per KV cache group, or None: nothing new
            resumed = cached.resumed_from_preemption[i]
            req_state.num_computed_tokens = num_computed_tokens
            if resumed:
                # Its old blocks were freed at preemption; these are all of its blocks now.
                req_state.block_ids = tuple(list(ids) for ids in new_block_ids)
            elif new_block_ids is not None:
                for block_ids, new_ids in zip(req_state.block_ids, new_block_ids):
                    block_ids.extend(new_ids)
            req_index = input_batch.req_id_to_index.get(req_id)
            if req_index is None:
                # Resumed, or skipped last step: it re-enters the batch in full.
                reqs_to_add.append(req_state)
                continue
            input_batch.num_computed_tokens_cpu[req_index] = num_computed_tokens
            if resumed:
                input_batch.block_table.add_row(new_block_ids, req_index)
            elif new_block_ids is not None:
                input_batch.block_table.append_row(new_block_ids, req_index)

        # Async scheduling: the penalties' bins count output tokens (refresh_metadata), and a
        # request re-entering the batch is written from its state, so both need the last
        # step's real tokens on the host: wait for them here. (A request the last step sampled
        # for re-enters only after an empty step, which fills nothing; or a new request takes
        # a finished one's id, and must not be fed its token.) Otherwise the wait comes after
        # the forward is queued (execute_model), behind the last step on the device anyway.
        prev_req_id_to_index = input_batch.prev_req_id_to_index
        if prev_req_id_to_index and (
            not input_batch.no_penalties or any(r.req_id in prev_req_id_to_index for r in reqs_to_add)
        ):
            self._fill_sampled_token_placeholders()

        # Fill the lowest holes first, then close whatever holes remain.
        removed_req_indices.sort(reverse=True)
        for req_state in reqs_to_add:
            input_batch.add_request(req_state, removed_req_indices.pop() if removed_req_indices else None)
        if removed_req_indices:
            input_batch.condense(removed_req_indices)
        input_batch.refresh_metadata()

        # Drafts to verify go right after the request's known tokens in the token table,
        # where _prepare_inputs gathers input ids; num_tokens does not count them, so
        # the next sampled tokens overwrite them.
        for req_id, spec_token_ids in scheduler_output.scheduled_spec_decode_tokens.items():
            req_index = input_batch.req_id_to_index[req_id]
            start = input_batch.num_tokens[req_index]
            input_batch.token_ids_cpu[req_index, start : start + len(spec_token_ids)] = spec_token_ids

    def _prepare_inputs(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[list[CommonAttentionMetadata], torch.Tensor, np.ndarray]:
        """Flat inputs for the step, from the persistent batch, with no loop over tokens.

        Fills `self.input_ids` and `self.positions` (first `total_num_scheduled_tokens`
        entries) and returns the common attention metadata of each KV cache group, the
        index of each request's last scheduled token in the flat batch (where its logits
        are taken), and the rows whose sample must be discarded (a prefill chunk that
        stops short of the prompt).
        """
        input_batch = self.input_batch
        num_reqs = input_batch.num_reqs
        total_num_tokens = scheduler_output.total_num_scheduled_tokens
        assert num_reqs > 0 and total_num_tokens > 0
        # Start the block table copies first; they overlap with the numpy work below.
        block_tables = input_batch.block_table.block_tables
        block_table_tensors = [block_table.commit_block_table(num_reqs) for block_table in block_tables]

        # E.g. 3 requests scheduled for [2, 5, 3] tokens, with [10, 0, 7] computed before.
        num_scheduled_tokens = np.array(
            [scheduler_output.num_scheduled_tokens[r] for r in input_batch.req_ids], dtype=np.int32
        )
        assert num_scheduled_tokens.sum() == total_num_tokens
        # BEGIN TASK ch05_t2: each token's row and position, each request's end; write self.positions; no loop
        # Batch row of each token: [0, 0, 1, 1, 1, 1, 1, 2, 2, 2]
        req_indices = np.repeat(self.arange_np[:num_reqs], num_scheduled_tokens)
        # End of each request's tokens in the flat batch: [2, 7, 10]
        cu_num_tokens = np.cumsum(num_scheduled_tokens)
        # Offset of each token within its request's chunk: [0, 1, 0, 1, 2, 3, 4, 0, 1, 2]
        chunk_offsets = self.arange_np[:total_num_tokens] - np.repeat(
            cu_num_tokens - num_scheduled_tokens, num_scheduled_tokens
        )
        # Position in its request: [10, 11, 0, 1, 2, 3, 4, 7, 8, 9]
        positions_np = self.positions.np[:total_num_tokens]
        np.add(input_batch.num_computed_tokens_cpu[req_indices], chunk_offsets, out=positions_np)
        # END TASK
        # Token ids: one gather from the flattened [max_num_reqs, max_model_len] token table.
        token_indices = req_indices * input_batch.token_ids_cpu.shape[1] + positions_np
        self.input_ids.np[:total_num_tokens] = input_batch.token_ids_cpu.ravel()[token_indices]
        input_batch.block_table.compute_slot_mapping(req_indices, positions_np)

        # Request i's queries are flat tokens query_start_loc[i] : query_start_loc[i + 1].
        self.query_start_loc.np[0] = 0
        self.query_start_loc.np[1 : num_reqs + 1] = cu_num_tokens
        seq_lens_np = self.seq_lens.np[:num_reqs]
        np.add(input_batch.num_computed_tokens_cpu[:num_reqs], num_scheduled_tokens, out=seq_lens_np)
        # A request whose context after this step is still short of its known tokens is
        # mid-prefill: the token it would sample is a prompt token we already have.
        discard_req_indices = np.flatnonzero(seq_lens_np < input_batch.num_tokens[:num_reqs])

        # Ship this step's inputs (non-blocking from pinned memory on CUDA).
        self._prepare_input_ids(total_num_tokens, cu_num_tokens)
        self.positions.copy_to_gpu(total_num_tokens)
        query_start_loc = self.query_start_loc.copy_to_gpu(num_reqs + 1)
        shared = {
            "query_start_loc": query_start_loc,
            "query_start_loc_cpu": self.query_start_loc.cpu[: num_reqs + 1],
            "seq_lens": self.seq_lens.copy_to_gpu(num_reqs),
            "seq_lens_cpu": self.seq_lens.cpu[:num_reqs],
            "num_computed_tokens_cpu": input_batch.num_computed_tokens_cpu_tensor[:num_reqs],
            "num_reqs": num_reqs,
            "num_actual_tokens": total_num_tokens,
            "max_query_len": int(num_scheduled_tokens.max()),
            "max_seq_len": int(seq_lens_np.max()),
        }
        # The groups differ only in where each request's keys live.
        common_attn_metadata = [
            CommonAttentionMetadata(
                **shared,
                block_table_tensor=block_table_tensor,
                slot_mapping=block_table.commit_slot_mapping(total_num_tokens),
            )
            for block_table, block_table_tensor in zip(block_tables, block_table_tensors)
        ]
        logits_indices = query_start_loc[1:].to(torch.int64) - 1  # [num_reqs]
        return common_attn_metadata, logits_indices, discard_req_indices

    def _prepare_input_ids(self, total_num_scheduled_tokens: int, cu_num_tokens: np.ndarray) -> None:
        """Put the step's input ids on the device: the host's, except that with async scheduling
        the tokens the last step sampled come from the device (`prev_sampled_token_ids`), where
        the host has placeholders.

        A request that the last step sampled for and that is still in the batch decodes that
        token now, as its one scheduled token, at flat index `cu_num_tokens[row] - 1`; the token
        is row `prev_req_id_to_index[req_id]` of `prev_sampled_token_ids`. Rows may have moved
        in between (requests finished, added, condensed), hence a gather by the old row and a
        scatter to the new flat index; when nothing moved, one slice copy does. A request that
        left the batch and came back has its real tokens on the host (`_update_states` waited
        for them) and is not in `prev_req_id_to_index` any more.
        """
        input_batch = self.input_batch
        prev_sampled_token_ids = input_batch.prev_sampled_token_ids
        if prev_sampled_token_ids is None:
            self.input_ids.copy_to_gpu(total_num_scheduled_tokens)
            return
        req_id_to_index = input_batch.req_id_to_index
        req_indices: list[int] = []
        prev_req_indices: list[int] = []
        for req_id, prev_req_index in input_batch.prev_req_id_to_index.items():
            req_index = req_id_to_index.get(req_id)
            if req_index is not None:
                req_indices.append(req_index)
                prev_req_indices.append(prev_req_index)
        num_common_tokens = len(req_indices)
        if num_common_tokens < total_num_scheduled_tokens:
            # Some of the step's tokens are the host's: ship them all, then overwrite the rest.
            self.input_ids.copy_to_gpu(total_num_scheduled_tokens)
        if num_common_tokens == 0:
            return
        flat_indices = cu_num_tokens[req_indices] - 1
        input_ids = self.input_ids.gpu
        # n distinct flat indices whose largest is n - 1 are 0 .. n - 1: each row's token goes
        # to the flat index equal to its old row.
        if flat_indices.max() == num_common_tokens - 1 and np.array_equal(flat_indices, prev_req_indices):
            input_ids[:num_common_tokens].copy_(
                prev_sampled_token_ids[:num_common_tokens, 0], non_blocking=True
            )
            return
        flat_index = torch.tensor(flat_indices, dtype=torch.int64, pin_memory=self.pin_memory)
        prev_index = torch.tensor(prev_req_indices, dtype=torch.int64, pin_memory=self.pin_memory)
        input_ids[flat_index.to(self.device, non_blocking=True)] = prev_sampled_token_ids[
            prev_index.to(self.device, non_blocking=True), 0
        ].to(input_ids.dtype)

    def _pad_for_full_graph(
        self, num_reqs: int, num_padded: int, max_seq_len: int
    ) -> list[CommonAttentionMetadata]:
        """Each group's attention metadata of `num_reqs` decodes padded with empty requests to `num_padded`.

        A FULL graph reads the metadata from the addresses it was captured with, so every
        tensor here is the head of a persistent buffer, refilled each step. The padding
        requests have no query and no context; their padding rows cache into the null block
        (of every group: a block id names a page in every tensor, and no group owns block 0).
        """
        self.query_start_loc.np[num_reqs + 1 : num_padded + 1] = num_reqs
        self.seq_lens.np[num_reqs:num_padded] = 0
        query_start_loc = self.query_start_loc.copy_to_gpu(num_padded + 1)
        seq_lens = self.seq_lens.copy_to_gpu(num_padded)
        common_attn_metadata = []
        for block_table in self.input_batch.block_table.block_tables:
            block_table.slot_mapping.np[num_reqs:num_padded] = NULL_BLOCK_SLOT
            common_attn_metadata.append(
                CommonAttentionMetadata(
                    query_start_loc=query_start_loc,
                    query_start_loc_cpu=self.query_start_loc.cpu[: num_padded + 1],
                    seq_lens=seq_lens,
                    seq_lens_cpu=self.seq_lens.cpu[:num_padded],
                    num_computed_tokens_cpu=self.input_batch.num_computed_tokens_cpu_tensor[:num_padded],
                    num_reqs=num_padded,
                    num_actual_tokens=num_padded,
                    max_query_len=1,
                    max_seq_len=max_seq_len,
                    block_table_tensor=block_table.commit_block_table(num_padded),
                    slot_mapping=block_table.commit_slot_mapping(num_padded),
                )
            )
        return common_attn_metadata

    def _build_attention_metadata(
        self, common_attn_metadata: list[CommonAttentionMetadata], num_common_prefix_blocks: list[int] | None
    ) -> dict[str, FlashAttentionMetadata]:
        """Each KV cache group's metadata, under the names of its layers (what the layers look up).

        `num_common_prefix_blocks` is None for a step that must not cascade (a FULL graph).
        """
        attn_metadata: dict[str, FlashAttentionMetadata] = {}
        for kv_cache_group_id, (group, common) in enumerate(
            zip(self.kv_cache_config.kv_cache_groups, common_attn_metadata)
        ):
            common_prefix_len = 0
            if self.cascade_attn_enabled and num_common_prefix_blocks is not None:
                common_prefix_len = self._compute_cascade_attn_prefix_len(
                    np.diff(common.query_start_loc_cpu.numpy()),
                    num_common_prefix_blocks[kv_cache_group_id],
                    group.kv_cache_spec,
                )
            metadata = self.attn_metadata_builder.build(
                common_prefix_len=common_prefix_len, common_attn_metadata=common
            )
            for layer_name in group.layer_names:
                attn_metadata[layer_name] = metadata
        return attn_metadata

    def _compute_cascade_attn_prefix_len(
        self, num_scheduled_tokens: np.ndarray, num_common_prefix_blocks: int, kv_cache_spec: KVCacheSpec
    ) -> int:
        """Tokens of shared prefix that cascade attention handles this step in one KV cache group; 0 for none.

        `num_scheduled_tokens` is per request of this step, the first rows of the persistent
        batch (chapter 07).

        Not simply the shared blocks: the prefix pass attends without a mask, so no query
        may sit inside the prefix. If all requests share [A B C D E] and one has computed
        [A B C] and now queries [D E X], a five-token prefix would let its query D see E, its
        future. So the prefix is capped by the smallest `num_computed_tokens` (not one more,
        which would still be correct: this way every request keeps at least one suffix key
        and the suffix pass is never empty), then rounded down to whole blocks, since the
        prefix pass reads whole blocks of the block table's first row.

        The rule refuses windowed layers: a sliding-window group, or full attention that
        remembers a window (the hybrid allocator off); its prefix pass would see keys
        outside the window. vLLM's takes the group's builder too; nano_v1 has one.
        """
        block_size = kv_cache_spec.block_size
        common_prefix_len = num_common_prefix_blocks * block_size
        if common_prefix_len == 0:
            return 0  # the common case: no block is shared by every running request
        num_computed_tokens = self.input_batch.num_computed_tokens_cpu[: len(num_scheduled_tokens)]
        common_prefix_len = min(common_prefix_len, int(num_computed_tokens.min()))
        common_prefix_len = common_prefix_len // block_size * block_size
        use_sliding_window = isinstance(kv_cache_spec, SlidingWindowSpec) or (
            isinstance(kv_cache_spec, FullAttentionSpec) and kv_cache_spec.sliding_window is not None
        )
        use_cascade = self.attn_metadata_builder.use_cascade_attention(
            common_prefix_len=common_prefix_len,
            query_lens=num_scheduled_tokens,
            num_query_heads=self.num_query_heads,
            num_kv_heads=kv_cache_spec.num_kv_heads,
            use_alibi=False,  # nano_v1's models have none of these variants
            use_sliding_window=use_sliding_window,
            use_local_attention=False,
            num_sms=self.num_sms,
        )
        return common_prefix_len if use_cascade else 0

    def _calc_spec_decode_metadata(self, scheduler_output: SchedulerOutput) -> SpecDecodeMetadata:
        """Which logits rows verify which drafts (`calc_spec_decode_metadata`), for this step's batch."""
        input_batch = self.input_batch
        num_draft_tokens = np.zeros(input_batch.num_reqs, dtype=np.int64)
        for req_id, spec_token_ids in scheduler_output.scheduled_spec_decode_tokens.items():
            num_draft_tokens[input_batch.req_id_to_index[req_id]] = len(spec_token_ids)
        cu_num_scheduled_tokens = self.query_start_loc.np[1 : input_batch.num_reqs + 1].astype(np.int64)
        return calc_spec_decode_metadata(
            num_draft_tokens, cu_num_scheduled_tokens, self.input_ids.np, self.device
        )

    def _execute_mm_encoder(self, scheduler_output: SchedulerOutput) -> None:
        """Encode this step's scheduled images, in one batch, into `self.encoder_cache` (chapter 11).

        The scheduler never schedules one mm_hash twice in a step, and a request preempted
        after its images were scheduled is still in `self.requests`: the encoder cache
        counts its images.
        """
        mm_hashes: list[str] = []
        pixel_values: list[torch.Tensor] = []
        for req_id, input_ids in scheduler_output.scheduled_encoder_inputs.items():
            mm_features = self.requests[req_id].mm_features
            for input_id in input_ids:
                mm_hashes.append(mm_features[input_id].identifier)
                pixel_values.append(mm_features[input_id].data["pixel_values"])
        if not mm_hashes:
            return
        batch = torch.stack(pixel_values).to(self.device, self.dtype)  # [num_images, 3, H, W]
        # [num_images, num_image_tokens, hidden_size]
        encoder_outputs = self.model.get_multimodal_embeddings(batch)
        for mm_hash, output in zip(mm_hashes, encoder_outputs):
            self.encoder_cache[mm_hash] = output

    def _gather_mm_embeddings(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The encoder output rows for exactly this step's image positions, and where they go.

        Returns the rows, one `[n, hidden_size]` piece per (request, image) in flat-batch
        order, and `is_mm_embed`, a `[num_tokens]` bool mask of the flat batch that is true
        at those positions (the same count, in the same order); None in a step without
        image positions (most steps: every decode). E.g. a chunk of positions 100..611
        over an image at 100..675 takes rows 0..511 of its output; the next chunk takes
        rows 512..575, from the cache.
        """
        total_num_tokens = scheduler_output.total_num_scheduled_tokens
        is_mm_embed = np.zeros(total_num_tokens, dtype=bool)
        mm_embeds: list[torch.Tensor] = []
        for req_index, req_id in enumerate(self.input_batch.req_ids):
            req_state = self.requests[req_id]
            num_computed_tokens = req_state.num_computed_tokens
            num_scheduled_tokens = scheduler_output.num_scheduled_tokens[req_id]
            for mm_feature in req_state.mm_features:
                start_pos, num_encoder_tokens = mm_feature.mm_position.offset, mm_feature.mm_position.length
                if start_pos >= num_computed_tokens + num_scheduled_tokens:
                    break  # this image and every later one lie beyond the chunk
                if start_pos + num_encoder_tokens <= num_computed_tokens:
                    continue  # in the KV cache already
                # Rows [start_idx, end_idx) of the image's output fall in this chunk.
                start_idx = max(num_computed_tokens - start_pos, 0)
                end_idx = min(num_computed_tokens + num_scheduled_tokens - start_pos, num_encoder_tokens)
                encoder_output = self.encoder_cache.get(mm_feature.identifier)
                assert encoder_output is not None, f"no encoder output for {mm_feature.identifier} ({req_id})"
                mm_embeds.append(encoder_output[start_idx:end_idx])
                flat_start = self.query_start_loc.np[req_index] + start_pos + start_idx - num_computed_tokens
                is_mm_embed[flat_start : flat_start + end_idx - start_idx] = True
        if not mm_embeds:
            return [], None
        return mm_embeds, torch.from_numpy(is_mm_embed).to(self.device)

    def _model_inputs(self, num_tokens: int) -> tuple[torch.Tensor | None, ...]:
        """The forward pass's arguments for the first `num_tokens` rows of the step buffers:
        `(input_ids, positions)`, or for a multimodal model `(None, positions, inputs_embeds)`.

        Always slices of the same persistent buffers, so that a compiled graph and its CUDA
        graphs see the same shapes and addresses at every step (chapter 08).
        """
        positions = self.positions.gpu[:num_tokens]
        if self.supports_mm_inputs:
            return None, positions, self.inputs_embeds[:num_tokens]
        return self.input_ids.gpu[:num_tokens], positions

    def _sample(
        self,
        logits: torch.Tensor,
        spec_decode_metadata: SpecDecodeMetadata | None,
        discard_req_indices: np.ndarray,
    ) -> SamplerOutput:
        """One token per request; with drafts, the rejection sampler's verdict on them too.

        The plain sampler always runs on one row per request (the bonus rows when there
        are drafts); the rejection sampler then keeps a prefix of each request's drafts
        and decides what follows it.
        """
        sampling_metadata = self.input_batch.sampling_metadata_for_step(discard_req_indices)
        bonus_logits = (
            logits if spec_decode_metadata is None else logits[spec_decode_metadata.bonus_logits_indices]
        )
        sampler_output = self.sampler(bonus_logits, sampling_metadata)
        if spec_decode_metadata is not None:
            sampler_output.sampled_token_ids = self.rejection_sampler(
                spec_decode_metadata,
                logits[spec_decode_metadata.target_logits_indices],
                sampler_output.sampled_token_ids,
                sampling_metadata,
            )
        return sampler_output

    def _bookkeeping_sync(
        self, sampler_output: SamplerOutput, discard_req_indices: np.ndarray
    ) -> ModelRunnerOutput:
        """Keep each row's tokens (unless discarded) in the persistent batch and its state.

        A row keeps one token, or with drafts 1 .. k + 1: a prefix of its sampled row,
        placeholders after it. vLLM's takes the scheduler output, logits and hidden states
        too, for outputs nano_v1 does not produce, and returns the output's parts.

        With async scheduling nothing waits for the device: each kept row gets a placeholder
        (-1) for its one token (speculative decoding is refused then), in the batch, in its
        state and in the output, and the tokens stay on the device as `prev_sampled_token_ids`
        for the next step's input. The next step writes them over the placeholders on the
        host (`_fill_sampled_token_placeholders`), and the output gets them in `get_output`.
        """
        input_batch = self.input_batch
        req_ids = input_batch.req_ids
        if self.use_async_scheduling:
            assert sampler_output.sampled_token_ids.shape[1] == 1, "one token per row with async scheduling"
            sampled_np = np.full((len(req_ids), 1), PLACEHOLDER_TOKEN_ID)
            num_sampled = np.ones(len(req_ids), dtype=np.int64)
        else:
            # The step's one device -> host synchronisation.
            sampled_np = sampler_output.sampled_token_ids.cpu().numpy()  # [num_reqs, 1 + max_spec_len]
            num_sampled = (sampled_np != PLACEHOLDER_TOKEN_ID).sum(axis=1)
        num_sampled[discard_req_indices] = 0
        sampled_token_ids: list[list[int]] = [
            row[:n] for row, n in zip(sampled_np.tolist(), num_sampled.tolist())
        ]
        # One scatter for the whole batch: row r's tokens go after its num_tokens[r] known ones.
        rows = np.repeat(np.arange(len(req_ids)), num_sampled)
        offsets = segment_arange(num_sampled)
        positions = input_batch.num_tokens[rows] + offsets
        assert (positions < self.max_model_len).all(), "the scheduler let a request outgrow max_model_len"
        input_batch.token_ids_cpu[rows, positions] = sampled_np[rows, offsets]
        input_batch.num_tokens[: len(req_ids)] += num_sampled.astype(np.int32)
        kept = num_sampled > 0
        kept_rows = np.flatnonzero(kept).tolist()
        for i in kept_rows:
            self.requests[req_ids[i]].output_token_ids.extend(sampled_token_ids[i])
        if self.use_async_scheduling:
            input_batch.prev_sampled_token_ids = sampler_output.sampled_token_ids
            input_batch.prev_req_id_to_index = {req_ids[i]: i for i in kept_rows}
        logprobs = None
        if sampler_output.logprobs_tensors is not None:
            num_logprobs = input_batch.num_logprobs
            logprobs = sampler_output.logprobs_tensors.tolists(
                [num_logprobs.get(req_id) if k else None for req_id, k in zip(req_ids, kept.tolist())]
            )
        return ModelRunnerOutput(
            req_ids=list(req_ids),
            req_id_to_index=dict(input_batch.req_id_to_index),
            sampled_token_ids=sampled_token_ids,
            logprobs=logprobs,
        )

    def _get_prompt_logprobs_dict(
        self, hidden_states: torch.Tensor, num_scheduled_tokens: dict[str, int]
    ) -> dict[str, LogprobsTensors | None]:
        """The prompt logprobs of the requests whose prefill completed this step, whole.

        Position i's logits predict prompt token i + 1, so a chunk of positions
        [start, start + n) yields the logprobs of tokens start + 1 .. start + n, computed
        here from the chunk's hidden states (a logits row per prompt token: the cost of the
        feature) and copied into the request's host tensors for the whole prompt
        (`in_progress_prompt_logprobs_cpu`). They are returned once the chunk reaching the
        last prompt token has run, the step that samples the first output token; a chunk
        ending one short of it has nothing left to compute but waits for that step.
        """
        num_prompt_logprobs_dict = self.input_batch.num_prompt_logprobs
        if not num_prompt_logprobs_dict:
            return {}
        in_progress_dict = self.input_batch.in_progress_prompt_logprobs_cpu
        prompt_logprobs_dict: dict[str, LogprobsTensors | None] = {}
        completed_prefill_reqs: list[str] = []
        for req_id, num_prompt_logprobs in num_prompt_logprobs_dict.items():
            num_tokens = num_scheduled_tokens[req_id]  # every batch member is scheduled
            request = self.requests[req_id]
            num_prompt_tokens = len(request.prompt_token_ids)
            logprobs_tensors = in_progress_dict.get(req_id)
            if logprobs_tensors is None:
                logprobs_tensors = LogprobsTensors.empty_cpu(num_prompt_tokens - 1, num_prompt_logprobs + 1)
                in_progress_dict[req_id] = logprobs_tensors
            start_idx = request.num_computed_tokens
            start_tok = start_idx + 1
            num_remaining_tokens = num_prompt_tokens - start_tok
            if num_tokens <= num_remaining_tokens:
                num_logits = num_tokens  # more prompt follows (or, at ==, only the last token)
            else:
                num_logits = num_remaining_tokens  # the last chunk
                completed_prefill_reqs.append(req_id)
                prompt_logprobs_dict[req_id] = logprobs_tensors
            if num_logits <= 0:
                continue  # the previous chunk computed them all
            offset = int(self.query_start_loc.np[self.input_batch.req_id_to_index[req_id]])
            logits = self.model.compute_logits(hidden_states[offset : offset + num_logits])
            tgt_token_ids = torch.tensor(
                request.prompt_token_ids[start_tok : start_tok + num_logits], device=self.device
            )
            logprobs = self.sampler.compute_logprobs(logits)
            chunk = self.sampler.gather_logprobs(logprobs, num_prompt_logprobs, tgt_token_ids)
            chunk_slice = slice(start_idx, start_idx + num_logits)
            logprobs_tensors.logprob_token_ids[chunk_slice].copy_(chunk.logprob_token_ids)
            logprobs_tensors.logprobs[chunk_slice].copy_(chunk.logprobs)
            logprobs_tensors.selected_token_ranks[chunk_slice].copy_(chunk.selected_token_ranks)
        for req_id in completed_prefill_reqs:
            del num_prompt_logprobs_dict[req_id]
            del in_progress_dict[req_id]
        return prompt_logprobs_dict

    @contextmanager
    def synchronize_input_prep(self) -> Iterator[None]:
        """Around the host's writes into the pinned step buffers, with async scheduling on CUDA:
        wait until the last step's copies out of them are done, and mark this step's.

        Without it a step could overwrite input ids, positions or block tables that the
        step before still has to copy to the device. Elsewhere nothing waits: on the CPU the
        copies are done when they return, and a synchronous step waits for its tokens.
        """
        if self.prepare_inputs_event is None:
            yield
            return
        self.prepare_inputs_event.synchronize()
        try:
            yield
        finally:
            self.prepare_inputs_event.record()

    @torch.inference_mode()
    def execute_model(
        self, scheduler_output: SchedulerOutput
    ) -> ModelRunnerOutput | AsyncGPUModelRunnerOutput:
        """One step: update the persistent batch, prepare inputs, run the model, sample, keep the tokens.

        With async scheduling it returns before the sampled tokens reach the host: an
        `AsyncGPUModelRunnerOutput`, whose `get_output` waits for them.
        """
        with self.synchronize_input_prep():
            self._update_states(scheduler_output)
            if scheduler_output.total_num_scheduled_tokens == 0:
                # A step that only reported finished requests, or only has KV transfers to drive.
                if not has_kv_transfer_group():
                    return EMPTY_MODEL_RUNNER_OUTPUT
                return self.kv_connector_no_forward(scheduler_output)
            common_attn_metadata, logits_indices, discard_req_indices = self._prepare_inputs(scheduler_output)
            spec_decode_metadata = None
            if scheduler_output.scheduled_spec_decode_tokens:
                spec_decode_metadata = self._calc_spec_decode_metadata(scheduler_output)
                logits_indices = spec_decode_metadata.logits_indices

            first = common_attn_metadata[0]  # the batch's shape is every group's
            num_tokens, num_reqs = first.num_actual_tokens, first.num_reqs
            if self.supports_mm_inputs:
                self._execute_mm_encoder(scheduler_output)
                mm_embeds, is_mm_embed = self._gather_mm_embeddings(scheduler_output)
                self.inputs_embeds[:num_tokens] = self.model.get_input_embeddings(
                    self.input_ids.gpu[:num_tokens], mm_embeds, is_mm_embed
                )
            uniform_decode = first.max_query_len == 1 and num_tokens == num_reqs
            cudagraph_runtime_mode, batch_descriptor = self.cudagraph_dispatcher.dispatch(
                num_tokens, uniform_decode
            )
            num_input_tokens = batch_descriptor.num_tokens if batch_descriptor is not None else num_tokens
            num_common_prefix_blocks = scheduler_output.num_common_prefix_blocks
            if cudagraph_runtime_mode == CUDAGraphMode.FULL:
                # The FULL graph captured plain attention, so a graphed step never cascades.
                common_attn_metadata = self._pad_for_full_graph(num_reqs, num_input_tokens, first.max_seq_len)
                num_common_prefix_blocks = None
            attn_metadata = self._build_attention_metadata(common_attn_metadata, num_common_prefix_blocks)

        with (
            set_forward_context(attn_metadata, self.attn_layers, cudagraph_runtime_mode, batch_descriptor),
            self.maybe_get_kv_connector_output(scheduler_output) as kv_connector_output,
        ):
            # With a KV connector (chapter 16): its loads start before the forward, each
            # attention layer waits for its own and saves its KV, and the saves are done
            # before the block exits.
            hidden_states = self.model(*self._model_inputs(num_input_tokens))
        logits = self.model.compute_logits(hidden_states[logits_indices])  # [num_reqs + num_drafts, vocab]
        if scheduler_output.grammar_bitmask is not None:
            # Structured outputs (chapter 15): forbidden tokens' logits to -inf, before any sampling.
            apply_grammar_bitmask(scheduler_output, self.input_batch, logits, self.device)
        if self.use_async_scheduling:
            # The sampler may read output tokens (bad words): the last step's must be real. Waiting
            # for them now costs the device nothing, as this step is queued behind that one.
            self._fill_sampled_token_placeholders()
        sampler_output = self._sample(logits, spec_decode_metadata, discard_req_indices)
        output = self._bookkeeping_sync(sampler_output, discard_req_indices)
        output.prompt_logprobs_dict = self._get_prompt_logprobs_dict(
            hidden_states[:num_tokens], scheduler_output.num_scheduled_tokens
        )
        output.kv_connector_output = kv_connector_output
        if self.drafter is not None:
            self._draft_token_ids = self.propose_draft_token_ids(output.sampled_token_ids)
        if not self.use_async_scheduling:
            return output
        self._prev_async_output = AsyncGPUModelRunnerOutput(
            output,
            sampler_output.sampled_token_ids,
            discard_req_indices.tolist(),
            self.async_output_copy_stream,
        )
        return self._prev_async_output

    def _fill_sampled_token_placeholders(self) -> None:
        """Write the last step's sampled tokens over their placeholders on the host (async scheduling).

        Waits for that step's copy to the host. Afterwards the host holds every token, in each
        request's state and in the batch's token table, so nothing needs the device's copy any
        more. A request finished since has no state left; a new request that took a finished
        one's id has no placeholder.
        """
        prev_output = self._prev_async_output
        if prev_output is None:
            return
        input_batch = self.input_batch
        sampled = prev_output._host_sampled_token_ids()[:, 0].tolist()
        for req_id, prev_req_index in input_batch.prev_req_id_to_index.items():
            req_state = self.requests.get(req_id)
            if req_state is None or req_state.output_token_ids[-1:] != [PLACEHOLDER_TOKEN_ID]:
                continue
            token = sampled[prev_req_index]
            req_state.output_token_ids[-1] = token
            req_index = input_batch.req_id_to_index.get(req_id)
            if req_index is not None:
                input_batch.token_ids_cpu[req_index, req_state.num_tokens - 1] = token
        self._prev_async_output = None
        input_batch.prev_sampled_token_ids = None
        input_batch.prev_req_id_to_index = None

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """Hand the drafts of the last step to the scheduler (once)."""
        if self._draft_token_ids is None:
            return None
        draft_token_ids = DraftTokenIds(list(self.input_batch.req_ids), self._draft_token_ids)
        self._draft_token_ids = None
        return draft_token_ids

    def propose_draft_token_ids(self, sampled_token_ids: list[list[int]]) -> list[list[int]]:
        """Next step's drafts, per row, from the tokens now in the persistent batch.

        Requests that want logprobs, or min_tokens, get none: their drafts would need
        per-position logprobs and stop masks (vLLM excludes similar settings, see
        vllm/v1/spec_decode/utils.py).
        """
        input_batch = self.input_batch
        return self.drafter.propose(
            sampled_token_ids,
            input_batch.req_ids,
            input_batch.num_tokens,
            input_batch.token_ids_cpu,
            input_batch.spec_decode_unsupported_reqs,
        )

    def load_model(self) -> None:
        self.model = get_model(self.vllm_config, self.device)
        self.attn_layers = {m.layer_name: m for m in self.model.modules() if isinstance(m, Attention)}
        if self.compilation_config.cudagraph_mode != CUDAGraphMode.NONE:
            self.graph_pool = GraphPool.create(self.device)
        if self.compilation_config.level == CompilationLevel.PIECEWISE:
            # Dynamo traces the model once and the piecewise backend splits it at attention.
            self.compile_backend = VllmBackend(
                self.compilation_config, self.graph_pool, self.cudagraph_wrapper_cls
            )
            num_tokens = min(self.max_num_tokens, 16)
            support_torch_compile(
                self.model, self.compile_backend, self._model_inputs(num_tokens), self.attn_layers
            )
        if self.compilation_config.cudagraph_mode.has_full_cudagraphs():
            # The whole forward pass, attention included, as one graph per size.
            self.model = self.cudagraph_wrapper_cls(self.model, CUDAGraphMode.FULL, self.graph_pool)

    def _dummy_run(
        self, num_tokens: int, cudagraph_runtime_mode: CUDAGraphMode, uniform_decode: bool = False
    ) -> torch.Tensor:
        """A forward pass over `num_tokens` dummy tokens, capturing a graph if the mode says so.

        A mixed batch has no attention metadata: attention (eager under PIECEWISE) attends
        within the batch and touches no cache. A uniform decode batch, the FULL graph's,
        has real metadata in the persistent buffers, here all padding requests, because
        a FULL graph captures attention too.
        """
        attn_metadata = None
        if uniform_decode:
            attn_metadata = self._build_attention_metadata(self._pad_for_full_graph(0, num_tokens, 1), None)
        batch_descriptor = BatchDescriptor(num_tokens, uniform_decode)
        with set_forward_context(attn_metadata, self.attn_layers, cudagraph_runtime_mode, batch_descriptor):
            return self.model(*self._model_inputs(num_tokens))

    def _dummy_sampler_run(self, hidden_states: torch.Tensor) -> None:
        """Logits and a sample with top-k and top-p for `max_num_seqs` rows (times 1 + k with k
        speculative tokens), the sampler's worst case (a sort)."""
        # Logits rows: one per request, and with speculative decoding one per draft too (chapter 10).
        num_reqs = min(self.max_num_reqs * (1 + (self.drafter.k if self.drafter else 0)), len(hidden_states))
        logits = self.model.compute_logits(hidden_states[:num_reqs])
        vocab_size = logits.shape[-1]
        self.sampler(
            logits,
            SamplingMetadata(
                temperature=torch.ones(num_reqs, device=self.device),
                all_greedy=False,
                all_random=True,
                top_p=torch.full((num_reqs,), 0.9, device=self.device),
                top_k=torch.full((num_reqs,), vocab_size, dtype=torch.int32, device=self.device),
                generators={},
                max_num_logprobs=None,
            ),
        )

    @torch.inference_mode()
    def profile_run(self) -> None:
        """Run the largest step the scheduler can send, without a KV cache, to measure peak memory.

        A forward over `max_num_batched_tokens` tokens (attention metadata None: the
        layers attend within the batch and write no cache), then the sampler's worst case.
        """
        hidden_states = self._dummy_run(self.max_num_tokens, CUDAGraphMode.NONE)
        self._dummy_sampler_run(hidden_states)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def capture_model(self) -> None:
        """Capture every CUDA graph the dispatcher has a key for, at start-up, into one memory pool.

        Each size runs once without graphs first, so that lazy work (cuBLAS workspaces,
        Triton compiles) is done before a capture, where it would be illegal.
        """
        keys = self.cudagraph_dispatcher.get_capture_descriptors()
        if not keys:
            return
        from tqdm import tqdm

        on_cuda = self.device.type == "cuda"
        free_before = torch.cuda.mem_get_info(self.device)[0] if on_cuda else 0
        start = time.perf_counter()
        for runtime_mode, key in tqdm(keys, desc="Capturing CUDA graphs", disable=not on_cuda):
            self._dummy_run(key.num_tokens, CUDAGraphMode.NONE, key.uniform_decode)  # warm-up
            self._dummy_run(key.num_tokens, runtime_mode, key.uniform_decode)
        if on_cuda:
            torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0] if on_cuda else 0
        sizes = sorted({key.num_tokens for _, key in keys})
        logger.info(
            "captured %d CUDA graphs (%s, sizes %d..%d) in %.2f s, using %.2f GiB",
            len(keys),
            self.compilation_config.cudagraph_mode.name,
            sizes[0],
            sizes[-1],
            time.perf_counter() - start,
            used / 2**30,
        )

    def initialize_cudagraph_capture(self) -> None:
        """Give up FULL graphs if the attention backend cannot be captured, then fix the graph keys.

        The reference plans every step on the host, which a graph cannot replay
        (`AttentionCGSupport.NEVER`); its steps then run PIECEWISE, or without graphs when
        nothing is compiled: vLLM's fallback for a FULL decode graph.
        """
        config = self.compilation_config
        mode = config.cudagraph_mode
        if (
            mode.has_full_cudagraphs()
            and self.attn_metadata_builder.cudagraph_support == AttentionCGSupport.NEVER
        ):
            fallback = (
                CUDAGraphMode.PIECEWISE if config.level == CompilationLevel.PIECEWISE else CUDAGraphMode.NONE
            )
            logger.warning(
                "cudagraph_mode=%s needs an attention backend a CUDA graph can capture, and %s cannot be: "
                "using %s",
                mode.name,
                self.attn_backend.get_name(),
                fallback.name,
            )
            config.cudagraph_mode = mode = fallback
        self.cudagraph_dispatcher.initialize_cudagraph_keys(mode)

    def _make_input_batch(self, block_sizes: list[int]) -> InputBatch:
        """The persistent batch, with one block table per KV cache group of these block sizes."""
        return InputBatch(
            max_num_reqs=self.max_num_reqs,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_tokens,
            device=self.device,
            pin_memory=self.pin_memory,
            vocab_size=self.model_config.get_vocab_size(),
            block_sizes=block_sizes,
            logitsprocs=build_logitsprocs(
                self.vllm_config, self.device, self.pin_memory, self.model_config.logits_processors or ()
            ),
        )

    def may_reinitialize_input_batch(self, kv_cache_config: KVCacheConfig) -> None:
        """A persistent batch with one block table per group, if there is more than one group."""
        block_sizes = [group.kv_cache_spec.block_size for group in kv_cache_config.kv_cache_groups]
        if block_sizes != [self.block_size]:
            assert not self.requests, "the persistent batch is rebuilt before any request arrives"
            # The old batch's per-vocab tables go back to the allocator first, for the new
            # batch's to reuse: the memory profile counted one batch, not two.
            del self.input_batch
            self.input_batch = self._make_input_batch(block_sizes)

    def _allocate_kv_cache_tensors(self, kv_cache_config: KVCacheConfig) -> dict[str, torch.Tensor]:
        """One zeroed byte buffer per `KVCacheTensor`, under the name of every layer that shares it.

        Zeros, not empty: a never-written slot must not hold NaNs that a masked attention
        weight of 0 could still turn into NaN (0 * NaN). Layers of different groups may
        share a buffer: the block pool never gives one block to two groups (chapter 12).
        """
        kv_cache_raw_tensors: dict[str, torch.Tensor] = {}
        for kv_cache_tensor in kv_cache_config.kv_cache_tensors:
            tensor = torch.zeros(kv_cache_tensor.size, dtype=torch.int8, device=self.device)
            for layer_name in kv_cache_tensor.shared_by:
                kv_cache_raw_tensors[layer_name] = tensor
        return kv_cache_raw_tensors

    def _reshape_kv_cache_tensors(
        self, kv_cache_config: KVCacheConfig, kv_cache_raw_tensors: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Each layer's byte buffer seen in its group's format: the backend's `get_kv_cache_shape`
        (`[2, num_blocks, block_size, num_kv_heads, head_size]`) of the group's dtype."""
        kv_caches: dict[str, torch.Tensor] = {}
        for group in kv_cache_config.kv_cache_groups:
            spec = group.kv_cache_spec
            for layer_name in group.layer_names:
                raw = kv_cache_raw_tensors[layer_name]
                num_blocks = raw.numel() // spec.page_size_bytes
                shape = self.attn_backend.get_kv_cache_shape(
                    num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size
                )
                kv_caches[layer_name] = raw.view(spec.dtype).view(shape)
        return kv_caches

    def initialize_kv_cache_tensors(self, kv_cache_config: KVCacheConfig) -> dict[str, torch.Tensor]:
        """The layers' KV caches: raw zeroed buffers, viewed in each group's format, bound to the layers."""
        kv_cache_raw_tensors = self._allocate_kv_cache_tensors(kv_cache_config)
        kv_caches = self._reshape_kv_cache_tensors(kv_cache_config, kv_cache_raw_tensors)
        bind_kv_cache(kv_caches, self.attn_layers)
        return kv_caches

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Take the KV cache groups, allocate the tensors, and bind each layer its view."""
        self.kv_cache_config = kv_cache_config
        self.may_reinitialize_input_batch(kv_cache_config)
        kv_caches = self.initialize_kv_cache_tensors(kv_cache_config)
        if has_kv_transfer_group():
            get_kv_transfer_group().register_kv_caches(kv_caches)

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        """Each attention layer's KV cache format (chapter 12): a sliding window if the layer
        has one, else full attention."""
        assert self.attn_layers, "load_model() first: the specs are the model's attention layers'"
        kv_cache_spec: dict[str, KVCacheSpec] = {}
        for layer_name, layer in self.attn_layers.items():
            if layer.sliding_window is not None:
                kv_cache_spec[layer_name] = SlidingWindowSpec(
                    self.block_size, layer.num_kv_heads, layer.head_size, self.dtype, layer.sliding_window
                )
            else:
                kv_cache_spec[layer_name] = FullAttentionSpec(
                    self.block_size, layer.num_kv_heads, layer.head_size, self.dtype
                )
        return kv_cache_spec
