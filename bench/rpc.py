"""Calls between two ranks: nexrl_hpc's signed ZMQ RPC vs an in-process call vs a Ray actor call.

Two processes on this machine: the second hosts a real TrajectoryPool and a small module behind an
``RpcEndpoint`` (the per-job key goes over a pipe, as MPI's broadcast does in a job); the first
calls it through remote handles, exactly as modules on different ranks do. Measured in one run:
the round-trip latency of a small call (sequential), pipelined small-call throughput (256 calls in
flight), and ``put_trajectory`` throughput (one call per trajectory, pipelined; and batches of 128
per call, as rollout workers send them). Ray (``pip install .[bench]``) runs the same methods in an
actor. Goals: <= 0.15x Ray's latency, >= 10x Ray's pipelined throughput, >= 5k trajectories/s.

    python bench/rpc.py [--calls 20000]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import statistics
import sys
import time
from collections import deque
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nexrl_hpc.core.execute import (  # noqa: E402
    execute,
    execute_async,
    quick,  # noqa: E402
)
from nexrl_hpc.rpc.endpoint import RpcEndpoint  # noqa: E402
from nexrl_hpc.rpc.handles import ModuleRegistry, RemoteModuleHandle  # noqa: E402
from nexrl_hpc.rpc.preauth import WireLimits  # noqa: E402
from nexrl_hpc.runtime.gc_tuning import settle_after_setup  # noqa: E402


class Echo:
    @quick
    def ping(self, x: int = 0) -> int:
        return x + 1


def default_config(overrides: list[str] | None = None) -> Any:
    from hydra import compose, initialize_config_dir

    from nexrl_hpc.assembly import validate_config
    from nexrl_hpc.config import register_resolvers

    register_resolvers()
    config_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
    with initialize_config_dir(config_dir=config_dir, version_base="1.3", job_name="bench"):
        return validate_config(compose("rl_train", overrides=overrides or []))


def configure_gc_like_a_run() -> None:
    """The GC settings every process of a run applies after start-up (``runtime.gc_thresholds``,
    ``runtime.gc_freeze_after_setup``); applied to this bench's processes alike, Ray's driver too."""
    settle_after_setup(default_config()["runtime"])


def make_pool() -> Any:
    from nexrl_hpc.pool.trajectory_pool import TrajectoryPool

    cfg = default_config(["trajectory_pool.key_list=[]"])

    class NoSync:
        def on_batch_ready(self, tag: str) -> bool:
            return False

    pool = TrajectoryPool(cfg)
    pool.set_module_references(None, NoSync())
    return pool


def trajectory(i: int) -> dict[str, Any]:
    """The shape of a default-task trajectory (token ids, logprobs, scores, bookkeeping)."""
    return {
        "uid": f"train-{i}",
        "epoch": 0,
        "group_id": f"train-{i}@0",
        "sample_index": i % 8,
        "prompt": "m372=",
        "answer": "7",
        "model_tag": "default",
        "response": "7",
        "finish_reason": "stop",
        "prompt_ids": [1, 14, 7, 11, 6, 15],
        "response_ids": [11, 2],
        "behaviour_log_probs": [-2.31, -0.11],
        "loss_mask": [1, 1],
        "weight_version": 3,
        "scores": {"reward": 1.0, "accuracy": 1.0},
        "reward": 1.0,
    }


def wire_limits() -> WireLimits:
    """A run's pre-authentication limits (``runtime.rpc``)."""
    return WireLimits.from_config(default_config()["runtime"]["rpc"])


