"""Steps and wall time to held-out accuracy >= 0.9 per algorithm preset, on the default task.

Every preset of configs/algorithm/ runs ``python -m launch.train algorithm=X seed=S`` with
validation after every step (the same greedy evaluation of the same 140 held-out prompts for all),
for each seed, in this one process on this machine; the ratio column compares each preset's median
training time to GRPO's (the default) measured in the same run. ``opd`` distills from a teacher:
the model of a finished default GRPO run (seed 0, trained first; its time is not counted).
Training time starts at the first rollout (after the validation before training). Each run's
last checkpoint is also scored by scripts/independent_eval.py (plain transformers, greedy, the same
held-out prompts): the "independent" column.

    python bench/algorithms.py [--seeds 1 2 3] [--algorithms grpo dapo ...] [--max-steps 50]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launch_runs import REPO, independent_accuracy, timed_train_run  # noqa: E402

PRESETS = ["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "dapo", "gspo", "opd"]
TARGET = 0.9


def train_teacher(max_steps: int) -> tuple[str, str]:
    """A finished default run (GRPO, seed 0): (its run dir, its last checkpoint's model)."""
    run_dir = tempfile.mkdtemp(prefix="bench_teacher_")
    cmd = [
        sys.executable,
        "-m",
        "launch.train",
        f"run_dir={run_dir}",
        "seed=0",
        "logger.backend=[]",
        f"train_worker.total_train_steps={max_steps}",
        "resume.mode=disable",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the teacher run failed:\n{proc.stderr[-3000:]}")
    return run_dir, os.path.join(run_dir, "checkpoints", f"global_step_{max_steps}", "model")


def measure(preset: str, seed: int, max_steps: int, teacher: str | None) -> dict:
    overrides = [
        f"algorithm={preset}",
        f"seed={seed}",
        f"train_worker.total_train_steps={max_steps}",
        "validate.eval.validate_freq=1",
        "train_worker.save_freq=0",
    ]
    if preset == "opd":
        overrides.append(f"algorithm.teacher_model_path={teacher}")
    independent: dict[str, float] = {}

    def evaluate_last_checkpoint(run_dir: str) -> None:
        independent["accuracy"] = independent_accuracy(run_dir, f"{preset} seed {seed}")

    rows, _, wall = timed_train_run(
        overrides, f"{preset}_seed{seed}", inspect_run_dir=evaluate_last_checkpoint
    )
    val = [r for r in rows if "val/accuracy" in r]
    start = val[0]["time"]  # the validation before training has ended: the first rollout starts
    hit = next((r for r in val if r["val/accuracy"] >= TARGET), None)
    return {
        "steps": hit["step"] if hit else None,
        "seconds": hit["time"] - start if hit else None,
        "final": val[-1]["val/accuracy"],
        "independent": independent["accuracy"],
        "wall": wall,
    }


def median_or_none(values: list) -> float | None:
    return statistics.median(values) if values and all(v is not None for v in values) else None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--algorithms", nargs="+", default=PRESETS, choices=PRESETS)
    parser.add_argument("--max-steps", type=int, default=50)
    args = parser.parse_args()
    teacher_dir, teacher = train_teacher(50) if "opd" in args.algorithms else (None, None)
    results: dict[str, list[dict]] = {}
    try:
        for preset in args.algorithms:
            results[preset] = [measure(preset, seed, args.max_steps, teacher) for seed in args.seeds]
            print(f"{preset}: {results[preset]}", flush=True)
    finally:
        if teacher_dir:
            shutil.rmtree(teacher_dir, ignore_errors=True)
    base = median_or_none([r["seconds"] for r in results.get("grpo", [])])
    print(f"\nseeds {args.seeds}, target held-out accuracy {TARGET}, at most {args.max_steps} steps\n")
    print(
        "| algorithm | steps to 0.9 (per seed) | median steps | median training s to 0.9 | vs grpo "
        "| final accuracy (per seed) | independent eval of the last checkpoint (per seed) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for preset, runs in results.items():
        steps = [r["steps"] for r in runs]
        median_steps = median_or_none(steps)
        secs = median_or_none([r["seconds"] for r in runs])
        ratio = f"{secs / base:.2f}x" if secs is not None and base else "-"
        finals = ", ".join(f"{r['final']:.2f}" for r in runs)
        independents = ", ".join(f"{r['independent']:.2f}" for r in runs)
        print(
            f"| {preset} | {', '.join(str(s) if s is not None else '-' for s in steps)} "
            f"| {median_steps if median_steps is not None else '-'} "
            f"| {f'{secs:.1f}' if secs is not None else '-'} | {ratio} | {finals} | {independents} |"
        )


if __name__ == "__main__":
    main()
