"""The shipped realistic task (``task=rg_aiw``) learns: validation reward rise and time to +0.4.

Runs ``python -m launch.train task=rg_aiw`` as a user would (local mode, the default local
inference backend), validating greedily on the held-out reasoning-gym questions every
``--validate-freq`` steps. The clock starts at process start (tokenizer training, model build and
warm-up, server start-up and validation included). The goal: validation reward up by >= 0.4
(absolute) over the warmed-up model's within 10 min on 2 CPU cores; the ratio column is
time-to-goal / 600 s. Prints the curve of each run and a table.

    python bench/rg_task.py [--seeds 1 2 3] [--steps 200] [--validate-freq 20] [overrides ...]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launch_runs import REPO, timed_train_run  # noqa: E402

BUDGET_S = 600.0
RISE = 0.4


def run(seed: int, steps: int, validate_freq: int, extra: list[str]) -> dict:
    rows, t0, wall = timed_train_run(
        [
            "task=rg_aiw",
            f"seed={seed}",
            f"train_worker.total_train_steps={steps}",
            f"validate.eval.validate_freq={validate_freq}",
            *extra,
        ],
        f"rg_aiw_seed{seed}",
    )
    curve = [(r["step"], r["time"] - t0, r["val/reward"]) for r in rows if "val/reward" in r]
    start = curve[0][2]
    reached = next((c for c in curve if c[2] - start >= RISE), None)
    return {
        "seed": seed,
        "curve": curve,
        "start": start,
        "end": curve[-1][2],
        "best": max(c[2] for c in curve),
        "goal_step": reached[0] if reached else None,
        "goal_s": reached[1] if reached else None,
        "wall": wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", nargs="+", type=int, default=[1])
    p.add_argument("--steps", type=int, default=None, help="default: the task's total_train_steps")
    p.add_argument("--validate-freq", type=int, default=20)
    p.add_argument("overrides", nargs="*", help="more Hydra overrides for every run")
    args = p.parse_args()
    steps = args.steps
    if steps is None:
        sys.path.insert(0, REPO)
        from tests.conftest import compose_config

        steps = compose_config(["task=rg_aiw"])["train_worker"]["total_train_steps"]
    results = []
    for seed in args.seeds:
        r = run(seed, steps, args.validate_freq, args.overrides)
        results.append(r)
        points = "  ".join(f"{s}:{v:.2f}@{t:.0f}s" for s, t, v in r["curve"])
        print(f"seed {seed} curve (step:val_reward@time)  {points}", flush=True)
    print(f"\ntask=rg_aiw steps={steps} (validation reward, greedy, held-out questions)")
    print(
        f"{'seed':>4} {'start':>6} {'end':>6} {'best':>6} {'+0.4 at step':>13} {'time to +0.4':>13} "
        f"{'/ 600 s':>8} {'wall':>7}"
    )
    for r in results:
        step = "never" if r["goal_step"] is None else str(r["goal_step"])
        secs = "-" if r["goal_s"] is None else f"{r['goal_s']:.0f} s"
        ratio = "-" if r["goal_s"] is None else f"{r['goal_s'] / BUDGET_S:.2f}"
        print(
            f"{r['seed']:>4} {r['start']:6.3f} {r['end']:6.3f} {r['best']:6.3f} {step:>13} {secs:>13} "
            f"{ratio:>8} {r['wall']:6.0f}s"
        )


if __name__ == "__main__":
    main()
