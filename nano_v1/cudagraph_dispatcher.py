"""Which CUDA graph a step replays, and how far its token count is padded.

Mirrors vllm/v1/cudagraph_dispatcher.py (`CudagraphDispatcher`) (chapter 08).

Why it exists: the runner captures graphs at start-up for a fixed set of keys (a padded
token count, and whether the batch is all one-token decodes); at run time every step must
map to one of those keys or run without graphs. The dispatcher holds that set of keys, the
only source of truth for what was captured, and answers both questions: what to capture
(`get_capture_descriptors`) and what this step replays (`dispatch`). The graph wrappers
then trust the key they find in the forward context.
"""

from __future__ import annotations

from nano_v1.config import CUDAGraphMode, VllmConfig
from nano_v1.forward_context import BatchDescriptor


class CudagraphDispatcher:
    def __init__(self, vllm_config: VllmConfig) -> None:
        self.compilation_config = vllm_config.compilation_config
        self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        self.cudagraph_keys: dict[CUDAGraphMode, set[BatchDescriptor]] = {
            CUDAGraphMode.PIECEWISE: set(),
            CUDAGraphMode.FULL: set(),
        }

    def initialize_cudagraph_keys(self, cudagraph_mode: CUDAGraphMode) -> None:
        """The keys to capture under `cudagraph_mode`, once the attention backend has been checked.

        PIECEWISE graphs serve any batch up to each capture size. FULL graphs serve pure
        decode batches, so only sizes up to max_num_seqs (one token per request) get one.
        """
        sizes = self.compilation_config.cudagraph_capture_sizes
        if cudagraph_mode.mixed_mode() == CUDAGraphMode.PIECEWISE:
            self.cudagraph_keys[CUDAGraphMode.PIECEWISE] = {BatchDescriptor(size) for size in sizes}
        if cudagraph_mode.has_full_cudagraphs():
            self.cudagraph_keys[CUDAGraphMode.FULL] = {
                BatchDescriptor(size, uniform_decode=True) for size in sizes if size <= self.max_num_seqs
            }

    def get_capture_descriptors(self) -> list[tuple[CUDAGraphMode, BatchDescriptor]]:
        """Every key to capture, PIECEWISE then FULL, each largest first (vLLM's order:
        the largest graph sizes the shared memory pool, and the smaller ones fit inside it)."""
        return [
            (mode, key)
            for mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL)
            for key in sorted(self.cudagraph_keys[mode], key=lambda k: k.num_tokens, reverse=True)
        ]

    def dispatch(self, num_tokens: int, uniform_decode: bool) -> tuple[CUDAGraphMode, BatchDescriptor | None]:
        """The graph this step replays and its key; (NONE, None) to run without graphs, unpadded.

        The step is padded up to the next capture size; a pure decode batch prefers its
        FULL graph and falls back to the PIECEWISE graph of the same size (vLLM also lets a
        uniform batch take a more general graph).
        """
        config = self.compilation_config
        if not 0 < num_tokens <= config.max_capture_size:
            return CUDAGraphMode.NONE, None
        num_padded = config.pad_for_cudagraph(num_tokens)
        if uniform_decode and BatchDescriptor(num_padded, True) in self.cudagraph_keys[CUDAGraphMode.FULL]:
            return CUDAGraphMode.FULL, BatchDescriptor(num_padded, True)
        if BatchDescriptor(num_padded) in self.cudagraph_keys[CUDAGraphMode.PIECEWISE]:
            return CUDAGraphMode.PIECEWISE, BatchDescriptor(num_padded)
        return CUDAGraphMode.NONE, None
