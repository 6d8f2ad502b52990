"""Encode call arguments and results for the wire: msgpack structure + raw buffers. No pickle.

Tensors and numpy arrays travel as separate frames (their bytes, with dtype and shape in the
header); ``Batch``, tuples, exceptions, enums and module handles have explicit markers. Anything
else that msgpack cannot represent is refused at encode time with the offending type named.
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
from nexrl_hpc.types import Batch, NexRLRole

MARK = "__nx__"
_ENUMS: dict[str, type[enum.Enum]] = {"ErrorSeverity": ErrorSeverity, "NexRLRole": NexRLRole}
_TORCH_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool,
)}  # fmt: skip


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


class Encoder:
    def __init__(self) -> None:
        self.buffers: list[memoryview] = []

    def _default(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().to("cpu").contiguous()
            if t.dtype == torch.bfloat16:
                raw = t.view(torch.int16).numpy()
            else:
                raw = t.numpy()
            self.buffers.append(memoryview(raw).cast("B") if raw.size else memoryview(b""))
            return {
                MARK: "tensor",
                "i": len(self.buffers) - 1,
                "d": str(t.dtype).removeprefix("torch."),
                "s": list(t.shape),
            }
        if isinstance(obj, np.ndarray):
            a = np.ascontiguousarray(obj)
            if a.dtype == object:
                raise TypeError("numpy object arrays cannot be sent")
            self.buffers.append(memoryview(a).cast("B") if a.size else memoryview(b""))
            return {MARK: "ndarray", "i": len(self.buffers) - 1, "d": a.dtype.str, "s": list(a.shape)}
        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, tuple):
            return {MARK: "tuple", "v": list(obj)}
        if isinstance(obj, Batch):
            return {MARK: "batch", "v": obj.values, "m": obj.metadata}
        if isinstance(obj, BaseException):
            return encode_exception(obj)
        if isinstance(obj, enum.Enum) and type(obj).__name__ in _ENUMS:
            return {MARK: "enum", "c": type(obj).__name__, "v": obj.value}
        if isinstance(obj, HandleRef):
            return {MARK: "handle", "n": obj.name}
        if isinstance(obj, (set, frozenset)):
            return {MARK: "set", "v": list(obj)}
        ref = getattr(obj, "__nexrl_handle_ref__", None)
        if ref is not None:
            return {MARK: "handle", "n": ref()}
        raise TypeError(f"cannot send a {type(obj).__module__}.{type(obj).__qualname__} over the wire")

    def encode(self, obj: Any) -> bytes:
        return msgpack.packb(obj, default=self._default, use_bin_type=True, strict_types=True)


def encode_exception(exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, RemoteError):
        return {
            MARK: "exc",
            "t": exc.type_name,
            "m": str(exc.args[0]),
            "tb": exc.remote_traceback,
            "o": exc.origin,
        }
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {MARK: "exc", "t": type(exc).__name__, "m": str(exc), "tb": tb, "o": ""}


def encode(obj: Any) -> tuple[bytes, list[memoryview]]:
    """(msgpack header, raw buffers) for ``obj``."""
    enc = Encoder()
    return enc.encode(obj), enc.buffers


def decode(header: bytes, buffers: list[Any], resolve_handle: Any = None) -> Any:
    """Inverse of ``encode``; ``resolve_handle(name)`` maps module references to local handles."""

    def hook(d: dict[str, Any]) -> Any:
        kind = d.get(MARK)
        if kind is None:
            return d
        if kind == "tensor":
            dtype = _TORCH_DTYPES[d["d"]]
            buf = buffers[d["i"]]
            shape = tuple(d["s"])
            if dtype == torch.bfloat16:
                arr = np.frombuffer(buf, dtype=np.int16).reshape(shape)
                return torch.from_numpy(arr.copy()).view(torch.bfloat16)
            np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
            arr = np.frombuffer(buf, dtype=np_dtype).reshape(shape)
            return torch.from_numpy(arr.copy())
        if kind == "ndarray":
            return np.frombuffer(buffers[d["i"]], dtype=np.dtype(d["d"])).reshape(tuple(d["s"])).copy()
        if kind == "tuple":
            return tuple(d["v"])
        if kind == "set":
            return set(d["v"])
        if kind == "batch":
            return Batch(values=d["v"], metadata=d["m"])
        if kind == "exc":
            return RemoteError(d["t"], d["m"], d["tb"], d.get("o", ""))
        if kind == "enum":
            return _ENUMS[d["c"]](d["v"])
        if kind == "handle":
            return resolve_handle(d["n"]) if resolve_handle is not None else HandleRef(d["n"])
        raise ValueError(f"unknown wire marker {kind!r}")

    return msgpack.unpackb(header, object_hook=hook, raw=False, strict_map_key=False, use_list=True)
