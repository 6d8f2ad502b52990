"""The standalone train service: API server + torchrun workers on loopback, driven by the
client the train worker uses, with the rank-0-centric ACK protocol.

Real processes: ``python -m launch.train_service`` (FastAPI/uvicorn) and
``torchrun --nproc_per_node 2 -m launch.train_worker`` (gloo), per identifier.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from nexrl_hpc.checkpoint.hf import read_safetensors_dir
from nexrl_hpc.trainer.group_client import ApiServerControl, TrainGroupClient
from nexrl_hpc.trainer.policy_trainer import PolicyTrainer
from nexrl_hpc.trainer.protocol import TrainerRankError, key_from_token
from nexrl_hpc.trainer.worker import TrainWorker
from tests.conftest import REPO, compose_config, wire_limits
from tests.test_policy_trainer import make_batch

pytestmark = pytest.mark.e2e
TOKEN = "test-token-0123456789"


# two ranks sum gradients in another order than one process; AdamW divides by sqrt(v), so where a
# gradient is near 0 that fp32 difference can move a weight by a fraction of lr (1e-3) a step: 1.6e-5
# seen on one machine. A wrong update differs by about lr.
WEIGHT_TOL = 1e-4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict[str, str]:
    return dict(os.environ, NEXRL_TRAIN_SERVICE_TOKEN=TOKEN, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


@pytest.fixture
def api_server(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    log = open(tmp_path / "api_server.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launch.train_service",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--heartbeat-timeout-s",
            "2",
        ],
        cwd=REPO,
        env=env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/health", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(10)
    log.close()


def start_workers(
    url: str, identifier: str, tmp_path: Path, backend: str = "fsdp", nproc: int = 2
) -> subprocess.Popen:
    log = open(tmp_path / f"workers_{identifier}.log", "w")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        "-m",
        "launch.train_worker",
        "--api-server-url",
        url,
        "--identifier",
        identifier,
        "--backend",
        backend,
        "--heartbeat-s",
        "0.5",
        "--idle-tick-s",
        "0.5",
    ]
    return subprocess.Popen(
        cmd, cwd=REPO, env=env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def workers_log_tail(tmp_path: Path, identifier: str, lines: int = 40) -> str:
    """The end of a worker group's log, for an assertion message (CI keeps no files)."""
    text = (tmp_path / f"workers_{identifier}.log").read_text(errors="replace")
    return "\n".join(text.splitlines()[-lines:])


def connect(url: str, identifier: str, model_dir: str, recv_timeout_ms: int = 120_000) -> TrainGroupClient:
    control = ApiServerControl(url, TOKEN, identifier, heartbeat_timeout_s=2.0)
    info = control.wait_ready(120)
    return TrainGroupClient(
        info["endpoints"]["0"],
        key_from_token(TOKEN, identifier, info["session"]),
        control,
        recv_timeout_ms=recv_timeout_ms,
        total_timeout_ms=600_000,
        max_message_bytes=1 << 30,
        limits=wire_limits(),
        model_path=model_dir,
    )


def payload(engine: str) -> dict:
    cfg = compose_config(
        [
            f"service.train_service.engine={engine}",
            "service.train_service.actor.ppo_mini_batch_size=8",
            "service.train_service.actor.ppo_micro_batch_size=3",
        ]
    )
    return TrainWorker(cfg, PolicyTrainer()).train_service_config()


