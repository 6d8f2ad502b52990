"""Elastic rollout ranks: the join credential, the door's refusals (a hostile test), and real
``nexrl-join`` processes joining, leaving and rejoining a real running ``mpirun`` run."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from nexrl_hpc.config.schema import ElasticConfig
from nexrl_hpc.runtime.elastic import (
    JoinCredential,
    JoinDoor,
    JoinRefused,
    door_path,
    mac,
    read_credential,
    recv_frame,
    send_frame,
    write_credential,
)
from nexrl_hpc.runtime.elastic_rank import prove_membership
from nexrl_hpc.runtime.preemption import PREEMPTED_EXIT
from nexrl_hpc.tracking.run_status import read_status
from tests.conftest import REPO, last_trained_step

ELASTIC: ElasticConfig = {
    "enabled": True,
    "max_members": 2,
    "handshake_timeout_s": 5.0,
    "admit_timeout_s": 5.0,
}
WELCOME = {"driver": {"address": "tcp://127.0.0.1:1", "lane_address": "tcp://127.0.0.1:2"}, "locations": {}}


def mode_of(path: str | Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_elastic_credential_is_0600_and_new_at_every_start_of_the_run(tmp_path: Path) -> None:
    first = write_credential(str(tmp_path), "127.0.0.1", 1234)
    path = door_path(str(tmp_path))
    assert mode_of(path) == 0o600 and mode_of(os.path.dirname(path)) == 0o700
    assert read_credential(str(tmp_path)) == first
    second = write_credential(str(tmp_path), "127.0.0.1", 1235)  # the next start (a requeue)
    assert second.run_id == first.run_id and second.generation == first.generation + 1
    assert second.secret != first.secret and len(second.secret) == 32
    assert mode_of(path) == 0o600
    os.chmod(path, 0o640)  # others may read it: a joiner refuses to use it, naming the file
    with pytest.raises(JoinRefused, match=r"join\.json: mode 640, others may read it"):
        read_credential(str(tmp_path))
    with pytest.raises(JoinRefused, match="no such file"):
        read_credential(str(tmp_path / "nowhere"))


def finish_join(admission: Any, cred: JoinCredential) -> None:
    """Step 4 of the handshake as a joiner sends it (its modules up)."""
    door_nonce, nonce = admission.nonces
    address, lane = "tcp://127.0.0.1:3", "tcp://127.0.0.1:4"
    proof = mac(cred.secret, "ready", door_nonce, nonce, admission.rank, address, lane)
    send_frame(admission.conn, {"address": address, "lane_address": lane, "proof": proof})


def wait_arrival(door: JoinDoor, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        arrivals = door.take_arrivals()
        if arrivals:
            return arrivals[0]
        time.sleep(0.02)
    raise AssertionError("the proven joiner never arrived")


def test_elastic_door_refuses_and_counts_wrong_old_copied_and_foreign_credentials(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Hostile joiners at a real door: a wrong secret, the credential of an older start, a run-dir
    copy of an older start, another run's, junk bytes — each refused, counted, logged without the
    secret; the run's own credential gets the job key, and the door proves itself to it."""
    caplog.set_level(logging.INFO)
    run_dir = tmp_path / "run"
    job_key = secrets.token_bytes(32)
    door = JoinDoor(ELASTIC, str(run_dir), "127.0.0.1", job_key, 3, WELCOME, 4)
    try:
        cred = read_credential(str(run_dir))
        assert (cred.host, cred.port, cred.generation) == ("127.0.0.1", door.credential.port, 1)
        admission = prove_membership(cred, 5.0)  # the real one
        assert (admission.rank, admission.key, admission.names) == (
            3,
            job_key,
            ["rollout_worker_e3", "inference_service_e3"],
        )
        finish_join(admission, cred)
        member = wait_arrival(door)
        assert (member.rank, member.address, member.host) == (3, "tcp://127.0.0.1:3", socket.gethostname())
        door.welcome(member)
        assert recv_frame(admission.conn) == {"admitted": True}
        admission.conn.close()
        wrong = dataclasses.replace(cred, secret=secrets.token_bytes(32))
        with pytest.raises(JoinRefused, match="proof does not match the credential"):
            prove_membership(wrong, 5.0)
        copy = tmp_path / "copy"
        shutil.copytree(run_dir, copy)  # a copy of the run dir taken during this start
        assert door.refused == 1
    finally:
        door.close()
    with pytest.raises(JoinRefused, match="start 1 of the run has ended"):  # the secret went with its door
        read_credential(str(run_dir))
    assert json.loads((run_dir / "elastic" / "members.json").read_text())["members"][0]["state"] == "ended"
    requeued = JoinDoor(ELASTIC, str(run_dir), "127.0.0.1", secrets.token_bytes(32), 3, WELCOME, 4)
    try:
        new = requeued.credential
        assert (new.run_id, new.generation) == (cred.run_id, 2)
        at_new_door = {"host": "127.0.0.1", "port": new.port}
        with pytest.raises(JoinRefused, match=r"start 1 of this run, which is at start 2"):
            prove_membership(dataclasses.replace(cred, **at_new_door), 5.0)  # the old credential
        copied = read_credential(str(copy))
        with pytest.raises(JoinRefused, match=r"a stale file or a copy of the run dir"):
            prove_membership(dataclasses.replace(copied, **at_new_door), 5.0)
        foreign = JoinCredential(secrets.token_hex(16), 2, secrets.token_bytes(32), "127.0.0.1", new.port)
        with pytest.raises(JoinRefused, match="another run's"):
            prove_membership(foreign, 5.0)
        with socket.create_connection(("127.0.0.1", new.port), timeout=5) as junk:
            recv_frame(junk)
            junk.sendall(b"\xff\xff\xff\xff" + b"x" * 64)  # a frame size far over the limit
        deadline = time.monotonic() + 5
        recorded = run_dir / "elastic" / "members.json"
        while time.monotonic() < deadline and json.loads(recorded.read_text())["refused"] < 4:
            time.sleep(0.02)
        assert requeued.refused == 4 and json.loads(recorded.read_text())["refused"] == 4
        assert mode_of(door_path(str(run_dir))) == 0o600
    finally:
        requeued.close()
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert logged.count("refused a joiner") == 5
    for secret in (cred.secret, new.secret):
        assert secret.hex() not in logged and secret.hex() not in caplog.text


