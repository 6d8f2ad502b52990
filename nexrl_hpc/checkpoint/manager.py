"""Atomic checkpoints on the (parallel) filesystem.

``checkpoints/global_step_<N>/`` holds ``model/`` (HF layout), ``optimizer/`` (per-rank engine
state) and ``state.h5`` (step, data loader position, RNG states, weight versions). It is written
in a temp dir, fsynced, renamed into place; ``COMPLETE`` is written last and ``latest`` is then
replaced atomically. A directory without ``COMPLETE`` is never resumed from. ``COMPLETE`` lists
every file with its size and digest (``digest``): a resume takes the newest complete checkpoint
whose files still match (``find_resume_checkpoint``), so one damaged after its save is skipped
with a warning instead of making every requeue of the job crash on it. A skipped one is moved into
``set_aside/`` (``set_aside``), never deleted: its weights may be intact, and out of the step dirs
no later save replaces it and no retention prunes it. When complete checkpoints exist and none
verifies, the run refuses to start over silently (``NoTrustedCheckpoint``) unless
``resume.when_all_damaged=start_over``.

One writer per checkpoint folder (the train worker): what a killed writer left behind (temp dirs,
step dirs without ``COMPLETE``) is removed by the next save, and a checkpoint being pruned loses its
``COMPLETE`` before its files, so a half-deleted directory is never taken for a complete one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
import time
from typing import Any

import h5py
import numpy as np
import torch

from nexrl_hpc.checkpoint.digest import complete_record, manifest, verify_checkpoint
from nexrl_hpc.checkpoint.hf import WritebackKicker, fsync_path
from nexrl_hpc.config.schema import ResumeConfig

logger = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^global_step_(\d+)$")
COMPLETE = "COMPLETE"
LATEST = "latest"
STATE_FILE = "state.h5"
TMP_PREFIX = ".tmp-"  # ".tmp-global_step_<N>-<pid>": a save in progress (or a killed one)
OLD_PREFIX = ".old-"  # ".old-global_step_<N>-<pid>": a complete step dir being replaced by a new save
OLD_STEP_DIR = re.compile(r"^\.old-global_step_(\d+)-\d+$")
SET_ASIDE = "set_aside"  # checkpoints a resume skipped as damaged: kept, out of the saves' way


class NoTrustedCheckpoint(ValueError):
    """Complete checkpoints exist and none of them verifies (each named with its reason)."""


def capture_rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    assert isinstance(np_state, tuple)  # legacy=True (the default): ("MT19937", keys, pos, has_gauss, cached)
    return {
        "python": json.dumps(random.getstate()),
        "numpy": {
            "name": np_state[0],
            "keys": np_state[1],
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached": float(np_state[4]),
        },
        "torch": torch.get_rng_state().numpy(),
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    py = json.loads(state["python"])
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"], n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(torch.from_numpy(np.asarray(state["torch"], dtype=np.uint8)))


def write_state_h5(path: str, state: dict[str, Any]) -> None:
    """``state``: global_step, weight_version (dict), dataloader (JSON-able), rng (capture_rng_state())."""
    with h5py.File(path, "w") as f:
        f.attrs["global_step"] = int(state["global_step"])
        f.attrs["format_version"] = 1
        f.attrs["created_unix"] = time.time()
        f.attrs["weight_version"] = json.dumps(state["weight_version"])
        f.create_dataset("dataloader", data=json.dumps(state["dataloader"]))
        if "extra" in state:
            f.create_dataset("extra", data=json.dumps(state["extra"]))
        rng = f.create_group("rng")
        rng.create_dataset("python", data=state["rng"]["python"])
        rng.create_dataset("torch", data=state["rng"]["torch"])
        npg = rng.create_group("numpy")
        npg.create_dataset("keys", data=state["rng"]["numpy"]["keys"])
        for k in ("name", "pos", "has_gauss", "cached"):
            npg.attrs[k] = state["rng"]["numpy"][k]


def read_state_h5(path: str) -> dict[str, Any]:
    with h5py.File(path, "r") as f:
        rng = f["rng"]
        npg = rng["numpy"]
        out = {
            "global_step": int(f.attrs["global_step"]),
            "weight_version": json.loads(f.attrs["weight_version"]),
            "dataloader": json.loads(f["dataloader"][()]),
            "rng": {
                "python": rng["python"][()].decode()
                if isinstance(rng["python"][()], bytes)
                else rng["python"][()],
                "torch": rng["torch"][()],
                "numpy": {
                    "name": str(npg.attrs["name"]),
                    "keys": npg["keys"][()],
                    "pos": int(npg.attrs["pos"]),
                    "has_gauss": int(npg.attrs["has_gauss"]),
                    "cached": float(npg.attrs["cached"]),
                },
            },
        }
        if "extra" in f:
            out["extra"] = json.loads(f["extra"][()])
    return out


def step_dir_name(step: int) -> str:
    return f"global_step_{step}"


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, COMPLETE))


def complete_checkpoints(checkpoint_folder: str) -> list[str]:
    """Complete ``global_step_*`` dirs, newest first (the ``latest`` pointer is a hint, the scan is
    the truth).

    A complete ``.old-global_step_<N>-<pid>`` counts when ``global_step_<N>`` is not complete: a
    writer killed between moving it aside and renaming its replacement into place left only that."""
    if not os.path.isdir(checkpoint_folder):
        return []
    best: dict[int, tuple[int, str]] = {}
    for name in os.listdir(checkpoint_folder):
        m = STEP_DIR.match(name) or OLD_STEP_DIR.match(name)
        path = os.path.join(checkpoint_folder, name)
        if m and is_complete(path):
            step, rank = int(m.group(1)), 1 if STEP_DIR.match(name) else 0
            if step not in best or rank > best[step][0]:
                best[step] = (rank, path)
    return [best[step][1] for step in sorted(best, reverse=True)]


def find_latest_checkpoint(checkpoint_folder: str) -> str | None:
    """Newest complete checkpoint, its files not checked (``find_resume_checkpoint`` checks them)."""
    found = complete_checkpoints(checkpoint_folder)
    return found[0] if found else None


def checkpoint_to_resume(resume: ResumeConfig, checkpoint_folder: str) -> str | None:
    """The checkpoint a run starts from, by ``resume.mode``: none (disable), ``resume.resume_path``
    (from_path; ValueError naming it when it is incomplete or fails its digests) or the newest
    trustworthy one in ``checkpoint_folder`` (auto; ``NoTrustedCheckpoint`` when there are complete
    ones and none verifies, unless ``resume.when_all_damaged=start_over``)."""
    if resume["mode"] == "disable":
        return None
    if resume["mode"] == "from_path":
        path = os.path.abspath(resume["resume_path"] or "")
        if not is_complete(path):
            raise ValueError(f"resume.resume_path={path!r} is not a complete checkpoint (no COMPLETE marker)")
        if problem := verify_checkpoint(path, COMPLETE):
            raise ValueError(f"resume.resume_path={path!r} cannot be trusted: {problem}")
        return path
    latest = find_resume_checkpoint(checkpoint_folder, start_over=resume["when_all_damaged"] == "start_over")
    if latest:
        logger.info("resuming from %s", latest)
    return latest


def find_resume_checkpoint(checkpoint_folder: str, start_over: bool = False) -> str | None:
    """Newest complete checkpoint whose files match the digests in its ``COMPLETE``; each newer one
    that does not is skipped with a warning naming the file and moved into ``set_aside/`` (kept).

    None when there is no complete checkpoint. When there are some and none verifies:
    ``NoTrustedCheckpoint`` naming each with its reason, nothing moved; with ``start_over`` they are
    all set aside (kept) and None is returned (the run starts from step 0)."""
    damaged: list[tuple[str, str]] = []
    found = None
    for path in complete_checkpoints(checkpoint_folder):
        problem = verify_checkpoint(path, COMPLETE)
        if problem is None:
            found = path
            break
        logger.warning("checkpoint %s skipped: %s; trying the previous one", path, problem)
        damaged.append((path, problem))
    if damaged and found is None and not start_over:
        listed = "; ".join(f"{path}: {problem}" for path, problem in damaged)
        raise NoTrustedCheckpoint(
            f"none of the {len(damaged)} complete checkpoint(s) in {checkpoint_folder} can be trusted "
            f"({listed}). Their files are kept. To start over from step 0 (they are moved into "
            f"{os.path.join(checkpoint_folder, SET_ASIDE)}/), run with resume.when_all_damaged=start_over; "
            "to resume from one anyway, resume.mode=from_path after repairing it"
        )
    for path, problem in damaged:
        set_aside(checkpoint_folder, path, problem)
    return found


def set_aside(checkpoint_folder: str, path: str, why: str) -> str:
    """Move the checkpoint at ``path`` into ``<checkpoint_folder>/set_aside/`` (a rename: every
    file kept), under a name no earlier one holds; returns where it went."""
    target_dir = os.path.join(checkpoint_folder, SET_ASIDE)
    os.makedirs(target_dir, exist_ok=True)
    m = STEP_DIR.match(os.path.basename(path)) or OLD_STEP_DIR.match(os.path.basename(path))
    base = step_dir_name(int(m.group(1))) if m else os.path.basename(path)
    target = os.path.join(target_dir, base)
    n = 1
    while os.path.exists(target):
        target, n = os.path.join(target_dir, f"{base}.{n}"), n + 1
    os.rename(path, target)
    fsync_path(target_dir)
    fsync_path(checkpoint_folder)
    logger.warning("checkpoint %s moved to %s (kept, not resumed from: %s)", path, target, why)
    return target


def _remove_step_dir(path: str) -> None:
    """``COMPLETE`` first (and durably), then the rest: a deletion cut short leaves an incomplete dir."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(path, COMPLETE))
        fsync_path(path)
    shutil.rmtree(path, ignore_errors=True)


