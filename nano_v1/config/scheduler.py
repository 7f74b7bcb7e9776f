"""The one token budget and its companions.

Mirrors vllm/config/scheduler.py (`SchedulerConfig`) (chapter 04).

vLLM's SchedulerConfig also carries a copy of `max_model_len` ("that value should be
manually duplicated here", its docstring says); nano_v1 keeps it only in `ModelConfig`,
and the scheduler reads it from there.
"""

from __future__ import annotations

from dataclasses import dataclass

from nano_v1.config.utils import check_positive_int

# The token budget when none is given (vLLM: vllm/utils/__init__.py::DEFAULT_MAX_NUM_BATCHED_TOKENS).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


@dataclass
class SchedulerConfig:
    """What one step may hold: tokens, requests, and how prompts are split."""

    max_num_batched_tokens: int | None = None
    """Token budget of one step; default: 8192, or max_model_len if larger and chunked prefill is off."""
    max_num_seqs: int = 256
    """Most requests running at once."""
    enable_chunked_prefill: bool = True
    """Split long prompts over several steps, sharing each step's budget with decodes."""
    long_prefill_token_threshold: int = 0
    """Cap on the tokens one request may take in a step; 0 means no cap beyond the budget."""
    policy: str = "fcfs"
    """Order of the waiting queue, and of preemption: fcfs or priority."""
    disable_hybrid_kv_cache_manager: bool = False
    """Give every attention layer blocks for every token, even sliding-window layers that attend to
    fewer (chapter 12)."""
    scheduler_reserve_full_isl: bool = False
    """Admit a waiting request only if the free KV blocks cover its whole prompt, not just
    its first chunk (vLLM 0.33's option, on by default there; v0.11.0 has no such gate)."""
    max_num_encoder_input_tokens: int | None = None
    """Encoder compute budget of one step, in image tokens (chapter 11); default: max_num_batched_tokens,
    or one image's tokens if more; 0 for a text-only model. vLLM v0.11.0 fixes it to that default."""
    encoder_cache_size: int | None = None
    """Image tokens of encoder output the model runner may keep (chapter 11); default: max_num_batched_tokens,
    or one image's tokens if more; 0 for a text-only model. vLLM v0.11.0 fixes it to that default."""
    disable_chunked_mm_input: bool = False
    """Never split an image's positions across steps: a chunk that would end inside an image stops before it."""
    async_scheduling: bool = False
    """Schedule step N + 1 while step N runs, so the scheduler's host time hides behind the model (chapter 14).
    Needs the multiprocess executor to overlap (the default with it); refuses speculative decoding."""

    def __post_init__(self) -> None:
        check_positive_int("max_num_seqs", self.max_num_seqs)
        for name in ("max_num_batched_tokens", "max_num_encoder_input_tokens", "encoder_cache_size"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        if not (
            isinstance(self.long_prefill_token_threshold, int) and self.long_prefill_token_threshold >= 0
        ):
            raise ValueError(
                f"long_prefill_token_threshold must be a non-negative integer, "
                f"got {self.long_prefill_token_threshold!r}."
            )
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.policy!r}.")

    def resolve(self, max_model_len: int) -> None:
        """Fill the budget's default and check it against the model's context (vLLM: __post_init__)."""
        if self.max_num_batched_tokens is None:
            # With chunked prefill a long prompt is split, so the budget can be smaller than a
            # context; without it, the whole prompt must fit into one step.
            self.max_num_batched_tokens = (
                DEFAULT_MAX_NUM_BATCHED_TOKENS
                if self.enable_chunked_prefill
                else max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len)
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                f"({max_model_len}) with chunked prefill disabled: long prompts could never be scheduled."
            )

    def resolve_encoder_budget(self, max_tokens_per_mm_item: int | None) -> None:
        """Settle the encoder budget and cache size, in image tokens (vLLM: `compute_encoder_budget`).

        `max_tokens_per_mm_item` is the most positions one image can take, None for a
        text-only model, which never has encoder inputs: both become 0. Otherwise an unset
        value becomes `max_num_batched_tokens`, raised to one image if that is larger, as
        v0.11.0 always does, so that any one image fits. An explicit value smaller than an
        image is kept: the frontend then rejects every request that has an image, and
        text-only requests still run. Call after `resolve`.
        """
        if max_tokens_per_mm_item is None:
            self.max_num_encoder_input_tokens = self.encoder_cache_size = 0
            return
        assert self.max_num_batched_tokens is not None
        if self.disable_chunked_mm_input and max_tokens_per_mm_item > self.max_num_batched_tokens:
            raise ValueError(
                f"disable_chunked_mm_input needs a whole image ({max_tokens_per_mm_item} tokens) to fit in "
                f"one step, but max_num_batched_tokens is {self.max_num_batched_tokens}: raise it."
            )
        default = max(self.max_num_batched_tokens, max_tokens_per_mm_item)
        self.max_num_encoder_input_tokens = self.max_num_encoder_input_tokens or default
        self.encoder_cache_size = self.encoder_cache_size or default
