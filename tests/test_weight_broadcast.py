"""The broadcast weight transport with nexrl_hpc's local server: the same weights as a disk reload,
nothing written, and a server killed mid-broadcast fails the sync naming it, within the timeout."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from nexrl_hpc.algorithm.batching import pack_trajectories
from nexrl_hpc.checkpoint.hf import write_hf_model_dir
from nexrl_hpc.checkpoint.trainer_io import tied_weight_names
from nexrl_hpc.inference.client import LLMServiceClient
from nexrl_hpc.inference.service import InferenceService
from nexrl_hpc.models.tiny import build_tiny_model, materialize_base_model
from nexrl_hpc.trainer.logprobs import response_log_probs
from nexrl_hpc.trainer.parallel import SingleProcess
from nexrl_hpc.trainer.weight_broadcast import broadcast_weights
from nexrl_hpc.types import Batch
from nexrl_hpc.weight_sync.publisher import WeightPublisher
from nexrl_hpc.weight_sync.transport import WeightSyncError
from nexrl_hpc.weight_sync.wire import plan_buckets
from tests.conftest import compose_config


class _Source:
    """The trainer's side in one process: ``model`` broadcast through ``par``."""

    def __init__(self, model: torch.nn.Module, par: SingleProcess | None = None):
        self.model, self.par = model, par or SingleProcess()
        self.sent: list[dict[str, Any]] = []

    def broadcast_weights(self, spec: dict[str, Any]) -> dict[str, Any]:
        result = broadcast_weights(self.par, self.model, spec, set(tied_weight_names(self.model)))
        self.sent.append(result)
        return result


def _services(cfg: dict[str, Any], model_dir: str, run_dir: Path, names: list[str]) -> list[InferenceService]:
    services = []
    for name in names:
        service = InferenceService(cfg, model_dir, str(run_dir))  # type: ignore[arg-type]
        service.set_module_name(name)
        service.launch()
        services.append(service)
    for service in services:
        service.wait_ready()
    return services


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[dict[str, Any], str]]:
    cfg = compose_config(["seed=1", f"run_dir={tmp_path / 'run'}", "weight.broadcast_timeout_s=15"])
    yield cfg, materialize_base_model(cfg["model"], str(tmp_path / "base"))


def _new_model(cfg: dict[str, Any]) -> Any:
    model, _ = build_tiny_model(dict(cfg["model"]["tiny"], init_seed=7))
    return model.eval()


def _gap(cfg: dict[str, Any], service: InferenceService, model: Any) -> float:
    """Largest |engine - trainer| log-prob of sampled response tokens."""
    url, key = service.get_endpoint()
    client = LLMServiceClient(cfg["service"]["inference_service"], base_url=url, api_key=key)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13], [14, 15]]

    async def run() -> list[Any]:
        try:
            return await asyncio.gather(
                *(client.acompletion(p, max_tokens=6, temperature=1.0) for p in prompts)
            )
        finally:
            await client.aclose()

    results = asyncio.run(run())
    batch = Batch(
        values={
            "prompt_ids": [r["prompt_ids"] for r in results],
            "response_ids": [r["response_ids"] for r in results],
            "behaviour_log_probs": [r["logprobs"] for r in results],
        }
    )
    packed = pack_trajectories(batch, 0)
    with torch.no_grad():
        trainer = response_log_probs(model, packed)
    return float(((trainer - packed["behaviour_log_probs"]).abs() * packed["response_mask"]).max())