def stop_group(proc: subprocess.Popen, url: str, identifier: str) -> None:
    """SIGTERM to trainer rank 0 (how an operator stops a group): it tells the others to stop."""
    if proc.poll() is not None:
        return
    try:
        info = ApiServerControl(url, TOKEN, identifier, 2.0).group_info()
        os.kill(next(r["pid"] for r in info["ranks"] if r["rank"] == 0), signal.SIGTERM)
        proc.wait(30)
    except Exception:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def test_two_groups_on_one_api_server_train_like_the_single_process_engine(
    api_server: str, tiny_model_dir: str, tmp_path: Path
) -> None:
    student = start_workers(api_server, "student", tmp_path)
    teacher = start_workers(api_server, "teacher", tmp_path)
    try:
        clients = {name: connect(api_server, name, tiny_model_dir) for name in ("student", "teacher")}
        for client in clients.values():
            client.initialize_worker(payload("fsdp"), role="actor", world_size=2)
            client.init_model()
        ref = PolicyTrainer(tiny_model_dir)
        ref.initialize_worker(payload("single"))
        ref.init_model()

        batches = [make_batch(13, seed=s) for s in range(3)]
        logp = clients["student"].compute_log_prob({"batch": dict(batches[0])})["batch"]["old_log_probs"]
        ref_logp = ref.compute_log_prob({"batch": dict(batches[0])})["batch"]["old_log_probs"]
        assert logp.shape == (13, 2)
        assert float((logp - ref_logp).abs().max()) <= 1e-6
        for b in batches:
            got = clients["student"].update_actor({"batch": dict(b)})["meta_info"]["metrics"]
            want = ref.update_actor({"batch": dict(b)})["meta_info"]["metrics"]
            assert got["actor/optimizer_steps"] == want["actor/optimizer_steps"] == 2
            assert got["actor/pg_loss"] == pytest.approx(want["actor/pg_loss"], abs=1e-6)

        ckpt = tmp_path / "ckpt"
        clients["student"].save_checkpoint(str(ckpt), global_step=3)
        assert sorted(p.name for p in (ckpt / "optimizer").iterdir()) == [
            "rank_0.safetensors",
            "rank_0.safetensors.xxh3",
            "rank_1.safetensors",
            "rank_1.safetensors.xxh3",
        ]
        ref.export_weights(str(tmp_path / "ref"))
        got_w, want_w = read_safetensors_dir(str(ckpt / "model")), read_safetensors_dir(str(tmp_path / "ref"))
        assert max(float((got_w[k] - want_w[k]).abs().max()) for k in want_w) <= WEIGHT_TOL
        # the teacher group was not trained: its weights are still the base model's
        clients["teacher"].export_weights(str(tmp_path / "teacher"))
        base = read_safetensors_dir(tiny_model_dir)
        teacher_w = read_safetensors_dir(str(tmp_path / "teacher"))
        assert max(float((teacher_w[k] - base[k]).abs().max()) for k in base) == 0.0

        # two updates sent back to back, the second while the group trains the first, each exporting
        # the weights it made: answered in order, each export holds its own version's weights
        later = [make_batch(13, seed=s) for s in (3, 4)]
        sent = [
            clients["student"].start_update_actor({"batch": dict(b)}, str(tmp_path / f"v{i}"))
            for i, b in enumerate(later)
        ]
        answers = [update.result()["meta_info"] for update in sent]
        for i, (b, answer) in enumerate(zip(later, answers)):
            want = ref.update_actor({"batch": dict(b)})["meta_info"]["metrics"]
            assert answer["metrics"]["actor/pg_loss"] == pytest.approx(want["actor/pg_loss"], abs=1e-6)
            assert answer["export_s"] > 0.0
            ref.export_weights(str(tmp_path / f"ref{i}"))
            got_w = read_safetensors_dir(str(tmp_path / f"v{i}"))
            want_w = read_safetensors_dir(str(tmp_path / f"ref{i}"))
            assert max(float((got_w[k] - want_w[k]).abs().max()) for k in want_w) <= WEIGHT_TOL

        # bad input is refused on the client, before anything is sent
        broken = dict(batches[0])
        del broken["advantages"]
        with pytest.raises(KeyError, match="advantages"):
            clients["student"].update_actor({"batch": broken})
        short = dict(batches[0])
        short["advantages"] = short["advantages"][:5]
        with pytest.raises(ValueError, match="row counts"):
            clients["student"].update_actor({"batch": short})
    finally:
        stop_group(student, api_server, "student")
        stop_group(teacher, api_server, "teacher")
    for proc, name in ((student, "student"), (teacher, "teacher")):
        assert proc.returncode == 0, f"{name} group exit {proc.returncode}:\n" + workers_log_tail(
            tmp_path, name
        )


