"""Incremental detokenization: text deltas from a growing list of token ids.

Mirrors vllm/v1/engine/detokenizer.py (chapter 09).

Why incremental: decoding the whole output every step costs O(length) per token. We
decode only a small window: the tokens since the last emitted text (`read_offset`),
plus a few before it (`prefix_offset`) so that byte-level BPE merges and spaces come
out right. If the window ends inside a multi-byte character, the decoder yields the
replacement character U+FFFD; we then emit nothing and wait for the next token.

`spaces_between_special_tokens=False` (with special tokens kept) is v0.11.0's rule for the
fast tokenizers nano_v1 loads: an added token that follows another added token is emitted
as its bare text, without the space some decoders (WordPiece, say) put between tokens.
A request with `detokenize=False` gets a detokenizer without a tokenizer: no text.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Added token id -> its text, when adjacent ones are to be glued; else None.
        self.added_tokens: dict[int, str] | None = None
        if tokenizer is not None and not (skip_special_tokens or spaces_between_special_tokens):
            self.added_tokens = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()} or None
        self.last_added = False  # whether the last output token is an added token
        self.token_ids: list[int] = list(prompt_token_ids)
        # Start the window a few prompt tokens back so the first output token decodes in context.
        self.read_offset = len(self.token_ids)
        self.prefix_offset = max(self.read_offset - 5, 0)
        self.output_text = ""

    def update(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the newly decodable text (possibly empty)."""
        if self.tokenizer is None:
            return ""
        delta = ""
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            delta += self._decode_next()
        self.output_text += delta
        return delta

    def _decode_next(self) -> str:
        if self.added_tokens is not None:
            added_text = self.added_tokens.get(self.token_ids[-1])
            glue = added_text is not None and self.last_added and self.read_offset == len(self.token_ids) - 1
            self.last_added = added_text is not None
            if glue:
                # The window keeps it, so the next token decodes with the space the decoder puts after it.
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.token_ids)
                return added_text
        decode = self.tokenizer.decode
        prefix_text = decode(
            self.token_ids[self.prefix_offset : self.read_offset], skip_special_tokens=self.skip_special_tokens
        )
        new_text = decode(self.token_ids[self.prefix_offset :], skip_special_tokens=self.skip_special_tokens)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # an incomplete character (or a token that prints nothing): wait
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return new_text[len(prefix_text) :]


def find_stop_string(text: str, new_char_count: int, stop: list[str]) -> tuple[str, int] | None:
    """Find the earliest stop string that ends within the last `new_char_count` characters.

    Returns (stop string, index where it starts) or None. Only the tail can hold a new
    match, so the search starts just far enough back to catch one that straddles steps.
    """
    best: tuple[str, int] | None = None
    for s in stop:
        start = max(len(text) - new_char_count - len(s) + 1, 0)
        idx = text.find(s, start)
        if idx != -1 and (best is None or idx < best[1]):
            best = (s, idx)
    return best
