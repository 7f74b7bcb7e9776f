"""Images from the wire: a chat message's `image_url`, decoded without touching the network.

Mirrors vllm/multimodal/utils.py (`fetch_image`) (chapter 11).

Why it exists: the OpenAI API passes images as URLs. vLLM fetches http(s) and file URLs
too; nano_v1 serves offline and must never reach out on a client's behalf, so it takes
only `data:` URLs (the image's bytes inline, base64) and says so when given anything else.
"""

from __future__ import annotations

import base64
import binascii
import io

from PIL import Image


def fetch_image(image_url: str) -> Image.Image:
    """The RGB image of a `data:<media type>;base64,<data>` URL; a ValueError naming the problem otherwise."""
    if not image_url.startswith("data:"):
        raise ValueError(
            "nano_v1 never fetches images: image_url must be a data: URL (data:image/png;base64,...), "
            f"got {image_url[:40]!r}."
        )
    header, comma, data = image_url.removeprefix("data:").partition(",")
    if not comma or not header.endswith(";base64"):
        raise ValueError("image_url must be a base64 data URL: data:<media type>;base64,<data>.")
    try:
        raw = base64.b64decode(data, validate=True)
    except binascii.Error as e:
        raise ValueError(f"image_url's data is not valid base64: {e}.") from None
    try:
        image = Image.open(io.BytesIO(raw))
        image.load()
    except (OSError, Image.DecompressionBombError) as e:
        raise ValueError(f"image_url's data cannot be decoded as an image: {e}") from None
    return image.convert("RGB")
