"""Python's cyclic garbage collector around a process's start-up (``runtime.gc_*``).

Why: once torch, transformers and the HTTP stack are imported a process tracks ~480k container
objects, and a full (generation 2) collection walks every one of them (bench/README.md). At Python's
default thresholds such passes run every second or two while a process imports and builds its
modules, and later whenever its heap has grown by a quarter — on a rollout rank, whose trajectories
come and go, that was a stall every few steps, in the middle of the trainer's weight sync. The
thresholds make collections rarer; freezing moves the start-up objects, which live as long as the
process, out of every later pass.

Nothing heavy here: ``launch.train`` calls ``hold_collections`` before its heavy imports.
"""

from __future__ import annotations

import gc
from typing import TypedDict


class GcSettings(TypedDict):
    """The ``runtime`` keys read here (a whole ``RuntimeConfig`` will do)."""

    gc_thresholds: list[int]  # gc.set_threshold(gen0, gen1, gen2); empty: left as they are
    gc_freeze_after_setup: bool


def hold_collections(runtime: GcSettings) -> None:
    """``runtime.gc_thresholds`` from now on (empty: left as they are) — call it before heavy imports."""
    if len(runtime["gc_thresholds"]) == 3:
        gc.set_threshold(*runtime["gc_thresholds"])


def freeze_imports(runtime: GcSettings) -> None:
    """After the heavy imports: what they created stays for the process's life, so no later pass
    need walk it (without a collection first: the few hundred objects the imports left as garbage
    are kept; a full collection to find them would walk every start-up object)."""
    if runtime["gc_freeze_after_setup"]:
        gc.freeze()


def settle_after_setup(runtime: GcSettings) -> None:
    """Modules built, models loaded: the thresholds, and (``runtime.gc_freeze_after_setup``) one
    collection of the start-up's garbage — cheap after ``freeze_imports`` — then everything left
    frozen."""
    hold_collections(runtime)
    if runtime["gc_freeze_after_setup"]:
        gc.collect()
        gc.freeze()
