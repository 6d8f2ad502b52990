"""Throughput of fully-async and batch-async RL against sync mode, with generation time ≈ train step time.

The trainer is the real one (the default task's tiny model); the LLM is the fake
engine (``service.inference_service.backend=fake``), whose requests take ``--gen-ms`` each — by
default the trainer's own step time, measured first in a calibration run, so that generating a
batch takes as long as training on it. Sync mode pays generation + training per step; the async
modes overlap them. Perfectly overlapped, a step costs the longer of generating a batch (the
fake engine's latency: a batch's requests run together) and training on it (sync mode's median
train time), so the ideal speedup is ``sync s/step / max(generation s, train s)`` (≈ 2x when the
two are equal); it is printed beside each speedup with the fraction of it reached. Throughput counts trained trajectories from
the end of the first step to the end of the last (warm-up excluded).

``--launch local`` runs everything in this process: the rollout side (fake engine, rollout worker,
reward threads) shares the trainer's interpreter and takes GIL time from it. ``--launch mpi`` puts
the driver, the trainer and the rollout side on three ranks (``mpirun -n 3``), as on a cluster.

    python bench/async.py [--steps 30] [--gen-ms auto] [--repeats 1] [--launch local|mpi]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

from local_run import run_local, run_mpi

GOALS = {"fully-async": 1.9, "batch-async": 1.6}
GOAL_OF_IDEAL = {"fully-async": 0.97}


def run(mode: str, threshold: int, steps: int, gen_ms: float, launch: str) -> dict[str, float]:
    overrides = [
        f"weight.sync_mode={mode}",
        f"weight.staleness_threshold={threshold}",
        "service.inference_service.backend=fake",
        f"service.inference_service.fake_latency_ms={gen_ms}",
        "service.train_service.num_threads=1",  # the rollout side needs the other core
        f"train_worker.total_train_steps={steps}",
    ]
    prefix = f"nexrl_bench_async_{mode}_"
    # mpi: driver, trainer and rollout side (worker + fake engine) on ranks 0, 1, 2
    cfg, rows = run_mpi(prefix, overrides, 3) if launch == "mpi" else run_local(prefix, overrides)
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
    parser.add_argument(
        "--launch",
        choices=["local", "mpi"],
        default="local",
        help="local: one process; mpi: mpirun -n 3 (driver, trainer, rollout side on ranks of their own)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("nexrl_hpc").setLevel(logging.WARNING)
    if args.gen_ms == "auto":
        calibration = run("sync", 0, max(6, args.steps // 3), 0.0, args.launch)
        gen_ms = round(1000 * calibration["train_s"], 1)
    else:
        gen_ms = float(args.gen_ms)
    modes = [("sync", 0), ("fully-async", 2), ("batch-async", 1)]
    results: dict[str, list[dict[str, float]]] = {m: [] for m, _ in modes}
    t0 = time.monotonic()
    for _ in range(args.repeats):
        for mode, threshold in modes:
            results[mode].append(run(mode, threshold, args.steps, gen_ms, args.launch))
    median = {m: sorted(rs, key=lambda r: r["per_s"])[len(rs) // 2] for m, rs in results.items()}
    sync = median["sync"]
    base = sync["per_s"]
    # overlapped perfectly, a step costs the longer of generating a batch and training on it
    ideal = sync["step_s"] / max(gen_ms / 1000, sync["train_s"])
    print()
    print(
        f"{args.launch} mode, generation {gen_ms:.1f} ms per request (fake engine), {args.steps} steps per run, "
        f"{args.repeats} run(s) per mode, {time.monotonic() - t0:.0f} s; "
        f"sync step {sync['step_s']:.3f} s of which training {sync['train_s']:.3f} s: ideal {ideal:.2f}x"
    )
    print()
    print(
        "| mode | staleness threshold | trajectories/s | s per step | median train s | max staleness | dropped "
        "| speedup vs sync | ideal | of ideal | goal |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for mode, threshold in modes:
        r = median[mode]
        speedup = r["per_s"] / base
        goals = [f"≥ {GOALS[mode]:.1f}x"] if mode in GOALS else []
        goals += [f"≥ {GOAL_OF_IDEAL[mode]:.2f} of ideal"] if mode in GOAL_OF_IDEAL else []
        print(
            f"| {mode} | {threshold if mode != 'sync' else '-'} | {r['per_s']:.0f} | {r['step_s']:.3f} | "
            f"{r['train_s']:.3f} | {r['staleness_max']:.0f} | {r['dropped']:.0f} | {speedup:.2f}x | "
            + (f"{ideal:.2f}x | {speedup / ideal:.2f} | " if mode != "sync" else "- | - | ")
            + f"{', '.join(goals) or '-'} |"
        )


if __name__ == "__main__":
    main()