class CheckpointManager:
    def __init__(self, checkpoint_folder: str, max_to_keep: int | None):
        self.folder = checkpoint_folder
        self.max_to_keep = max_to_keep

    def save(self, step: int, save_model: Any, state: dict[str, Any]) -> str:
        """``save_model(dir)`` writes model/ and optimizer/ into ``dir``; then state.h5, rename, COMPLETE, latest."""
        os.makedirs(self.folder, exist_ok=True)
        self._remove_leftovers()
        final = os.path.join(self.folder, step_dir_name(step))
        tmp = os.path.join(self.folder, f"{TMP_PREFIX}{step_dir_name(step)}-{os.getpid()}")
        os.makedirs(tmp)
        with WritebackKicker(tmp):
            save_model(tmp)
            state_path = os.path.join(tmp, STATE_FILE)
            write_state_h5(state_path, state)
        # the writers' digests of the big files (their sidecars), the small ones read and hashed
        record = complete_record(step, manifest(tmp))
        fsync_path(state_path)
        fsync_path(tmp)
        old = None
        if os.path.exists(final):
            if is_complete(final):
                # the same step saved again (e.g. a preemption save right after a periodic one): move
                # the complete one aside with a rename, never rmtree it before the new one is in place
                old = os.path.join(self.folder, f"{OLD_PREFIX}{step_dir_name(step)}-{os.getpid()}")
                os.replace(final, old)
            else:  # an incomplete leftover of an interrupted save of this step
                shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_path(self.folder)
        marker = os.path.join(final, COMPLETE)
        with open(marker, "w") as f:
            f.write(record)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(final)
        self._point_latest(step)
        if old is not None:
            _remove_step_dir(old)
        self._prune(step)
        return final

    def _remove_leftovers(self) -> None:
        """Temp dirs and stale ``latest`` temp files of saves that were killed (this process is the
        folder's only writer and is not saving now, so none of them is in progress). A complete
        ``.old-`` dir whose step has no complete replacement is renamed back instead."""
        for name in sorted(os.listdir(self.folder)):
            path = os.path.join(self.folder, name)
            if (m := OLD_STEP_DIR.match(name)) and is_complete(path):
                final = os.path.join(self.folder, step_dir_name(int(m.group(1))))
                if not is_complete(final):
                    logger.info("restoring %s as %s (its replacement was never completed)", path, final)
                    if os.path.exists(final):
                        shutil.rmtree(final)
                    os.replace(path, final)
                    fsync_path(self.folder)
                    continue
            if name.startswith((TMP_PREFIX, OLD_PREFIX)) and os.path.isdir(path):
                logger.info("removing %s, left by an interrupted checkpoint save", path)
                _remove_step_dir(path)
            elif name.startswith(f".{LATEST}.tmp-"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    def _point_latest(self, step: int) -> None:
        tmp = os.path.join(self.folder, f".{LATEST}.tmp-{os.getpid()}")
        with open(tmp, "w") as f:
            f.write(step_dir_name(step) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.folder, LATEST))
        fsync_path(self.folder)

    def _prune(self, current: int) -> None:
        """Keep the newest ``max_to_keep`` complete checkpoints (``current`` always); step dirs
        without ``COMPLETE`` other than ``current`` are leftovers of killed saves and go too."""
        complete: list[int] = []
        incomplete: list[int] = []
        for name in os.listdir(self.folder):
            if m := STEP_DIR.match(name):
                path = os.path.join(self.folder, name)
                (complete if is_complete(path) else incomplete).append(int(m.group(1)))
        for s in incomplete:
            if s != current:
                _remove_step_dir(os.path.join(self.folder, step_dir_name(s)))
        if self.max_to_keep is None:
            return
        for s in sorted(complete)[: -self.max_to_keep]:
            if s != current:
                _remove_step_dir(os.path.join(self.folder, step_dir_name(s)))

    def latest(self) -> str | None:
        return find_latest_checkpoint(self.folder)
