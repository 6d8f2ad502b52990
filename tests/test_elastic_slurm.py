"""launcher.elastic on the real dev cluster: the default task (the local engine, the tiny model) with
one rollout rank; join jobs submitted alongside the run's job join it, one is cancelled and one
preempted by a high-priority job, and the run finishes exactly as planned and learns as the default
run does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from tests.helpers.hosts import DevHosts
from tests.test_mpi import assert_trained_as_planned, metrics
from tests.test_slurm_launcher import launch, sacct_state, trained_steps, wait_until

pytestmark = pytest.mark.e2e
STEPS = 80  # the default task; 30 steps more than its default run: room for every event on a slow machine


def joined(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Joined ranks by their Slurm job id."""
    path = run_dir / "elastic" / "members.json"
    if not path.exists():
        return {}
    return {m["job"]: m for m in json.loads(path.read_text())["members"] if m["job"]}


def test_elastic_join_jobs_join_then_one_is_cancelled_and_one_preempted(
    slurm_env: dict[str, str], slurm_hosts: DevHosts, tmp_path: Path
) -> None:
    """The run's job (1 rollout rank) in partition high, 2 join jobs in partition debug (the
    preemptible one): one submitted with the run (launcher.elastic.count=1), one by hand once the
    run trains with the first; both join (rollout/live_ranks 3); one is scancelled mid-run, the
    other is preempted by a high-priority job that needs its CPU (--no-requeue: it is gone, not
    requeued); the run goes on with its own rank and finishes, every step once, every prompt as
    planned, and its held-out accuracy at the end is the default run's."""
    run_dir = tmp_path / "elastic"
    interface = [f"runtime.rpc.interface={slurm_hosts.network}"] if slurm_hosts.two_hosts else []
    args = [
        f"run_dir={run_dir}",
        f"train_worker.total_train_steps={STEPS}",
        "logger.dump_rollouts=true",
        "validate.validate_before_train=false",
        "validate.eval.validate_freq=0",  # the held-out set once, at the end
        "logger.backend=[]",
        "launcher.rollout_ranks=1",
        "launcher.partition=high",
        "launcher.elastic.count=1",
        "launcher.elastic.partition=debug",
        "runtime_monitor.health_check.check_interval=1.0",
        "runtime_monitor.health_check.timeout=5",
        *interface,
    ]
    proc = launch(slurm_env, args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads((run_dir / "launcher.json").read_text())
    job_id, join_jobs = info["job_id"], info["elastic_jobs"]
    assert len(join_jobs) == 1
    wait_until(
        lambda: (
            (run_dir / "metrics.jsonl").exists()
            and any(r.get("rollout/live_ranks") == 2 for r in metrics(run_dir))
        ),
        300,
        "a step with the first join job's rank",
    )
    by_hand = subprocess.run(  # docs/elastic.md: "Submit more by hand at any time"
        [
            "sbatch",
            "--parsable",
            "--no-requeue",
            "--partition=debug",
            "--ntasks=1",
            f"--chdir={REPO}",
            f"--output={tmp_path}/join-%j.out",
            f"--wrap={sys.executable} -m launch.join --wait {run_dir}",
        ],
        env=slurm_env,
        capture_output=True,
        text=True,
        check=True,
    )
    join_jobs.append(by_hand.stdout.strip().split(";")[0])
    wait_until(
        lambda: all(joined(run_dir).get(j, {}).get("first_task_at") for j in join_jobs),
        300,
        "both join jobs serving",
    )
    wait_until(
        lambda: any(r.get("rollout/live_ranks") == 3 for r in metrics(run_dir)),
        120,
        "a step with 3 rollout ranks",
    )
    cancelled, preempted = join_jobs
    subprocess.run(["scancel", cancelled], env=slurm_env, check=True)
    wait_until(lambda: joined(run_dir)[cancelled]["state"] == "left", 120, "the cancelled rank's leave")
    # every CPU of the two nodes the run's own job leaves: only the preemptible join job can make room
    main_cpus = subprocess.run(
        ["squeue", "-h", "-j", job_id, "-o", "%C"], env=slurm_env, capture_output=True, text=True, check=True
    ).stdout.split()
    wanted = 8 - sum(int(c) for c in main_cpus)
    high = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "-p",
            "high",
            f"-n{wanted}",
            f"--output={tmp_path}/high-%j.out",
            "--wrap",
            "sleep 5",
        ],
        env=slurm_env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    wait_until(lambda: joined(run_dir)[preempted]["state"] == "left", 180, "the preempted rank's leave")
    wait_until(lambda: sacct_state(slurm_env, high) == "COMPLETED", 120, "the high-priority job")
    at_preemption = trained_steps(run_dir)
    wait_until(lambda: sacct_state(slurm_env, job_id) in ("COMPLETED", "FAILED", "CANCELLED"), 600, "the end")
    assert sacct_state(slurm_env, job_id) == "COMPLETED"
    assert at_preemption < STEPS  # the run was still training when its last joined rank went
    assert sacct_state(slurm_env, cancelled).split()[0] == "CANCELLED"  # "CANCELLED by <uid>"
    assert sacct_state(slurm_env, preempted).split()[0] in ("PREEMPTED", "CANCELLED")
    rows = [r for r in metrics(run_dir) if "rollout/live_ranks" in r]
    assert sum(r["rollout/joins"] for r in rows) == 2 and sum(r["rollout/leaves"] for r in rows) == 2
    assert rows[-1]["rollout/live_ranks"] == 1
    assert (
        "resumed at step" not in (run_dir / "train.log").read_text()
    )  # the run's own job was never preempted
    assert_trained_as_planned(run_dir, STEPS)
    val = [r["val/accuracy"] for r in metrics(run_dir) if "val/accuracy" in r]
    assert len(val) == 1 and val[0] >= 0.8, val  # test_e2e's bar for the default run
    status = subprocess.run(
        [sys.executable, "-m", "launch.status", str(run_dir)],
        cwd=REPO,
        env=slurm_env,
        capture_output=True,
        text=True,
    )
    assert f"{cancelled}: CANCELLED" in status.stdout
    assert "2 left" in status.stdout
