"""Tensors into a safetensors-layout file, hashed as they are written (the reverse of ``tensor_reads``).

Why not ``safetensors.save_file``: the checkpoint needs each file's digest (``digest``), and hashing
the bytes on their way out costs a thread running beside the writes (``os.write`` releases the GIL)
where reading the file back would cost a second pass over the disk. The data starts on a page
boundary (spaces are valid JSON padding): cold reads from an unaligned offset are much slower (the
checkpoint bench, bench/README.md). Widest elements first: every tensor then starts aligned to its element
size (the format forbids gaps), so a reader can view it in place.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import torch

from nexrl_hpc.checkpoint.digest import StreamDigest
from nexrl_hpc.checkpoint.tensor_reads import CHUNK, DTYPES, PAGE


def writable(tensors: list[tuple[str, torch.Tensor]]) -> bool:
    """Whether every dtype has a code here (others go through safetensors' own writer)."""
    return all(t.dtype in DTYPES for _, t in tensors)


def write_tensor_file(
    path: str, tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str], hashed: bool = True
) -> tuple[str, int]:
    """Write ``tensors`` (name, tensor) with ``metadata`` to ``path``; returns (xxh3-128, size).

    ``hashed=False`` returns "" for the digest: a weight-sync export is read once and replaced, and
    its digest thread (started per file, one hand-off per tensor) was half of a small model's
    export. No fsync: the checkpoint's writer fsyncs what it wrote."""
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i][1].element_size())
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for i in order:
        name, t = tensors[i]
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % PAGE)
    digest = StreamDigest() if hashed else None
    size = 0
    with open(path, "wb", buffering=0) as f:
        size += _write(f, digest, memoryview(struct.pack("<Q", len(raw)) + raw))
        for i in order:
            data = tensors[i][1].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            # numpy's stubs give ndarray the buffer protocol on Python >= 3.12 only
            view = memoryview(data)  # type: ignore[arg-type]
            for lo in range(0, len(view), CHUNK):
                size += _write(f, digest, view[lo : lo + CHUNK])
    return (digest.hexdigest() if digest is not None else ""), size


def _write(f: Any, digest: StreamDigest | None, part: memoryview) -> int:
    if digest is not None:
        digest.update(part)  # hashed on its thread while this one is in the write
    done = 0
    while done < len(part):
        done += f.write(part[done:])
    return done
