"""The frame codec: frames over a byte stream, and tensors to and from raw bytes.

Shared by the peer's handlers and the client's connections, whatever transport carries the
stream (libp2p, the direct TCP path, in-memory pipes): it knows stream readers and writers and
torch, and nothing about sessions. Layout and limits are defined in ``protocol.py``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import torch

from p2pserve.dtypes import DTYPE_SIZES
from p2pserve.protocol import FRAME_PREFIX, FrameLimits, TensorMeta, check_prefix, encode_frame

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPE_SIZES}  # every wire dtype
_DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
_COALESCE_BYTES = 256 * 1024


def tensor_to_wire(t: torch.Tensor) -> tuple[TensorMeta, memoryview]:
    """Describe a tensor and expose its bytes without copying (after making it contiguous)."""
    t = t.detach().contiguous().cpu()
    if t.dtype not in _DTYPE_NAMES:
        raise TypeError(f"cannot send tensors of dtype {t.dtype}")
    raw: Any = t.view(torch.uint8).reshape(-1).numpy() if t.numel() else b""  # an ndarray exports its buffer
    data = memoryview(raw)
    return TensorMeta(dtype=_DTYPE_NAMES[t.dtype], shape=list(t.shape), nbytes=len(data)), data


def tensor_from_wire(meta: TensorMeta, payload: bytes | bytearray) -> torch.Tensor:
    """Rebuild a tensor from a validated TensorMeta and its payload."""
    meta.validate(len(payload))
    dtype = TORCH_DTYPES[meta.dtype]
    if not meta.nbytes:
        return torch.empty(meta.shape, dtype=dtype)
    buf = payload if isinstance(payload, bytearray) else bytearray(payload)
    return torch.frombuffer(buf, dtype=dtype).reshape(meta.shape)


def _put_frame(writer, message: msgspec.Struct, payload: bytes | memoryview) -> None:
    """Encode one frame and hand it to ``writer`` whole, in this call."""
    prefix, header, body = encode_frame(message, payload)
    if len(body) <= _COALESCE_BYTES:
        # One write per small frame: the libp2p daemon forwards each write as its own
        # message, so three small writes cost three daemon round trips' worth of latency.
        writer.write(b"".join((prefix, header, body)))
    else:
        writer.write(prefix + header)
        writer.write(body)  # large payloads are not copied


async def write_frame(writer: asyncio.StreamWriter, message: msgspec.Struct, payload: bytes | memoryview = b"") -> None:
    """Write one frame and wait until the transport accepted it."""
    _put_frame(writer, message, payload)
    await writer.drain()


def unsent_bytes(writer) -> int:
    """Bytes written to ``writer`` that its socket has not taken yet (0 where it cannot tell)."""
    own = getattr(writer, "unsent_bytes", None)
    if own is not None:
        return own()
    transport = getattr(writer, "transport", None)
    return transport.get_write_buffer_size() if transport is not None else 0


def write_frame_now(writer, message: msgspec.Struct, payload: bytes | memoryview = b"",
                    max_unsent: int = 64 << 20) -> bool:
    """Write one frame without waiting for the transport; False, and nothing written, when
    ``writer`` is closing or already holds ``max_unsent`` bytes its reader has not taken (a
    reader that stops reading cannot make the writer buffer without bound)."""
    if writer.is_closing() or unsent_bytes(writer) >= max_unsent:
        return False
    _put_frame(writer, message, payload)
    return True


async def read_frame(reader: asyncio.StreamReader, limits: FrameLimits) -> tuple[bytes, bytes]:
    """Read one frame's header and payload bytes, enforcing limits before reading the body.

    Raises asyncio.IncompleteReadError at end of stream and PayloadTooLargeError when a limit
    is exceeded (the stream is then out of sync and must be closed by the caller).
    """
    prefix = await reader.readexactly(FRAME_PREFIX.size)
    header_len, payload_len = check_prefix(prefix, limits)
    header = await reader.readexactly(header_len)
    payload = await reader.readexactly(payload_len) if payload_len else b""
    return header, payload
