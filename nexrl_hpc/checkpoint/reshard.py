"""Optimizer state saved by one trainer layout, loaded into another: resume on another shape.

The per-rank optimizer files (``trainer_io``) are keyed so that their layout can be undone without
the process group that wrote them. Each rank's file holds, for each parameter, one contiguous range
of the parameter's elements in row-major (flattened) order:

- a single-process file holds every parameter whole (AdamW's state keyed by the parameter's index
  in ``named_parameters`` order);
- an FSDP2 file holds each parameter's dim-0 shard keyed by its name; FSDP2 shards dim 0 as
  ``torch.chunk`` does (rank ``r`` of ``W`` holds rows ``[r*c, min((r+1)*c, n))`` with
  ``c = ceil(n / W)``), so its range is elements ``[lo*row, hi*row)``;
- a DeepSpeed ZeRO-3 file holds each parameter's partition keyed by its name, as a flat 1-D tensor
  of the valid elements (ZeRO-3 partitions the flattened parameter: ``p = ceil(numel / W)``, rank
  ``r`` holds ``[r*p, min((r+1)*p, numel))``; the last rank's padding is not saved), with the fp32
  master partition beside the moments (``master``: with bf16 the model files hold the rounded weights).

So a trainer of any world size and any of these engines reads, for each of its parameters, the
element range it holds now out of whichever saved files hold parts of it (header-addressed
``pread``s, one contiguous read per saved piece: no rank reads the whole state), and gets bit for
bit the values that were saved: FSDP2 and single-process trainers in their parameters' shapes, a
ZeRO-3 trainer as flat partitions. A ZeRO-3 trainer resuming from another engine takes its fp32
masters from the checkpoint's model files (fp32: the other engines' masters); a single-process or
FSDP2 trainer resuming from ZeRO-3 takes its weights from the saved masters.

DeepSpeed ZeRO stages 0-2 (and ZeRO-3 files of DeepSpeed's own ``state_dict``, from before its files
were keyed by name) hold flat partitions of parameter groups laid out by DeepSpeed's bookkeeping;
they load only into the engine, stage and world size that wrote them. ``layout_problem`` is the
rule both the pre-flight check and the trainer apply.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from nexrl_hpc.checkpoint.hf import safetensors_files
from nexrl_hpc.checkpoint.state_file import StateFileError, peek_state_file
from nexrl_hpc.checkpoint.tensor_reads import TensorEntry, TensorFileError, read_header

FLAT_BY_NAME = "flat_by_name"  # a ZeRO-3 optimizer file's "layout": its state keyed by parameter name
MASTER = "master"  # a ZeRO-3 file's fp32 master partition, beside AdamW's moments


@dataclass(frozen=True)
class SavedLayout:
    """How the optimizer files of a checkpoint were laid out (from rank 0's file header)."""

    engine: str
    world_size: int
    zero_stage: int | None  # DeepSpeed's ZeRO stage; None for the other engines
    by_name: bool = True  # False: DeepSpeed's own state_dict (loads at the same layout only)


@dataclass(frozen=True)
class LiveLayout:
    """The layout a resuming run has: ``service.train_service.engine``, ``.world_size`` and
    ``.deepspeed.zero_stage``."""

    engine: str
    world_size: int
    zero_stage: int | None


def reshardable(engine: str, zero_stage: int | None, by_name: bool = True) -> bool:
    """Whether optimizer state of this engine says which elements of which parameter it holds."""
    return engine in ("single", "fsdp") or (engine == "deepspeed" and zero_stage == 3 and by_name)


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
    return layout_of(head)


def layout_of(head: Any) -> SavedLayout:
    """The layout an optimizer file's structure (its header, or the file read) records."""
    engine = str(head.get("engine", "single"))
    stage, by_name = None, True
    if engine == "deepspeed":
        optimizer = head.get("optimizer")
        optimizer = optimizer if isinstance(optimizer, dict) else {}
        stage = int(optimizer.get("zero_stage", 0))
        by_name = optimizer.get("layout") == FLAT_BY_NAME
    return SavedLayout(engine, int(head.get("world_size", 1)), stage, by_name)


def layout_problem(saved: SavedLayout, live: LiveLayout) -> tuple[str, str] | None:
    """``(config key, why)`` when optimizer state of layout ``saved`` cannot be loaded by a trainer
    of layout ``live``; None when it can (the same layout, or both layouts reshardable)."""
    if (saved.engine, saved.world_size, saved.zero_stage) == (live.engine, live.world_size, live.zero_stage):
        return None
    if reshardable(saved.engine, saved.zero_stage, saved.by_name) and reshardable(
        live.engine, live.zero_stage
    ):
        return None
    what = f"optimizer state of engine={saved.engine} on {saved.world_size} rank(s)"
    if saved.engine == "deepspeed":
        what += f" (ZeRO stage {saved.zero_stage})"
    rule = (
        "only engines single, fsdp and deepspeed with ZeRO stage 3 resume on another shape "
        "(ZeRO stages 0-2 load only into the engine, stage and world size that wrote them"
    )
    rule += (
        "; this ZeRO-3 file is DeepSpeed's own state_dict, from before ZeRO-3 files were keyed by name)"
        if reshardable(saved.engine, saved.zero_stage) and not saved.by_name
        else ")"
    )
    options = (
        "resume with the layout that wrote it, or start a new run from its weights "
        "(model.path=<checkpoint>/model)"
    )
    if saved.engine != live.engine:
        into = f"engine={live.engine}" + (
            f" with ZeRO stage {live.zero_stage}" if live.zero_stage is not None else ""
        )
        return ("service.train_service.engine", f"{what} is not resharded into {into}: {rule}; {options}")
    if saved.zero_stage != live.zero_stage:
        return (
            "service.train_service.deepspeed.zero_stage",
            f"{what} does not load with zero_stage={live.zero_stage}: {rule}; {options}",
        )
    return (
        "service.train_service.world_size",
        f"{what} does not load on {live.world_size} rank(s): {rule}; {options}",
    )


def dim0_rows(engine: str, rank: int, world_size: int, rows: int) -> tuple[int, int]:
    """The rows ``[lo, hi)`` of a parameter with ``rows`` rows that ``rank`` holds under ``engine``
    (FSDP2: a ``torch.chunk`` of dim 0; the others: every row)."""
    if engine != "fsdp":
        return 0, rows
    chunk = math.ceil(rows / world_size) if rows else 0
    lo = min(rank * chunk, rows)
    return lo, min(lo + chunk, rows)


def flat_range(engine: str, rank: int, world_size: int, shape: tuple[int, ...]) -> tuple[int, int]:
    """The elements ``[lo, hi)`` of a parameter of ``shape``, flattened row-major, that ``rank`` of
    ``world_size`` holds under ``engine``: an FSDP2 shard's rows, a ZeRO-3 partition, or all."""
    numel = math.prod(shape)
    if engine == "deepspeed":
        part = math.ceil(numel / world_size)
        lo = min(rank * part, numel)
        return lo, min(lo + part, numel)
    rows = shape[0] if shape else 1
    lo, hi = dim0_rows(engine, rank, world_size, rows)
    row = numel // rows if rows else 0
    return lo * row, hi * row


@dataclass(frozen=True)
class LiveParameter:
    """One parameter of the resuming trainer: its name, whole shape, the elements ``[lo, hi)`` of it
    (flattened) this rank holds, and the shape they have here (FSDP2: rows; ZeRO-3: flat)."""

    name: str
    shape: tuple[int, ...]
    lo: int
    hi: int
    local_shape: tuple[int, ...]


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
    """Elements ``[lo, hi)`` of ``entry`` flattened (one contiguous read), as a 1-D tensor; a 0-d
    entry whole."""
    size_of = torch.empty((), dtype=entry.dtype).element_size()
    shape: tuple[int, ...] = (hi - lo,) if entry.shape else ()
    begin = entry.begin + lo * size_of if entry.shape else entry.begin
    size = (hi - lo) * size_of if entry.shape else entry.end - entry.begin
    data = bytearray(size)
    view, done = memoryview(data), 0
    while done < size:
        got = os.preadv(fd, [view[done:]], begin + done)
        if got <= 0:
            raise ValueError(f"{path}: ends inside tensor {entry.name}")
        done += got
    return torch.frombuffer(data, dtype=torch.uint8).view(entry.dtype).reshape(shape).clone()


class _Pieces:
    """The saved files, open, and where each parameter's elements are in them."""

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

    def flat(self, param: LiveParameter, key: str) -> torch.Tensor | None:
        """``param``'s state ``key`` for the elements this rank holds (1-D), from every saved file
        holding some; a scalar whole; None when no file holds it."""
        pieces, found = [], False
        for rank, state in enumerate(self.states):
            entry = state.get(param.name, {}).get(key)
            if not isinstance(entry, TensorEntry):
                continue
            if not entry.shape:  # a scalar (AdamW's step): every file holds the same
                return _read(self.fds[rank], self.paths[rank], entry, 0, 0)
            found = True
            s_lo, s_hi = flat_range(self.saved.engine, rank, self.saved.world_size, param.shape)
            if math.prod(entry.shape) != s_hi - s_lo:
                raise ValueError(
                    f"{self.paths[rank]}: {param.name} {key} has shape {list(entry.shape)}; elements "
                    f"{s_lo}..{s_hi} of {list(param.shape)} expected"
                )
            lo, hi = max(param.lo, s_lo), min(param.hi, s_hi)
            if lo < hi:
                pieces.append(_read(self.fds[rank], self.paths[rank], entry, lo - s_lo, hi - s_lo))
        if not found:
            return None
        if not pieces:
            if param.lo == param.hi:  # this rank holds no element of it
                return torch.empty((0,))
            raise ValueError(f"{self.paths[0]}: no saved rank holds {param.name} {key}")
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def _local(flat: torch.Tensor, param: LiveParameter) -> torch.Tensor:
    return flat if flat.dim() == 0 else flat.reshape(param.local_shape)


def resharded_state(
    checkpoint_dir: str,
    saved: SavedLayout,
    live_engine: str,
    params: list[LiveParameter],
    model_names: dict[str, str] | None = None,
) -> dict[str, Any]:
    """What this rank's own optimizer file would hold had its layout saved the checkpoint:
    ``{"optimizer", "scheduler", "global_step", "masters"}``, the optimizer state in the live
    engine's form (keyed by name for fsdp and deepspeed, by index for single; ZeRO-3's with its
    fp32 masters), each tensor read from the elements that hold it. ``masters``: for a single or
    fsdp trainer, the saved ZeRO-3 masters its weights become (empty from other engines).
    ``model_names``: a parameter's name in the checkpoint's model files where it differs (a LoRA
    adapter's), for a ZeRO-3 trainer's masters read from them."""
    names = [p.name for p in params]
    files = saved_files(checkpoint_dir, saved)
    pieces = _Pieces(files, saved, names)
    masters: dict[str, torch.Tensor] = {}
    try:
        state: dict[Any, dict[str, Any]] = {}
        for index, param in enumerate(params):
            entry = {
                k: _value(pieces, param, k)
                for k in sorted({k for s in pieces.states for k in s.get(param.name, {})})
            }
            if live_engine != "deepspeed" and isinstance(entry.get(MASTER), torch.Tensor):
                masters[param.name] = entry.pop(MASTER)
            if entry:  # none saved for it (never stepped): none now either
                state[index if live_engine == "single" else param.name] = entry
        position = {name: i for i, name in enumerate(names)}
        groups = [
            dict(g, params=[position[p] if live_engine == "single" else p for p in g["params"]])
            for g in pieces.groups
        ]
    finally:
        pieces.close()
    optimizer: dict[str, Any] = {"state": state, "param_groups": groups}
    if live_engine == "deepspeed":
        if saved.engine != "deepspeed":  # the other engines' masters are the checkpoint's fp32 weights
            _masters_from_model_dir(os.path.join(checkpoint_dir, "model"), params, state, model_names or {})
        optimizer.update(zero_stage=3, layout=FLAT_BY_NAME)
    head = files[0][1]
    return {
        "optimizer": optimizer,
        "scheduler": _whole(head["scheduler"], files[0][0]),
        "global_step": head["global_step"],
        "masters": masters,
    }


def _value(pieces: _Pieces, param: LiveParameter, key: str) -> Any:
    """A state entry: this rank's elements when tensor-valued, the plain value otherwise (the same
    in every file)."""
    for state in pieces.states:
        value = state.get(param.name, {}).get(key)
        if value is not None and not isinstance(value, TensorEntry):
            return value
    flat = pieces.flat(param, key)
    return None if flat is None else _local(flat, param)


def _masters_from_model_dir(
    model_dir: str, params: list[LiveParameter], state: dict[Any, dict], file_names: dict[str, str]
) -> None:
    """Each parameter's elements of its fp32 weight in the checkpoint's model files (under its name
    there: ``file_names`` or its own) into its state's ``master``; a parameter the files lack keeps
    the master the weights' load set."""
    for path in safetensors_files(model_dir):
        fd = os.open(path, os.O_RDONLY)
        try:
            try:
                entries = {e.name: e for e in read_header(fd, path)[0]}
            except TensorFileError as exc:
                raise ValueError(str(exc)) from exc
            for param in params:
                entry = entries.get(file_names.get(param.name, param.name))
                if entry is None:
                    continue
                if entry.shape != param.shape:
                    raise ValueError(
                        f"{path}: {param.name} has shape {list(entry.shape)}, not {list(param.shape)}"
                    )
                master = _read(fd, path, entry, param.lo, param.hi).float()
                state.setdefault(param.name, {})[MASTER] = master
        finally:
            os.close(fd)


def _whole(node: Any, path: str) -> Any:
    """``node`` with every tensor read whole (the scheduler's state: plain values, as a rule)."""
    if isinstance(node, TensorEntry):
        fd = os.open(path, os.O_RDONLY)
        try:
            return _read(fd, path, node, 0, math.prod(node.shape)).reshape(node.shape)
        finally:
            os.close(fd)
    if isinstance(node, dict):
        return {k: _whole(v, path) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_whole(v, path) for v in node)
    return node
