"""Optimizer state saved by one trainer layout, loaded into another: resume on another shape.

The per-rank optimizer files (``trainer_io``) are keyed so that their layout can be undone without
the process group that wrote them: a single-process file holds every parameter whole (AdamW's
state keyed by the parameter's index in ``named_parameters`` order), an FSDP2 file holds each
parameter's dim-0 shard keyed by its name, and FSDP2 shards dim 0 as ``torch.chunk`` does (rank
``r`` of ``W`` holds rows ``[r*c, min((r+1)*c, n))`` with ``c = ceil(n / W)``). So a trainer of
any world size and either of these engines reads, for each of its parameters, the rows it holds
now out of whichever saved files hold them (header-addressed ``pread``s: no rank reads the whole
state), and gets bit for bit the values that were saved.

DeepSpeed ZeRO's files hold flat partitions of its parameter groups, laid out by its own
bookkeeping; they load only into the engine, stage and world size that wrote them. ``layout_problem``
is the rule both the pre-flight check and the trainer apply.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from nexrl_hpc.checkpoint.state_file import StateFileError, peek_state_file
from nexrl_hpc.checkpoint.tensor_reads import TensorEntry

RESHARDABLE_ENGINES = ("single", "fsdp")  # their files say which rows of which parameter they hold


@dataclass(frozen=True)
class SavedLayout:
    """How the optimizer files of a checkpoint were laid out (from rank 0's file header)."""

    engine: str
    world_size: int
    zero_stage: int | None  # DeepSpeed's ZeRO stage; None for the other engines


@dataclass(frozen=True)
class LiveLayout:
    """The layout a resuming run has: ``service.train_service.engine``, ``.world_size`` and
    ``.deepspeed.zero_stage``."""

    engine: str
    world_size: int
    zero_stage: int | None


def optimizer_dir(checkpoint_dir: str) -> str:
    return os.path.join(checkpoint_dir, "optimizer")


def rank_file(checkpoint_dir: str, rank: int) -> str:
    return os.path.join(optimizer_dir(checkpoint_dir), f"rank_{rank}.safetensors")


def saved_layout(checkpoint_dir: str) -> SavedLayout | None:
    """The layout rank 0's optimizer file records, from its header alone; None when the checkpoint
    has no such file (weights only, or an older ``torch.save`` file: loaded as before). ValueError
    naming the file when it is not a state file."""
    path = rank_file(checkpoint_dir, 0)
    if not os.path.exists(path):
        return None
    try:
        head = peek_state_file(path)
    except (OSError, StateFileError) as exc:
        raise ValueError(f"{path}: cannot read its header: {exc}") from exc
    engine = str(head.get("engine", "single"))
    stage = None
    if engine == "deepspeed":
        optimizer = head.get("optimizer")
        stage = int(optimizer.get("zero_stage", 0)) if isinstance(optimizer, dict) else 0
    return SavedLayout(engine, int(head.get("world_size", 1)), stage)


def layout_problem(saved: SavedLayout, live: LiveLayout) -> tuple[str, str] | None:
    """``(config key, why)`` when optimizer state of layout ``saved`` cannot be loaded by a trainer
    of layout ``live``; None when it can (the same layout, or both engines reshardable)."""
    same = saved.engine == live.engine and saved.world_size == live.world_size
    if same and saved.zero_stage == live.zero_stage:
        return None
    if saved.engine in RESHARDABLE_ENGINES and live.engine in RESHARDABLE_ENGINES:
        return None
    what = f"optimizer state of engine={saved.engine} on {saved.world_size} rank(s)"
    if saved.engine == "deepspeed":
        what += f" (ZeRO stage {saved.zero_stage})"
    options = (
        "resume with the layout that wrote it, or start a new run from its weights "
        "(model.path=<checkpoint>/model)"
    )
    if saved.engine != live.engine:
        return (
            "service.train_service.engine",
            f"{what} is not resharded into engine={live.engine}: only engines "
            f"{' and '.join(RESHARDABLE_ENGINES)} resume on another shape; {options}",
        )
    if saved.world_size != live.world_size:
        return (
            "service.train_service.world_size",
            f"{what} does not load on {live.world_size} rank(s): DeepSpeed's partitions are "
            f"resharded by no engine here; {options}",
        )
    return (
        "service.train_service.deepspeed.zero_stage",
        f"{what} does not load with zero_stage={live.zero_stage}; {options}",
    )


def dim0_rows(engine: str, rank: int, world_size: int, rows: int) -> tuple[int, int]:
    """The rows ``[lo, hi)`` of a parameter with ``rows`` rows that ``rank`` holds under ``engine``."""
    if engine != "fsdp":
        return 0, rows
    chunk = math.ceil(rows / world_size) if rows else 0
    lo = min(rank * chunk, rows)
    return lo, min(lo + chunk, rows)


@dataclass(frozen=True)
class LiveParameter:
    """One parameter of the resuming trainer: its name, whole shape and the rows this rank holds."""

    name: str
    shape: tuple[int, ...]
    lo: int
    hi: int


def saved_files(checkpoint_dir: str, saved: SavedLayout) -> list[tuple[str, Any]]:
    """Every saved rank's file with its header structure (tensors as ``TensorEntry``); ValueError
    naming a missing or unreadable file."""
    out = []
    for rank in range(saved.world_size):
        path = rank_file(checkpoint_dir, rank)
        if not os.path.exists(path):
            raise ValueError(
                f"{path}: missing (the checkpoint's optimizer state was written by {saved.world_size} "
                "rank(s)); a resume on another shape reads every rank's file"
            )
        try:
            out.append((path, peek_state_file(path)))
        except (OSError, StateFileError) as exc:
            raise ValueError(f"{path}: cannot read its header: {exc}") from exc
    return out


def _by_name(head: Any, names: list[str], path: str) -> tuple[dict[str, dict[str, Any]], list[dict]]:
    """A saved optimizer state's per-parameter entries and param groups, keyed by parameter name
    (a single-process file keys them by index in ``names``' order)."""
    try:
        state, groups = head["optimizer"]["state"], head["optimizer"]["param_groups"]

        def name(key: Any) -> str:
            return names[key] if isinstance(key, int) else str(key)

        by_name = {name(k): v for k, v in state.items()}
        named_groups = [dict(g, params=[name(p) for p in g["params"]]) for g in groups]
    except (KeyError, TypeError, IndexError, AttributeError) as exc:
        raise ValueError(f"{path}: not an optimizer state this trainer reshards ({exc!r})") from exc
    return by_name, named_groups


def _read(fd: int, path: str, entry: TensorEntry, lo: int, hi: int) -> torch.Tensor:
    """Rows ``[lo, hi)`` of ``entry`` (a 0-d entry whole), read from the file."""
    row_shape = entry.shape[1:]
    row_bytes = math.prod(row_shape) * torch.empty((), dtype=entry.dtype).element_size()
    shape: tuple[int, ...] = (hi - lo, *row_shape) if entry.shape else ()
    begin = entry.begin + lo * row_bytes if entry.shape else entry.begin
    size = (hi - lo) * row_bytes if entry.shape else entry.end - entry.begin
    data = bytearray(size)
    view, done = memoryview(data), 0
    while done < size:
        got = os.preadv(fd, [view[done:]], begin + done)
        if got <= 0:
            raise ValueError(f"{path}: ends inside tensor {entry.name}")
        done += got
    return torch.frombuffer(data, dtype=torch.uint8).view(entry.dtype).reshape(shape).clone()


class _Pieces:
    """The saved files, open, and where each parameter's rows are in them."""

    def __init__(self, files: list[tuple[str, Any]], saved: SavedLayout, names: list[str]):
        self.saved = saved
        self.paths = [p for p, _ in files]
        self.fds = [os.open(p, os.O_RDONLY) for p in self.paths]
        parts = [_by_name(head, names, path) for path, head in files]
        self.states = [state for state, _ in parts]
        self.groups = parts[0][1]

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)

    def rows(self, param: LiveParameter, key: str) -> torch.Tensor:
        """``param``'s state ``key`` for the rows this rank holds, from every saved file holding some."""
        pieces = []
        n = param.shape[0] if param.shape else 1
        for rank, state in enumerate(self.states):
            entry = state.get(param.name, {}).get(key)
            if not isinstance(entry, TensorEntry):
                continue
            s_lo, s_hi = dim0_rows(self.saved.engine, rank, self.saved.world_size, n)
            if not entry.shape:  # a scalar (AdamW's step): every file holds the same
                return _read(self.fds[rank], self.paths[rank], entry, 0, 0)
            if entry.shape != (s_hi - s_lo, *param.shape[1:]):
                raise ValueError(
                    f"{self.paths[rank]}: {param.name} {key} has shape {list(entry.shape)}; rows "
                    f"{s_lo}..{s_hi} of {list(param.shape)} expected"
                )
            lo, hi = max(param.lo, s_lo), min(param.hi, s_hi)
            if lo < hi:
                pieces.append(_read(self.fds[rank], self.paths[rank], entry, lo - s_lo, hi - s_lo))
        if not pieces:
            if param.lo == param.hi:  # this rank holds no row of it
                return torch.empty((0, *param.shape[1:]))
            raise ValueError(f"{self.paths[0]}: no saved rank holds {param.name} {key}")
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def resharded_state(
    checkpoint_dir: str, saved: SavedLayout, live_engine: str, params: list[LiveParameter]
) -> dict[str, Any]:
    """What this rank's own optimizer file would hold had its layout saved the checkpoint:
    ``{"optimizer", "scheduler", "global_step"}``, the optimizer state in the live engine's form
    (keyed by name for fsdp, by index for single), each tensor read from the rows that hold it."""
    names = [p.name for p in params]
    files = saved_files(checkpoint_dir, saved)
    pieces = _Pieces(files, saved, names)
    try:
        state: dict[Any, dict[str, Any]] = {}
        for index, param in enumerate(params):
            keys = {k for s in pieces.states for k in s.get(param.name, {})}
            if not keys:
                continue  # no state saved for it (never stepped): none now either
            key_of = param.name if live_engine == "fsdp" else index
            state[key_of] = {k: _value(pieces, param, k) for k in sorted(keys)}
        position = {name: i for i, name in enumerate(names)}
        groups = [
            dict(g, params=[p if live_engine == "fsdp" else position[p] for p in g["params"]])
            for g in pieces.groups
        ]
    finally:
        pieces.close()
    head = files[0][1]
    return {
        "optimizer": {"state": state, "param_groups": groups},
        "scheduler": _whole(head["scheduler"], files[0][0]),
        "global_step": head["global_step"],
    }


def _value(pieces: _Pieces, param: LiveParameter, key: str) -> Any:
    """A state entry: rows when tensor-valued, the plain value otherwise (the same in every file)."""
    for state in pieces.states:
        value = state.get(param.name, {}).get(key)
        if value is not None and not isinstance(value, TensorEntry):
            return value
    return pieces.rows(param, key)


def _whole(node: Any, path: str) -> Any:
    """``node`` with every tensor read whole (the scheduler's state: plain values, as a rule)."""
    if isinstance(node, TensorEntry):
        fd = os.open(path, os.O_RDONLY)
        try:
            rows = node.shape[0] if node.shape else 0
            return _read(fd, path, node, 0, rows)
        finally:
            os.close(fd)
    if isinstance(node, dict):
        return {k: _whole(v, path) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_whole(v, path) for v in node)
    return node
