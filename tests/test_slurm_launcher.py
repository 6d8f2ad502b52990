"""launcher=slurm against the real dev cluster: a heterogeneous job that learns, preemption by signal
and by a high-priority job with exact resume, a sweep, and bad input refused before sbatch."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from tests.helpers.hosts import DevHosts, Outsider, listening_addresses
from tests.test_mpi import FAST, assert_trained_as_planned, metrics

pytestmark = pytest.mark.e2e


def launch(env: dict[str, str], args: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "launch.train", "launcher=slurm", "launcher.poll_s=1", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def sacct_state(env: dict[str, str], job_id: str) -> str:
    out = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-o", "JobID,State", "-j", job_id],
        env=env,
        capture_output=True,
        text=True,
    ).stdout
    states = [ln.split("|")[1] for ln in out.splitlines() if ln.split("|")[0] in (job_id, f"{job_id}+0")]
    return states[0] if states else "UNKNOWN"


def restarts(env: dict[str, str], job_id: str) -> int:
    out = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True).stdout
    return int(out.split("Restarts=")[1].split()[0])


def queued(env: dict[str, str]) -> str:
    return subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True).stdout


def trained_steps(run_dir: Path) -> int:
    if not (run_dir / "metrics.jsonl").exists():
        return 0
    return len([r for r in metrics(run_dir) if "train/reward_mean" in r])


def wait_until(check, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_heterogeneous_job_learns_across_two_hosts_and_shrugs_off_an_outsider(
    slurm_env: dict[str, str], two_hosts: DevHosts, outsider: Outsider, tmp_path: Path
) -> None:
    """The done-when run of the two-host dev cluster: rollout ranks want 2 CPUs, driver and trainer
    1: two components, each on a host of its own, binding eth0 (runtime.rpc.interface=eth0). While
    it trains, a host on the same network that is in no job (the outsider) sends every rank's ports
    the hostile inputs: all dropped and counted, nothing run, the run learns as before."""
    run_dir = tmp_path / "het"
    cmd = [
        sys.executable,
        "-m",
        "launch.train",
        "launcher=slurm",
        "launcher.poll_s=1",
        "launcher.wait=true",
        f"run_dir={run_dir}",
        "seed=2",
        "placement.resources.rollout.cpus_per_rank=2",
        f"runtime.rpc.interface={two_hosts.interface}",
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=slurm_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        ranks_file = run_dir / "logs" / "ranks.json"
        wait_until(lambda: ranks_file.exists() or proc.poll() is not None, 600, "the ranks' addresses")
        assert ranks_file.exists(), proc.communicate()[1][-3000:]
        ranks = json.loads(ranks_file.read_text())
        # each rank listens on its host's eth0 address only: not on loopback, not on every interface
        netns = {n["name"]: n["netns"] for n in two_hosts.nodes}
        node_addresses = {n["name"]: n["address"] for n in two_hosts.nodes}
        for r in ranks:
            listening = listening_addresses(netns[r["node"]], r["pid"])
            assert listening and {a.rsplit(":", 1)[0] for a in listening} == {node_addresses[r["node"]]}, (
                r,
                listening,
            )
        zmq_ports = [r["address"] for r in ranks] + [
            r["trainer_address"] for r in ranks if r["trainer_address"]
        ]
        lanes = [r["lane_address"] for r in ranks]
        marker = tmp_path / "pwned"
        attacked = outsider.python(
            ["-m", "tests.helpers.attack", "--marker", str(marker), "--zmq", *zmq_ports, "--lane", *lanes]
        )
        assert attacked.returncode == 0, attacked.stderr[-3000:]
        out, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    info = json.loads((run_dir / "launcher.json").read_text())
    assert info["heterogeneous"] and [c["ntasks"] for c in info["components"]] == [2, 2]
    assert f"submitted heterogeneous job (2 components) {info['job_id']}" in out
    assert f"job {info['job_id']}: COMPLETED" in out
    submission = (run_dir / "slurm" / f"{info['job_id']}_submission.sh").read_text()
    assert "#SBATCH hetjob" in submission and "--het-group=0-1" in submission and "--mpi=pmi2" in submission
    assert [r["group"] for r in ranks] == ["driver", "trainer", "rollout", "rollout"]
    # two hosts, each rank announcing its own host's eth0 address (never loopback)
    hosts = {r["group"]: r["host"] for r in ranks}
    assert hosts["driver"] == hosts["trainer"] != hosts["rollout"]
    for r in ranks:
        assert r["interface"] == "eth0" and r["address"].startswith(f"tcp://{node_addresses[r['node']]}:"), r
    assert len({node_addresses[r["node"]] for r in ranks}) == 2
    # the outsider's inputs: dropped at every port (4 per port), each logged (with its address where
    # ZMQ reports the peer), and counted in the step lines' rpc/rejected (a running total that
    # reaches the driver with the ranks' heartbeats: the last line may predate the last few
    # rejections, the logs do not)
    logs = "".join(p.read_text() for p in [run_dir / "train.log", *(run_dir / "logs").glob("rank_*.log")])
    assert logs.count(": rejected a message from ") >= 4 * (len(zmq_ports) + len(lanes))
    assert f"rejected a message from {outsider.address}:" in logs
    counted = [r["rpc/rejected"] for r in metrics(run_dir) if "train/reward_mean" in r]
    assert counted == sorted(counted) and counted[-1] >= 4, counted
    assert not marker.exists()
    val = [r["val/accuracy"] for r in metrics(run_dir) if "val/accuracy" in r]
    assert val[0] <= 0.3 and val[-1] >= 0.8, val
    # the default transport across hosts: every sync a broadcast to both rollout ranks' engines,
    # each verified to compute with the trainer's weights; no weights through the filesystem
    syncs = [r for r in metrics(run_dir) if "weight_sync/seconds" in r]
    assert len(syncs) >= 50 and all(r["weight_sync/bytes"] > 0 for r in syncs)
    assert all(r["weight_sync/verify_max_abs_diff"] <= 1e-4 for r in syncs), syncs
    assert "verified on 2 engine(s)" in (run_dir / "train.log").read_text()
    assert not (run_dir / "weights").exists()
    status = subprocess.run(
        [sys.executable, "-m", "launch.status", str(run_dir)],
        cwd=REPO,
        env=slurm_env,
        capture_output=True,
        text=True,
    )
    assert status.returncode == 0
    assert "COMPLETED" in status.stdout and "global_step_50" in status.stdout
    assert "finished (exit 0): run finished" in status.stdout


def across_hosts(hosts: DevHosts) -> list[str]:
    """A one-component job spread over both hosts (2 ranks each), binding the cluster network given
    as a CIDR (each rank resolves it to its own host's address)."""
    return ["launcher.nodes=2", f"runtime.rpc.interface={hosts.network}"]


def preemptible_run(run_dir: Path, steps: int) -> list[str]:
    """A short run with a fake LLM and rollout dumps (every trained prompt recorded per step)."""
    return [
        f"run_dir={run_dir}",
        f"train_worker.total_train_steps={steps}",
        "logger.dump_rollouts=true",
        "service.inference_service.backend=fake",
        "service.inference_service.fake_latency_ms=150",
        "data.batch_size=8",
        "train_worker.save_freq=4",
        "launcher.signal_grace_s=60",
        *FAST,
    ]


def test_usr2_twice_requeues_and_resumes_exactly(
    slurm_env: dict[str, str], two_hosts: DevHosts, tmp_path: Path
) -> None:
    steps, run_dir = 24, tmp_path / "usr2"
    proc = launch(slurm_env, [*preemptible_run(run_dir, steps), *across_hosts(two_hosts)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    job_id = json.loads((run_dir / "launcher.json").read_text())["job_id"]
    rng = random.Random(7)
    for round_, (low, high) in enumerate([(3, 8), (11, 16)], start=1):
        at = rng.randint(low, high)  # a random moment: some step in the window
        wait_until(lambda at=at: trained_steps(run_dir) >= at, 300, f"step {at}")
        subprocess.run(["scancel", "--signal=USR2", job_id], env=slurm_env, check=True)
        wait_until(lambda r=round_: restarts(slurm_env, job_id) >= r, 120, f"requeue {round_}")
    wait_until(lambda: sacct_state(slurm_env, job_id) in ("COMPLETED", "FAILED", "CANCELLED"), 600, "the end")
    assert sacct_state(slurm_env, job_id) == "COMPLETED"
    log = (run_dir / "train.log").read_text()
    assert log.count("checkpoint saved, the run resumes from it") == 2, log[-3000:]
    assert log.count("resumed at step") == 2
    assert restarts(slurm_env, job_id) == 2
    assert_trained_as_planned(run_dir, steps)  # every step once; every prompt as often as planned


def test_preemption_by_a_high_priority_job_resumes_exactly(
    slurm_env: dict[str, str], two_hosts: DevHosts, tmp_path: Path
) -> None:
    steps, run_dir = 20, tmp_path / "preempted"
    proc = launch(slurm_env, [*preemptible_run(run_dir, steps), *across_hosts(two_hosts)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    job_id = json.loads((run_dir / "launcher.json").read_text())["job_id"]
    wait_until(lambda: trained_steps(run_dir) >= 6, 300, "step 6")
    # every CPU of both nodes, in the high-priority partition: the run's job must make room
    high = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "-p",
            "high",
            "-N2",
            "--ntasks-per-node=4",
            f"--output={tmp_path}/high-%j.out",
            "--wrap",
            "sleep 8",
        ],
        env=slurm_env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    wait_until(lambda: restarts(slurm_env, job_id) >= 1, 120, "the preemption requeue")
    wait_until(lambda: sacct_state(slurm_env, high) == "COMPLETED", 120, "the high-priority job")
    wait_until(lambda: sacct_state(slurm_env, job_id) in ("COMPLETED", "FAILED", "CANCELLED"), 600, "the end")
    assert sacct_state(slurm_env, job_id) == "COMPLETED"
    assert "resumed at step" in (run_dir / "train.log").read_text()
    assert_trained_as_planned(run_dir, steps)


def test_a_two_point_sweep_gives_two_finished_runs(slurm_env: dict[str, str], tmp_path: Path) -> None:
    # one host per point: two two-node MPICH jobs starting at once have hung in MPI_Init (the
    # bootstrap watchdog then failed the job); hosts are covered by the tests above and below
    run_dir = tmp_path / "sweep"
    args = [a for a in preemptible_run(run_dir, 6) if not a.startswith("run_dir=")]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.train",
            "-m",
            "launcher=slurm",
            f"run_dir={run_dir}",
            "seed=1,2",
            *args,
        ],
        cwd=REPO,
        env=slurm_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = [json.loads((run_dir / str(k) / "launcher.json").read_text())["job_id"] for k in (0, 1)]
    assert len(set(jobs)) == 2
    listed = [f"  {run_dir / str(k)} (Slurm job {job})" for k, job in enumerate(jobs)]
    assert "\n".join(["sweep of 2 run(s):", *listed]) in proc.stdout, proc.stdout[-2000:]
    try:
        for job in jobs:
            wait_until(
                lambda job=job: sacct_state(slurm_env, job) in ("COMPLETED", "FAILED"), 600, f"job {job}"
            )
            assert sacct_state(slurm_env, job) == "COMPLETED"
    finally:  # a job left behind would hold the nodes the next tests need
        subprocess.run(["scancel", *jobs], env=slurm_env)
    seeds = [yaml.safe_load((run_dir / str(k) / "config.yaml").read_text())["seed"] for k in (0, 1)]
    assert seeds == [1, 2]
    for k in (0, 1):  # each point is a run of its own: its steps, its checkpoints
        assert trained_steps(run_dir / str(k)) == 6
        assert (run_dir / str(k) / "checkpoints" / "global_step_6" / "COMPLETE").exists()
    assert not (run_dir / "checkpoints").exists()


@pytest.mark.parametrize(
    ("args", "path", "says"),
    [
        (
            ["launcher.partition=nowhere"],
            "launcher.partition",
            "unknown partition 'nowhere' (available: debug, high)",
        ),
        (
            [
                "placement.mode=manual",
                "+placement.roles.rollout_worker={count:2,colocation_group:rollout}",
                "+placement.roles.inference_service={count:1,colocation_group:rollout}",
            ],
            "placement.roles (rollout)",
            "All roles in colocation group must have same count",
        ),
        (["data.batch_size=0"], "data.batch_size", ">= 1"),
        # placements that cannot fit the dev cluster (2 nodes of 4 CPUs): Slurm would queue them for good
        (
            ["launcher.rollout_ranks=7"],
            "launcher.partition",
            "the job (driver, trainer, rollout) needs 9 task(s) x 1 CPU(s), more than partition 'debug' "
            "(2 node(s) of 4 CPUs) holds: use fewer ranks (launcher.rollout_ranks",
        ),
        (
            ["placement.resources.rollout.cpus_per_rank=3"],
            "launcher.partition",
            "component 1 (rollout): 2 task(s) x 3 CPU(s) -> 2 node(s); 3 nodes in all, but partition 'debug'",
        ),
        (
            ["placement.resources.rollout.cpus_per_rank=5"],
            "placement.resources.rollout.cpus_per_rank",
            "component 1 (rollout) asks for 5 CPU(s) on one node; no node of partition 'debug' (2 node(s) of 4 "
            "CPUs) has more than 4",
        ),
        (
            ["placement.resources.trainer.gpus_per_rank=1"],
            "placement.resources.trainer.gpus_per_rank",
            "asks for 1 GPU(s) on one node; no node of partition 'debug'",
        ),
        (["-m", "launcher.rollout_ranks=2,7"], "launcher.partition", "needs 9 task(s)"),  # not even point 0
        # a job on several nodes cannot exchange loopback addresses (the default binds 127.0.0.1)
        (
            ["placement.resources.rollout.cpus_per_rank=2"],
            "runtime.rpc.interface",
            "'127.0.0.1' is loopback, but the job's ranks will be on more than one node (a heterogeneous job gives "
            "each component nodes of its own) and no other node can reach a loopback address",
        ),
        (
            ["launcher.nodes=2", "runtime.rpc.interface=lo"],
            "runtime.rpc.interface",
            "'lo' is loopback, but the job's ranks will be on more than one node (launcher.nodes=2)",
        ),
        (["runtime.rpc.interface=0.0.0.0"], "runtime.rpc.interface", "0.0.0.0 binds every interface"),
    ],
)
def test_bad_input_is_refused_before_sbatch(
    slurm_env: dict[str, str], tmp_path: Path, args: list[str], path: str, says: str
) -> None:
    before = queued(slurm_env)
    proc = launch(slurm_env, [f"run_dir={tmp_path / 'bad'}", *args], timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert path in proc.stderr and says in proc.stderr, proc.stderr
    assert not (tmp_path / "bad").exists()  # refused before Hydra made the run dir
    assert queued(slurm_env) == before  # nothing was submitted


def test_a_time_limit_above_the_partitions_is_refused_before_sbatch(
    slurm_env: dict[str, str], tmp_path: Path
) -> None:
    """Slurm would queue it for good (PartitionTimeLimit); here the partition gets a limit for the test."""
    before = queued(slurm_env)
    subprocess.run(["scontrol", "update", "PartitionName=high", "MaxTime=30"], env=slurm_env, check=True)
    try:
        proc = launch(
            slurm_env,
            [f"run_dir={tmp_path / 'bad'}", "launcher.partition=high", "launcher.time_min=45"],
            timeout=120,
        )
        fits = launch(
            slurm_env,
            [
                f"run_dir={tmp_path / 'ok'}",
                "launcher.partition=high",
                "launcher.time_min=30",
                "data.batch_size=0",
            ],
            timeout=120,
        )
    finally:
        subprocess.run(
            ["scontrol", "update", "PartitionName=high", "MaxTime=INFINITE"], env=slurm_env, check=True
        )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "launcher.time_min: 45 min is above the time limit of partition 'high' (30 min)" in proc.stderr
    assert queued(slurm_env) == before and not (tmp_path / "bad").exists()
    assert fits.returncode == 2 and "time_min" not in fits.stderr  # at the limit: only the other problem
    assert "data.batch_size" in fits.stderr


def test_plain_sbatch_template_runs_the_mpi_mode(
    slurm_env: dict[str, str], two_hosts: DevHosts, tmp_path: Path
) -> None:
    run_dir = tmp_path / "sbatch"
    job = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--nodes=2",
            f"--output={tmp_path}/%j.out",
            str(REPO / "slurm" / "mpi.sbatch"),
            *preemptible_run(run_dir, 6),
            f"runtime.rpc.interface={two_hosts.interface}",
        ],
        cwd=REPO,
        env=slurm_env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    wait_until(lambda: sacct_state(slurm_env, job) in ("COMPLETED", "FAILED", "CANCELLED"), 600, "the end")
    assert sacct_state(slurm_env, job) == "COMPLETED", (tmp_path / f"{job}.out").read_text()[-3000:]
    assert trained_steps(run_dir) == 6
    ranks = json.loads((run_dir / "logs" / "ranks.json").read_text())
    assert len(ranks) == 4 and len({r["host"] for r in ranks}) == 2


def test_the_run_saves_and_requeues_before_the_time_limit(
    slurm_env: dict[str, str], two_hosts: DevHosts, tmp_path: Path
) -> None:
    """No signal at all: the run reads the job's end time and stops in time (preemption.save_before_end_s)."""
    run_dir = tmp_path / "deadline"
    args = [
        *preemptible_run(run_dir, 400),
        "launcher.time_min=2",
        "launcher.signal_grace_s=0",
        "preemption.save_before_end_s=100",
        *across_hosts(two_hosts),
    ]
    proc = launch(slurm_env, args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    job_id = json.loads((run_dir / "launcher.json").read_text())["job_id"]
    try:
        wait_until(lambda: restarts(slurm_env, job_id) >= 1, 150, "a requeue before the time limit")
        log = (run_dir / "train.log").read_text()
        assert "the job's end time is near" in log and "checkpoint saved, the run resumes from it" in log
        wait_until(lambda: "resumed at step" in (run_dir / "train.log").read_text(), 120, "the resume")
    finally:
        subprocess.run(["scancel", job_id], env=slurm_env)


def hydra_submitit(env: dict[str, str], args: list[str], **kwargs) -> subprocess.Popen:  # type: ignore[no-untyped-def]
    """``python -m launch.train -m hydra/launcher=submitit_slurm ARGS``: Hydra submits the points."""
    cmd = [
        sys.executable,
        "-m",
        "launch.train",
        "-m",
        "hydra/launcher=submitit_slurm",
        "hydra.launcher.timeout_min=20",
        *args,
    ]
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs
    )


def test_hydra_submitit_sweep_of_mpi_runs_resumes_a_preempted_point(
    slurm_env: dict[str, str], two_hosts: DevHosts, tmp_path: Path
) -> None:
    """hydra/launcher=submitit_slurm with a homogeneous placement (4 tasks of one job per point, 2 on
    each host): 2 points, 2 finished runs; point 0, signalled mid-run, requeues itself and resumes exactly."""
    steps, run_dir = 12, tmp_path / "hydra_sweep"
    args = [a for a in preemptible_run(run_dir, steps) if not a.startswith("run_dir=")]
    proc = hydra_submitit(
        slurm_env,
        [
            "launch_mode=mpi",
            "hydra.launcher.nodes=2",
            "hydra.launcher.tasks_per_node=2",
            f"runtime.rpc.interface={two_hosts.network}",
            f"run_dir={run_dir}",
            "seed=1,2",
            *args,
        ],
    )
    try:
        wait_until(lambda: trained_steps(run_dir / "0") >= 3, 300, "point 0's step 3")
        queue = subprocess.run(["squeue", "-h", "-o", "%i"], env=slurm_env, capture_output=True, text=True)
        (point0,) = [j for j in queue.stdout.split() if j.endswith("_0")]  # the array's task 0: point 0
        subprocess.run(["scancel", "--signal=USR2", point0], env=slurm_env, check=True)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    assert f"sweep of 2 run(s):\n  {run_dir / '0'}\n  {run_dir / '1'}\n" in out, out[-2000:]
    assert restarts(slurm_env, point0) == 1
    log = (run_dir / "0" / "train.log").read_text()
    assert "checkpoint saved, the run resumes from it" in log and "resumed at step" in log
    seeds = [yaml.safe_load((run_dir / str(k) / "config.yaml").read_text())["seed"] for k in (0, 1)]
    assert seeds == [1, 2]
    for k in (0, 1):  # each point a run of its own, every sample trained as planned
        ranks = json.loads((run_dir / str(k) / "logs" / "ranks.json").read_text())
        assert len(ranks) == 4 and len({r["host"] for r in ranks}) == 2
        assert (run_dir / str(k) / "checkpoints" / f"global_step_{steps}" / "COMPLETE").exists()
        assert_trained_as_planned(run_dir / str(k), steps)


@pytest.mark.parametrize(
    ("args", "path", "says"),
    [
        (["hydra.launcher.partition=nowhere"], "hydra.launcher.partition", "unknown partition 'nowhere'"),
        (
            ["launch_mode=mpi", "hydra.launcher.tasks_per_node=2"],
            "placement",
            "hydra.launcher.nodes x tasks_per_node = 2 tasks",
        ),
        (
            ["hydra.launcher.tasks_per_node=4"],
            "hydra.launcher.tasks_per_node",
            "launch_mode=local is one process",
        ),
        (
            [
                "launch_mode=mpi",
                "hydra.launcher.tasks_per_node=4",
                "placement.resources.rollout.cpus_per_rank=2",
            ],
            "placement.resources",
            "use launcher=slurm (a heterogeneous job)",
        ),
        (
            [
                "launch_mode=mpi",
                "hydra.launcher.tasks_per_node=4",
                "hydra.launcher.setup=['export SLURM_MPI_TYPE=none']",
            ],
            "hydra.launcher.setup",
            "launch_mode=mpi needs pmi2",
        ),
        (
            ["launch_mode=mpi", "hydra.launcher.nodes=3", "hydra.launcher.tasks_per_node=2"],
            "hydra.launcher.partition",
            "each of the 3 node(s) of the job needs 6 task(s) x 1 CPU(s) (2 per node), more than partition 'debug'",
        ),
        (
            ["launch_mode=mpi", "hydra.launcher.tasks_per_node=4", "hydra.launcher.cpus_per_task=2"],
            "hydra.launcher.cpus_per_task, hydra.launcher.tasks_per_node",
            "asks for 8 CPU(s) on one node",
        ),
        (
            ["launch_mode=mpi", "hydra.launcher.nodes=2", "hydra.launcher.tasks_per_node=2"],
            "runtime.rpc.interface",
            "'127.0.0.1' is loopback, but the job's ranks will be on more than one node (hydra.launcher.nodes=2)",
        ),
    ],
)
def test_hydra_submitit_bad_input_is_refused_before_sbatch(
    slurm_env: dict[str, str], tmp_path: Path, args: list[str], path: str, says: str
) -> None:
    before = queued(slurm_env)
    proc = hydra_submitit(slurm_env, [f"run_dir={tmp_path / 'bad'}", "seed=1,2", *args])
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, out + err
    assert path in err and says in err, err
    assert not (tmp_path / "bad").exists()
    assert queued(slurm_env) == before  # nothing was submitted
