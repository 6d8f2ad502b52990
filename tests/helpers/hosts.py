"""The dev cluster's hosts, and an outsider host for hostile-input tests.

``slurm/dev/start.sh`` writes ``$NEXRL_SLURM_DIR/run/hosts.json``: in mode ``netns`` each node is a
network namespace of its own (eth0 on a private bridge) and a third namespace, the outsider, sits on
the same network in no job — where an attacker on a real cluster's network is: it reaches the
ranks' ports only over the network, never over their loopback. In mode ``loopback`` (namespaces
could not be made) both nodes share this host and there is no outsider; tests that need two hosts
fail with the reason start.sh recorded (the ``two_hosts`` / ``outsider`` fixtures in conftest).

    def test_probe(outsider: Outsider) -> None:
        proc = outsider.python(["-m", "tests.helpers.attack", "--marker", m, "--zmq", address])
        assert proc.returncode == 0, proc.stderr
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class DevHosts:
    """What start.sh made: ``mode`` netns (two hosts) or loopback (one, and ``reason`` why)."""

    mode: str
    reason: str | None
    interface: str | None  # the nodes' cluster NIC inside their namespaces (eth0)
    network: str | None  # the cluster network, CIDR (what runtime.rpc.interface may name)
    controller: str  # where slurmctld listens, as the nodes see it
    nodes: list[dict[str, Any]]  # name, netns, hostname, address
    outsider: dict[str, Any] | None  # netns, hostname, address

    @property
    def two_hosts(self) -> bool:
        return self.mode == "netns"


def dev_hosts(env: dict[str, str] | None = None) -> DevHosts:
    """The running dev cluster's hosts (``env``: the clients' environment, for NEXRL_SLURM_DIR)."""
    base = (env or os.environ).get("NEXRL_SLURM_DIR", "/tmp/nexrl-slurm-dev")
    path = Path(base) / "run" / "hosts.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: start the dev cluster first (bash slurm/dev/start.sh)")
    return DevHosts(**json.loads(path.read_text()))


def listening_addresses(netns: str, pid: int) -> list[str]:
    """The TCP addresses (host:port) process ``pid`` listens on in network namespace ``netns``."""
    out = subprocess.run(
        ["ip", "netns", "exec", netns, "ss", "-Htlnp"], capture_output=True, text=True, check=True
    ).stdout
    return [line.split()[3] for line in out.splitlines() if f"pid={pid}," in line]


class Outsider:
    """Processes on the outsider host: a network namespace on the dev cluster's network that is part
    of no job (``ip netns exec``; needs root, as the dev cluster does). Its processes see the same
    files as the tests (only the network differs), so a helper module runs there as it would here."""

    def __init__(self, hosts: DevHosts):
        if hosts.outsider is None:
            raise ValueError(f"the dev cluster has no outsider host (mode {hosts.mode}: {hosts.reason})")
        self.netns: str = hosts.outsider["netns"]
        self.address: str = hosts.outsider["address"]  # what the job's ranks see as the peer address
        self.hostname: str = hosts.outsider["hostname"]

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` as run on the outsider host."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def run(
        self, argv: list[str], *, timeout: float = 120, env: dict[str, str] | None = None, cwd: Path = REPO
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` there to its end (text output captured)."""
        return subprocess.run(
            self.command(argv), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
        )

    def popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` there (``subprocess.Popen`` keywords)."""
        return subprocess.Popen(self.command(argv), **kwargs)

    def python(self, args: list[str], *, timeout: float = 120) -> subprocess.CompletedProcess:
        """This interpreter there, with the checkout importable (``-m tests.helpers...``)."""
        env = dict(os.environ, PYTHONPATH=str(REPO))
        return self.run([sys.executable, *args], timeout=timeout, env=env)
