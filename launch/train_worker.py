"""One trainer rank of a standalone train service, started by torchrun:

    NEXRL_TRAIN_SERVICE_TOKEN=... torchrun --nproc_per_node=N -m launch.train_worker \\
        --api-server-url http://127.0.0.1:8000 --identifier actor --backend fsdp

Rank 0 registers the group and binds the ZMQ socket clients send batches to; every rank reports
itself and heartbeats to the API server. Exit codes: 0 stopped (SIGTERM/SIGINT on rank 0, or rank 0
said stop), 1 the group broke (a rank died or a collective failed), 2 bad arguments / no token.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Any


def _post(http: Any, path: str, body: dict[str, Any]) -> None:
    resp = http.post(path, json=body)
    if resp.status_code != 200:
        raise RuntimeError(f"{path}: HTTP {resp.status_code}: {resp.text[:300]}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchrun ... -m launch.train_worker", description=__doc__.splitlines()[0]
    )
    p.add_argument("--api-server-url", required=True)
    p.add_argument("--identifier", required=True, help="worker group name (e.g. student, teacher)")
    p.add_argument("--backend", choices=["single", "fsdp", "deepspeed"], default="fsdp", help="train engine")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="what rank 0 binds for clients, resolved on its host: an IP, an interface (eth0, ib0), "
        "a CIDR network or 'hostname'",
    )
    p.add_argument("--port", type=int, default=0, help="rank 0's port (0: any free port)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--token-env", default="NEXRL_TRAIN_SERVICE_TOKEN")
    p.add_argument("--heartbeat-s", type=float, default=5.0)
    p.add_argument("--collective-timeout-s", type=float, default=1800.0)
    p.add_argument("--idle-tick-s", type=float, default=1.0)
    p.add_argument("--max-message-mb", type=int, default=4096)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    token = os.environ.get(args.token_env, "")
    from nexrl_hpc.rpc.preauth import token_problem

    if why := token_problem(token, f"${args.token_env} (--token-env)"):
        print(f"error: {why}", file=sys.stderr)
        return 2
    from nexrl_hpc.config.validate import ConfigError
    from nexrl_hpc.runtime.network import resolve_bind_address

    try:
        host = resolve_bind_address(args.host, "--host").address
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    logging.basicConfig(
        level=logging.INFO, format=f"[%(asctime)s][{args.identifier} rank {rank}][%(levelname)s] %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per heartbeat otherwise
    return _serve(args, token, host, rank, world_size)


def _serve(args: argparse.Namespace, token: str, host: str, rank: int, world_size: int) -> int:
    """Join the group (process group, registration, endpoint report), serve until stopped; the exit code."""
    log = logging.getLogger("launch.train_worker")
    import httpx
    import torch
    import torch.distributed as dist

    from nexrl_hpc.config.location import default_section
    from nexrl_hpc.rpc.preauth import WireLimits
    from nexrl_hpc.trainer.policy_trainer import PolicyTrainer
    from nexrl_hpc.trainer.protocol import key_from_token
    from nexrl_hpc.trainer.trainer_rank import TrainerRank

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        "nccl" if args.device == "cuda" else "gloo",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=args.collective_timeout_s),
    )
    http = httpx.Client(
        base_url=args.api_server_url, headers={"Authorization": f"Bearer {token}"}, timeout=30
    )
    ident = args.identifier
    if rank == 0:
        _post(http, "/register_worker_group", {"identifier": ident, "world_size": world_size})
    dist.barrier()  # the group exists before anyone reports into it
    # this start's session (drawn by the API server at registration): the group key derives from it
    info = http.get("/get_worker_group_info", params={"identifier": ident})
    if info.status_code != 200:
        raise RuntimeError(f"/get_worker_group_info: HTTP {info.status_code}: {info.text[:300]}")
    trainer = TrainerRank(
        PolicyTrainer(engine=args.backend),
        torch.device(args.device),
        key_from_token(token, ident, info.json()["session"]),
        host=host,
        port=args.port,
        max_message_bytes=args.max_message_mb << 20,
        idle_tick_s=args.idle_tick_s,
        limits=WireLimits.from_config(default_section("runtime.rpc")),  # the shipped runtime.rpc defaults
    )
    me = {
        "identifier": ident,
        "rank": rank,
        "endpoint": trainer.address,
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }
    _post(http, "/report_worker_endpoint", me)
    log.info("rank %d/%d ready%s", rank, world_size, f" at {trainer.address}" if trainer.address else "")

    stop = threading.Event()
    if rank == 0:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())

    def heartbeat() -> None:
        while not stop.wait(args.heartbeat_s):
            try:
                _post(http, "/heartbeat", {"identifier": ident, "rank": rank})
            except Exception as exc:  # the server may be restarting: keep trying
                log.warning("heartbeat: %s", exc)

    beating = threading.Thread(target=heartbeat, daemon=True, name="heartbeat")
    beating.start()
    code = _run_rank(trainer, rank, stop, log)
    stop.set()
    beating.join(args.heartbeat_s + 1.0)  # no heartbeat thread writing while the interpreter exits
    if trainer.broken is not None:
        log.error("rank %d: %s", rank, trainer.broken)
    elif code == 0:
        dist.destroy_process_group()  # every rank stopped together: a clean gloo/NCCL teardown
    return code


def _run_rank(trainer: Any, rank: int, stop: threading.Event, log: logging.Logger) -> int:
    """Serve until ``stop`` (rank 0 on a thread, the main thread kept free for signals): 0, or 1 broken."""
    code = 0
    try:
        if rank == 0:
            serving = threading.Thread(target=trainer.serve, args=(stop,), name="trainer-rank-0")
            serving.start()
            while serving.is_alive():  # the main thread stays free for signals
                serving.join(0.2)
                if trainer.broken is not None and not stop.is_set():
                    time.sleep(2.0)  # let the error answers go out, then end the group
                    stop.set()
            code = 1 if trainer.broken is not None else 0
        else:
            trainer.serve(stop)
    except Exception as exc:
        log.error("rank %d: trainer group broke: %s", rank, exc)
        code = 1
    return code


if __name__ == "__main__":
    from nexrl_hpc.trainer.parallel import exit_trainer_process

    exit_trainer_process(main())