def serve(conn: Any) -> None:
    key = conn.recv()
    registry = ModuleRegistry()
    registry.add("echo", Echo())
    registry.add("trajectory_pool", make_pool())
    configure_gc_like_a_run()
    endpoint = RpcEndpoint(
        1,
        "127.0.0.1",
        key,
        1 << 30,
        8,
        60.0,
        registry.lookup,
        direct_sockets_per_peer=4,
        long_poll_threads=2,
        limits=wire_limits(),
    )
    conn.send((endpoint.address, endpoint.lane_address))
    address, lane = conn.recv()
    endpoint.connect({0: address}, {0: lane})
    conn.send("connected")  # replies to rank 0 need this connection: no call before it exists
    conn.recv()  # until told to stop
    endpoint.close()


def pipelined(submit: Any, n: int, window: int = 256) -> float:
    """Calls/s with up to ``window`` in flight."""
    inflight: deque = deque()
    t0 = time.perf_counter()
    for i in range(n):
        if len(inflight) >= window:
            inflight.popleft().result()
        inflight.append(submit(i))
    while inflight:
        inflight.popleft().result()
    return n / (time.perf_counter() - t0)


def latency_us(call: Any, n: int) -> float:
    samples = []
    for i in range(n):
        t0 = time.perf_counter()
        call(i)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def bench_nexrl(calls: int) -> dict[str, float]:
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=serve, args=(child,), daemon=True)
    proc.start()
    key = secrets.token_bytes(32)
    parent.send(key)
    address, lane = parent.recv()
    client = RpcEndpoint(
        0,
        "127.0.0.1",
        key,
        1 << 30,
        8,
        60.0,
        ModuleRegistry().lookup,
        direct_sockets_per_peer=4,
        long_poll_threads=2,
        limits=wire_limits(),
    )
    client.connect({1: address}, {1: lane})
    parent.send((client.address, client.lane_address))
    assert parent.recv() == "connected"
    echo = RemoteModuleHandle(client, 1, "echo", Echo)
    from nexrl_hpc.pool.trajectory_pool import TrajectoryPool

    pool = RemoteModuleHandle(client, 1, "trajectory_pool", TrajectoryPool)
    execute(echo.ping)  # connect
    out = {
        "latency_us": latency_us(lambda i: execute(echo.ping, i), 2000),
        "calls_per_s": pipelined(lambda i: execute_async(echo.ping, i), calls),
        "traj_per_s_single": pipelined(
            lambda i: execute_async(pool.put_trajectory, trajectory(i)), calls // 4
        ),
    }
    batch = 128
    n_batches = max(calls // batch, 20)
    t0 = time.perf_counter()
    futures: deque = deque()
    for b in range(n_batches):
        if len(futures) >= 4:
            futures.popleft().result()
        futures.append(
            execute_async(pool.put_trajectories, [trajectory(b * batch + j) for j in range(batch)])
        )
    while futures:
        futures.popleft().result()
    out["traj_per_s_batched"] = n_batches * batch / (time.perf_counter() - t0)
    out["rejected"] = client.stats()["rejected"]
    parent.send("stop")
    client.close()
    proc.join(5)
    return out


def bare_echo_server(address: str) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(address)
    while True:
        msg = sock.recv_multipart()
        if msg[1] == b"stop":
            break
        sock.send_multipart(msg)
    ctx.destroy(linger=0)


def bench_bare_zmq(calls: int) -> dict[str, float]:
    """The floor: one unsigned frame each way between two processes, blocking recv, no decoding."""
    import socket

    import zmq

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    proc = mp.get_context("spawn").Process(target=bare_echo_server, args=(address,), daemon=True)
    proc.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    sock.send(b"x")
    sock.recv()

    def call(i: int) -> None:
        sock.send(b"ping")
        sock.recv()

    latency = latency_us(call, 2000)
    t0 = time.perf_counter()
    window = 256
    for i in range(calls):
        sock.send(b"ping")
        if i >= window:
            sock.recv()
    for _ in range(min(calls, window)):
        sock.recv()
    rate = calls / (time.perf_counter() - t0)
    sock.send(b"stop")
    proc.join(5)
    ctx.destroy(linger=0)
    nan = float("nan")
    return {"latency_us": latency, "calls_per_s": rate, "traj_per_s_single": nan, "traj_per_s_batched": nan}


def bench_inprocess(calls: int) -> dict[str, float]:
    echo, pool = Echo(), make_pool()
    out = {
        "latency_us": latency_us(lambda i: execute(echo.ping, i), 2000),
        "calls_per_s": pipelined(lambda i: execute_async(echo.ping, i), calls),
        "traj_per_s_single": pipelined(
            lambda i: execute_async(pool.put_trajectory, trajectory(i)), calls // 4
        ),
    }
    t0 = time.perf_counter()
    n = calls // 128
    for b in range(n):
        pool.put_trajectories([trajectory(b * 128 + j) for j in range(128)])
    out["traj_per_s_batched"] = n * 128 / (time.perf_counter() - t0)
    return out


def bench_ray(calls: int) -> dict[str, float] | None:
    try:
        import ray
    except ImportError:
        return None
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)

    @ray.remote
    class Actor:
        def __init__(self) -> None:
            self.echo = Echo()
            self.pool = make_pool()

        def ping(self, x: int = 0) -> int:
            return self.echo.ping(x)

        def put_trajectory(self, t: dict[str, Any]) -> str:
            return self.pool.put_trajectory(t)

        def put_trajectories(self, ts: list[dict[str, Any]]) -> list[str]:
            return self.pool.put_trajectories(ts)

    actor = Actor.remote()
    ray.get(actor.ping.remote())

    class RayFuture:
        def __init__(self, ref: Any) -> None:
            self.ref = ref

        def result(self) -> Any:
            return ray.get(self.ref)

    out = {
        "latency_us": latency_us(lambda i: ray.get(actor.ping.remote(i)), 1000),
        "calls_per_s": pipelined(lambda i: RayFuture(actor.ping.remote(i)), calls // 4),
        "traj_per_s_single": pipelined(
            lambda i: RayFuture(actor.put_trajectory.remote(trajectory(i))), calls // 8
        ),
    }
    n = max(calls // 128 // 4, 10)
    t0 = time.perf_counter()
    ray.get([actor.put_trajectories.remote([trajectory(b * 128 + j) for j in range(128)]) for b in range(n)])
    out["traj_per_s_batched"] = n * 128 / (time.perf_counter() - t0)
    ray.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    configure_gc_like_a_run()
    results = {
        "in-process call": bench_inprocess(args.calls),
        "bare pyzmq frame, unsigned (2 processes; the floor)": bench_bare_zmq(args.calls),
        "nexrl_hpc RPC (2 processes)": bench_nexrl(args.calls),
    }
    ray_result = bench_ray(args.calls)
    if ray_result is not None:
        results["Ray actor call (2 processes)"] = ray_result
    print()
    print(
        "| path | small-call round trip | pipelined calls/s | put_trajectory/s (1 per call) | trajectories/s (128 per call) |"
    )
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['latency_us']:.1f} µs | {r['calls_per_s']:,.0f} | {r['traj_per_s_single']:,.0f} | {r['traj_per_s_batched']:,.0f} |"
        )
    ours = results["nexrl_hpc RPC (2 processes)"]
    if ray_result is None:
        print("\nRay is not installed (pip install .[bench]): no ratios against it.")
        return
    print()
    print("| ratio (nexrl_hpc RPC / Ray) | value | goal |")
    print("|---|---|---|")
    print(f"| round-trip latency | {ours['latency_us'] / ray_result['latency_us']:.2f}x | <= 0.15x |")
    print(f"| pipelined call throughput | {ours['calls_per_s'] / ray_result['calls_per_s']:.2f}x | >= 10x |")
    print(f"| trajectories/s across ranks (batched) | {ours['traj_per_s_batched']:,.0f}/s | >= 5,000/s |")
    print(f"\nmessages rejected during the run: {ours['rejected']}")


if __name__ == "__main__":
    main()
