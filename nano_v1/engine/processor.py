"""Input processing: turn a user prompt and its sampling parameters into an `EngineCoreRequest`.

Mirrors vllm/v1/engine/processor.py (chapters 01, 11 and 15).

Why here: this is the boundary where user input enters the engine, so every check that
can fail because of the user happens here, before anything is queued. A bad prompt is
rejected with a `ValueError` that names the problem, and no other request is touched.
A multimodal model's prompt may carry images (`{"prompt": ..., "multi_modal_data":
{"image": ...}}`); the model's processor checks them and expands their placeholders
here too (chapter 11), so the engine core receives nothing it could fail on. A
structured-output request's schema, regex or grammar is converted by xgrammar here
(chapter 15), so that one that cannot be built never reaches the scheduler.

What differs from v0.11.0: `truncate_prompt_tokens` is checked and applied here, in one
place; v0.11.0 checks it in `LLM` and `AsyncLLM` (`_validate_truncation_size` in
vllm/entrypoints/utils.py) and cuts the prompt in its input preprocessor
(`InputPreprocessor._truncate_inputs` in vllm/inputs/preprocess.py, or the tokenizer's
left truncation for a text).
"""

from __future__ import annotations

import copy
import time
from typing import Any

from nano_v1.config import ModelConfig, VllmConfig
from nano_v1.engine import EngineCoreRequest
from nano_v1.multimodal import MULTIMODAL_REGISTRY
from nano_v1.multimodal.inputs import MultiModalFeatureSpec
from nano_v1.sampling_params import SamplingParams

# A prompt is a string, or a dict with "prompt_token_ids" (or "prompt") and, for a
# multimodal model, "multi_modal_data", as in vLLM.
PromptType = str | dict[str, Any]

# The most top logprobs a request may ask for per token: vLLM's default `ModelConfig.max_logprobs`.
MAX_LOGPROBS = 20


