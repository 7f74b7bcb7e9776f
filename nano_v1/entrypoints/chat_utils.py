"""Chat messages with content parts (text, images) into a chat-template conversation and its images.

Mirrors vllm/entrypoints/chat_utils.py (`parse_chat_messages`) (chapter 11).

Why it exists: an OpenAI chat message's content is a string, or a list of parts such as
`{"type": "text", ...}` and `{"type": "image_url", ...}`. A tokenizer's chat template
takes text only, so each image becomes the model's placeholder string (LLaVA's
`<image>`) in its message's text, and the image itself goes on, in order, as the
prompt's `multi_modal_data`. As in vLLM, a message's placeholders come first, each on
its own line, then its text parts joined by newlines.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from PIL import Image

from nano_v1.multimodal.utils import fetch_image

if TYPE_CHECKING:
    from nano_v1.config import ModelConfig
    from nano_v1.entrypoints.openai.protocol import ChatMessage


def parse_chat_messages(
    messages: list[ChatMessage], model_config: ModelConfig, model_name: str
) -> tuple[list[dict[str, str]], list[Image.Image]]:
    """(the conversation for `apply_chat_template`, the images of every message in order).

    `model_name` is the model as the client knows it (the served name), which errors name:
    `model_config.model` may be a path on the server, which is none of the client's business.
    """
    from nano_v1.model_executor.models import resolve_model_cls

    conversation: list[dict[str, str]] = []
    images: list[Image.Image] = []
    for message in messages:
        if isinstance(message.content, str):
            conversation.append({"role": message.role, "content": message.content})
            continue
        texts, placeholders = [], []
        for part in message.content:
            if part.type == "text":
                texts.append(part.text)
                continue
            if not model_config.is_multimodal_model:
                raise ValueError(f"model {model_name!r} is not multimodal; it takes no image_url parts.")
            images.append(fetch_image(part.image_url.url))
            model_cls = resolve_model_cls(model_config.hf_config.architectures)
            placeholders.append(model_cls.get_placeholder_str("image", len(images)))
        conversation.append({"role": message.role, "content": "\n".join([*placeholders, "\n".join(texts)])})
    return conversation, images