def test_requests_without_the_token_are_refused(api_server: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        assert httpx.get(f"{api_server}/health", headers=headers).status_code == 401
        r = httpx.post(
            f"{api_server}/register_worker_group", json={"identifier": "x", "world_size": 1}, headers=headers
        )
        assert r.status_code == 401
    ok = httpx.get(f"{api_server}/health", headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 200 and "x" not in ok.json()["groups"]


def test_a_killed_worker_gives_the_client_a_clear_error_not_a_hang(
    api_server: str, tiny_model_dir: str, tmp_path: Path
) -> None:
    group = start_workers(api_server, "victim", tmp_path)
    try:
        client = connect(api_server, "victim", tiny_model_dir, recv_timeout_ms=30_000)
        client.initialize_worker(payload("fsdp"), role="actor", world_size=2)
        client.init_model()
        info = client._control.group_info()  # type: ignore[attr-defined]
        rank1_pid = next(r["pid"] for r in info["ranks"] if r["rank"] == 1)
        os.kill(rank1_pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(TrainerRankError) as err:
            client.update_actor({"batch": make_batch(13, seed=0)})
        took = time.monotonic() - t0
        assert took < 30, took
        assert "trainer rank 1" in str(err.value), err.value
    finally:
        stop_group(group, api_server, "victim")


def test_a_run_trains_through_a_standalone_service(api_server: str, tmp_path: Path) -> None:
    """``python -m launch.train service.train_service.backend=direct-zmq``: the default task learns
    with its trainer in another job (the API server and a torchrun worker group)."""
    group = start_workers(api_server, "actor", tmp_path)
    run_dir = tmp_path / "run"
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "launch.train",
                f"run_dir={run_dir}",
                "seed=2",
                "service.train_service.backend=direct-zmq",
                f"service.train_service.url={api_server}",
                "service.train_service.engine=fsdp",
                "service.train_service.world_size=2",
            ],
            cwd=REPO,
            env=env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "last validation: val/accuracy=" in proc.stdout
        last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        val = [r["val/accuracy"] for r in last if "val/accuracy" in r]
        assert val[0] <= 0.3 and val[-1] >= 0.8, val
        assert (run_dir / "checkpoints" / "global_step_50" / "optimizer" / "rank_1.safetensors").exists()
    finally:
        stop_group(group, api_server, "actor")
    assert group.returncode == 0, workers_log_tail(tmp_path, "actor")


def test_a_run_without_the_token_stops_before_training(tmp_path: Path) -> None:
    environ = {k: v for k, v in env().items() if k != "NEXRL_TRAIN_SERVICE_TOKEN"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.train",
            f"run_dir={tmp_path / 'run'}",
            "service.train_service.backend=direct-zmq",
            "service.train_service.url=http://127.0.0.1:9",
        ],
        cwd=REPO,
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "NEXRL_TRAIN_SERVICE_TOKEN" in proc.stderr and "service.train_service.token_env" in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_guessable_token_is_refused_before_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from nexrl_hpc.config.validate import ConfigError

    monkeypatch.setenv("NEXRL_TRAIN_SERVICE_TOKEN", "abc")
    overrides = ["service.train_service.backend=direct-zmq", "service.train_service.url=http://127.0.0.1:9"]
    with pytest.raises(ConfigError) as err:
        compose_config(overrides)
    assert (
        "service.train_service.token_env: backend=direct-zmq: the bearer token in the environment variable "
        "'NEXRL_TRAIN_SERVICE_TOKEN' has 3 characters, fewer than 16" in str(err.value)
    )
    assert err.value.exit_code == 2
    monkeypatch.setenv("NEXRL_TRAIN_SERVICE_TOKEN", TOKEN)
    assert compose_config(overrides)["service"]["train_service"]["backend"] == "direct-zmq"


def test_an_unclosed_client_in_a_reference_cycle_does_not_hang_the_garbage_collector() -> None:
    """Collected in a cycle, a client's ZMQ context used to wait forever for a socket nobody closed
    (a GC pass in a later test hung until pytest's timeout)."""
    import gc
    import threading

    client = TrainGroupClient("tcp://127.0.0.1:9", b"k" * 32, None, 1000, 1000, 1 << 20, wire_limits())  # type: ignore[arg-type]
    client.cycle = client  # type: ignore[attr-defined]  # only the cyclic collector can free it now
    ctx = client._ctx
    del client
    done = threading.Event()
    collector = threading.Thread(target=lambda: (gc.collect(), done.set()), daemon=True)
    collector.start()
    assert done.wait(20), "gc.collect() hung on the client's ZMQ context"
    assert ctx.closed


class RecordingControl(ApiServerControl):
    """The standalone control's protocol, recording its execute signals instead of sending them."""

    def __init__(self) -> None:
        self.executed: list[str] = []

    def execute(self, client: TrainGroupClient, op_id: str, timeout_s: float) -> None:
        self.executed.append(op_id)


@pytest.mark.parametrize("embedded", [True, False])
def test_the_embedded_group_takes_the_execute_signal_with_the_batch(embedded: bool) -> None:
    """Inside the MPI job the batch's message carries the execute signal (one round trip, no ACK);
    the standalone service keeps data, ACK, then execute through the API server."""
    from nexrl_hpc.trainer.group_client import DirectControl

    control = DirectControl() if embedded else RecordingControl()
    client = TrainGroupClient(
        "tcp://127.0.0.1:9",
        b"k" * 32,
        control,
        recv_timeout_ms=1_000,
        total_timeout_ms=1_000,
        max_message_bytes=1 << 20,
        limits=wire_limits(),
    )
    sent: list[dict] = []
    waited: list[str] = []
    client.send = lambda header, tensors=None: sent.append(header)  # type: ignore[method-assign]

    def wait_result(op_id: str, operation: str, timeout_s: float, kind: str = "result") -> tuple:
        waited.append(kind)
        return {"metrics": {"actor/loss": 0.5}}, {}

    client.wait_result = wait_result  # type: ignore[method-assign]
    batch = make_batch(n=4)
    metrics = client.update_actor({"batch": batch, "meta_info": {}})["meta_info"]["metrics"]
    assert metrics == {"actor/loss": 0.5}
    assert [h["kind"] for h in sent] == ["data"]
    if embedded:
        assert sent[0]["execute"] is True and waited == ["result"]
    else:
        assert "execute" not in sent[0] and waited == ["ack", "result"]
        assert control.executed == [sent[0]["op_id"]]  # type: ignore[attr-defined]
    client.close()
