"""How a run ends on the signals the process controls: SIGTERM (what Slurm sends at the time limit)
is a preemption request inside a Slurm job and an orderly stop elsewhere (exit 143); the preemption
signal and SIGTERM are caught from the first line of ``main()`` (not fatal during start-up); every
such end leaves ``status.json`` in a final state."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nexrl_hpc.config.schema import PreemptionConfig
from nexrl_hpc.runtime.preemption import (
    PREEMPTED_EXIT,
    TERMINATED_EXIT,
    PreemptionWatch,
    Terminated,
    catch_signal_early,
    ignore_preemption_signal,
)
from nexrl_hpc.tracking.run_status import read_status
from tests.conftest import REPO
from tests.test_hostile_wire import idle_connections
from tests.test_mpi import FAST, mpirun, wait_for
from tests.test_rpc import attack, attack_lane

CFG: PreemptionConfig = {"signal": "USR2", "save_before_end_s": 0.0, "requeue": False}
RUN = [
    "service.inference_service.backend=fake",
    "data.batch_size=4",
    "train_worker.save_freq=0",
    "preemption.requeue=false",
    "preemption.save_before_end_s=0",
    *FAST,
]


@pytest.fixture
def own_handlers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The test process's handlers for the signals under test, restored afterwards."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    sigs = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)
    saved = {s: signal.getsignal(s) for s in sigs}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def _deliver(sig: int) -> None:
    """Send ``sig`` to this process and give Python a chance to run its handler."""
    os.kill(os.getpid(), sig)
    for _ in range(100):
        time.sleep(0.001)


@pytest.mark.usefixtures("own_handlers")
def test_a_preemption_signal_during_start_up_is_remembered_then_requested() -> None:
    catch_signal_early()
    _deliver(signal.SIGUSR2)  # would have ended the process (the default action)
    watch = PreemptionWatch(CFG)
    watch.install()
    assert watch.requested() and watch.reason == "signal SIGUSR2 during start-up"
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # not the configured one: default again


@pytest.mark.usefixtures("own_handlers")
def test_sigterm_outside_slurm_stops_like_sigint_and_only_once() -> None:
    catch_signal_early()
    _deliver(signal.SIGTERM)
    watch = PreemptionWatch(CFG)
    with pytest.raises(Terminated):  # during start-up: raised as the run takes the signal over
        watch.install()
    assert not watch.requested()
    _deliver(signal.SIGTERM)  # a second one while the run stops: logged, not raised
    watch.uninstall()
    watch = PreemptionWatch(CFG)
    watch.install()
    with pytest.raises(Terminated, match="terminated"):  # mid-run: raised in the main thread
        _deliver(signal.SIGTERM)
    _deliver(signal.SIGTERM)  # again: logged
    watch.stopping()
    watch.uninstall()
    assert getattr(signal.getsignal(signal.SIGTERM), "__name__", None) == "_remember"  # what it replaced
    assert not isinstance(Terminated(), Exception) and isinstance(Terminated(), KeyboardInterrupt)


@pytest.mark.usefixtures("own_handlers")
def test_sigterm_in_a_slurm_job_is_a_preemption_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    catch_signal_early()
    _deliver(signal.SIGTERM)
    watch = PreemptionWatch(CFG)
    watch.install()
    assert watch.requested() and watch.reason == "signal SIGTERM during start-up"
    watch = PreemptionWatch(CFG)
    watch.install()
    assert not watch.requested()
    watch = PreemptionWatch({**CFG, "requeue": True})
    watch.install()
    _deliver(signal.SIGTERM)
    assert watch.requested() and watch.reason == "signal SIGTERM"
    assert watch.requeue() is False  # the time limit or scancel: never requeued (scontrol not called)


@pytest.mark.usefixtures("own_handlers")
def test_other_ranks_ignore_the_preemption_signal_and_sigterm() -> None:
    catch_signal_early()
    ignore_preemption_signal(CFG)
    for sig in (signal.SIGUSR2, signal.SIGTERM):
        assert callable(signal.getsignal(sig))  # caught, not SIG_IGN (which a started server would inherit)
        _deliver(sig)  # still alive
    child = subprocess.run(
        [sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)"],
        capture_output=True,
        text=True,
    )
    assert child.stdout.strip() == "True"  # a process the rank starts still stops on SIGTERM


def _sig_caught(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (its SigCgt mask)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(mask >> (sig - 1) & 1)


def _rank_pids(run_dir: Path) -> list[int]:
    """The python processes running ``launch.train`` on ``run_dir`` (mpirun's ranks, not mpirun)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[0] == sys.executable.encode() and f"run_dir={run_dir}".encode() in argv:
            pids.append(int(entry))
    return pids


def _start(run_dir: Path, steps: int, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launch.train",
            f"run_dir={run_dir}",
            f"train_worker.total_train_steps={steps}",
            *RUN,
        ],
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, **(env or {})),
    )


