"""`/tokenize` and `/detokenize`: the token ids the engine would run a prompt as, and back to text.

Mirrors vllm/entrypoints/openai/serving_tokenization.py (`OpenAIServingTokenization`,
`create_tokenize`, `create_detokenize`) (chapter 09).

Why it exists: a client that budgets tokens (or debugs a chat template) needs the ids
exactly as the engine will see them: the same `Processor.tokenize`, and for messages the
same chat prompt as `/v1/chat/completions` (`OpenAIServing._preprocess_chat`), both in the
tokenizer thread.

What differs from v0.11.0: detokenizing rejects an id outside the vocabulary with a 400
naming it; there is no `/tokenizer_info`.
"""

from __future__ import annotations

from http import HTTPStatus

from fastapi.responses import JSONResponse

from nano_v1.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from nano_v1.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    async def create_tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> JSONResponse:
        """The token ids the engine would run a prompt (or the chat-templated messages) as."""
        if (error := self._check_model(request.model)) is not None:
            return error
        engine = self.engine_client

        def encode() -> list[int]:
            if isinstance(request, TokenizeChatRequest):
                return engine.processor.tokenize(self._preprocess_chat(request.messages))[1]
            return engine.processor.tokenize(request.prompt)[1]

        try:
            token_ids = await engine.run_in_tokenizer_thread(encode)
        except ValueError as e:
            return self.create_error_response(HTTPStatus.BAD_REQUEST, str(e))
        token_strs = engine.tokenizer.convert_ids_to_tokens(token_ids) if request.return_token_strs else None
        response = TokenizeResponse(
            count=len(token_ids),
            max_model_len=engine.vllm_config.model_config.max_model_len,
            tokens=token_ids,
            token_strs=token_strs,
        )
        return JSONResponse(response.model_dump())

    async def create_detokenize(self, request: DetokenizeRequest) -> JSONResponse:
        if (error := self._check_model(request.model)) is not None:
            return error
        engine = self.engine_client
        if engine.tokenizer is None:
            return self.create_error_response(HTTPStatus.BAD_REQUEST, "this model has no tokenizer", "tokens")
        vocab_size = engine.processor.vocab_size

        def decode() -> str:
            """The text; ValueError naming the first id outside the vocabulary."""
            bad = next((t for t in request.tokens if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise ValueError(f"token id {bad} is out of vocabulary (vocab_size={vocab_size})")
            return engine.tokenizer.decode(request.tokens)

        # In the tokenizer thread, the check too: for millions of ids it takes a while.
        try:
            text = await engine.run_in_tokenizer_thread(decode)
        except ValueError as e:
            return self.create_error_response(HTTPStatus.BAD_REQUEST, str(e), "tokens")
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())
