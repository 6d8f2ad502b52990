"""Throughput of fully-async and batch-async RL against sync mode, with generation time ≈ train step time.

The trainer is the real one (the default task's tiny model, local mode); the LLM is the fake
engine (``service.inference_service.backend=fake``), whose requests take ``--gen-ms`` each — by
default the trainer's own step time, measured first in a calibration run, so that generating a
batch takes as long as training on it. Sync mode pays generation + training per step; the async
modes overlap them (ideal: 2x). Throughput counts trained trajectories from the end of the first
step to the end of the last (warm-up excluded).

    python bench/async.py [--steps 30] [--gen-ms auto] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hydra import compose, initialize_config_dir  # noqa: E402

from nexrl_hpc.config import register_resolvers, validate_config  # noqa: E402
from nexrl_hpc.controller import NexRLController  # noqa: E402

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
GOALS = {"fully-async": 1.9, "batch-async": 1.6}


def run(mode: str, threshold: int, steps: int, gen_ms: float) -> dict[str, float]:
    register_resolvers()
    run_dir = tempfile.mkdtemp(prefix=f"nexrl_bench_async_{mode}_")
    overrides = [
        f"run_dir={run_dir}",
        f"weight.sync_mode={mode}",
        f"weight.staleness_threshold={threshold}",
        "service.inference_service.backend=fake",
        f"service.inference_service.fake_latency_ms={gen_ms}",
        "service.train_service.num_threads=1",  # the rollout side needs the other core
        f"train_worker.total_train_steps={steps}",
        "train_worker.save_freq=0",
        "validate.validate_before_train=false",
        "validate.validate_at_end=false",
        "validate.eval.validate_freq=0",
        "logger.backend=[]",
        "resume.mode=disable",
    ]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3", job_name="bench"):
        cfg = validate_config(compose("rl_train", overrides=overrides))
    NexRLController(cfg).run()
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if "train/reward_mean" in line]
    elapsed = rows[-1]["time"] - rows[0]["time"]
    trajectories = sum(r["train/num_groups"] for r in rows[1:]) * cfg["data"]["rollout_repeat_n"]
    train_s = [r["timing/update_s"] + r["timing/export_s"] + r["timing/old_log_prob_s"] for r in rows[1:]]
    return {
        "per_s": trajectories / elapsed,
        "step_s": elapsed / (len(rows) - 1),
        "train_s": statistics.median(train_s),
        "staleness_max": max(r.get("train/staleness_max", 0.0) for r in rows),
        "dropped": rows[-1].get("train/stale_dropped_total", 0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--gen-ms", default="auto", help="fake generation time per request; auto: the train step time"
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs per mode; the table shows the median")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("nexrl_hpc").setLevel(logging.WARNING)
    if args.gen_ms == "auto":
        calibration = run("sync", 0, max(6, args.steps // 3), 0.0)
        gen_ms = round(1000 * calibration["train_s"], 1)
    else:
        gen_ms = float(args.gen_ms)
    modes = [("sync", 0), ("fully-async", 2), ("batch-async", 1)]
    results: dict[str, list[dict[str, float]]] = {m: [] for m, _ in modes}
    t0 = time.monotonic()
    for _ in range(args.repeats):
        for mode, threshold in modes:
            results[mode].append(run(mode, threshold, args.steps, gen_ms))
    median = {m: sorted(rs, key=lambda r: r["per_s"])[len(rs) // 2] for m, rs in results.items()}
    base = median["sync"]["per_s"]
    print()
    print(
        f"generation {gen_ms:.1f} ms per request (fake engine), {args.steps} steps per run, "
        f"{args.repeats} run(s) per mode, {time.monotonic() - t0:.0f} s"
    )
    print()
    print(
        "| mode | staleness threshold | trajectories/s | s per step | median train s | max staleness | dropped | speedup vs sync | goal |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for mode, threshold in modes:
        r = median[mode]
        goal = GOALS.get(mode)
        print(
            f"| {mode} | {threshold if mode != 'sync' else '-'} | {r['per_s']:.0f} | {r['step_s']:.3f} | "
            f"{r['train_s']:.3f} | {r['staleness_max']:.0f} | {r['dropped']:.0f} | {r['per_s'] / base:.2f}x | "
            f"{f'≥ {goal:.1f}x' if goal else '-'} |"
        )


if __name__ == "__main__":
    main()
