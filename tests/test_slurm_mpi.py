"""MPI mode under a real Slurm (the dev cluster's two hosts): srun --mpi=pmi2, a SIGKILLed rollout rank
on the other host survived, a trainer group across hosts, loopback refused on a job across hosts,
vLLM servers on both hosts fed by broadcast."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.helpers.hosts import DevHosts, listening_addresses
from tests.test_mpi import (
    assert_trained_as_planned,
    declared_dead_at,
    failure_run_args,
    metrics,
    wait_for_steps,
)

pytestmark = pytest.mark.e2e


def srun_launch_train(nodes: tuple[str, ...]) -> list[str]:
    """``srun --mpi=pmi2`` of one MPI-mode run, rank ``i`` on ``nodes[i]`` (any rank failing ends it)."""
    return [
        "srun",
        "--mpi=pmi2",
        f"-n{len(nodes)}",
        "--distribution=arbitrary",
        f"--nodelist={','.join(nodes)}",
        "--kill-on-bad-exit=1",
        sys.executable,
        "-m",
        "launch.train",
        "launch_mode=mpi",
    ]


def test_srun_pmi2_killed_rollout_rank_with_continue_loses_and_doubles_nothing(
    slurm_env: dict[str, str], two_hosts: DevHosts, tmp_path: Path
) -> None:
    """The rank killed is on the other host than rank 0: its loss is seen over the network."""
    steps = 16
    run_dir = tmp_path / "srun"
    srun = ["srun", "--mpi=pmi2", "-N2", "-n4", "--kill-on-bad-exit=0"]
    cmd = [
        *srun,
        sys.executable,
        "-m",
        "launch.train",
        "launch_mode=mpi",
        f"runtime.rpc.interface={two_hosts.network}",
    ]
    proc = subprocess.Popen(
        [*cmd, *failure_run_args(run_dir, "continue", steps)],
        cwd=REPO,
        env=slurm_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_steps(run_dir, proc)
    ranks = json.loads((run_dir / "logs" / "ranks.json").read_text())
    victim = [r for r in ranks if r["group"] == "rollout"][1]
    assert victim["host"] != ranks[0]["host"] and victim["address"] != ranks[0]["address"]
    killed_at = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    when, line = declared_dead_at(run_dir, victim["rank"])
    assert when - killed_at <= 2 * 1.0 + 0.1, line  # within 2x the heartbeat interval
    assert "rollout_worker_1" in line
    assert "last validation" in out or "run dir:" in out  # rank 0 finished the run
    assert_trained_as_planned(run_dir, steps)


def test_mpi_start_up_across_nodes_never_hangs(slurm_env: dict[str, str]) -> None:
    """runtime.mpi_env's netmod: MPI_Init over srun --mpi=pmi2 on two nodes, 8 starts in a row.

    With MPICH's UCX netmod about one such start in three hung (slurmstepd: "value not properly
    terminated in client request"), so 8 clean starts would pass by chance about once in twenty."""
    srun = ["srun", "--mpi=pmi2", "-N2", "-n2", "--time=2", "--kill-on-bad-exit=1"]  # a node root each
    for attempt in range(8):
        try:
            proc = subprocess.run(
                [*srun, sys.executable, "-m", "tests.helpers.mpi_start"],
                cwd=REPO,
                env=slurm_env,
                capture_output=True,
                text=True,
                timeout=90,
            )
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"start {attempt}: MPI_Init hung for 90 s; stderr:\n{exc.stderr}")
        assert proc.returncode == 0, f"start {attempt}: {proc.stderr[-2000:]}"
        assert proc.stdout.strip() == "started [0, 1]", proc.stdout
        assert "not properly terminated" not in proc.stderr, proc.stderr[-2000:]