def test_local_server_by_broadcast_serves_what_a_disk_reload_serves(
    setup: tuple[dict[str, Any], str], tmp_path: Path
) -> None:
    cfg, model_dir = setup
    disk_cfg = compose_config(["seed=1", f"run_dir={tmp_path / 'run'}", "weight.transport=disk"])
    (by_broadcast,) = _services(cfg, model_dir, tmp_path, ["inference_service_0"])
    (by_disk,) = _services(disk_cfg, model_dir, tmp_path, ["inference_service_1"])
    try:
        model = _new_model(cfg)
        exported = tmp_path / "v1"
        write_hf_model_dir(model.state_dict(), model_dir, str(exported), max_shard_bytes=1 << 30)
        by_disk.reload_weights(str(exported), 1)
        publisher = WeightPublisher(cfg["weight"])
        publisher.set_inference_services([by_broadcast])
        source = _Source(model)
        publisher.set_weight_source(source)
        publisher.publish(1)
        assert source.sent[0]["bytes"] == sum(
            v.numel() * v.element_size()
            for k, v in model.state_dict().items()
            if k not in tied_weight_names(model)
        )
        assert publisher.last_sync["bytes"] == source.sent[0]["bytes"]
        assert not os.path.exists(cfg["weight"]["sync_weight_path"])  # nothing written
        assert _gap(cfg, by_broadcast, model) <= 1e-4
        assert _gap(disk_cfg, by_disk, model) <= 1e-4
        publisher.publish(2)  # a new group per sync: the same server takes the next one
        assert len(source.sent) == 2
    finally:
        by_broadcast.stop()
        by_disk.stop()


class _KillsAfterFirstBucket(SingleProcess):
    """Sends 64 KiB buckets (the tiny model is a few of them); after the first it SIGKILLs
    ``victim``'s server (once) and goes on sending."""

    def __init__(self, victim: InferenceService, before_kill: Any = None):
        self.victim, self.before_kill = victim, before_kill

    def weight_buckets(self, model: Any, bucket_bytes: int, skip: set[str]) -> Iterator[Any]:
        for i, bucket in enumerate(super().weight_buckets(model, 64 << 10, skip)):
            if i == 1 and self.victim._server is not None and self.victim._server.process.poll() is None:
                if self.before_kill is not None:
                    self.before_kill()
                server = self.victim._server
                assert server is not None and server.process is not None
                os.killpg(server.process.pid, signal.SIGKILL)
                server.process.wait()
            yield bucket


def test_server_killed_mid_broadcast_fails_the_sync_naming_it_within_the_timeout(
    setup: tuple[dict[str, Any], str], tmp_path: Path
) -> None:
    cfg = compose_config(["seed=1", f"run_dir={tmp_path / 'run'}", "weight.broadcast_timeout_s=20"])
    model_dir = setup[1]
    keeps, dies = _services(cfg, model_dir, tmp_path, ["inference_service_0", "inference_service_1"])
    try:
        model = _new_model(cfg)
        sizes = [(k, v.numel() * v.element_size()) for k, v in model.state_dict().items()]
        assert len(plan_buckets(sizes, 64 << 10)) >= 3  # the kill lands mid-stream
        publisher = WeightPublisher(cfg["weight"])
        publisher.set_inference_services([keeps, dies])
        publisher.set_weight_source(_Source(model, _KillsAfterFirstBucket(dies)))
        started = time.monotonic()
        with pytest.raises(WeightSyncError) as failed:
            publisher.publish(1)
        assert time.monotonic() - started < cfg["weight"]["broadcast_timeout_s"] + 15
        message = str(failed.value)
        assert "weight version 1 not broadcast" in message and "inference_service_1:" in message
        # the survivor takes the next sync, with a new group of the services that are left
        publisher.set_inference_services([keeps])
        publisher.set_weight_source(_Source(model))
        publisher.publish(2)
        assert _gap(cfg, keeps, model) <= 1e-4
    finally:
        keeps.stop()
        dies.stop()