def load_tokenizer(model_config: ModelConfig):
    """The checkpoint's Hugging Face tokenizer, or None if the directory has none."""
    from pathlib import Path

    path = Path(model_config.tokenizer)
    if not ((path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists()):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def max_prompt_chars(tokenizer, max_model_len: int) -> int:
    """The longest text that could still fit in `max_model_len` tokens: longer is rejected untokenized.

    Every token stands for at most `longest` characters of the text it was cut from: its
    vocabulary string spells it with one character per byte (byte-level BPE) or per
    character (SentencePiece), and a character is at least one byte. Normalizers can
    shorten a text before it is cut, but only by composing characters (NFC, NFKC: at most
    4 code points into one), hence the factor 4. So a longer text has more than
    `max_model_len` tokens, and tokenizing it (seconds, for megabytes) would be wasted.
    """
    longest = max(map(len, tokenizer.get_vocab()))
    return 4 * longest * max_model_len


def _generation_eos_ids(model_config: ModelConfig) -> set[int]:
    """EOS ids that generation_config.json adds on top of the tokenizer's (as HF generate uses)."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_config.model).eos_token_id
    except OSError:
        eos = model_config.hf_text_config.eos_token_id
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)


class Processor:
    def __init__(self, vllm_config: VllmConfig, tokenizer) -> None:
        model_config = self.model_config = vllm_config.model_config
        self.tokenizer = tokenizer
        self.vocab_size = model_config.get_vocab_size()
        self.generation_eos_ids = _generation_eos_ids(model_config)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_id = tokenizer.eos_token_id
        else:
            self.eos_token_id = min(self.generation_eos_ids) if self.generation_eos_ids else None
        max_model_len = model_config.max_model_len
        self.max_prompt_chars = None if tokenizer is None else max_prompt_chars(tokenizer, max_model_len)
        # Multimodal models only: the model's processor, and the largest image the engine
        # core could ever schedule (its encoder budget and cache, in image tokens).
        self.mm_processor = None
        if MULTIMODAL_REGISTRY.supports_multimodal_inputs(model_config):
            self.mm_processor = MULTIMODAL_REGISTRY.create_processor(model_config)
        scheduler_config = vllm_config.scheduler_config
        self.max_num_encoder_input_tokens = scheduler_config.max_num_encoder_input_tokens
        self.encoder_cache_size = scheduler_config.encoder_cache_size
        self.async_scheduling = scheduler_config.async_scheduling

    def tokenize(self, prompt: PromptType, truncating: bool = False) -> tuple[str | None, list[int]]:
        """Return (prompt text or None, prompt token ids), validating their form.

        `truncating`: only the last tokens will be kept, so a text too long to fit is not refused.
        """
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                token_ids = prompt["prompt_token_ids"]
                if not isinstance(token_ids, (list, tuple)) or not all(isinstance(t, int) for t in token_ids):
                    raise ValueError("prompt_token_ids must be a list of integers.")
                return prompt.get("prompt"), list(token_ids)
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}.")
        if not isinstance(prompt, str):
            raise ValueError(f"a prompt must be a string or a dict, got {type(prompt).__name__}.")
        if self.tokenizer is None:
            raise ValueError(
                f"model {self.model_config.model!r} has no tokenizer; pass {{'prompt_token_ids': [...]}} instead of text."
            )
        self._validate_text(prompt, check_length=not truncating)
        return prompt, self.tokenizer.encode(prompt, add_special_tokens=False) if prompt else []

    def _validate_text(self, text: str, what: str = "the prompt", check_length: bool = True) -> None:
        """Reject text that cannot be tokenized, or that is certain not to fit, before tokenizing it."""
        if check_length and len(text) > self.max_prompt_chars:
            raise ValueError(
                f"{what} has {len(text)} characters, more than can fit in max_model_len="
                f"{self.model_config.max_model_len} tokens with this tokenizer "
                f"(at most {self.max_prompt_chars} characters)."
            )
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate, e.g. "\ud800" in JSON
            raise ValueError(
                f"{what} is not valid Unicode text: {text[e.start : e.end]!r} at character {e.start} "
                "is half of a UTF-16 surrogate pair."
            ) from None

    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> tuple[str | None, EngineCoreRequest]:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}.")
        self._validate_logprobs(params)
        truncate = self._truncation_size(params.truncate_prompt_tokens)
        prompt_text, token_ids = self.tokenize(prompt, truncating=truncate is not None)
        if truncate is not None:
            token_ids = token_ids[-truncate:]  # left truncation: the prompt's end is what the model continues
        token_ids, mm_features = self._process_multimodal(prompt, token_ids)
        self._validate_prompt(token_ids)
        max_model_len = self.model_config.max_model_len
        params = copy.copy(params)  # the engine fills in per-request fields
        self._validate_sampling_params(params)
        self._validate_structured_output(params)
        room = max_model_len - len(token_ids)
        params.max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        params.all_stop_token_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            # EOS counts as a stop token too (for `min_tokens`, which must hold all of them back).
            params.all_stop_token_ids |= self.generation_eos_ids
            if self.eos_token_id is not None:
                params.all_stop_token_ids.add(self.eos_token_id)
        return prompt_text, EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            priority=priority,
            mm_features=mm_features,
        )

    def _truncation_size(self, truncate_prompt_tokens: int | None) -> int | None:
        """How many of the prompt's last tokens to keep (-1: `max_model_len`), or None for all of them.

        As v0.11.0, before the prompt reaches the engine: on the token ids, before images expand
        their placeholders, so what the scheduler and the prefix cache see is the kept part only.
        """
        if truncate_prompt_tokens is None:
            return None
        max_model_len = self.model_config.max_model_len
        if truncate_prompt_tokens == -1:
            return max_model_len
        if truncate_prompt_tokens > max_model_len:
            raise ValueError(
                f"truncate_prompt_tokens value ({truncate_prompt_tokens}) is greater than max_model_len "
                f"({max_model_len}). Please, select a smaller truncation size."
            )
        return truncate_prompt_tokens

    def _process_multimodal(
        self, prompt: PromptType, token_ids: list[int]
    ) -> tuple[list[int], list[MultiModalFeatureSpec] | None]:
        """Expand the prompt's image placeholders and check every image can be scheduled.

        Returns the token ids unchanged and None for a text-only model. A multimodal
        model's prompt is always checked, images or not: placeholder tokens without an
        image are an error too.
        """
        mm_data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if self.mm_processor is None:
            if mm_data is not None:
                raise ValueError(f"model {self.model_config.model!r} is not multimodal; it takes no multi_modal_data.")
            return token_ids, None
        token_ids, mm_features = self.mm_processor.apply(token_ids, {} if mm_data is None else mm_data)
        limit = min(self.max_num_encoder_input_tokens, self.encoder_cache_size)
        for i, feature in enumerate(mm_features):
            if feature.mm_position.length > limit:
                raise ValueError(
                    f"{feature.modality} {i} takes {feature.mm_position.length} tokens, more than the encoder can "
                    f"ever hold (max_num_encoder_input_tokens={self.max_num_encoder_input_tokens}, "
                    f"encoder_cache_size={self.encoder_cache_size}): raise them."
                )
        return token_ids, mm_features or None

    def _validate_logprobs(self, params: SamplingParams) -> None:
        """At most `MAX_LOGPROBS` top logprobs per sampled token and per prompt token (-1: the vocabulary)."""
        if params.logprobs is not None and params.logprobs > MAX_LOGPROBS:
            raise ValueError(
                f"Requested sample logprobs of {params.logprobs}, which is greater than max allowed: "
                f"{MAX_LOGPROBS}."
            )
        if params.prompt_logprobs is not None:
            num_prompt_logprobs = self.vocab_size if params.prompt_logprobs == -1 else params.prompt_logprobs
            if num_prompt_logprobs > MAX_LOGPROBS:
                raise ValueError(
                    f"Requested prompt logprobs of {num_prompt_logprobs}, which is greater than max allowed: "
                    f"{MAX_LOGPROBS}."
                )

    def _validate_sampling_params(self, params: SamplingParams) -> None:
        """Check every token id the params name is in the vocabulary; tokenize `bad_words` into `params`."""
        self._validate_token_ids("logit_bias", list(params.logit_bias or ()))
        self._validate_token_ids("allowed_token_ids", params.allowed_token_ids or [])
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError(
                    f"model {self.model_config.model!r} has no tokenizer, so bad_words cannot be tokenized."
                )
            for word in params.bad_words:
                self._validate_text(word, what=f"bad word {word[:20]!r}")
            params.update_from_tokenizer(self.tokenizer)
            self._validate_token_ids("bad_words", [t for ids in params.bad_words_token_ids for t in ids])

    def _validate_structured_output(self, params: SamplingParams) -> None:
        """Check that xgrammar can build the request's grammar (chapter 15), on a copy of its
        `structured_outputs`: the check rewrites a choice (and whitespace options) as a grammar."""
        if params.structured_outputs is None:
            return
        if self.tokenizer is None:
            raise ValueError(
                f"model {self.model_config.model!r} has no tokenizer: structured outputs need one to map the "
                "grammar onto tokens."
            )
        if self.async_scheduling:
            # The bitmask of step N + 1 would be built before step N's token reaches the matcher.
            raise ValueError("structured outputs are not supported with async scheduling in this release.")
        from nano_v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

        params.structured_outputs = copy.copy(params.structured_outputs)
        validate_xgrammar_grammar(params)

    def _validate_token_ids(self, name: str, token_ids: list[int]) -> None:
        invalid = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if invalid:
            raise ValueError(
                f"{name} has out-of-vocabulary token ids {invalid}: every id must be in [0, {self.vocab_size})."
            )

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty: it must contain at least one token.")
        max_model_len = self.model_config.max_model_len
        if len(token_ids) >= max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, which leaves no room for output within "
                f"max_model_len={max_model_len}; shorten the prompt or raise max_model_len."
            )
        low, high = min(token_ids), max(token_ids)
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"token id {bad} is out of vocabulary (vocab_size={self.vocab_size}).")