def test_srun_without_pmi2_is_refused_by_every_task(slurm_env: dict[str, str], tmp_path: Path) -> None:
    """srun without an MPI plugin gives every task a world of its own: each would run the whole job
    into the same run dir. Every task refuses, saying what to change, before anything runs."""
    run_dir = tmp_path / "no_pmi"
    proc = subprocess.run(
        [
            "srun",
            "--mpi=none",
            "-N1",
            "-n2",
            sys.executable,
            "-m",
            "launch.train",
            "launch_mode=mpi",
            f"run_dir={run_dir}",
        ],
        cwd=REPO,
        env=slurm_env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (
        proc.stderr.count(
            "srun started 2 tasks but MPI sees a world of 1: srun must start them with --mpi=pmi2"
        )
        == 2
    )
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()


def test_loopback_on_a_job_across_hosts_is_refused_by_every_rank(
    slurm_env: dict[str, str], two_hosts: DevHosts, tmp_path: Path
) -> None:
    """srun spreads the ranks over both hosts; the default runtime.rpc.interface (127.0.0.1) would
    announce addresses no other host reaches. Every rank finds out at start-up, before binding
    anything; rank 0 says which key, which ranks, which hosts; nothing runs."""
    run_dir = tmp_path / "loopback"
    proc = subprocess.run(
        [
            "srun",
            "--mpi=pmi2",
            "-N2",
            "-n3",
            sys.executable,
            "-m",
            "launch.train",
            "launch_mode=mpi",
            f"run_dir={run_dir}",
        ],
        cwd=REPO,
        env=slurm_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    hostnames = sorted(n["hostname"] for n in two_hosts.nodes)
    assert (
        "runtime.rpc.interface: '127.0.0.1' resolves to loopback (127.0.0.1) on rank(s) 0, 1, 2"
        in proc.stderr
    )
    assert "the job's ranks are on 2 hosts" in proc.stderr and all(
        f"{h}: rank(s)" in proc.stderr for h in hostnames
    )
    assert proc.stderr.count("error: invalid config") == 1  # rank 0 says it, once
    assert not (run_dir / "logs" / "ranks.json").exists() and not (run_dir / "checkpoints").exists()


def test_fsdp2_trainer_group_across_hosts_learns(
    slurm_env: dict[str, str], two_hosts: DevHosts, tmp_path: Path
) -> None:
    """One FSDP2 trainer rank per host: the trainer group's TCPStore, gloo and batch port over eth0
    (ranks 0, 2, 4 on one host, 1, 3 on the other: trainer ranks 1 and 2 apart)."""
    run_dir = tmp_path / "fsdp"
    n1, n2 = (n["name"] for n in two_hosts.nodes)
    proc = subprocess.Popen(
        [
            *srun_launch_train((n1, n2, n1, n2, n1)),
            f"run_dir={run_dir}",
            "seed=2",
            "service.train_service.engine=fsdp",
            "service.train_service.world_size=2",
            f"runtime.rpc.interface={two_hosts.interface}",
        ],
        cwd=REPO,
        env=slurm_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_steps(run_dir, proc, steps=1, timeout=600)
        ranks = json.loads((run_dir / "logs" / "ranks.json").read_text())
        # trainer rank 0 serves the group's TCPStore and batch port: on its eth0 address only
        node = {n["name"]: n for n in two_hosts.nodes}[ranks[1]["node"]]
        listening = listening_addresses(node["netns"], ranks[1]["pid"])
        assert len(listening) >= 4 and {a.rsplit(":", 1)[0] for a in listening} == {node["address"]}, (
            listening
        )
        out, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    assert [r["group"] for r in ranks] == ["driver", "trainer", "trainer", "rollout", "rollout"]
    assert [r["node"] for r in ranks] == [n1, n2, n1, n2, n1]
    trainers = [r for r in ranks if r["group"] == "trainer"]
    assert trainers[0]["host"] != trainers[1]["host"]  # one trainer rank per host
    assert trainers[0]["trainer_address"].startswith(trainers[0]["address"].rsplit(":", 1)[0])  # its eth0
    assert "collective sockets: GLOO_SOCKET_IFNAME=eth0" in (run_dir / "logs" / "rank_1.log").read_text()
    val = [(r["step"], r["val/accuracy"]) for r in metrics(run_dir) if "val/accuracy" in r]
    assert val[-1][0] == 50 and val[-1][1] >= 0.8, val
    ckpt = run_dir / "checkpoints" / "global_step_50"
    assert sorted(p.name for p in (ckpt / "optimizer").iterdir()) == [
        "rank_0.safetensors",
        "rank_1.safetensors",
    ]


def test_vllm_rollout_ranks_on_both_hosts_learn_by_broadcast(
    slurm_env: dict[str, str], two_hosts: DevHosts, tmp_path: Path
) -> None:
    """The default task with backend=vllm under srun: a CPU vLLM server on each host's rollout rank
    (driver and rollout rank 0 on one host, trainer and rollout rank 1 on the other). Every sync is
    a broadcast over the cluster network through vLLM's weight-transfer API to both servers, each
    verified to compute with the trainer's weights; nothing goes through the filesystem; 20 steps
    of it lift held-out accuracy by 0.3 or more (the default run's bar under Slurm is the two-host
    local-engine run's, tests/test_slurm_launcher.py)."""
    run_dir = tmp_path / "vllm"
    n1, n2 = (n["name"] for n in two_hosts.nodes)
    proc = subprocess.run(
        [
            *srun_launch_train((n1, n2, n1, n2)),
            f"run_dir={run_dir}",
            "seed=2",
            "service.inference_service.backend=vllm",
            f"runtime.rpc.interface={two_hosts.interface}",
            "train_worker.total_train_steps=20",
            "validate.eval.validate_freq=0",  # the held-out set before and after
            "logger.backend=[]",
        ],
        cwd=REPO,
        env=slurm_env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    ranks = json.loads((run_dir / "logs" / "ranks.json").read_text())
    rollout_hosts = {r["host"] for r in ranks if r["group"] == "rollout"}
    assert len(rollout_hosts) == 2, ranks
    rows = metrics(run_dir)
    syncs = [r for r in rows if "weight_sync/seconds" in r]
    assert len(syncs) >= 20 and all(r["weight_sync/bytes"] > 0 for r in syncs)
    assert max(r["weight_sync/verify_max_abs_diff"] for r in syncs) <= 1e-4
    assert "verified on 2 engine(s)" in (run_dir / "train.log").read_text()
    assert not (run_dir / "weights").exists()
    val = [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r]
    assert [v[0] for v in val] == [0, 20] and val[1][1] - val[0][1] >= 0.3, val
