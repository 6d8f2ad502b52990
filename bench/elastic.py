"""Rollout throughput while rollout ranks join and leave a running mpirun job (``nexrl-join``).

``mpirun -n 2`` (rank 0 the driver roles and the no-op trainer, one rollout rank); each rollout
rank's LLM is a fake that answers after ``--latency-ms`` per request, ``--concurrency`` requests in
flight per rank, and every step hands out ``--waves`` x ``--concurrency`` tasks, so a step takes
``waves / ranks`` x latency on ``ranks`` rollout ranks. The bench then runs ``nexrl-join RUN_DIR``
twice (2, then 3 rollout ranks), SIGTERMs the joined ranks one by one (2, then 1), each capacity
level held for ``--phase-s`` seconds, and finally ends the run. Per phase: trajectories/s over the
steps wholly inside it (from the first step that starts after the level changed); the ideal is
capacity-proportional: ranks x concurrency / latency (what the phase's rollout ranks can generate).
``join time`` is from starting ``nexrl-join`` to rank 0 handing the joined worker its first task.

    python bench/elastic.py [--latency-ms 500] [--concurrency 64] [--waves 6] [--phase-s 25]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOAL_OF_IDEAL = 0.90
GOAL_JOIN_S = 10.0


def metrics(run_dir: str) -> list[dict[str, Any]]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [r for r in map(json.loads, f) if "train/reward_mean" in r]


def members(run_dir: str) -> list[dict[str, Any]]:
    path = os.path.join(run_dir, "elastic", "members.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return list(json.load(f)["members"])


def wait_for(what: str, check: Any, run: subprocess.Popen, timeout: float = 300.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        if run.poll() is not None:
            raise SystemExit(f"the run ended (exit {run.returncode}) while waiting for {what}")
        time.sleep(0.05)
    raise SystemExit(f"timed out waiting for {what}")


def join(run_dir: str, log: str) -> tuple[subprocess.Popen, float]:
    with open(log, "w") as out:
        started = time.time()
        proc = subprocess.Popen(
            [sys.executable, "-m", "launch.join", run_dir], cwd=REPO, stdout=out, stderr=subprocess.STDOUT
        )
    return proc, started


def served(run_dir: str, pid: int) -> dict[str, Any] | None:
    found = [m for m in members(run_dir) if m["pid"] == pid and m.get("first_task_at")]
    return found[0] if found else None


def rate(
    rows: list[dict[str, Any]], start: float, end: float, per_step: int
) -> tuple[float, int, set[float]]:
    """Trajectories/s over the steps that began after ``start`` and ended by ``end``; how many;
    the rollout ranks their step lines counted (rollout/live_ranks)."""
    spans = [(a, b) for a, b in zip(rows, rows[1:]) if a["time"] >= start and b["time"] <= end]
    if not spans:
        return 0.0, 0, set()
    seconds = sum(b["time"] - a["time"] for a, b in spans)
    return per_step * len(spans) / seconds, len(spans), {b.get("rollout/live_ranks", -1.0) for _, b in spans}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--latency-ms", type=float, default=500.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--waves", type=int, default=6)
    parser.add_argument("--phase-s", type=float, default=25.0)
    args = parser.parse_args()
    run_dir = tempfile.mkdtemp(prefix="nexrl_bench_elastic_")
    per_step = args.waves * args.concurrency
    cmd = [
        "mpirun",
        "-n",
        "2",  # the no-op trainer needs no rank of its own: the driver and one rollout rank
        sys.executable,
        "-m",
        "launch.train",
        "launch_mode=mpi",
        f"run_dir={run_dir}",
        "service.inference_service.backend=fake",
        f"service.inference_service.fake_latency_ms={args.latency_ms}",
        "service.train_service.backend=noop",
        f"data.batch_size={per_step // 8}",
        "data.rollout_repeat_n=8",
        f"rollout_worker.max_concurrency={args.concurrency}",
        f"rollout_worker.fetch_size={args.concurrency}",
        "train_worker.total_train_steps=100000",
        "train_worker.save_freq=0",
        "validate.validate_before_train=false",
        "validate.validate_at_end=false",
        "validate.eval.validate_freq=0",
        "logger.backend=[]",
        "runtime_monitor.health_check.check_interval=2.0",
        "runtime_monitor.health_check.timeout=10.0",
    ]
    with open(os.path.join(run_dir, "mpirun.out"), "w") as out:
        run = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    phases: list[tuple[int, float, float]] = []  # (rollout ranks, start, end)
    joined: list[subprocess.Popen] = []
    join_times: list[float] = []
    try:
        wait_for("the first steps", lambda: len(metrics(run_dir)) >= 2, run)
        start = time.time()
        for ranks in (1, 2, 3, 2, 1):
            if ranks > len(joined) + 1:  # one more: nexrl-join, held from its first task on
                proc, launched = join(run_dir, os.path.join(run_dir, f"join_{len(join_times)}.out"))
                member = wait_for("the joiner's first task", lambda p=proc: served(run_dir, p.pid), run)
                join_times.append(member["first_task_at"] - launched)
                joined.append(proc)
            elif ranks < len(joined) + 1:  # one fewer: the last joiner is cancelled
                proc = joined.pop()
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
                wait_for(
                    "its leave",
                    lambda p=proc: any(m["pid"] == p.pid and m["state"] == "left" for m in members(run_dir)),
                    run,
                )
            start = time.time()
            time.sleep(args.phase_s)
            phases.append((ranks, start, time.time()))
    finally:
        for proc in joined:
            proc.send_signal(signal.SIGTERM)
        os.killpg(run.pid, signal.SIGTERM)
        try:
            run.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
    rows = metrics(run_dir)
    base = args.concurrency / (args.latency_ms / 1000.0)
    print(
        f"{per_step} trajectories per step, fake engine {args.latency_ms:.0f} ms/request, "
        f"{args.concurrency} in flight per rollout rank; ideal = rollout ranks x {base:.1f}/s"
    )
    print("| phase | rollout ranks | steps | trajectories/s | ideal | of ideal |")
    print("|---|---|---|---|---|---|")
    lines = []
    for i, (ranks, start, end) in enumerate(phases, 1):
        measured, steps, seen = rate(rows, start, end, per_step)
        if seen != {float(ranks)}:
            raise SystemExit(f"phase {i}: the run counted {sorted(seen)} rollout ranks, not {ranks}")
        ideal = ranks * base
        print(f"| {i} | {ranks} | {steps} | {measured:.1f} | {ideal:.1f} | {measured / ideal:.2f} |")
        lines.append(
            f"{ranks} rollout rank(s), phase {i}: {measured:.1f} trajectories/s, ideal {ideal:.1f}: {measured / ideal:.2f} of ideal"
        )
    print()
    print("\n".join(lines))
    for i, seconds in enumerate(join_times, 1):
        print(f"join time: {seconds:.1f} s (joiner {i}: nexrl-join to its first task)")
    worst = min(float(line.rsplit(": ", 1)[1].split()[0]) for line in lines)
    print(
        f"goal >= {GOAL_OF_IDEAL:.2f} of ideal at every level: {'met' if worst >= GOAL_OF_IDEAL else 'NOT met'} "
        f"(lowest {worst:.2f}); join time <= {GOAL_JOIN_S:.0f} s: "
        f"{'met' if max(join_times) <= GOAL_JOIN_S else 'NOT met'} (longest {max(join_times):.1f} s)"
    )
    print(f"run dir: {run_dir}")


if __name__ == "__main__":
    main()
