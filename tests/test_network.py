"""Bind addresses: the forms a setting takes, resolution on a host's own interfaces, and when a job's
addresses could not reach each other (loopback across hosts). The resolution is checked on the dev
cluster's node hosts, whose interfaces are known; the rules on this machine's loopback."""

from __future__ import annotations

import ipaddress
import json
import socket
import subprocess
import sys

import pytest

from nexrl_hpc.config.validate import ConfigError
from nexrl_hpc.runtime.network import (
    is_loopback_spec,
    local_interfaces,
    network_host,
    reachability_problems,
    resolve_bind_address,
    spec_problem,
)
from tests.conftest import compose_config
from tests.helpers.hosts import REPO, DevHosts


def test_loopback_forms_resolve_to_loopback_on_any_host() -> None:
    for spec in ("127.0.0.1", "127.0.0.0/8", "lo"):
        bind = resolve_bind_address(spec, "runtime.rpc.interface")
        assert bind.address == "127.0.0.1" and bind.loopback and bind.interface == "lo", spec
        assert is_loopback_spec(spec)
    assert is_loopback_spec("localhost") and is_loopback_spec("::1")
    assert (
        not is_loopback_spec("eth0")
        and not is_loopback_spec("10.0.0.0/8")
        and not is_loopback_spec("0.0.0.0")
    )


def test_every_listed_interface_exists_and_holds_its_address() -> None:
    names = {name for _, name in socket.if_nameindex()}
    found = local_interfaces()
    assert ("lo", ipaddress.ip_interface("127.0.0.1/8")) in found
    for name, iface in found:
        assert name in names
        if iface.version == 4:  # each IPv4 address can be bound: it is this host's
            with socket.socket() as s:
                s.bind((str(iface.ip), 0))


def foreign_address() -> str:
    """An IPv4 address no interface of this host has, nor its network (documentation ranges first)."""
    mine = local_interfaces()
    for candidate in ("203.0.113.77", "198.51.100.7", "192.0.2.77", "100.127.255.77"):
        ip = ipaddress.ip_address(candidate)
        if not any(ip in iface.network for _, iface in mine):
            return candidate
    raise AssertionError(f"every candidate is on a network of this host: {mine}")


FOREIGN = foreign_address()


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("no-such-nic0", "no interface 'no-such-nic0' on this host"),
        (f"{FOREIGN}/32", "no IPv4 address of this host"),
        (FOREIGN, f"{FOREIGN} is not an address of this host"),
        ("::1", "only IPv4 addresses are supported here"),
        ("0.0.0.0", "0.0.0.0 binds every interface and is no address another host can reach"),
        ("10.0.0.0/33", "is not a CIDR network"),
        ("eth 0", "is not an IP, a CIDR network, 'hostname' or an interface name"),
    ],
)
def test_what_this_host_cannot_bind_is_refused_naming_the_key(spec: str, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_bind_address(spec, "runtime.rpc.interface")
    (problem,) = err.value.problems
    assert problem.path == "runtime.rpc.interface" and says in problem.message, problem


def test_an_inference_server_may_bind_every_interface_or_ipv6() -> None:
    """Its own rank's server: 0.0.0.0 is the user's explicit choice there, and uvicorn takes IPv6."""
    assert resolve_bind_address("0.0.0.0", "k", allow_unspecified=True).address == "0.0.0.0"
    assert resolve_bind_address("::1", "k", ipv6=True).address == "::1"
    assert spec_problem("0.0.0.0", allow_unspecified=True) is None


def test_the_config_check_names_each_bad_bind_setting() -> None:
    with pytest.raises(ConfigError) as err:
        compose_config(
            [
                "runtime.rpc.interface=0.0.0.0",
                "service.inference_service.local.host='a b'",
                "service.inference_service.vllm.host=10.0.0.0/99",
            ]
        )
    paths = {p.path: p.message for p in err.value.problems}
    assert "0.0.0.0 binds every interface" in paths["runtime.rpc.interface"]
    assert "is not an IP" in paths["service.inference_service.local.host"]
    assert "is not a CIDR network" in paths["service.inference_service.vllm.host"]
    compose_config(["runtime.rpc.interface=ib0", "service.inference_service.local.host=10.0.0.0/8"])  # valid


def rank(net: str, host: str, address: str | None, error: str | None = None) -> dict:
    return {
        "net": net,
        "host": host,
        "address": address,
        "loopback": bool(address and address.startswith("127.")),
        "error": error,
    }


def test_loopback_is_refused_only_when_the_ranks_are_on_more_than_one_host() -> None:
    key = "runtime.rpc.interface"
    one_host = [rank("a", "n1", "127.0.0.1") for _ in range(3)]
    assert reachability_problems(one_host, "127.0.0.1", key) == []
    spread = [rank("a", "n1", "10.0.0.1"), rank("b", "n2", "10.0.0.2")]
    assert reachability_problems(spread, "10.0.0.0/8", key) == []
    mixed = [rank("a", "n1", "127.0.0.1"), rank("a", "n1", "127.0.0.1"), rank("b", "n2", "127.0.0.1")]
    (problem,) = reachability_problems(mixed, "hostname", key)
    assert problem.path == key
    assert problem.message.startswith(
        "'hostname' resolves to loopback (127.0.0.1) on rank(s) 0, 1, 2, but the job's ranks are on 2 hosts "
        "(n1: rank(s) 0, 1; n2: rank(s) 2)"
    )
    failed = [
        rank("a", "n1", "10.0.0.1"),
        rank("b", "n2", None, "no interface 'ib0'"),
        rank("c", "n3", None, "no interface 'ib0'"),
    ]
    assert [p.message for p in reachability_problems(failed, "ib0", key)] == [
        "rank(s) 1, 2: no interface 'ib0'"
    ]


def test_processes_in_one_network_namespace_share_a_loopback_scope() -> None:
    other = subprocess.run(
        [sys.executable, "-c", "from nexrl_hpc.runtime.network import network_host; print(network_host())"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert other.stdout.strip() == network_host()


@pytest.mark.e2e
def test_each_node_host_resolves_the_settings_to_its_own_address(two_hosts: DevHosts) -> None:
    """On the dev cluster's node hosts (eth0 with a 10.x address each): the interface, the network
    and the hostname all give the node's own address; loopback scopes differ between hosts."""
    import subprocess

    code = (
        "import json, sys; from nexrl_hpc.runtime.network import resolve_bind_address as r, network_host\n"
        "print(json.dumps({s: r(s, 'k').address for s in sys.argv[1:]} | {'net': network_host()}))"
    )
    specs = [two_hosts.interface, two_hosts.network, "hostname"]
    seen = []
    for node in two_hosts.nodes:
        # the node's namespaces as slurmd has them: its network, hostname and /etc/hosts
        proc = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                node["netns"],
                "unshare",
                "--uts",
                "sh",
                "-c",
                f'hostname {node["hostname"]} && exec "$0" "$@"',
                sys.executable,
                "-c",
                code,
                *specs,
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        got = json.loads(proc.stdout)
        assert [got[s] for s in specs] == [node["address"]] * 3, got
        seen.append(got["net"])
    assert len({*seen, network_host()}) == 3  # two node hosts and this one: three loopbacks
