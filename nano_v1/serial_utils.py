"""msgpack encoding of the messages between the frontend and the engine-core process.

Mirrors vllm/v1/serial_utils.py (chapter 09).

Why msgpack through msgspec, not pickle: every step sends one `EngineCoreOutputs` and
every request one `EngineCoreRequest`, so serialization sits on the hot path of both
processes. msgspec encodes a dataclass straight from its fields and decodes into the
declared type (nested dataclasses, enums, sets included) several times faster than
pickle, and a decoder bound to a type can only ever build that type.

Tensors (an image's pixel values, chapter 11) are not msgpack types: `enc_hook` turns one
into `(dtype, shape, raw bytes)`, and a decoder turns that back into a tensor wherever
the declared type says `torch.Tensor`. vLLM sends large tensors as separate zero-copy
frames beside the message; ours travel inside it, one copy each way.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch


def _encode_tensor(obj: Any) -> Any:
    if not isinstance(obj, torch.Tensor):
        raise NotImplementedError(f"cannot encode a {type(obj).__name__} as msgpack.")
    tensor = obj.detach().cpu().contiguous()
    # Any dtype as bytes: numpy has no bfloat16, so go through uint8.
    return (str(tensor.dtype).removeprefix("torch."), list(tensor.shape), tensor.view(torch.uint8).numpy().tobytes())


def _decode_tensor(t: type, obj: Any) -> Any:
    if t is not torch.Tensor:
        raise NotImplementedError(f"cannot decode a {t!r} from msgpack.")
    dtype, shape, data = obj
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)


class MsgpackEncoder:
    """Encode any message (dataclasses, lists, dicts, enums, tensors) to msgpack bytes."""

    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder(enc_hook=_encode_tensor)

    def encode(self, obj: Any) -> bytes:
        return self.encoder.encode(obj)


class MsgpackDecoder:
    """Decode msgpack bytes into `t` (checked against its type hints), or into plain values."""

    def __init__(self, t: Any = Any) -> None:
        self.decoder = msgspec.msgpack.Decoder(t, dec_hook=_decode_tensor)

    def decode(self, data: bytes | memoryview) -> Any:
        return self.decoder.decode(data)
