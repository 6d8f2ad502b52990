"""MPI mode under mpirun: learning, placement errors, a killed rank (continue / stop_on_error), hostile input."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import h5py
import pytest
import torch
import yaml

from nexrl_hpc.checkpoint.hf import read_safetensors_dir
from nexrl_hpc.config.validate import ConfigError
from nexrl_hpc.data.loader import DatasetLoader
from nexrl_hpc.launcher.preflight import preflight
from tests.conftest import CONFIG_DIR, REPO
from tests.test_hostile_wire import flood_lane, flood_zmq, idle_connections, still_open
from tests.test_rpc import attack, attack_lane
from tests.test_samples import assert_samples_match_dumps, read_rows

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True)
def _mpirun_installed() -> None:
    """A missing MPI is an install failure (scripts/install.sh --dev installs it), not a skip."""
    if shutil.which("mpirun") is None:
        pytest.fail("mpirun not found: install the dev extra (bash scripts/install.sh --dev: mpi4py + mpich)")


FAST = [
    "validate.validate_before_train=false",
    "validate.validate_at_end=false",
    "validate.eval.validate_freq=0",
    "logger.backend=[]",
]


def mpirun(n: int, args: list[str], *, no_cleanup: bool = False) -> list[str]:
    flags = ["-disable-auto-cleanup"] if no_cleanup else []
    return ["mpirun", *flags, "-n", str(n), sys.executable, "-m", "launch.train", "launch_mode=mpi", *args]


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the run ended before {path} appeared"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)


def test_mpi_run_learns_and_shrugs_off_hostile_input(tmp_path: Path) -> None:
    """mpirun -n 4 learns the default task like local mode; every rank's port survives attacks
    (hostile input, and the pre-authentication floods and idle connections)."""
    run_dir = tmp_path / "mpi"
    proc = subprocess.Popen(
        mpirun(4, [f"run_dir={run_dir}", "seed=5"]),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ranks_file = run_dir / "logs" / "ranks.json"
    wait_for(ranks_file, proc)
    ranks = json.loads(ranks_file.read_text())
    assert [r["group"] for r in ranks] == ["driver", "trainer", "rollout", "rollout"]
    marker = tmp_path / "pwned"
    ports = [r["address"] for r in ranks] + [r["trainer_address"] for r in ranks if r["trainer_address"]]
    assert len(ports) == len(ranks) + 1  # every rank's RPC port and trainer rank 0's batch port
    for address in ports:
        attack(address, secrets.token_bytes(32), marker)
    lanes = [r["lane_address"] for r in ranks]  # every rank's direct lane (blocking @quick calls)
    for address in lanes:
        attack_lane(address, secrets.token_bytes(32), marker)
    # the pre-authentication attacks: 150 MiB of MORE frames and a 150 MiB handshake
    # frame on every ZMQ port, 150 MiB announced on every lane, 200 idle connections on every port
    for address in ports:
        assert all(n < 32 << 20 for n in flood_zmq(address).values()), address
    for address in lanes:
        assert all(n < 32 << 20 for n in flood_lane(address)), address
    idle = idle_connections(ports + lanes, 200)
    ports += lanes
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    left = still_open(idle)  # closed by the run long before its end (preauth_timeout_s)
    for s in idle:
        s.close()
    assert left == 0
    assert not marker.exists()
    rows = metrics(run_dir)
    val = [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r]
    assert val[0] == (0, pytest.approx(val[0][1])) and val[0][1] <= 0.3
    assert val[-1][0] == 50 and val[-1][1] >= 0.8, val
    steps = [r for r in rows if "train/reward_mean" in r]
    assert [r["step"] for r in steps] == list(range(1, 51))
    # every attack input and flood on every port was counted by the last step; the idle connections
    # are closed by preauth_timeout_s, some after the last step's snapshot (left == 0 above proves them)
    assert steps[-1]["rpc/rejected"] >= 4 * len(ports) + 2 * len(ports)
    for name in (
        "config.yaml",
        "data/validation.jsonl",
        "checkpoints/global_step_50/COMPLETE",
        "checkpoints/latest",
    ):
        assert (run_dir / name).exists(), name
    assert (run_dir / "logs" / "rank_2.log").exists() and (
        run_dir / "logs" / "inference_service_1.log"
    ).exists()
    assert "last validation" in out, out[-1500:]


def test_mpi_agent_episodes_run_on_the_rollout_ranks(tmp_path: Path) -> None:
    """task=tool_lookup under mpirun -n 4: multi-turn episodes from the rollout ranks reach the trainer.

    (Learning in mpi mode is timed by bench/tool_task.py; this checks the wiring in a few steps.)
    """
    run_dir = tmp_path / "agent"
    proc = subprocess.run(
        mpirun(
            4,
            [
                "task=tool_lookup",
                f"run_dir={run_dir}",
                "seed=1",
                "train_worker.total_train_steps=4",
                "task.params.val_size=32",
                "validate.validate_before_train=false",
                "logger.backend=[]",
                "logger.dump_rollouts=true",
            ],
        ),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(run_dir)
    steps = [r for r in rows if "train/reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:  # two-turn episodes: a lookup call, then an answer
        assert r["train/num_turns"] >= 1.9 and r["train/num_tool_calls"] >= 0.9, r
        assert r["train/termination/env_done"] >= 0.9
    (val,) = [r for r in rows if "val/reward" in r]  # validate_at_end: the held-out tables
    assert val["val/num_samples"] == 32 and val["val/num_turns"] >= 1.9
    ranks = json.loads((run_dir / "logs" / "ranks.json").read_text())
    assert [r["group"] for r in ranks] == ["driver", "trainer", "rollout", "rollout"]
    # the decoded samples, written where the train worker runs: the tool's turns are in the response
    assert_samples_match_dumps(run_dir, [1, 2, 3, 4], per_step=4)
    samples = [row for step in (1, 2, 3, 4) for row in read_rows(run_dir, step)]
    assert any(row["loss_tokens"] < row["response_length"] for row in samples)


def failure_run_args(run_dir: Path, policy: str, steps: int) -> list[str]:
    """A short run with a fake LLM, 1 s heartbeats and rollout dumps: the failure tests' run."""
    return [
        f"run_dir={run_dir}",
        f"train_worker.total_train_steps={steps}",
        "logger.dump_rollouts=true",
        "service.inference_service.backend=fake",
        "service.inference_service.fake_latency_ms=150",
        f"runtime_monitor.exception_handling.policy={policy}",
        "runtime_monitor.health_check.check_interval=1.0",
        "runtime_monitor.health_check.timeout=1.5",
        "data.batch_size=8",
        *FAST,
    ]


