"""launcher.elastic: rollout jobs submitted alongside the run's job that join it (``nexrl-join``).

Each is a one-task job of its own (``launcher.elastic.partition`` / ``qos`` / ``time_min`` /
``gpus``: typically a preemptible or scavenger partition), never requeued (``--no-requeue``: a
preempted or cancelled one is simply gone, the run re-issues its tasks), which waits for the run's
door (``nexrl-join --wait``) and serves rollouts until the run ends, it is cancelled or preempted,
or its time is up. Nothing secret is on its command line or in its environment: it reads the
credential from the run dir, as the run's user.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

from nexrl_hpc.config.schema import RLTrainConfig


def join_job_command(config: RLTrainConfig, run_dir: str, folder: str) -> list[str]:
    """The sbatch command line of one join job."""
    lc = config["launcher"]
    el = lc["elastic"]
    script = "\n".join([*lc["setup"], shlex.join([sys.executable, "-m", "launch.join", "--wait", run_dir])])
    cmd = [
        "sbatch",
        "--parsable",
        "--no-requeue",
        f"--job-name={lc['job_name']}-join",
        f"--time={el['time_min']}",
        "--ntasks=1",
        f"--chdir={os.getcwd()}",
        f"--output={os.path.join(folder, 'join_%j.out')}",
    ]
    partition = el["partition"] or lc["partition"]
    if partition:
        cmd.append(f"--partition={partition}")
    if el["qos"]:
        cmd.append(f"--qos={el['qos']}")
    if lc["account"]:
        cmd.append(f"--account={lc['account']}")
    if el["gpus"]:
        cmd.append(f"--gpus-per-task={el['gpus']}")
    return [*cmd, f"--wrap={script}"]


def submit_join_jobs(config: RLTrainConfig, run_dir: str, folder: str) -> list[str]:
    """Submit ``launcher.elastic.count`` join jobs; their job ids."""
    ids = []
    for _ in range(config["launcher"]["elastic"]["count"]):
        proc = subprocess.run(
            join_job_command(config, run_dir, folder), capture_output=True, text=True, timeout=120
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"sbatch of a launcher.elastic join job failed: {proc.stderr.strip() or proc.returncode}"
            )
        ids.append(proc.stdout.strip().split(";")[0])
    return ids