def test_a_leaving_joined_rank_killed_mid_broadcast_does_not_fail_the_sync(
    setup: tuple[dict[str, Any], str], tmp_path: Path
) -> None:
    """A joined rank that leaves (scancel) tells rank 0 first, whose controller drops its service
    from the weight-sync set; then its server goes, in the middle of a broadcast. The error of its
    call is not the sync's failure: the version is broadcast again to the services left."""
    cfg = compose_config(["seed=1", f"run_dir={tmp_path / 'run'}", "weight.broadcast_timeout_s=20"])
    keeps, leaves = _services(cfg, setup[1], tmp_path, ["inference_service_0", "inference_service_e3"])
    try:
        model = _new_model(cfg)
        publisher = WeightPublisher(cfg["weight"])
        publisher.set_inference_services([keeps, leaves])
        departed = lambda: publisher.set_inference_services([keeps])  # noqa: E731 - the controller's poll
        killing = _Source(model, _KillsAfterFirstBucket(leaves, before_kill=departed))
        publisher.set_weight_source(killing)
        publisher.publish(1)
        assert leaves._server is not None and leaves._server.process.poll() is not None  # killed mid-sync
        # the broken broadcast raised; the one sent again, to the service left, is the one recorded
        assert len(killing.sent) == 1 and publisher.served == [keeps]
        assert _gap(cfg, keeps, model) <= 1e-4
    finally:
        keeps.stop()
        leaves.stop()