def _signal_at_start(proc: subprocess.Popen, sig: int) -> None:
    """``sig`` as soon as the process catches it (the first line of main())."""
    deadline = time.monotonic() + 60
    while not _sig_caught(proc.pid, sig):
        assert proc.poll() is None and time.monotonic() < deadline, "main() never caught the signal"
        time.sleep(0.002)
    os.kill(proc.pid, sig)


def _signal_after_step(proc: subprocess.Popen, run_dir: Path, sig: int, pid: int | None = None) -> None:
    """``sig`` to ``pid`` (the run's process) once a step is in metrics.jsonl."""
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 300
    while not (metrics.exists() and "train/reward_mean" in metrics.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, "no step trained"
        time.sleep(0.05)
    os.kill(pid or proc.pid, sig)


def _ended(proc: subprocess.Popen, run_dir: Path) -> tuple[int, dict[str, Any], str]:
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    status = read_status(str(run_dir))
    assert status is not None, out[-3000:]
    return proc.returncode, status, out


@pytest.mark.e2e
@pytest.mark.parametrize("when", ["at_start", "mid_run"])
def test_sigterm_outside_slurm_exits_143_with_a_final_status(tmp_path: Path, when: str) -> None:
    run_dir = tmp_path / "run"
    proc = _start(run_dir, 200)
    if when == "at_start":
        _signal_at_start(proc, signal.SIGTERM)
    else:
        _signal_after_step(proc, run_dir, signal.SIGTERM)
    code, status, out = _ended(proc, run_dir)
    assert code == TERMINATED_EXIT, out[-3000:]
    assert (status["state"], status["exit_code"], status["reason"]) == ("failed", 143, "terminated (SIGTERM)")
    assert "terminated (SIGTERM)" in out


@pytest.mark.e2e
def test_an_early_preemption_signal_stops_at_a_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _start(run_dir, 200)
    _signal_at_start(proc, signal.SIGUSR2)
    code, status, out = _ended(proc, run_dir)
    assert code == PREEMPTED_EXIT, out[-3000:]
    assert (status["state"], status["exit_code"]) == ("preempted", PREEMPTED_EXIT)
    assert status["reason"].startswith("signal SIGUSR2 during start-up: checkpoint saved at step ")
    step = int(status["reason"].rsplit(" ", 1)[1])
    assert (run_dir / "checkpoints" / f"global_step_{step}" / "COMPLETE").is_file()


@pytest.mark.e2e
def test_sigterm_in_a_slurm_job_checkpoints_and_exits_3(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _start(run_dir, 200, env={"SLURM_JOB_ID": "4242"})
    _signal_after_step(proc, run_dir, signal.SIGTERM)
    code, status, out = _ended(proc, run_dir)
    assert code == PREEMPTED_EXIT, out[-3000:]
    assert (status["state"], status["slurm_job_id"]) == ("preempted", "4242")
    assert status["reason"].startswith("signal SIGTERM: checkpoint saved at step ")
    step = int(status["reason"].rsplit(" ", 1)[1])
    assert (run_dir / "checkpoints" / f"global_step_{step}" / "COMPLETE").is_file()
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"] == step


RANK_EXIT = """
import ctypes, sys, threading
import torch, zmq  # loaded before MPI_Init, as in a rank
libc = ctypes.CDLL(None)
# stands for a library's exit-time teardown that breaks when it runs beside live threads (the glibc
# abort a preempted rank hit after hostile traffic): registered before MPI_Init, it must never run
libc.on_exit(ctypes.cast(libc.abort, ctypes.c_void_p), None)
from nexrl_hpc.config.location import default_section
from nexrl_hpc.runtime.mpi import exit_process, finalize_mpi, start_mpi

MPI = start_mpi(default_section("runtime")["mpi_env"])
comm = MPI.COMM_WORLD
ctx = zmq.Context()
server = ctx.socket(zmq.ROUTER)
ports = comm.allgather(server.bind_to_random_port("tcp://127.0.0.1"))

def hostile():  # connections that come and go on every rank's port until the process ends
    while True:
        for port in ports:
            s = ctx.socket(zmq.DEALER)
            s.connect(f"tcp://127.0.0.1:{port}")
            s.send(b"x" * 64)
            s.close(linger=0)

threading.Thread(target=hostile, daemon=True).start()
threading.Thread(target=lambda: [server.recv_multipart() for _ in iter(int, 1)], daemon=True).start()
torch.ones(256, 256) @ torch.ones(256, 256)
comm.Barrier()
finalize_mpi(30.0, int(sys.argv[1]))
exit_process(int(sys.argv[1]), 10.0)
"""


@pytest.mark.parametrize("code", [PREEMPTED_EXIT, 0])
def test_finalized_ranks_exit_with_their_code_and_no_exit_time_teardown(tmp_path: Path, code: int) -> None:
    """4 ranks with live ZMQ traffic leave through ``exit_process``: mpirun reports the ranks' code
    (MPICH's exit handler told Hydra each rank finalized: no rank SIGKILLed, no 9), and no handler
    registered before MPI_Init runs (the stand-in abort would make it 6)."""
    script = tmp_path / "rank_exit.py"
    script.write_text(RANK_EXIT)
    for _ in range(3):
        done = subprocess.run(
            ["mpirun", "-n", "4", sys.executable, str(script), str(code)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
        )
        assert done.returncode == code, done.stdout[-2000:] + done.stderr[-2000:]
        assert "BAD TERMINATION" not in done.stdout + done.stderr


@pytest.mark.e2e
def test_an_early_preemption_signal_to_every_mpi_rank_stops_the_job_at_a_checkpoint(tmp_path: Path) -> None:
    """USR2 to all 4 ranks as soon as each catches it (what Slurm does: every task gets the signal):
    ranks other than 0 used to die of it; now rank 0 stops the job at a checkpoint, mpirun exits 3."""
    run_dir = tmp_path / "mpi"
    proc = subprocess.Popen(
        mpirun(4, [f"run_dir={run_dir}", "train_worker.total_train_steps=200", *RUN]),
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline, signalled = time.monotonic() + 120, set[int]()
        while len(signalled) < 4:
            assert proc.poll() is None and time.monotonic() < deadline, "the ranks never caught USR2"
            for pid in _rank_pids(run_dir):
                if pid not in signalled and _sig_caught(pid, signal.SIGUSR2):
                    os.kill(pid, signal.SIGUSR2)
                    signalled.add(pid)
            time.sleep(0.002)
        code, status, out = _ended(proc, run_dir)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == PREEMPTED_EXIT, out[-3000:]
    assert (status["state"], status["exit_code"]) == ("preempted", PREEMPTED_EXIT)
    assert status["reason"].startswith("signal SIGUSR2 during start-up: checkpoint saved at step ")


# repetitions of the hostile preemption below (each a whole 4-rank job): once per backend in the
# suite; raise it to soak the exit path
HOSTILE_PREEMPT_REPEATS = int(os.environ.get("NEXRL_HOSTILE_PREEMPT_REPEATS", "1"))


@pytest.mark.e2e
@pytest.mark.parametrize("attempt", range(HOSTILE_PREEMPT_REPEATS))
@pytest.mark.parametrize("backend", ["fake", "local"])  # local: each rollout rank's HF server too
def test_a_preempted_4_rank_job_after_hostile_traffic_exits_3(
    tmp_path: Path, backend: str, attempt: int
) -> None:
    """Every rank's RPC port, trainer rank 0's batch port and every direct lane get hostile input
    and idle connections still open at the preemption: every rank leaves through its exit path
    with native threads busy, and mpirun reports 3 (a rank aborting in glibc at exit made it 6)."""
    run_dir = tmp_path / "mpi"
    proc = subprocess.Popen(
        mpirun(
            4,
            [
                f"run_dir={run_dir}",
                "train_worker.total_train_steps=200",
                *(a for a in RUN if not a.startswith("service.inference_service.backend=")),
                f"service.inference_service.backend={backend}",
            ],
        ),
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    idle = []
    try:
        ranks_file = run_dir / "logs" / "ranks.json"
        wait_for(ranks_file, proc)
        ranks = json.loads(ranks_file.read_text())
        ports = [r["address"] for r in ranks] + [r["trainer_address"] for r in ranks if r["trainer_address"]]
        lanes = [r["lane_address"] for r in ranks]
        marker = tmp_path / "pwned"
        for address in ports:
            attack(address, secrets.token_bytes(32), marker)
        for address in lanes:
            attack_lane(address, secrets.token_bytes(32), marker)
        idle = idle_connections(ports + lanes, 50)
        _signal_after_step(proc, run_dir, signal.SIGUSR2, ranks[0]["pid"])
        code, status, out = _ended(proc, run_dir)
    finally:
        for sock in idle:
            sock.close()
        if proc.poll() is None:
            proc.kill()
    assert code == PREEMPTED_EXIT, out[-3000:]
    assert "free()" not in out and "BAD TERMINATION" not in out, out[-3000:]
    assert (status["state"], status["exit_code"]) == ("preempted", PREEMPTED_EXIT)
    assert not marker.exists()
    assert (run_dir / "logs" / "inference_service_1.log").exists() == (backend == "local")  # its server ran
