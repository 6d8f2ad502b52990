"""Tensors out of safetensors-layout files by large sequential ``pread``s, straight into the tensors
a resumed trainer already holds (its parameters, its optimizer state) when the caller names them.

Why in place: memory the process has not touched yet costs a page fault per 4 KiB on first write
(the checkpoint bench in bench/README.md), which a load into fresh buffers pays and
``dd`` does not; reading into the live tensors pays only the disk. Tensors with no live counterpart
are read into new memory, with a second thread faulting their pages in ahead of the reads.

Nothing here executes what it reads: the header is JSON, checked against the file's size before a
byte of tensor data is read.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from dataclasses import dataclass

import torch

PAGE = 4096
CHUNK = 16 << 20  # pread size: large sequential I/O, the fastest in bench/README.md's reads
DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
BY_NAME = {v: k for k, v in DTYPES.items()}


class TensorFileError(ValueError):
    """A safetensors-layout file that cannot be read back (names the file and what is wrong)."""


class PartialLoadError(OSError):
    """A read failed after live tensors had been partly overwritten: they no longer hold what they
    held before the load, nor the file's values — load again before using them."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a file: where its bytes are (absolute file offsets) and what they are."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(fd: int, path: str) -> tuple[list[TensorEntry], dict[str, str]]:
    """The tensors (in file order) and the ``__metadata__`` of the safetensors file open as ``fd``,
    checked: known dtypes, sizes that match shapes, every range inside the file."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise TensorFileError(f"{path}: {size} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", head)
    if 8 + n > size:
        raise TensorFileError(f"{path}: header of {n} bytes runs past the end of the file ({size} bytes)")
    start = 8 + n
    try:
        header = json.loads(os.pread(fd, n, 8))
        metadata = header.pop("__metadata__", None) or {}
        entries = []
        for name, e in header.items():
            lo, hi = (int(x) for x in e["data_offsets"])
            dtype, shape = BY_NAME[e["dtype"]], tuple(int(d) for d in e["shape"])
            entries.append(TensorEntry(name, dtype, shape, start + lo, start + hi))
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise TensorFileError(f"{path}: not a safetensors header ({type(exc).__name__}: {exc})") from exc
    entries.sort(key=lambda e: e.begin)
    for e in entries:
        nbytes = math.prod(e.shape) * e.dtype.itemsize
        if e.end - e.begin != nbytes or e.begin < start or e.end > size:
            raise TensorFileError(
                f"{path}: tensor {e.name!r} ({e.dtype}, shape {list(e.shape)}) has bytes "
                f"[{e.begin}, {e.end}) in a file of {size} bytes (truncated?)"
            )
    return entries, metadata


def _takes_whole(target: torch.Tensor, entry: TensorEntry) -> bool:
    """Whether the file's bytes can go straight into ``target``'s memory."""
    return (
        type(target) in (torch.Tensor, torch.nn.Parameter)
        and target.device.type == "cpu"
        and target.dtype == entry.dtype
        and tuple(target.shape) == entry.shape
        and target.is_contiguous()
    )


def exclusive(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` without those whose memory overlaps another's (tied weights, views of one
    buffer): a load into those in place would let one file tensor overwrite another."""
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), n)
        for n, t in tensors.items()
        if t.numel()
    )
    clash: set[str] = set()
    reach, owner = -1, ""
    for lo, hi, name in spans:
        if lo < reach:
            clash.update((name, owner))
        if hi > reach:
            reach, owner = hi, name
    return {n: t for n, t in tensors.items() if n not in clash}


def read_tensors(
    fd: int, path: str, entries: list[TensorEntry], into: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Every entry's tensor, by name. ``into[name]`` receives the bytes in place when it is a plain
    contiguous CPU tensor of the same dtype and shape whose memory no other target overlaps; every
    other tensor is new. Reads follow file order, ``CHUNK`` at a time.

    Raises ``PartialLoadError`` when a read fails after a target was written."""
    by_name = {e.name: e for e in entries if e.end > e.begin}
    targets = exclusive(
        {n: t.detach() for n, t in (into or {}).items() if n in by_name and _takes_whole(t, by_name[n])}
    )
    out: dict[str, torch.Tensor] = {}
    plan: list[tuple[int, memoryview, torch.Tensor | None]] = []  # file offset, destination, fresh
    for e in entries:
        dest = targets.get(e.name)
        if dest is None:
            dest = torch.empty(e.shape, dtype=e.dtype)
        out[e.name] = dest
        if e.end == e.begin:
            continue
        flat = dest.reshape(-1).view(torch.uint8)
        # numpy's stubs give ndarray the buffer protocol on Python >= 3.12 only
        view = memoryview(flat.numpy())  # type: ignore[arg-type]
        for lo in range(0, e.end - e.begin, CHUNK):
            hi = min(lo + CHUNK, e.end - e.begin)
            plan.append((e.begin + lo, view[lo:hi], None if e.name in targets else flat[lo:hi]))
    _run_plan(fd, path, plan)
    return out


def _run_plan(fd: int, path: str, plan: list[tuple[int, memoryview, torch.Tensor | None]]) -> None:
    """Each (file offset, destination, fresh tensor or None for a live target) in order; a thread
    faults the fresh destinations' pages in ahead of their reads."""
    fresh = [(i, t) for i, (_, _, t) in enumerate(plan) if t is not None]
    faulted = {i: threading.Event() for i, _ in fresh}

    def fault_pages() -> None:  # torch releases the GIL in fill_
        for i, t in fresh:
            t[::PAGE].fill_(0)
            faulted[i].set()

    toucher = threading.Thread(target=fault_pages, name="tensor-read-prefault", daemon=True)
    if fresh:
        toucher.start()
    if plan and hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, plan[0][0], 0, os.POSIX_FADV_SEQUENTIAL)
    live_written = False
    try:
        for i, (offset, view, fresh_dest) in enumerate(plan):
            if i in faulted:
                faulted[i].wait()
            done = 0
            while done < len(view):
                try:
                    got = os.preadv(fd, [view[done:]], offset + done)
                except OSError as exc:
                    what = f"read failed at byte {offset + done}: {exc}"
                else:
                    what = f"file ended at byte {offset + done}" if got == 0 else ""
                if what:
                    if live_written:
                        raise PartialLoadError(f"{path}: {what}; the tensors loaded in place are incomplete")
                    raise TensorFileError(f"{path}: {what}")
                done += got
                live_written = live_written or fresh_dest is None
    finally:
        if fresh:
            toucher.join()
