"""Optimizer and engine state as one safetensors file: the nested structure in the header, the
tensors as one byte stream after it.

Why not ``torch.save``: its zip container is parsed record by record on load (~0.3 GB/s cold here,
a third of the disk), and it is a pickle. This file is read with large sequential ``pread``s straight
into the tensors (``tensor_reads``) — disk speed — and decoding it executes nothing. It is a
valid safetensors file (``safetensors.torch.load_file`` reads its tensors; the structure is JSON in
``__metadata__["nexrl_structure"]``).

The structure holds dicts (any int/str/float/bool keys), lists, tuples, tensors, and plain scalars
(int, float, str, bool, None); anything else is refused at save time, naming where it sits.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch

from nexrl_hpc.checkpoint.tensor_reads import (
    DTYPES,
    TensorEntry,
    TensorFileError,
    read_header,
    read_tensors,
)
from nexrl_hpc.checkpoint.tensor_writes import write_tensor_file

STRUCTURE_KEY = "nexrl_structure"


class StateFileError(TensorFileError):
    """A state file that cannot be read back (names the file and what is wrong)."""


def _encode(value: Any, tensors: list[torch.Tensor], where: str) -> Any:
    """JSON for ``value``; tensors are replaced by their index in ``tensors``."""
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
            raise TypeError(f"{where}: {type(value).__name__} (a local tensor is needed)")
        if value.dtype not in DTYPES:
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


def save_state_file(state: Any, path: str) -> tuple[str, int]:
    """Write ``state`` to ``path``; returns the file's (xxh3-128, size), hashed as it was written
    (no fsync: the checkpoint's writer fsyncs what it wrote)."""
    tensors: list[torch.Tensor] = []
    structure = _encode(state, tensors, "state")
    return write_tensor_file(
        path, [(f"t{i}", t) for i, t in enumerate(tensors)], {STRUCTURE_KEY: json.dumps(structure)}
    )


def _live_targets(node: Any, live: Any, found: dict[str, torch.Tensor]) -> None:
    """The tensors of ``live`` that sit where the file's structure has tensor ``t<i>``."""
    if not isinstance(node, dict) or live is None:
        return
    if "t" in node:
        if isinstance(live, torch.Tensor):
            found[f"t{node['t']}"] = live
    elif "d" in node and isinstance(live, dict):
        for k, v in node["d"]:
            _live_targets(v, live.get(k), found)
    elif ("l" in node or "u" in node) and isinstance(live, (list, tuple)):
        for v, w in zip(node["l"] if "l" in node else node["u"], live, strict=False):
            _live_targets(v, w, found)


def _open_structure(fd: int, path: str) -> tuple[list[TensorEntry], Any]:
    try:
        entries, metadata = read_header(fd, path)
        return entries, json.loads(metadata[STRUCTURE_KEY])
    except TensorFileError as exc:
        raise StateFileError(str(exc)) from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise StateFileError(f"{path}: not a nexrl state file ({type(exc).__name__}: {exc})") from exc


def _decoded(path: str, structure: Any, tensors: dict[str, Any], count: int) -> Any:
    values: list[Any] = [None] * count
    try:
        for name, t in tensors.items():
            values[int(name[1:])] = t
        return _decode(structure, values)
    except (KeyError, ValueError, IndexError, TypeError) as exc:
        raise StateFileError(f"{path}: inconsistent header ({type(exc).__name__}: {exc})") from exc


def peek_state_file(path: str) -> Any:
    """The structure of a state file with every tensor as its ``TensorEntry`` (dtype, shape, file
    range) and no tensor bytes read: to check a file before loading it over live state."""
    fd = os.open(path, os.O_RDONLY)
    try:
        entries, structure = _open_structure(fd, path)
    finally:
        os.close(fd)
    return _decoded(path, structure, {e.name: e for e in entries}, len(entries))


def load_state_file(path: str, into: Any = None) -> Any:
    """Read a file written by ``save_state_file`` (CPU tensors).

    ``into``: a structure like the saved one (say, the optimizer state the trainer holds now); each
    of its tensors that matches the file's tensor at the same place in dtype and shape receives the
    bytes in place and is returned in the result (no new memory); the others are read into new
    tensors. A read that fails after a live tensor was written raises ``PartialLoadError``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        entries, structure = _open_structure(fd, path)
        live: dict[str, torch.Tensor] = {}
        _live_targets(structure, into, live)
        read = read_tensors(fd, path, entries, live)
    finally:
        os.close(fd)
    return _decoded(path, structure, read, len(entries))
