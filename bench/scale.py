"""Rollout throughput from 1 to 32 rollout ranks (mpirun, oversubscribed on this machine).

Each rollout rank runs a rollout worker whose LLM is a fake that takes ``--latency-ms`` per request
(``service.inference_service.backend=fake``); the trainer is a no-op, so the measured rate is what
the rollout side and the controller's data path (rank 0: loader, pool, processor, weight sync)
sustain. Every step hands each rank ``--waves`` x ``--concurrency`` tasks, so the ideal rate is
ranks x concurrency / latency. Efficiency = measured / (ranks x the 1-rank rate). Rank 0's CPU
use per trajectory shows where the controller saturates. Goal: >= 90% linear efficiency.

    python bench/scale.py [--ranks 1 2 4 8 16 32] [--latency-ms 500] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(ranks: int, latency_ms: float, concurrency: int, waves: int, steps: int) -> dict[str, float]:
    run_dir = tempfile.mkdtemp(prefix=f"nexrl_scale_{ranks}_")
    per_step = ranks * concurrency * waves  # trajectories
    cmd = [
        "mpirun",
        "-n",
        str(ranks + 1),
        sys.executable,
        "-m",
        "launch.train",
        "launch_mode=mpi",
        f"run_dir={run_dir}",
        "service.inference_service.backend=fake",
        f"service.inference_service.fake_latency_ms={latency_ms}",
        "service.train_service.backend=noop",
        f"data.batch_size={per_step // 8}",
        "data.rollout_repeat_n=8",
        f"rollout_worker.max_concurrency={concurrency}",
        f"rollout_worker.fetch_size={concurrency}",
        f"train_worker.total_train_steps={steps}",
        "train_worker.save_freq=0",
        "validate.validate_before_train=false",
        "validate.validate_at_end=false",
        "validate.eval.validate_freq=0",
        "logger.backend=[]",
        "runtime_monitor.health_check.check_interval=5.0",
        "runtime_monitor.health_check.timeout=30.0",
    ]
    out_path = os.path.join(run_dir, "mpirun.out")  # mpirun's own report of a failed rank goes here
    with open(out_path, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.PIPE, text=True)
    ranks_file = os.path.join(run_dir, "logs", "ranks.json")
    while not os.path.exists(ranks_file):
        if proc.poll() is not None:
            raise SystemExit(
                f"run with {ranks} rollout ranks failed (exit {proc.returncode}):\n{proc.stderr.read()[-3000:]}"
            )
        time.sleep(0.2)
    time.sleep(0.5)
    with open(ranks_file) as f:
        placed = json.load(f)
    pid0 = placed[0]["pid"]
    rollout_ranks = sum(1 for r in placed if r["group"] == "rollout")
    if rollout_ranks != ranks:  # the no-op trainer lives on rank 0: every other rank rolls out
        proc.kill()
        raise SystemExit(f"placement gave {rollout_ranks} rollout ranks, not {ranks}: {ranks_file}")
    cpu0_start = cpu_seconds(pid0)
    cpu0 = cpu0_start
    t_start = time.monotonic()
    while proc.poll() is None:  # rank 0's CPU time, read while it runs
        try:
            cpu0 = cpu_seconds(pid0)
        except (FileNotFoundError, ProcessLookupError):
            break
        time.sleep(0.25)
    wall = time.monotonic() - t_start
    _, err = proc.communicate(timeout=3600)
    if proc.returncode != 0:
        with open(out_path) as f:
            mpirun_out = f.read()[-2000:]
        raise SystemExit(
            f"run with {ranks} rollout ranks failed (exit {proc.returncode}):\n{err[-3000:]}\n{mpirun_out}"
        )
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if "train/reward_mean" in line]
    timed = rows[1:]  # the first step includes start-up
    elapsed = timed[-1]["time"] - rows[0]["time"]
    rate = len(timed) * per_step / elapsed
    return {
        "rate": rate,
        "step_s": elapsed / len(timed),
        "ideal_rate": ranks * concurrency / (latency_ms / 1000.0),
        "rank0_busy": (cpu0 - cpu0_start) / wall,  # share of one core the controller's rank used
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--latency-ms", type=float, default=500.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--waves", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    results = {}
    for n in args.ranks:
        results[n] = run(n, args.latency_ms, args.concurrency, args.waves, args.steps)
        print(f"{n} rollout ranks: {results[n]['rate']:,.0f} trajectories/s", file=sys.stderr)
    base = results[args.ranks[0]]["rate"] / args.ranks[0]
    print()
    print(
        f"fake LLM latency {args.latency_ms:.0f} ms, {args.concurrency} requests in flight per rank, {args.waves} waves per step, {os.cpu_count()} CPU cores"
    )
    print()
    print(
        "| rollout ranks | processes | trajectories/s | ideal (ranks x concurrency / latency) | step | efficiency vs linear | rank 0 CPU (share of a core) |"
    )
    print("|---|---|---|---|---|---|---|")
    for n, r in results.items():
        eff = r["rate"] / (base * n)
        print(
            f"| {n} | {n + 1} | {r['rate']:,.0f} | {r['ideal_rate']:,.0f} | {r['step_s']:.2f} s | {eff:.0%} | {r['rank0_busy']:.0%} |"
        )


if __name__ == "__main__":
    main()
