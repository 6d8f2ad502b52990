"""Encode call arguments and results for the wire: msgpack structure + raw buffers. No pickle.

Plain data (dicts, lists, str, numbers, bytes, None) is msgpack and decodes at C speed. Everything
else is a msgpack extension type: tensors and numpy arrays (their bytes travel as separate frames,
dtype and shape in the extension), tuples, sets, ``Batch``, exceptions, enums, module references.
Anything msgpack cannot represent is refused at encode time with the offending type named.
"""

from __future__ import annotations

import enum
import traceback
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

from nexrl_hpc.core.errors import ErrorSeverity
from nexrl_hpc.types import Batch, NexRLRole, PutStatus, RolloutServiceStatus

_ENUMS: dict[str, type[enum.Enum]] = {
    cls.__name__: cls for cls in (ErrorSeverity, NexRLRole, PutStatus, RolloutServiceStatus)
}
_TORCH_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
TENSOR, NDARRAY, TUPLE, SET, BATCH, EXC, ENUM, HANDLE = range(1, 9)


class RemoteError(Exception):
    """An exception raised on another rank, re-raised here with its type name and traceback."""

    def __init__(self, type_name: str, message: str, remote_traceback: str = "", origin: str = ""):
        super().__init__(message)
        self.type_name = type_name
        self.remote_traceback = remote_traceback
        self.origin = origin

    def __str__(self) -> str:
        where = f" (on {self.origin})" if self.origin else ""
        return f"{self.type_name}: {self.args[0]}{where}"


@dataclass(frozen=True)
class HandleRef:
    """A module reference sent to another rank; the receiver turns it into its own handle."""

    name: str


def exception_fields(exc: BaseException) -> list[str]:
    if isinstance(exc, RemoteError):
        return [exc.type_name, str(exc.args[0]), exc.remote_traceback, exc.origin]
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return [type(exc).__name__, str(exc), tb, ""]


class Encoder:
    def __init__(self) -> None:
        self.buffers: list[memoryview] = []

    def _pack(self, obj: Any) -> bytes:
        return msgpack.packb(obj, default=self._default, use_bin_type=True, strict_types=True)

    def _default(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().to("cpu").contiguous()
            raw = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
            self.buffers.append(memoryview(raw).cast("B") if raw.size else memoryview(b""))  # type: ignore[arg-type]
            return msgpack.ExtType(
                TENSOR,
                self._pack([len(self.buffers) - 1, str(t.dtype).removeprefix("torch."), list(t.shape)]),
            )
        if isinstance(obj, np.ndarray):
            a = np.ascontiguousarray(obj)
            if a.dtype == object:
                raise TypeError("numpy object arrays cannot be sent")
            self.buffers.append(memoryview(a).cast("B") if a.size else memoryview(b""))  # type: ignore[arg-type]
            return msgpack.ExtType(NDARRAY, self._pack([len(self.buffers) - 1, a.dtype.str, list(a.shape)]))
        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, tuple):
            return msgpack.ExtType(TUPLE, self._pack(list(obj)))
        if isinstance(obj, (set, frozenset)):
            return msgpack.ExtType(SET, self._pack(list(obj)))
        if isinstance(obj, Batch):
            return msgpack.ExtType(BATCH, self._pack([obj.values, obj.metadata]))
        if isinstance(obj, BaseException):
            return msgpack.ExtType(EXC, self._pack(exception_fields(obj)))
        if isinstance(obj, enum.Enum) and type(obj).__name__ in _ENUMS:
            return msgpack.ExtType(ENUM, self._pack([type(obj).__name__, obj.value]))
        if isinstance(obj, HandleRef):
            return msgpack.ExtType(HANDLE, obj.name.encode())
        ref = getattr(obj, "__nexrl_handle_ref__", None)
        if ref is not None:
            return msgpack.ExtType(HANDLE, ref().encode())
        raise TypeError(f"cannot send a {type(obj).__module__}.{type(obj).__qualname__} over the wire")


def encode(obj: Any) -> tuple[bytes, list[memoryview]]:
    """(msgpack bytes, raw buffers) for ``obj``."""
    enc = Encoder()
    return enc._pack(obj), enc.buffers


def encode_exception(exc: BaseException) -> RemoteError:
    """What a failed call sends back: the exception's type name, message and traceback."""
    return RemoteError(*exception_fields(exc))


def decode(data: bytes, buffers: list[Any], resolve_handle: Any = None) -> Any:
    """Inverse of ``encode``; ``resolve_handle(name)`` maps module references to local handles."""

    def unpack(raw: bytes) -> Any:
        return msgpack.unpackb(raw, ext_hook=ext, raw=False, strict_map_key=False)

    def ext(code: int, raw: bytes) -> Any:
        if code == TENSOR:
            index, dtype_name, shape = unpack(raw)
            dtype = _TORCH_DTYPES[dtype_name]
            buf = buffers[index]
            if dtype == torch.bfloat16:
                return torch.from_numpy(np.frombuffer(buf, dtype=np.int16).reshape(shape).copy()).view(
                    torch.bfloat16
                )
            np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
            return torch.from_numpy(np.frombuffer(buf, dtype=np_dtype).reshape(shape).copy())
        if code == NDARRAY:
            index, dtype_str, shape = unpack(raw)
            return np.frombuffer(buffers[index], dtype=np.dtype(dtype_str)).reshape(shape).copy()
        if code == TUPLE:
            return tuple(unpack(raw))
        if code == SET:
            return set(unpack(raw))
        if code == BATCH:
            values, metadata = unpack(raw)
            return Batch(values=values, metadata=metadata)
        if code == EXC:
            return RemoteError(*unpack(raw))
        if code == ENUM:
            cls_name, value = unpack(raw)
            return _ENUMS[cls_name](value)
        if code == HANDLE:
            name = raw.decode()
            return resolve_handle(name) if resolve_handle is not None else HandleRef(name)
        raise ValueError(f"unknown wire extension {code}")

    return unpack(data)