@pytest.mark.e2e
def test_mpi_run_with_two_rollout_ranks_learns_by_broadcast_and_writes_no_weights(tmp_path: Path) -> None:
    """mpirun -n 4 (driver, trainer, two rollout ranks with a local server each), the default task,
    weight.transport=broadcast (the default): it learns as the default run does, and nothing but
    checkpoints holds weights on disk."""
    import subprocess

    from tests.conftest import REPO
    from tests.test_mpi import metrics, mpirun

    run_dir = tmp_path / "run"
    quiet = ["validate.validate_before_train=false", "validate.eval.validate_freq=0", "logger.backend=[]"]
    args = [f"run_dir={run_dir}", "seed=5", "weight.transport=broadcast", *quiet]  # validated at the end
    proc = subprocess.run(mpirun(4, args), cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    placement = (run_dir / "train.log").read_text()
    assert "rollout_worker_0, inference_service_0" in placement
    assert "rollout_worker_1, inference_service_1" in placement
    rows = metrics(run_dir)
    val = [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r]
    assert val[-1][0] == 50 and val[-1][1] >= 0.8, val
    syncs = [r for r in rows if "weight_sync/seconds" in r]
    assert [r["step"] for r in syncs] == list(range(51))  # the initial weights, then every step
    assert all(r["weight_sync/verify_max_abs_diff"] <= 1e-4 for r in syncs)  # verified after each broadcast
    assert len({r["weight_sync/bytes"] for r in syncs}) == 1 and syncs[0]["weight_sync/bytes"] > 0
    assert not (run_dir / "weights").exists()
    weight_files = [p for p in run_dir.rglob("*.safetensors") if "checkpoints" not in p.parts]
    assert [p for p in weight_files if "base_model" not in p.parts] == []


def test_config_names_the_transport_keys() -> None:
    from nexrl_hpc.config.validate import ConfigError

    with pytest.raises(ConfigError) as bad:
        compose_config(["weight.broadcast_backend=nccl"])  # a CPU trainer
    assert "weight.broadcast_backend" in str(bad.value) and "nccl" in str(bad.value)
    with pytest.raises(ConfigError) as bad:
        compose_config(["weight.transport=nfs"])
    assert "weight.transport" in str(bad.value)
    assert compose_config(["hardware=gpu"])["weight"]["broadcast_backend"] == "nccl"


def test_local_mode_broadcasts_over_gloo_whatever_the_hardware() -> None:
    """One GPU cannot hold two ranks of one NCCL group: local mode (trainer and engine on one
    machine) uses gloo; mpi mode takes hardware=gpu's nccl."""
    gpu = compose_config(["hardware=gpu"])
    assert WeightPublisher(gpu["weight"], "local")._broadcast_backend == "gloo"
    assert WeightPublisher(gpu["weight"], "mpi")._broadcast_backend == "nccl"


def test_a_receiver_takes_buckets_in_place_where_they_fit_and_can_refuse_one_by_its_header() -> None:
    """``receive_buckets(into=...)``: a tensor that fits (dtype, shape, contiguous) is received in
    place, one that does not (or none named) into a new tensor; an ``into`` that raises refuses
    the bucket from its header, before any of its tensors is written."""
    from nexrl_hpc.weight_sync.broadcast import BroadcastRendezvous
    from nexrl_hpc.weight_sync.wire import (
        BroadcastAborted,
        BroadcastGroup,
        receive_buckets,
        send_bucket,
        send_end,
    )

    rendezvous = BroadcastRendezvous("127.0.0.1", "gloo", 60.0, 1)
    sent = [
        ("a", torch.arange(4.0)),
        ("b", torch.arange(6.0).reshape(2, 3)),
        ("c", torch.tensor([7, 8, 9])),
    ]
    live = {"a": torch.zeros(4), "b": torch.zeros(3, 2).t(), "c": torch.zeros(3)}  # b: not contiguous
    spec = rendezvous.spec(2, version=1)
    outcome: dict[str, Any] = {}

    def sender(spec: dict[str, Any], ends: bool) -> None:
        group = BroadcastGroup(spec, rank=0)
        try:
            send_bucket(group, sent)
            if ends:
                send_end(group)
        except BroadcastAborted as exc:
            outcome["sender"] = exc
        finally:
            group.close()

    thread = threading.Thread(target=sender, args=(spec, True))
    thread.start()
    group = BroadcastGroup(spec, rank=1)
    buckets = list(receive_buckets(group, into=lambda name, dtype, shape: live[name]))
    group.close()
    thread.join(timeout=30)
    [bucket] = buckets
    received = dict(bucket)
    assert received["a"] is live["a"] and torch.equal(live["a"], torch.arange(4.0))
    assert received["b"] is not live["b"] and torch.equal(received["b"], sent[1][1])
    assert received["c"] is not live["c"] and torch.equal(received["c"], sent[2][1])  # int64 into fp32: no
    assert torch.equal(live["b"], torch.zeros(3, 2).t()) and torch.equal(live["c"], torch.zeros(3))

    live["a"].zero_()
    spec = rendezvous.spec(2, version=2)

    def refuse(name: str, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        if name == "c":
            raise ValueError(f"weight broadcast: unexpected weight {name!r}")
        return live[name]

    thread = threading.Thread(target=sender, args=(spec, False))
    thread.start()
    group = BroadcastGroup(spec, rank=1)
    with pytest.raises(ValueError, match="unexpected weight 'c'"):
        next(receive_buckets(group, into=refuse))
    rendezvous.abort(spec, "inference_service_0 failed: unexpected weight 'c'")
    thread.join(timeout=30)
    assert not thread.is_alive() and isinstance(outcome.get("sender"), BroadcastAborted)
    assert torch.equal(live["a"], torch.zeros(4))  # nothing of the refused bucket was written


def test_prefetched_buckets_keep_their_order_and_raise_where_the_stream_broke() -> None:
    from nexrl_hpc.weight_sync.wire import prefetched

    buckets = [[(f"w{i}", torch.full((2,), float(i)))] for i in range(5)]
    assert [b[0][0] for b in prefetched(iter(buckets))] == [f"w{i}" for i in range(5)]

    def broken() -> Iterator[Any]:
        yield buckets[0]
        raise RuntimeError("peer closed the connection")

    seen = []
    with pytest.raises(RuntimeError, match="peer closed"):
        for bucket in prefetched(broken()):
            seen.append(bucket[0][0])
    assert seen == ["w0"]


class _LostRank:
    """An inference service whose rank is declared dead while the sync starts: its call fails with
    ``PeerDeadError`` after ``after_s`` (the heartbeat timeout), having never joined the group."""

    def __init__(self, name: str, after_s: float):
        self.name, self.after_s = name, after_s

    def get_module_name(self) -> str:
        return self.name

    def weight_receivers(self) -> int:
        return 1

    def receive_weights(self, spec: dict[str, Any], rank_offset: int, version: int) -> None:
        from nexrl_hpc.rpc.calls import PeerDeadError

        time.sleep(self.after_s)
        raise PeerDeadError(f"rank 3 is dead (stopped answering); {self.name}.receive_weights failed")


def test_a_rank_lost_before_the_group_forms_calls_it_off_and_the_services_left_get_the_version(
    setup: tuple[dict[str, Any], str], tmp_path: Path
) -> None:
    """Policy continue: the controller removes the lost service a moment after its rank is declared
    dead. The others do not wait the group's timeout for it, and the version is broadcast again to
    the services left: the sync succeeds."""
    cfg = compose_config(["seed=1", f"run_dir={tmp_path / 'run'}", "weight.broadcast_timeout_s=60"])
    (keeps,) = _services(cfg, setup[1], tmp_path, ["inference_service_0"])
    lost = _LostRank("inference_service_1", after_s=1.0)
    try:
        model = _new_model(cfg)
        publisher = WeightPublisher(cfg["weight"])
        publisher.set_inference_services([keeps, lost])  # type: ignore[list-item]
        source = _Source(model)
        publisher.set_weight_source(source)

        def controller() -> None:  # _continue_without, a moment after the error
            time.sleep(1.5)
            publisher.set_inference_services([keeps])

        removal = threading.Thread(target=controller)
        started = time.monotonic()
        removal.start()
        publisher.publish(1)
        removal.join()
        assert time.monotonic() - started < 15  # not the group's 60 s
        assert len(source.sent) == 1 and publisher.last_sync["bytes"] == source.sent[0]["bytes"]
        assert _gap(cfg, keeps, model) <= 1e-4
    finally:
        keeps.stop()


def test_a_lost_rank_the_controller_keeps_fails_the_sync_naming_it(
    setup: tuple[dict[str, Any], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any other policy keeps the lost service: the sync fails naming it (and the survivor that the
    broken group took down), after the grace for a removal, not the group's timeout."""
    from nexrl_hpc.weight_sync import lost as lost_module

    monkeypatch.setattr(lost_module, "REMOVAL_GRACE_S", 1.0)
    monkeypatch.setattr(lost_module, "DEPARTURE_GRACE_S", 1.0)
    cfg = compose_config(["seed=1", f"run_dir={tmp_path / 'run'}", "weight.broadcast_timeout_s=60"])
    (keeps,) = _services(cfg, setup[1], tmp_path, ["inference_service_0"])
    try:
        publisher = WeightPublisher(cfg["weight"])
        publisher.set_inference_services([keeps, _LostRank("inference_service_1", after_s=0.5)])  # type: ignore[list-item]
        publisher.set_weight_source(_Source(_new_model(cfg)))
        started = time.monotonic()
        with pytest.raises(WeightSyncError) as failed:
            publisher.publish(1)
        assert time.monotonic() - started < 15
        message = str(failed.value)
        assert "weight version 1 not broadcast" in message
        assert "inference_service_1: rank 3 is dead" in message
        assert "inference_service_0:" in message and "called off" in message
    finally:
        keeps.stop()


def test_the_join_barrier_raises_the_reason_it_was_called_off() -> None:
    from nexrl_hpc.weight_sync.broadcast import BroadcastRendezvous
    from nexrl_hpc.weight_sync.wire import BroadcastAborted, BroadcastGroup

    rendezvous = BroadcastRendezvous("127.0.0.1", "gloo", 60.0, 1)
    spec = rendezvous.spec(3, version=4)  # the trainer and two receivers; one never comes
    errors: list[BaseException] = []

    def member(rank: int) -> None:
        try:
            BroadcastGroup(spec, rank=rank)
        except BaseException as exc:
            errors.append(exc)

    members = [threading.Thread(target=member, args=(r,)) for r in (0, 1)]
    started = time.monotonic()
    for t in members:
        t.start()
    time.sleep(0.5)
    rendezvous.abort(spec, "inference_service_2 failed: rank 5 is dead")
    for t in members:
        t.join(timeout=10)
    assert time.monotonic() - started < 5
    assert len(errors) == 2 and all(isinstance(e, BroadcastAborted) for e in errors)
    assert all("inference_service_2 failed: rank 5 is dead" in str(e) for e in errors)


def test_a_member_that_dies_after_joining_fails_the_group_within_the_form_timeout() -> None:
    """A member that passed the join barrier and never connected (a server killed at that moment)
    fails the others' group set-up after ``weight.broadcast_form_timeout_s``, not the whole
    ``broadcast_timeout_s``; a group that formed keeps ``broadcast_timeout_s`` for its collectives
    (a receiver waits longer than the form timeout for the trainer's first bucket)."""
    import datetime

    import torch
    import torch.distributed as dist

    from nexrl_hpc.weight_sync.broadcast import BroadcastRendezvous
    from nexrl_hpc.weight_sync.wire import BroadcastGroup, join

    rendezvous = BroadcastRendezvous("127.0.0.1", "gloo", 60.0, 1, form_timeout_s=2.0)
    spec = rendezvous.spec(2, version=1)
    assert spec["form_timeout_s"] == 2.0
    store = dist.TCPStore(spec["host"], spec["port"], None, False, timeout=datetime.timedelta(seconds=10))
    ghost = threading.Thread(target=join, args=(dist.PrefixStore(spec["prefix"], store), 2, 10.0))
    ghost.start()  # joins, then never forms the group
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="timeout after 2000ms"):
        BroadcastGroup(spec, rank=0)
    assert time.monotonic() - started < 10
    ghost.join()

    spec = rendezvous.spec(2, version=2)
    received: list[torch.Tensor] = []

    def receiver() -> None:
        group = BroadcastGroup(spec, rank=1)
        tensor = torch.zeros(4)
        group.broadcast(tensor)
        received.append(tensor)
        group.close()

    thread = threading.Thread(target=receiver)
    thread.start()
    sender = BroadcastGroup(spec, rank=0)
    time.sleep(3.0)  # the trainer gathering its first bucket: longer than the form timeout
    sender.broadcast(torch.arange(4.0))
    thread.join(timeout=30)
    sender.close()
    assert len(received) == 1 and torch.equal(received[0], torch.arange(4.0))


def _join_then_die_after_publishing(spec: dict[str, Any]) -> None:
    """A member that passes the join barrier, publishes its gloo address and dies before it
    connects (a server killed at that moment): gloo's pair connect on the other side then retries
    for about five times its timeout."""
    import datetime

    import torch.distributed as dist

    from nexrl_hpc.weight_sync.wire import join

    class DiesAfterPublishing(dist.Store):
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def set(self, key: str, value: Any) -> None:
            self.inner.set(key, value)
            os._exit(0)

        def get(self, key: str) -> bytes:
            return self.inner.get(key)

        def add(self, key: str, amount: int) -> int:
            return self.inner.add(key, amount)

        def check(self, keys: list[str]) -> bool:
            return self.inner.check(keys)

        def wait(self, keys: list[str], *timeout: Any) -> None:
            self.inner.wait(keys, *timeout)

    form = datetime.timedelta(seconds=float(spec["form_timeout_s"]))
    store = dist.TCPStore(spec["host"], int(spec["port"]), None, False, timeout=form)
    prefixed = dist.PrefixStore(spec["prefix"], store)
    join(prefixed, int(spec["world_size"]), 10.0)
    dist.ProcessGroupGloo(DiesAfterPublishing(prefixed), 1, int(spec["world_size"]), form)


@pytest.mark.parametrize("called_off", [False, True])
def test_a_member_dead_after_publishing_its_address_fails_the_group_within_the_form_timeout(
    called_off: bool,
) -> None:
    """Gloo's set-up waits about five form timeouts (11 s for 2 s here) for a member that published
    its address and died when this side is the one that listens, or retries its connect as long;
    the group is given up at the form timeout (plus a second), or at once when the publisher calls
    the sync off (a 30 s form timeout here), naming why. Which side of a pair connects is gloo's
    choice (by port): when this side connects, gloo can even end up connected to itself and form
    the group (the sync then fails at its call-off, mid-stream), so the death is replayed until
    one attempt meets the wait (one attempt in two or three)."""
    import multiprocessing
    import multiprocessing.connection

    import torch.distributed as dist

    from nexrl_hpc.weight_sync.broadcast import BroadcastRendezvous
    from nexrl_hpc.weight_sync.wire import BroadcastAborted, BroadcastGroup

    form_s = 30.0 if called_off else 2.0
    rendezvous = BroadcastRendezvous("127.0.0.1", "gloo", 60.0, 1, form_timeout_s=form_s)
    if called_off:
        expected: tuple[type[Exception], str] = (
            BroadcastAborted,
            "called off while its group formed: server 'rollout-1' failed",
        )
    else:
        expected = (
            TimeoutError,
            r"rank 0's gloo group of 2 did not connect within 2s \(weight.broadcast_form_timeout_s\)",
        )
    waits: list[float] = []
    for version in range(1, 11):
        spec = rendezvous.spec(2, version=version)
        member = multiprocessing.get_context("spawn").Process(
            target=_join_then_die_after_publishing, args=(spec,)
        )
        member.start()
        if called_off:

            def call_off_when_it_died(member: Any = member, spec: Any = spec) -> None:
                # its sentinel, not join: two threads joining one process race to reap it, and the
                # loser reads exitcode None for a process that exited 0
                multiprocessing.connection.wait([member.sentinel], timeout=60)
                rendezvous.abort(spec, "server 'rollout-1' failed: connection refused")

            threading.Thread(target=call_off_when_it_died, daemon=True).start()
        watch = dist.PrefixStore(spec["prefix"], dist.TCPStore(spec["host"], spec["port"], None, False))
        while int(watch.add("joined", 0)) < 1:  # the member's interpreter starting is not the wait
            time.sleep(0.05)
        started = time.monotonic()
        try:
            group = BroadcastGroup(spec, rank=0)
        except expected[0] as exc:
            waits.append(time.monotonic() - started)
            assert re.search(expected[1], str(exc)), exc
            break
        finally:
            member.join(timeout=30)
            assert member.exitcode == 0  # it died where meant: after publishing its address
        group.close()  # connected to itself: gloo's, not this test's, to fix
    assert waits and waits[0] < (4.0 if called_off else form_s + 2.0), waits


def _receive_one_then_stop_reading(spec: dict[str, Any], received: Any) -> None:
    """A receiver that takes the first broadcast and then never reads again (a process about to die)."""
    from nexrl_hpc.weight_sync.wire import BroadcastGroup

    group = BroadcastGroup(spec, rank=1)
    group.broadcast(torch.zeros(4))
    received.set()
    time.sleep(600)


def test_a_send_in_flight_to_a_receiver_that_stopped_ends_when_the_sync_is_called_off() -> None:
    """A gloo send in flight to a peer that no longer reads (or was killed meanwhile: gloo does not
    fail such a send before the group's timeout) ends as soon as the publisher calls the sync off,
    as it does when the peer's own call fails: ``BroadcastAborted`` with the reason, within a
    second, not ``weight.broadcast_timeout_s`` (60 s here) later."""
    import multiprocessing

    from nexrl_hpc.weight_sync.broadcast import BroadcastRendezvous
    from nexrl_hpc.weight_sync.wire import BroadcastAborted, BroadcastGroup

    rendezvous = BroadcastRendezvous("127.0.0.1", "gloo", 60.0, 1)
    spec = rendezvous.spec(2, version=1)
    context = multiprocessing.get_context("spawn")
    received = context.Event()
    receiver = context.Process(target=_receive_one_then_stop_reading, args=(spec, received))
    receiver.start()
    try:
        sender = BroadcastGroup(spec, rank=0)
        sender.broadcast(torch.ones(4))
        assert received.wait(60)
        errors: list[BaseException] = []

        def send() -> None:
            try:
                sender.broadcast(torch.ones(32 << 20))  # 128 MB: more than the sockets take in
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=send)
        thread.start()
        time.sleep(1.0)
        assert thread.is_alive() and not errors  # the send cannot complete
        called_off = time.monotonic()
        rendezvous.abort(spec, "inference_service_0 failed: Server disconnected")
        thread.join(timeout=30)
        assert not thread.is_alive() and time.monotonic() - called_off < 2
        assert len(errors) == 1 and isinstance(errors[0], BroadcastAborted)
        assert "mid-stream: inference_service_0 failed: Server disconnected" in str(errors[0])
        sender.close()  # returns at once: the abandoned group shuts down on a thread of its own
    finally:
        receiver.kill()
        receiver.join()


def test_a_neighbour_at_the_rendezvous_store_cannot_call_off_or_join_a_sync(
    setup: tuple[dict[str, Any], str], tmp_path: Path
) -> None:
    """The store answers anyone who reaches its port. A neighbour who connects and writes the
    call-off and a full join count under every prefix a sync could be given by counting (the
    version and the sync number) changes nothing: the next sync's keys are under a prefix only the
    run's signed calls carry, and its weights arrive."""
    import datetime

    import torch.distributed as dist

    from nexrl_hpc.weight_sync.wire import _JOINED_KEY, ABORT_KEY

    cfg, model_dir = setup
    (service,) = _services(cfg, model_dir, tmp_path, ["inference_service_0"])
    try:
        publisher = WeightPublisher(cfg["weight"])
        publisher.set_inference_services([service])
        publisher.set_weight_source(_Source(_new_model(cfg)))
        publisher.publish(1)  # the store exists from the first sync on
        store = publisher._rendezvous
        assert store is not None
        outsider = dist.TCPStore(store.host, store.port, None, False, timeout=datetime.timedelta(seconds=10))
        for sync in range(8):
            outsider.set(f"v2.{sync}/{ABORT_KEY}", "the neighbour called it off")
            outsider.add(f"v2.{sync}/{_JOINED_KEY}", 100)
        model = build_tiny_model(dict(cfg["model"]["tiny"], init_seed=9))[0].eval()  # not sync 1's
        publisher.set_weight_source(_Source(model))
        publisher.publish(2)
        assert _gap(cfg, service, model) <= 1e-4
        prefixes = {store.spec(2, 2)["prefix"] for _ in range(2)}
        assert len(prefixes) == 2 and all(len(p.rsplit(".", 1)[1]) == 32 for p in prefixes)
    finally:
        service.stop()


def test_a_trainer_that_cannot_send_fails_the_sync_without_a_second_try(
    setup: tuple[dict[str, Any], str], tmp_path: Path
) -> None:
    """The trainer's side failing is the sync's failure, named; it is no lost service to broadcast
    again without (one attempt, the service left as it was)."""

    class Broken(_Source):
        def broadcast_weights(self, spec: dict[str, Any]) -> dict[str, Any]:
            self.sent.append({"attempt": True})
            raise RuntimeError("the trainer's gather failed")

    cfg, model_dir = setup
    (service,) = _services(cfg, model_dir, tmp_path, ["inference_service_0"])
    try:
        publisher = WeightPublisher(cfg["weight"])
        publisher.set_inference_services([service])
        broken = Broken(_new_model(cfg))
        publisher.set_weight_source(broken)
        with pytest.raises(
            WeightSyncError, match="weight version 1 not broadcast: .*trainer: .*gather failed"
        ):
            publisher.publish(1)
        assert len(broken.sent) == 1 and publisher.served == []
    finally:
        service.stop()
