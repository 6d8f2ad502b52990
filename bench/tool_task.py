"""The multi-turn tool task (``task=tool_lookup``) learns: time to validation reward >= 0.7, local and mpi.

Each mode runs ``python -m launch.train task=tool_lookup`` as a user would (local: one process;
mpi: ``mpirun -n 4 ... launch_mode=mpi``), validating greedily on the 128 held-out tables every
``--validate-freq`` steps. The clock starts at process start (model warm-up, server start-up and
validation included). The goal: validation reward from <= 0.3 to >= 0.7 within 10 min
on 2 CPU cores; the ratio column is time-to-goal / 600 s (<= 1 meets it).

    python bench/tool_task.py [--modes local mpi] [--seed 1] [--steps 80]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launch_runs import timed_train_run  # noqa: E402

BUDGET_S = 600.0
GOAL = 0.7


def run(mode: str, seed: int, steps: int, validate_freq: int, extra: list[str]) -> dict:
    overrides = [
        "task=tool_lookup",
        f"seed={seed}",
        f"train_worker.total_train_steps={steps}",
        f"validate.eval.validate_freq={validate_freq}",
        *extra,
    ]
    launcher: list[str] = []
    if mode == "mpi":
        if shutil.which("mpirun") is None:
            raise SystemExit("mpirun not found: bash scripts/install.sh --dev installs MPICH")
        launcher, overrides = ["mpirun", "-n", "4"], [*overrides, "launch_mode=mpi"]
    rows, t0, wall = timed_train_run(overrides, f"tool_{mode}", launcher)
    val = [r for r in rows if "val/reward" in r]
    reached = next((r for r in val if r["val/reward"] >= GOAL), None)
    return {
        "mode": mode,
        "start": val[0]["val/reward"],
        "end": val[-1]["val/reward"],
        "end_correct": val[-1]["val/is_correct"],
        "goal_step": reached["step"] if reached else None,
        "goal_s": reached["time"] - t0 if reached else None,
        "wall": wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", choices=["local", "mpi"], default=["local", "mpi"])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--validate-freq", type=int, default=10)
    p.add_argument("overrides", nargs="*", help="more Hydra overrides for both runs")
    args = p.parse_args()
    results = [run(m, args.seed, args.steps, args.validate_freq, args.overrides) for m in args.modes]
    print(f"\ntask=tool_lookup seed={args.seed} steps={args.steps} (validation reward, greedy, 128 tables)")
    print(
        f"{'mode':6} {'start':>6} {'end':>6} {'correct':>8} {'>=0.7 at step':>14} {'time to 0.7':>12} "
        f"{'/ 600 s':>8} {'wall':>7}"
    )
    for r in results:
        step = "never" if r["goal_step"] is None else str(r["goal_step"])
        secs = "-" if r["goal_s"] is None else f"{r['goal_s']:.0f} s"
        ratio = "-" if r["goal_s"] is None else f"{r['goal_s'] / BUDGET_S:.2f}"
        print(
            f"{r['mode']:6} {r['start']:6.3f} {r['end']:6.3f} {r['end_correct']:8.3f} {step:>14} {secs:>12} "
            f"{ratio:>8} {r['wall']:6.0f}s"
        )


if __name__ == "__main__":
    main()
