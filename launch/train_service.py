"""The standalone train-service API server:

    NEXRL_TRAIN_SERVICE_TOKEN=... python -m launch.train_service --host 127.0.0.1 --port 8000

Binds loopback unless told otherwise; refuses to start without a bearer token (from the
environment variable named by ``--token-env``). The HTTP port keeps the run's pre-authentication
limits (``runtime.rpc.preauth_*`` of the shipped config; ``nexrl_hpc/rpc/http_guard.py``). Worker groups register themselves:
``torchrun --nproc_per_node=N -m launch.train_worker --api-server-url URL --identifier ID``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.train_service", description=__doc__.splitlines()[0])
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind: an IP, an interface (eth0, ib0), a CIDR network or 'hostname' (default: loopback)",
    )
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--token-env", default="NEXRL_TRAIN_SERVICE_TOKEN", help="environment variable with the token"
    )
    p.add_argument("--heartbeat-timeout-s", type=float, default=15.0, help="a rank silent this long is dead")
    p.add_argument("--relay-timeout-s", type=float, default=3600.0, help="longest wait for rank 0's answer")
    p.add_argument("--max-message-mb", type=int, default=64, help="largest relayed answer")
    args = p.parse_args(argv)
    token = os.environ.get(args.token_env, "")
    from nexrl_hpc.rpc.preauth import token_problem

    if why := token_problem(token, f"${args.token_env} (--token-env)"):
        print(f"error: {why}", file=sys.stderr)
        return 2
    from nexrl_hpc.config.validate import ConfigError
    from nexrl_hpc.runtime.network import resolve_bind_address

    try:
        host = resolve_bind_address(args.host, "--host", ipv6=True, allow_unspecified=True).address
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][train_service][%(levelname)s] %(message)s")
    import uvicorn

    from nexrl_hpc.config.location import default_section
    from nexrl_hpc.rpc.http_guard import BearerFirst, guarded_protocol
    from nexrl_hpc.rpc.preauth import WireLimits
    from nexrl_hpc.trainer.api_server import create_app

    limits = WireLimits.from_config(default_section("runtime.rpc"))  # the shipped runtime.rpc defaults
    app = create_app(token, args.heartbeat_timeout_s, args.relay_timeout_s, args.max_message_mb << 20, limits)
    uvicorn.run(
        BearerFirst(app, token, limits.preauth_max_bytes),  # the token before a byte of a body is read
        host=host,
        port=args.port,
        log_level="warning",
        http=guarded_protocol(limits),  # a request head within the timeout; waiting connections capped
        timeout_keep_alive=5,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
