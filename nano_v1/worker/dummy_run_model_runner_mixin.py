"""The model runner's dummy runs: the memory profile, the CUDA-graph captures, and FULL-graph padding.

Mirrors vllm/v1/worker/gpu_model_runner.py (`GPUModelRunner._dummy_run`,
`GPUModelRunner._dummy_sampler_run`, `GPUModelRunner.profile_run`,
`GPUModelRunner.capture_model`, `GPUModelRunner._capture_cudagraphs`) (chapters 05 and 08).

Why it exists: a dummy run is the runner running itself over a batch that serves no
request, in its own persistent buffers, so these are methods of `GPUModelRunner` under
vLLM's names; they live in a mixin of it, as v0.11.0 keeps the runner's LoRA methods in
vllm/v1/worker/lora_model_runner_mixin.py (`LoRAModelRunnerMixin`), so that the runner's
file reads as the step. They use the runner's model, sampler, `attn_layers`,
`cudagraph_dispatcher`, its step buffers (`query_start_loc`, `seq_lens`, the persistent
batch's block tables) and its `_model_inputs` and `_build_attention_metadata`.

The memory profile (`profile_run`) runs the largest step without a KV cache, so that
the worker can size the cache from the peak (chapter 05). CUDA graphs (chapter 08): with
compilation on, `load_model` has Dynamo trace the model once (the token count symbolic)
and the piecewise backend split it at attention; `capture_model` then records a CUDA
graph per key of the `CudagraphDispatcher` at start-up. Each step asks the dispatcher
which graph to replay and how far to pad, and tells the graph wrappers through the
forward context. The padding rows compute garbage that nothing reads: attention caches
and attends only the real tokens, and logits take real rows only.

What differs from v0.11.0: one capture loop over the dispatcher's keys instead of a
`_capture_cudagraphs` call per mode; no garbage-collector freeze, data-parallel padding
or micro-batches; and `_pad_for_full_graph` is nano_v1's own (vLLM pads the same buffers
in `_prepare_inputs` on every step).
"""

from __future__ import annotations

import logging
import time

import torch

from nano_v1.attention.backends.utils import AttentionCGSupport, CommonAttentionMetadata
from nano_v1.config import CompilationLevel, CUDAGraphMode
from nano_v1.forward_context import BatchDescriptor, set_forward_context
from nano_v1.sample.metadata import SamplingMetadata

logger = logging.getLogger(__name__)

# Where the padding rows of a FULL graph write their keys and values: slot 0 of block 0,
# the null block, which the block pool never hands to a request.
NULL_BLOCK_SLOT = 0


class DummyRunModelRunnerMixin:
    """`GPUModelRunner`'s runs that serve no request, and what its CUDA graphs need (see above)."""

    def _check_and_update_cudagraph_mode(self) -> None:
        """Give up FULL graphs if the attention backend cannot be captured, then fix the graph keys.

        vLLM's method of the same name. The reference plans every step on the host, which a
        graph cannot replay (`AttentionCGSupport.NEVER`); its steps then run PIECEWISE.
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
