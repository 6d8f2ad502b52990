"""The local inference server's process: GC thresholds first, then ``nexrl_hpc.inference.server``.

    python -m nexrl_hpc.inference.server_process [--gc-thresholds G0 G1 G2] <server arguments>

Why a step before the server module: its imports (torch, transformers, the HTTP stack) leave ~480k
objects for the garbage collector, and at Python's default thresholds its full passes over them
take a good part of the server's start-up — which the run waits for. The thresholds
(``runtime.gc_thresholds``) must be set before those imports, so before the module is loaded.
Only the standard library here.
"""

from __future__ import annotations

import argparse
import gc
import runpy
import sys

SERVER_MODULE = "nexrl_hpc.inference.server"


def threshold_args(thresholds: list[int]) -> list[str]:
    """This entry point's own arguments for ``runtime.gc_thresholds`` (empty: Python's)."""
    return ["--gc-thresholds", *map(str, thresholds)] if len(thresholds) == 3 else []


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
    parser.add_argument("--gc-thresholds", type=int, nargs=3, default=None)
    known, server_args = parser.parse_known_args()
    if known.gc_thresholds:
        gc.set_threshold(*known.gc_thresholds)
    sys.argv = [sys.argv[0], *server_args]
    runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