# --- a real mpirun run ------------------------------------------------------------------------------
STEPS = 10_000  # never reached: the test stops the run at a checkpoint once its events have happened
STEPS_WITH_C = 5  # steps trained after the third joiner served, before that stop


def run_args(run_dir: Path) -> list[str]:
    return [
        f"run_dir={run_dir}",
        f"train_worker.total_train_steps={STEPS}",
        "logger.dump_rollouts=true",
        "service.inference_service.backend=fake",
        "service.inference_service.fake_latency_ms=300",
        # joined ranks leave whatever the policy: the strictest one shows it
        "runtime_monitor.exception_handling.policy=stop_on_error",
        "runtime_monitor.health_check.check_interval=1.0",
        "runtime_monitor.health_check.timeout=3",
        "data.batch_size=8",
        "validate.validate_before_train=false",
        "validate.validate_at_end=false",
        "validate.eval.validate_freq=0",
        "logger.backend=[]",
    ]


def join(run_dir: Path, out: Path) -> subprocess.Popen:
    with open(out, "w") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "launch.join", str(run_dir)], cwd=REPO, stdout=f, stderr=subprocess.STDOUT
        )


def members(run_dir: Path) -> dict[int, dict[str, Any]]:
    path = run_dir / "elastic" / "members.json"
    if not path.exists():
        return {}
    return {m["rank"]: m for m in json.loads(path.read_text())["members"]}


