"""The content hash of a multimodal item: the key of the encoder cache and of KV blocks.

Mirrors vllm/multimodal/hasher.py (`MultiModalHasher`) (chapter 11).

Why it exists: two requests that show the same image need its encoder output once, and
two prompts with the same text but different images must never share KV blocks. Both
need a name for an image's *content*, independent of the request, the image's position
in the prompt, or the Python object that holds it: `mm_hash`. It hashes the model's name
(another model's encoder output is another thing) and the image's mode, size and pixel
bytes. SHA-256 where vLLM uses blake3 (one dependency fewer, the same 256 bits).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from PIL import Image


class MultiModalHasher:
    @classmethod
    def serialize_item(cls, obj: object) -> Iterable[bytes]:
        """The bytes that identify `obj`: a string, or a PIL image."""
        if isinstance(obj, str):
            return (obj.encode("utf-8"),)
        if isinstance(obj, Image.Image):
            # Mode and size first: the same pixel bytes are a 2x8 image or a 4x4 one. A
            # palette image's pixels are indices, so its palette is part of its content.
            header = f"{obj.mode}:{obj.width}x{obj.height}".encode()
            return (header, obj.tobytes(), bytes(obj.getpalette() or ()))
        raise TypeError(f"cannot hash a {type(obj).__name__} as multimodal content.")

    @classmethod
    def iter_item_to_bytes(cls, key: str, obj: object) -> Iterable[bytes]:
        yield key.encode("utf-8")
        yield from cls.serialize_item(obj)

    @classmethod
    def hash_kwargs(cls, **kwargs: object) -> str:
        """Hex SHA-256 of every (name, value), each piece length-prefixed so that no two
        different inputs give the same byte stream."""
        hasher = hashlib.sha256()
        for key, value in kwargs.items():
            for piece in cls.iter_item_to_bytes(key, value):
                hasher.update(len(piece).to_bytes(8, "little"))
                hasher.update(piece)
        return hasher.hexdigest()
