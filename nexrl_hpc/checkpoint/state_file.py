"""Optimizer and engine state as one safetensors file: the nested structure in the header, the
tensors as one byte stream after it.

Why not ``torch.save``: its zip container is parsed record by record on load (~0.3 GB/s cold here,
a third of the disk), and it is a pickle. This file is read with large sequential ``pread``s straight
into one buffer the tensors then view — disk speed — and decoding it executes nothing. It is a
valid safetensors file (``safetensors.torch.load_file`` reads its tensors; the structure is JSON in
``__metadata__["nexrl_structure"]``).

The structure holds dicts (any int/str/float/bool keys), lists, tuples, tensors, and plain scalars
(int, float, str, bool, None); anything else is refused at save time, naming where it sits.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from typing import Any

import torch

STRUCTURE_KEY = "nexrl_structure"
_PAGE = 4096
_CHUNK = 16 << 20  # pread/write size: large sequential I/O, measured fastest here (bench/README.md)
_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}  # fmt: skip
_BY_NAME = {v: k for k, v in _DTYPES.items()}


class StateFileError(ValueError):
    """A state file that cannot be read back (names the file and what is wrong)."""


def _encode(value: Any, tensors: list[torch.Tensor], where: str) -> Any:
    """JSON for ``value``; tensors are replaced by their index in ``tensors``."""
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
            raise TypeError(f"{where}: {type(value).__name__} (a local tensor is needed)")
        if value.dtype not in _DTYPES:
            raise TypeError(f"{where}: tensor dtype {value.dtype} has no safetensors code")
        tensors.append(value.detach())
        return {"t": len(tensors) - 1}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"f": repr(value)}  # inf/nan survive JSON
    if isinstance(value, dict):
        items = []
        for k, v in value.items():
            if not isinstance(k, (str, int, float, bool)) and k is not None:
                raise TypeError(f"{where}: dict key {k!r} of type {type(k).__name__}")
            items.append([k, _encode(v, tensors, f"{where}[{k!r}]")])
        return {"d": items}
    if isinstance(value, (list, tuple)):
        encoded = [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
        return {"l": encoded} if isinstance(value, list) else {"u": encoded}
    raise TypeError(f"{where}: {type(value).__name__} cannot be stored (tensors and plain values only)")


def _decode(node: Any, tensors: list[torch.Tensor]) -> Any:
    if not isinstance(node, dict):
        return node
    if "t" in node:
        return tensors[node["t"]]
    if "f" in node:
        return float(node["f"])
    if "d" in node:
        return {k: _decode(v, tensors) for k, v in node["d"]}
    if "l" in node:
        return [_decode(v, tensors) for v in node["l"]]
    return tuple(_decode(v, tensors) for v in node["u"])


def save_state_file(state: Any, path: str) -> None:
    """Write ``state`` to ``path`` (no fsync: the checkpoint's writer fsyncs what it wrote)."""
    tensors: list[torch.Tensor] = []
    structure = _encode(state, tensors, "state")
    # widest elements first: every tensor then starts aligned to its element size (the format
    # forbids gaps), so a reader can view it in place
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
    header: dict[str, Any] = {"__metadata__": {STRUCTURE_KEY: json.dumps(structure)}}
    offset = 0
    for i in order:
        t = tensors[i]
        nbytes = t.numel() * t.element_size()
        header[f"t{i}"] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    # the data starts on a page boundary (spaces are valid JSON padding): cold reads from an
    # unaligned offset ran at a third of the speed here (bench/README.md)
    raw += b" " * (-(8 + len(raw)) % _PAGE)
    with open(path, "wb", buffering=0) as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for i in order:
            data = tensors[i].cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            view = memoryview(data)
            for lo in range(0, len(view), _CHUNK):
                f.write(view[lo : lo + _CHUNK])


def _read_range(fd: int, start: int, length: int, path: str) -> torch.Tensor:
    """``length`` bytes from ``start`` into a new buffer, by sequential ``pread``s of ``_CHUNK``.

    A second thread faults the buffer's pages in one chunk ahead of the reads: a fresh page costs a
    fault (~1.3 µs here, 0.6 s per 2 GB) that would otherwise stall the copy out of the page cache
    between disk reads."""
    buffer = torch.empty(length, dtype=torch.uint8)
    view = memoryview(buffer.numpy())
    chunks = [(lo, min(lo + _CHUNK, length)) for lo in range(0, length, _CHUNK)]
    faulted = [threading.Event() for _ in chunks]

    def fault_pages() -> None:  # torch releases the GIL in fill_
        for (lo, hi), done in zip(chunks, faulted, strict=True):
            buffer[lo:hi:_PAGE].fill_(0)
            done.set()

    toucher = threading.Thread(target=fault_pages, name="state-file-prefault", daemon=True)
    toucher.start()
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, start, length, os.POSIX_FADV_SEQUENTIAL)
    try:
        for (lo, hi), done in zip(chunks, faulted, strict=True):
            done.wait()
            while lo < hi:
                got = os.preadv(fd, [view[lo:hi]], start + lo)
                if got <= 0:
                    raise StateFileError(f"{path}: read ended at byte {start + lo}")
                lo += got
    finally:
        toucher.join()
    return buffer


def load_state_file(path: str) -> Any:
    """Read a file written by ``save_state_file``: one buffer, filled by sequential reads; the
    tensors are views of it (CPU)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise StateFileError(f"{path}: {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise StateFileError(f"{path}: header of {n} bytes runs past the end of the file ({size} bytes)")
        try:
            header = json.loads(os.pread(fd, n, 8))
            structure = json.loads(header.pop("__metadata__")[STRUCTURE_KEY])
            data_len = max((int(e["data_offsets"][1]) for e in header.values()), default=0)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise StateFileError(f"{path}: not a nexrl state file ({type(exc).__name__}: {exc})") from exc
        start = 8 + n
        if start + data_len != size:
            raise StateFileError(
                f"{path}: {size} bytes, the header describes {start + data_len} (truncated?)"
            )
        buffer = _read_range(fd, start, data_len, path)
    finally:
        os.close(fd)
    tensors: list[torch.Tensor] = [torch.empty(0)] * len(header)
    try:
        for name, entry in header.items():
            lo, hi = entry["data_offsets"]
            tensors[int(name[1:])] = buffer[lo:hi].view(_BY_NAME[entry["dtype"]]).reshape(entry["shape"])
        return _decode(structure, tensors)
    except (KeyError, ValueError, IndexError, RuntimeError, TypeError) as exc:
        raise StateFileError(f"{path}: inconsistent header ({type(exc).__name__}: {exc})") from exc