def wait_until(what: str, check: Any, run: subprocess.Popen, timeout: float = 240.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        assert run.poll() is None, f"the run ended while waiting for {what}"
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def serving(run_dir: Path, pid: int) -> dict[str, Any] | None:
    """The joined rank of process ``pid`` once rank 0 handed it a task."""
    found = [m for m in members(run_dir).values() if m["pid"] == pid and m["state"] == "joined"]
    return found[0] if found and found[0]["first_task_at"] else None


@pytest.mark.e2e
def test_elastic_ranks_join_leave_and_rejoin_a_running_mpirun_run(tmp_path: Path) -> None:
    """mpirun -n 3 (driver, trainer, 1 rollout rank) under policy stop_on_error: two nexrl-join
    processes join and serve; one leaves on SIGTERM, one is SIGKILLed (found by its heartbeats);
    a joiner with a wrong credential is refused and counted; a new one joins and serves; the run
    trains on, then stops at a checkpoint on the preemption signal (rc 3) and tells the joiner to
    stop: every step once and every prompt trained exactly as planned; the credential is in no log."""
    from tests.test_mpi import assert_trained_as_planned, metrics, mpirun

    run_dir = tmp_path / "run"
    run = subprocess.Popen(
        mpirun(3, run_args(run_dir)),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    outs: list[Path] = []
    try:
        wait_until("the credential", lambda: os.path.exists(door_path(str(run_dir))), run)
        assert mode_of(door_path(str(run_dir))) == 0o600
        secret = read_credential(str(run_dir)).secret.hex()
        outs = [tmp_path / f"join_{n}.out" for n in "abcw"]
        a, b = join(run_dir, outs[0]), join(run_dir, outs[1])
        joined_a = wait_until("A serving", lambda: serving(run_dir, a.pid), run)
        joined_b = wait_until("B serving", lambda: serving(run_dir, b.pid), run)
        wait_until(
            "a step with 3 rollout ranks",
            lambda: any(r.get("rollout/live_ranks") == 3 for r in metrics(run_dir)),
            run,
        )
        a.send_signal(signal.SIGTERM)  # cancelled / preempted: it says it leaves
        b.kill()  # dies without a word: its heartbeats stop
        assert a.wait(60) == 0
        wait_until(
            "both gone",
            lambda: {members(run_dir)[r]["state"] for r in (joined_a["rank"], joined_b["rank"])} == {"left"},
            run,
        )
        # a run dir copy with a wrong secret: refused (exit 2), counted, the reason on stderr
        copy = tmp_path / "copy"
        (copy / "elastic").mkdir(parents=True, mode=0o700)
        shutil.copy(run_dir / "config.yaml", copy / "config.yaml")
        forged = json.loads(Path(door_path(str(run_dir))).read_text()) | {"secret": secrets.token_hex(32)}
        fd = os.open(door_path(str(copy)), os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, json.dumps(forged).encode())
        os.close(fd)
        wrong = join(copy, outs[3])
        assert wrong.wait(120) == 2
        assert "proof does not match the credential" in outs[3].read_text()
        c = join(run_dir, outs[2])  # capacity comes back as a new member
        joined_c = wait_until("C serving", lambda: serving(run_dir, c.pid), run)
        with_c = last_trained_step(run_dir) + STEPS_WITH_C
        wait_until(f"step {with_c}", lambda: last_trained_step(run_dir) >= with_c, run)
        status = read_status(str(run_dir))
        assert status is not None
        os.kill(int(status["pid"]), signal.SIGUSR2)  # the driver's preemption signal
        stdout, stderr = run.communicate(timeout=600)
        assert run.returncode == PREEMPTED_EXIT, stdout[-2000:] + stderr[-3000:]
        assert c.wait(60) == PREEMPTED_EXIT  # told the run stopped at a checkpoint (no --wait: it ends too)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    states = members(run_dir)
    assert states[joined_a["rank"]]["state"] == "left" and "SIGTERM" in states[joined_a["rank"]]["reason"]
    assert "stopped answering" in states[joined_b["rank"]]["reason"]
    assert states[joined_c["rank"]]["state"] == "ended"
    assert len({joined_a["rank"], joined_b["rank"], joined_c["rank"]}) == 3  # a new member each time
    rows = [r for r in metrics(run_dir) if "rollout/live_ranks" in r]
    assert sum(r["rollout/joins"] for r in rows) == 3 and sum(r["rollout/leaves"] for r in rows) == 2
    assert max(r["rollout/live_ranks"] for r in rows) == 3 and rows[-1]["rollout/live_ranks"] == 2
    assert rows[-1]["rollout/join_refused"] == 1
    assert_trained_as_planned(run_dir, rows[-1]["step"])
    assert rows[-1]["step"] >= with_c
    assert "secret" not in json.loads(Path(door_path(str(run_dir))).read_text())  # gone with the run's door
    for path in [*run_dir.rglob("*"), *outs]:
        if path.is_file() and path.stat().st_size < 50 << 20:
            assert secret not in path.read_bytes().decode(errors="replace"), path
    assert secret not in stdout + stderr
    status = subprocess.run(
        [sys.executable, "-m", "launch.status", str(run_dir)], cwd=REPO, capture_output=True, text=True
    )
    assert (
        "1 served to the end" in status.stdout and "2 left" in status.stdout and "1 refused" in status.stdout
    )
    assert f"rank {joined_c['rank']}" in status.stdout and "join time" in status.stdout


def test_elastic_a_lost_consumers_waiting_long_poll_takes_none_of_its_reissued_tasks(tmp_path: Path) -> None:
    """A rank that leaves may still have a long poll waiting at the loader: the tasks re-issued for
    it must go to the others, once, not back to it (they would be lost with it)."""
    import threading

    from tests.test_data_loader import loader

    dl = loader(tmp_path, n_rows=4, rollout_repeat_n=2, shuffle=False)
    dl.set_dispatch_budget(3)
    held = dl.get_next_items(3, 0.0, "rollout_worker_e3")
    got: list[list[dict[str, Any]]] = []
    waiting = threading.Thread(target=lambda: got.append(dl.get_next_items(3, 5.0, "rollout_worker_e3")))
    waiting.start()  # the leaving rank's next fetch, already at the loader
    time.sleep(0.2)
    assert dl.requeue_consumer("rollout_worker_e3") == 3
    waiting.join(10)
    assert got == [[]]
    again = dl.get_next_items(5, 0.0, "rollout_worker_0")  # re-issued once
    assert sorted(t["uid"] for t in again) == sorted(t["uid"] for t in held) and len(again) == 3
    assert dl.outstanding() == {"rollout_worker_0": 3}
    assert dl.get_next_items(3, 0.0, "rollout_worker_e3") == []  # nothing more goes to it


def test_elastic_join_jobs_are_not_requeued_and_carry_no_secret(tmp_path: Path) -> None:
    """launcher.elastic: each join job is one task on the elastic partition/qos with its time and
    GPUs, --no-requeue, running ``launch.join --wait RUN_DIR`` after the setup lines."""
    from nexrl_hpc.launcher.elastic_jobs import join_job_command
    from tests.conftest import compose_config

    cfg = compose_config(
        [
            "launcher=slurm",
            "launcher.partition=main",
            "launcher.elastic.count=2",
            "launcher.elastic.partition=scavenger",
            "launcher.elastic.qos=low",
            "launcher.elastic.time_min=30",
            "launcher.elastic.gpus=1",
            "launcher.setup=[module load cuda]",
        ]
    )
    cmd = join_job_command(cfg, str(tmp_path), str(tmp_path / "slurm"))
    assert cmd[:3] == ["sbatch", "--parsable", "--no-requeue"]
    for flag in ("--partition=scavenger", "--qos=low", "--time=30", "--gpus-per-task=1", "--ntasks=1"):
        assert flag in cmd
    script = cmd[-1].removeprefix("--wrap=").splitlines()
    assert script[0] == "module load cuda"
    assert script[1].endswith(f"-m launch.join --wait {tmp_path}")
    default = compose_config(["launcher=slurm", "launcher.partition=main"])
    assert "--partition=main" in join_job_command(default, str(tmp_path), str(tmp_path))
    assert default["launcher"]["elastic"]["count"] == 0


def test_elastic_join_wait_ends_when_the_run_ended_and_refuses_without_a_door(tmp_path: Path) -> None:
    """``nexrl-join --wait``: a join job that starts after the run ended leaves (exit 0); without
    --wait a run dir with no open door is refused (exit 2)."""
    from nexrl_hpc.tracking.run_status import RunStatus

    status = RunStatus(str(tmp_path))
    status.started()
    status.ended(0, "run finished")
    (tmp_path / "config.yaml").write_text("runtime: {}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "launch.join", "--wait", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "the run ended before this rank could join" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "launch.join", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "elastic/join.json: no such file" in proc.stderr


def test_elastic_a_joined_ranks_leave_counts_once_when_its_modules_are_lost_in_two_looks() -> None:
    """A leaving rank's server may be found dead by one health check and its worker lost with the
    rank's notice in the next: one leave, one status entry, both modules out of the rollout set."""
    from types import SimpleNamespace

    from nexrl_hpc.core.activity import ActivityTracker
    from nexrl_hpc.membership import RolloutMembership
    from nexrl_hpc.types import NexRLRole

    class Named:
        def __init__(self, name: str):
            self.name = name

        def get_module_name(self) -> str:
            return self.name

        def requeue_consumer(self, name: str) -> int:
            return 0

    left: list[tuple[int, str]] = []
    tracker = ActivityTracker()
    roles = {
        "rollout_worker_e4": NexRLRole.ROLLOUT_WORKER,
        "inference_service_e4": NexRLRole.INFERENCE_SERVICE,
    }
    controller = SimpleNamespace(
        _rollout_workers=[Named("rollout_worker"), Named("rollout_worker_e4")],
        _inference_services=[Named("inference_service"), Named("inference_service_e4")],
        scheduler=SimpleNamespace(set_inference_services=lambda services: None),
        _health=SimpleNamespace(module_roles=roles),
        dataloader=Named("dataloader"),
        validate_dataloader=Named("validate_dataloader"),
        activity_tracker=tracker,
        runtime=SimpleNamespace(elastic_door=lambda: SimpleNamespace(left=lambda *a: left.append(a))),
    )
    members = RolloutMembership(controller)  # type: ignore[arg-type]
    members._joined = {"rollout_worker_e4": 4, "inference_service_e4": 4}
    members.continue_without({"inference_service_e4"}, "module(s) not alive: inference_service_e4")
    members.continue_without({"rollout_worker_e4"}, "joined rank 4 left (SIGTERM)")
    assert left == [(4, "module(s) not alive: inference_service_e4")]
    assert tracker._step_counts["rollout/leaves"] == 1.0
    assert [w.name for w in controller._rollout_workers] == ["rollout_worker"]
    assert [s.name for s in controller._inference_services] == ["inference_service"]
