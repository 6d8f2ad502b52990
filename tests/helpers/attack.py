"""The hostile inputs of tests/test_rpc.py against a job's ports, as a command (run it where the
attacker is, e.g. ``Outsider.python``): every ZMQ address gets ``attack`` (random bytes, a wrong
key, a pickle, a 2 GiB frame header), every direct lane ``attack_lane``; exit 0 when each port
dropped them all (a lane must close the connection without replying).

    python -m tests.helpers.attack --marker /tmp/pwned --zmq tcp://10.77.0.11:4001 --lane tcp://...
"""

from __future__ import annotations

import argparse
import secrets
from pathlib import Path

from tests.test_rpc import attack, attack_lane


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--marker", required=True, help="a file that exists only if a pickle ran")
    p.add_argument("--zmq", nargs="*", default=[], help="RPC / trainer batch addresses (tcp://host:port)")
    p.add_argument("--lane", nargs="*", default=[], help="direct lane addresses (tcp://host:port)")
    args = p.parse_args()
    for address in args.zmq:
        attack(address, secrets.token_bytes(32), Path(args.marker))
    for address in args.lane:
        attack_lane(address, secrets.token_bytes(32), Path(args.marker))
    print(f"attacked {len(args.zmq)} ZMQ port(s) and {len(args.lane)} lane(s)")


if __name__ == "__main__":
    main()
