"""Wall time to validation accuracy >= 0.9: nexrl_hpc vs TRL's GRPOTrainer, same model/task/hyperparameters.

For each seed, nexrl_hpc runs first (``python -m launch.train``, validating after every step); its
run dir provides the initial model (``base_model/``) and the data (``data/train.jsonl``,
``data/validation.jsonl``) that TRL then trains on (bench/trl_baseline.py). Both use 32 prompts x 8
samples, 2 new tokens, temperature 1, AdamW lr 1e-3 constant, clip 0.2, no KL, token-mean loss,
group-std advantages, greedy validation on the same 140 held-out prompts after every step.
"training" time starts after start-up (first rollout); "with start-up" counts from process start.

    python bench/learning.py [--seeds 1 2 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_nexrl(run_dir: str, seed: int, target: float, max_steps: int, extra: list[str]) -> dict:
    t_start = time.time()
    cmd = [
        sys.executable,
        "-m",
        "launch.train",
        f"run_dir={run_dir}",
        f"seed={seed}",
        f"train_worker.total_train_steps={max_steps}",
        "validate.eval.validate_freq=1",
        "train_worker.save_freq=0",
        "logger.backend=[]",
        "resume.mode=disable",
        *extra,
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"nexrl_hpc run failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    val = [r for r in rows if "val/accuracy" in r]
    t0 = val[0]["time"]  # end of validation before training = start of the first rollout
    hit = next((r for r in val if r["val/accuracy"] >= target), None)
    return {
        "framework": "nexrl_hpc",
        "seed": seed,
        "initial_accuracy": val[0]["val/accuracy"],
        "hit_step": hit["step"] if hit else None,
        "seconds_to_target": hit["time"] - t0 if hit else None,
        "seconds_to_target_with_startup": hit["time"] - t_start if hit else None,
        "final_accuracy": val[-1]["val/accuracy"],
    }


def run_trl(run_dir: str, seed: int, target: float, max_steps: int) -> dict:
    cmd = [
        sys.executable,
        os.path.join(REPO, "bench", "trl_baseline.py"),
        "--model",
        os.path.join(run_dir, "base_model"),
        "--train",
        os.path.join(run_dir, "data", "train.jsonl"),
        "--val",
        os.path.join(run_dir, "data", "validation.jsonl"),
        "--seed",
        str(seed),
        "--target",
        str(target),
        "--max-steps",
        str(max_steps),
        "--out-dir",
        os.path.join(run_dir, "trl"),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"TRL run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--max-steps", type=int, default=80)
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for the nexrl_hpc side")
    args = parser.parse_args()
    results = []
    for seed in args.seeds:
        run_dir = tempfile.mkdtemp(prefix=f"nexrl_learning_s{seed}_")
        ours = run_nexrl(run_dir, seed, args.target, args.max_steps, args.overrides)
        trl = run_trl(run_dir, seed, args.target, args.max_steps)
        results.append((ours, trl))
        print(f"seed {seed}: nexrl_hpc {ours}\n         trl {trl}", file=sys.stderr)

    print()
    print(
        f"| seed | framework | initial val acc | steps to {args.target} | s to {args.target} (training) | s/step "
        f"| s to {args.target} (with start-up) | last val acc | ratio vs TRL (training) | ratio vs TRL (with start-up) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    ratios: dict[str, list[float]] = {"seconds_to_target": [], "seconds_to_target_with_startup": []}
    for ours, trl in results:
        row_ratios: dict[str, float | None] = {}
        for key, kept in ratios.items():
            ratio = ours[key] / trl[key] if ours.get(key) and trl.get(key) else None
            row_ratios[key] = ratio
            if ratio is not None:
                kept.append(ratio)
        ours_shown = [f"{fmt(v)}x" if v is not None else "n/a" for v in row_ratios.values()]
        for r, shown in ((ours, ours_shown), (trl, ["1.00x", "1.00x"])):
            per_step = r["seconds_to_target"] / r["hit_step"] if r.get("hit_step") else None
            last = r.get("final_accuracy", (r.get("accuracy_curve") or [None])[-1])
            print(
                f"| {r['seed']} | {r['framework']} | {r['initial_accuracy']:.3f} | {r['hit_step']} | "
                f"{fmt(r.get('seconds_to_target'))} | {fmt(per_step, '.3f')} | "
                f"{fmt(r.get('seconds_to_target_with_startup'))} | {fmt(last, '.3f')} | {shown[0]} | {shown[1]} |"
            )
    goals = {
        "seconds_to_target": ("training wall time", 0.50),
        "seconds_to_target_with_startup": ("wall time", 1.00),
    }
    for key, kept in ratios.items():
        name, goal = goals[key]
        median = f"{statistics.median(kept):.2f}x" if kept else "n/a"
        suffix = " with start-up" if key.endswith("startup") else ""
        print(
            f"median ratio nexrl_hpc / TRL ({name} to {args.target}{suffix}): {median} (goal <= {goal:.2f}x)"
        )


if __name__ == "__main__":
    main()
