"""FrozenLake (``task=frozenlake``) learns: greedy success on held-out maps against the random policy.

Each seed runs ``python -m launch.train task=frozenlake seed=S`` as a user would (local mode),
validating greedily on the 128 held-out maps every ``--validate-freq`` steps. The baseline is the
exact success probability of uniformly random moves on the same maps within the same step budget
(``random_success`` of the validation rows). The clock starts at process start (model warm-up,
server start-up and validations included). Goal: success >= baseline + 0.2 within 10 minutes on
2 CPU cores; the ratio column is time-to-goal / 600 s.

    python bench/frozenlake.py [--seeds 1 2 3] [--steps 60] [overrides ...]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launch_runs import REPO, timed_train_run  # noqa: E402

BUDGET_S = 600.0
MARGIN = 0.2


def random_baseline(overrides: list[str]) -> float:
    """Mean random-policy success on the validation maps the run with ``overrides`` holds out."""
    sys.path.insert(0, REPO)
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from nexrl_hpc.assembly import validate_config
    from nexrl_hpc.config import register_resolvers
    from nexrl_hpc.config.location import config_dir
    from nexrl_hpc.tasks.frozenlake import generate_splits

    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name="bench"):
        cfg = validate_config(compose("rl_train", overrides=overrides))
    rows = generate_splits(cfg["task"]["params"], cfg["data"]["seed"])["validation"]
    return sum(r["random_success"] for r in rows) / len(rows)


def run(seed: int, steps: int, validate_freq: int, extra: list[str]) -> dict:
    overrides = [
        "task=frozenlake",
        f"seed={seed}",
        f"train_worker.total_train_steps={steps}",
        f"validate.eval.validate_freq={validate_freq}",
        *extra,
    ]
    baseline = random_baseline(overrides)
    rows, t0, wall = timed_train_run(overrides, f"frozenlake_{seed}")
    val = [r for r in rows if "val/is_correct" in r]
    reached = next((r for r in val if r["val/is_correct"] >= baseline + MARGIN), None)
    return {
        "seed": seed,
        "baseline": baseline,
        "start": val[0]["val/is_correct"],
        "end": val[-1]["val/is_correct"],
        "best": max(r["val/is_correct"] for r in val),
        "goal_step": reached["step"] if reached else None,
        "goal_s": reached["time"] - t0 if reached else None,
        "wall": wall,
        "curve": [(r["step"], r["val/is_correct"], r["time"] - t0) for r in val],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--validate-freq", type=int, default=10)
    p.add_argument("overrides", nargs="*", help="more Hydra overrides for every run")
    args = p.parse_args()
    results = [run(s, args.steps, args.validate_freq, args.overrides) for s in args.seeds]
    print(f"\ntask=frozenlake steps={args.steps} (greedy success on the held-out maps)")
    print(
        f"{'seed':>4} {'random':>7} {'start':>6} {'end':>6} {'best':>6} {'+0.2 at step':>13} "
        f"{'time to +0.2':>13} {'/ 600 s':>8} {'wall':>7}"
    )
    for r in results:
        step = "never" if r["goal_step"] is None else str(r["goal_step"])
        secs = "-" if r["goal_s"] is None else f"{r['goal_s']:.0f} s"
        ratio = "-" if r["goal_s"] is None else f"{r['goal_s'] / BUDGET_S:.2f}"
        print(
            f"{r['seed']:>4} {r['baseline']:7.3f} {r['start']:6.3f} {r['end']:6.3f} {r['best']:6.3f} {step:>13} "
            f"{secs:>13} {ratio:>8} {r['wall']:6.0f}s"
        )
    print("\ncurves (step: success @ seconds since process start)")
    for r in results:
        print(f"seed {r['seed']}: " + ", ".join(f"{s}: {v:.3f} @ {t:.0f}s" for s, v, t in r["curve"]))


if __name__ == "__main__":
    main()
