"""msgpack encoding of the messages between the frontend and the engine-core process.

Mirrors vllm/v1/serial_utils.py (chapter 09).

Why msgpack through msgspec, not pickle: every step sends one `EngineCoreOutputs` and
every request one `EngineCoreRequest`, so serialization sits on the hot path of both
processes. msgspec encodes a dataclass straight from its fields and decodes into the
declared type (nested dataclasses, enums, sets included) several times faster than
pickle, and a decoder bound to a type can only ever build that type. vLLM also sends
tensors as side buffers without copying; our messages hold only token ids, so we don't.
"""

from __future__ import annotations

from typing import Any

import msgspec


class MsgpackEncoder:
    """Encode any message (dataclasses, lists, dicts, enums) to msgpack bytes."""

    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder()

    def encode(self, obj: Any) -> bytes:
        return self.encoder.encode(obj)


class MsgpackDecoder:
    """Decode msgpack bytes into `t` (checked against its type hints), or into plain values."""

    def __init__(self, t: Any = Any) -> None:
        self.decoder = msgspec.msgpack.Decoder(t)

    def decode(self, data: bytes | memoryview) -> Any:
        return self.decoder.decode(data)