def wait_for_steps(run_dir: Path, proc: subprocess.Popen, steps: int = 3, timeout: float = 300) -> None:
    """Until the run has logged ``steps`` training steps (it must not end before)."""
    deadline = time.monotonic() + timeout
    while (
        not (run_dir / "logs" / "ranks.json").exists()
        or not (run_dir / "metrics.jsonl").exists()
        or len([r for r in metrics(run_dir) if "train/reward_mean" in r]) < steps
    ):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)


def start_run(tmp_path: Path, policy: str, steps: int) -> tuple[subprocess.Popen, Path]:
    run_dir = tmp_path / policy
    proc = subprocess.Popen(
        mpirun(4, failure_run_args(run_dir, policy, steps)),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    wait_for_steps(run_dir, proc)
    return proc, run_dir


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[float]:
    """SIGSTOP ``pid`` (a rank that hangs without dying) for the block; yields when it stopped."""
    stopped_at = time.time()
    os.kill(pid, signal.SIGSTOP)
    try:
        yield stopped_at
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:  # mpirun may already have reaped it
            pass


def assert_trained_as_planned(run_dir: Path, steps: int) -> None:
    """Every step logged once, and every prompt trained exactly as often as in an uninterrupted run
    (the rollout dumps of each step against the data order)."""
    rows = [r for r in metrics(run_dir) if "train/reward_mean" in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())  # the run's own (seed, batch sizes)
    reference = DatasetLoader(cfg["data"], data_files=[str(run_dir / "data" / "train.jsonl")])
    per_step = cfg["trajectory_pool"]["batch_size"]
    for step in range(1, steps + 1):
        expected = collections.Counter(
            (t["uid"], t["epoch"]) for t in (reference.get_next_item() for _ in range(per_step))
        )
        with h5py.File(run_dir / "rollouts" / f"step_{step}.h5") as f:
            got = collections.Counter(zip([u.decode() for u in f["uid"][()]], f["epoch"][()].tolist()))
        assert got == expected, step


def declared_dead_at(run_dir: Path, rank: int) -> tuple[float, str]:
    """When rank 0 first acted on the loss of ``rank`` (its heartbeats, or its modules' health checks)."""
    for line in (run_dir / "train.log").read_text().splitlines():
        if f"rank {rank}" in line and ("continuing without it" in line or "policy stop_on_error" in line):
            stamp = re.match(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]", line).group(1)
            return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp(), line
    raise AssertionError("the dead rank was never declared dead")


def test_hung_rollout_rank_with_continue_loses_and_doubles_nothing(tmp_path: Path) -> None:
    """A rollout rank that stops answering (SIGSTOP: no exit, no error) is declared dead within 2x the
    heartbeat interval; with policy continue its tasks are re-issued and training goes on to the end.
    (A SIGKILLed rank is the same to the controller, but mpich's mpirun then tears the job down itself;
    under srun the job survives — see the Slurm tests.)"""
    steps = 16
    proc, run_dir = start_run(tmp_path, "continue", steps)
    ranks = json.loads((run_dir / "logs" / "ranks.json").read_text())
    victim = [r for r in ranks if r["group"] == "rollout"][1]
    with stopped(victim["pid"]) as stopped_at:
        deadline = time.monotonic() + 120
        while os.path.exists(f"/proc/{ranks[0]['pid']}"):  # rank 0 finishes the run and exits
            assert time.monotonic() < deadline, "the run did not finish without the hung rank"
            time.sleep(0.2)
    proc.communicate(timeout=120)
    when, line = declared_dead_at(run_dir, victim["rank"])
    assert when - stopped_at <= 2 * 1.0 + 0.1, line  # within 2x the heartbeat interval
    assert "rollout_worker_1" in line and "inference_service_1" in line
    assert_trained_as_planned(run_dir, steps)


def test_killed_rollout_rank_with_stop_on_error_stops_every_rank(tmp_path: Path) -> None:
    proc, run_dir = start_run(tmp_path, "stop_on_error", 400)
    ranks = json.loads((run_dir / "logs" / "ranks.json").read_text())
    killed_at = time.time()
    os.kill([r for r in ranks if r["group"] == "rollout"][1]["pid"], signal.SIGKILL)
    try:
        proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode != 0 and time.time() - killed_at <= 30
    for r in ranks:
        assert not os.path.exists(f"/proc/{r['pid']}"), f"rank {r['rank']} is still running"


def test_hung_rollout_rank_with_stop_on_error_stops_the_others_with_the_reason(tmp_path: Path) -> None:
    proc, run_dir = start_run(tmp_path, "stop_on_error", 400)
    ranks = json.loads((run_dir / "logs" / "ranks.json").read_text())
    victim = [r for r in ranks if r["group"] == "rollout"][1]
    with stopped(victim["pid"]) as stopped_at:
        deadline = time.monotonic() + 30
        others = [r for r in ranks if r is not victim]
        while any(os.path.exists(f"/proc/{r['pid']}") for r in others):
            assert time.monotonic() < deadline, "ranks still running 30 s after the failure"
            time.sleep(0.2)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and time.time() - stopped_at <= 60
    assert f"rank {victim['rank']} on" in err and "stopped answering" in err and "policy stop_on_error" in err
    assert err.count("error: rank ") >= 2  # ranks 1 and 2 print why they stop


def test_a_rank_stuck_in_mpi_init_exits_after_the_bootstrap_timeout(tmp_path: Path) -> None:
    """MPI_Init holds the GIL, so only faulthandler's C thread can end a rank whose peer never starts
    (here: the second 'rank' is a plain sleep); the rank says where it stood and exits 1."""
    cmd = mpirun(1, [f"run_dir={tmp_path / 'run'}", "runtime.bootstrap_timeout_s=2"])
    started = time.monotonic()
    proc = subprocess.run(
        [*cmd, ":", "-n", "1", "sleep", "120"], cwd=REPO, capture_output=True, text=True, timeout=100
    )
    took = time.monotonic() - started
    assert proc.returncode != 0
    assert 12 <= took < 60, (took, proc.stderr[-2000:])  # bootstrap_timeout_s + the 10 s grace
    assert "Timeout (0:00:12)!" in proc.stderr and "in start_mpi" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("code", [0, 3])
def test_finalized_ranks_leaving_one_by_one_keep_the_exit_code(code: int) -> None:
    """This MPICH tells Hydra a rank finished (PMI ``cmd=finalize``) from a C exit handler, not in
    MPI_Finalize: a finalized rank that left with ``os._exit`` looked crashed, and Hydra SIGKILLed
    the ranks still running (mpirun exit 9 after a finished run; this helper with ``--os-exit``:
    8 of 8 jobs, so two jobs per code catch a regression). ``exit_process`` leaves through
    ``exit``: every job ends with the ranks' code."""
    cmd = ["mpirun", "-n", "4", sys.executable, "-m", "tests.helpers.mpi_exit", str(code)]
    for _ in range(2):
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == code, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert "BAD TERMINATION" not in proc.stdout


def test_world_size_that_does_not_fit_is_refused_before_start(tmp_path: Path) -> None:
    proc = subprocess.run(
        mpirun(2, [f"run_dir={tmp_path / 'x'}"]), cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2
    assert "world size 2 does not fit placement=auto" in proc.stderr and "at least 3 ranks" in proc.stderr
    assert not (tmp_path / "x" / "metrics.jsonl").exists()


def test_colocation_group_placement_errors_before_start() -> None:
    base = ["launch_mode=mpi", "placement.mode=manual"]
    roles = {
        "data_loader": ("driver", 1),
        "validate_dataloader": ("driver", 1),
        "trajectory_pool": ("driver", 1),
        "algorithm_processor": ("driver", 1),
        "train_batch_pool": ("driver", 1),
        "weight_sync_controller": ("driver", 1),
        "validator": ("driver", 1),
        "train_worker": (None, 1),
        "rollout_worker": ("rollout", 2),
        "inference_service": ("rollout", 1),
    }
    spec = [
        f"+placement.roles.{k}={{count:{c},colocation_group:{g if g else 'null'}}}"
        for k, (g, c) in roles.items()
    ]
    with pytest.raises(ConfigError) as err:
        preflight(
            CONFIG_DIR, "rl_train", [*base, *spec, "+placement.roles.teacher={count:1,colocation_group:null}"]
        )
    messages = {p.path: p.message for p in err.value.problems}
    assert messages["placement.roles.teacher"].startswith("unknown role 'teacher'")
    assert messages["placement.roles (rollout)"] == (
        "All roles in colocation group must have same count: rollout_worker=2, inference_service=1"
    )
    fixed = [a.replace("inference_service={count:1", "inference_service={count:2") for a in spec]
    preflight(CONFIG_DIR, "rl_train", [*base, *fixed])  # valid


@pytest.mark.parametrize("engine", ["deepspeed"])  # fsdp: across two hosts, tests/test_slurm_mpi.py
def test_mpi_run_with_two_trainer_ranks_learns(tmp_path: Path, engine: str) -> None:
    """mpirun -n 5: driver, a trainer group of 2 ranks (rank-0-centric protocol, torch.distributed), 2 rollout ranks."""
    run_dir = tmp_path / engine
    args = [
        f"run_dir={run_dir}",
        "seed=2",
        f"service.train_service.engine={engine}",
        "service.train_service.world_size=2",
    ]
    proc = subprocess.run(mpirun(5, args), cwd=REPO, capture_output=True, text=True, timeout=900)
    # mpirun's own verdict (which rank ended how) is on stdout: seen once, exit 9 after a finished run
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    ranks = json.loads((run_dir / "logs" / "ranks.json").read_text())
    assert [r["group"] for r in ranks] == ["driver", "trainer", "trainer", "rollout", "rollout"]
    assert "train_worker" in ranks[0]["modules"] and ranks[2]["modules"] == ["trainer_rank_1"]
    val = [(r["step"], r["val/accuracy"]) for r in metrics(run_dir) if "val/accuracy" in r]
    assert val[-1][0] == 50 and val[-1][1] >= 0.8, val
    ckpt = run_dir / "checkpoints" / "global_step_50"
    assert sorted(p.name for p in (ckpt / "optimizer").iterdir()) == [
        "rank_0.safetensors",
        "rank_1.safetensors",
    ]
    assert (ckpt / "model" / "model.safetensors").exists()


def test_mpi_fully_async_feeds_the_trainer_back_to_back_and_exports_each_version(tmp_path: Path) -> None:
    """mpirun -n 3 (driver, trainer, rollout), fully-async with batches always ready (the fake
    engine): the next batch goes to the trainer rank while it trains the current one, every step
    trains once, and each checkpoint holds exactly the weights exported as its version."""
    run_dir = tmp_path / "ahead"
    args = [
        f"run_dir={run_dir}",
        "seed=4",
        "weight.sync_mode=fully-async",
        "weight.staleness_threshold=2",
        "service.inference_service.backend=fake",
        "train_worker.total_train_steps=16",
        "train_worker.save_freq=8",
        "train_worker.max_ckpt_to_keep=null",
        "weight.keep_versions=20",
        "service.train_service.num_threads=1",
        *FAST,
    ]
    proc = subprocess.run(mpirun(3, args), cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [r for r in metrics(run_dir) if "train/sent_ahead" in r]
    assert [r["step"] for r in rows] == list(range(1, 17))
    ahead = [r["step"] for r in rows if r["train/sent_ahead"] == 1.0]
    assert ahead, "no batch went to the trainer while it trained"
    assert not {1, 9} & set(ahead)  # nothing rides past a checkpoint (steps 8 and 16), the first waits
    for step in (8, 16):
        saved = read_safetensors_dir(str(run_dir / "checkpoints" / f"global_step_{step}" / "model"))
        exported = read_safetensors_dir(str(run_dir / "weights" / f"version_{step}"))
        assert set(exported) <= set(saved)
        assert all(torch.equal(saved[k], exported[k]) for k in exported), step
