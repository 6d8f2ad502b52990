"""Bind addresses resolved on each rank's own host, and whether the ranks' hosts share a loopback.

A setting names an address the way a cluster's config would: an IP, an interface (``eth0``,
``ib0``), a network in CIDR form (``10.0.0.0/8``: this host's address in it), or ``hostname`` (what
this host's name resolves to). Each rank resolves it on its own host, so one value serves every
node of a cluster whose nodes differ in addresses. Nothing here assumes the machine it runs on:
the host's interfaces are read when resolving (libc's ``getifaddrs``).

Loopback is per network namespace (per host, on a real cluster): an address in 127.0.0.0/8 that a
rank announces is reachable only from ranks on the same host. ``network_host`` names that scope
(the kernel's boot id + the network namespace) so the bootstrap can tell when a job spans hosts
and refuse a loopback setting before anything binds.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
from dataclasses import dataclass
from typing import Any

from nexrl_hpc.config.validate import ConfigError, ConfigProblem

HOSTNAME = "hostname"  # the special value: this host's name, resolved
IFNAMSIZ = 16  # Linux: interface names are at most 15 characters


@dataclass(frozen=True)
class BindAddress:
    """What a rank binds and announces, and the interface holding it (for GLOO/NCCL_SOCKET_IFNAME)."""

    address: str
    interface: str | None  # None: the unspecified address (0.0.0.0, ::), held by no interface
    loopback: bool


class _Sockaddr(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("data", ctypes.c_ubyte * 26)]  # Linux: no sa_len byte


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = [
    ("next", ctypes.POINTER(_Ifaddrs)),
    ("name", ctypes.c_char_p),
    ("flags", ctypes.c_uint),
    ("addr", ctypes.POINTER(_Sockaddr)),
    ("netmask", ctypes.POINTER(_Sockaddr)),
    ("ifu", ctypes.POINTER(_Sockaddr)),
    ("data", ctypes.c_void_p),
]


def _ip_of(sa: Any) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    if not sa:
        return None
    raw = bytes(sa.contents.data)
    if sa.contents.family == socket.AF_INET:
        return ipaddress.IPv4Address(raw[2:6])  # port, then the address
    if sa.contents.family == socket.AF_INET6:
        return ipaddress.IPv6Address(raw[6:22])  # port, flow info, then the address
    return None


def local_interfaces() -> list[tuple[str, ipaddress.IPv4Interface | ipaddress.IPv6Interface]]:
    """(interface name, address with its network) for every IP address of this host's network
    namespace, in the kernel's order (libc's getifaddrs, Linux); IPv6 link-local addresses are
    left out (they need a scope to use)."""
    libc = ctypes.CDLL(None, use_errno=True)
    head = ctypes.POINTER(_Ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        raise OSError(ctypes.get_errno(), "getifaddrs failed")
    out: list[tuple[str, ipaddress.IPv4Interface | ipaddress.IPv6Interface]] = []
    try:
        node = head
        while node:
            entry = node.contents
            ip, mask = _ip_of(entry.addr), _ip_of(entry.netmask)
            if ip is not None and mask is not None and not (ip.version == 6 and ip.is_link_local):
                out.append((entry.name.decode(), ipaddress.ip_interface(f"{ip}/{bin(int(mask)).count('1')}")))
            node = entry.next
    finally:
        libc.freeifaddrs(head)
    return out


def _describe(found: list[tuple[str, Any]]) -> str:
    return ", ".join(f"{name} {iface.ip}" for name, iface in found) or "none"


def spec_problem(spec: Any, *, allow_unspecified: bool) -> str | None:
    """What is wrong with a setting's form, wherever it is resolved (None: a well-formed value)."""
    if not isinstance(spec, str) or not spec.strip():
        return "must be an IP, an interface name (eth0, ib0), a CIDR network (10.0.0.0/8) or 'hostname'"
    try:
        ip = ipaddress.ip_address(spec)
    except ValueError:
        pass
    else:
        if ip.is_unspecified and not allow_unspecified:
            return (
                f"{spec} binds every interface and is no address another host can reach: "
                "name the interface (eth0, ib0), a CIDR network (10.0.0.0/8) or an IP of this host"
            )
        return None
    if "/" in spec:
        try:
            ipaddress.ip_network(spec, strict=False)
        except ValueError as exc:
            return f"{spec!r} is not a CIDR network ({exc})"
        return None
    if spec == HOSTNAME:
        return None
    if len(spec) >= IFNAMSIZ or any(c.isspace() for c in spec) or spec in (".", ".."):
        return f"{spec!r} is not an IP, a CIDR network, 'hostname' or an interface name"
    return None


def is_loopback_spec(spec: str) -> bool:
    """A setting that means loopback wherever it is resolved: 127.x / ::1, a loopback network,
    ``localhost``, ``lo`` (Linux's loopback interface)."""
    if spec in ("localhost", "lo"):
        return True
    try:
        return ipaddress.ip_address(spec).is_loopback
    except ValueError:
        pass
    try:
        net = ipaddress.ip_network(spec, strict=False)
    except ValueError:
        return False
    return net.network_address.is_loopback and net.broadcast_address.is_loopback


def resolve_bind_address(
    spec: str, key: str, *, ipv6: bool = False, allow_unspecified: bool = False
) -> BindAddress:
    """``spec`` resolved on this host; a ConfigError naming ``key`` when this host has no such
    address. ``ipv6``: an IPv6 address is acceptable (the RPC sockets take IPv4 only)."""
    problem = spec_problem(spec, allow_unspecified=allow_unspecified)
    if problem:
        raise ConfigError([ConfigProblem(key, problem)])
    found = local_interfaces()
    usable = [(n, i) for n, i in found if ipv6 or i.version == 4]
    versions = "IPv4 or IPv6" if ipv6 else "IPv4"
    try:
        literal: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(spec)
    except ValueError:
        literal = None
    if literal is not None and literal.is_unspecified:
        return BindAddress(str(literal), None, False)
    if spec == HOSTNAME:
        name = socket.gethostname()
        try:
            literal = ipaddress.ip_address(socket.gethostbyname(name))
        except OSError as exc:
            raise ConfigError([ConfigProblem(key, f"'hostname': {name!r} does not resolve ({exc})")]) from exc
    if literal is not None:
        if literal.version == 6 and not ipv6:
            raise ConfigError([ConfigProblem(key, f"{spec}: only IPv4 addresses are supported here")])
        holder = next((n for n, i in found if i.ip == literal), None)
        holder = holder or next((n for n, i in found if literal in i.network and i.ip.is_loopback), None)
        if holder is None:
            what = f"'hostname' resolves to {literal}, which" if spec == HOSTNAME else f"{literal}"
            raise ConfigError(
                [
                    ConfigProblem(
                        key,
                        f"{what} is not an address of this host ({socket.gethostname()}: {_describe(found)})",
                    )
                ]
            )
        return BindAddress(str(literal), holder, literal.is_loopback)
    if "/" in spec:
        net = ipaddress.ip_network(spec, strict=False)
        inside = [(n, i) for n, i in usable if i.ip in net]
        if not inside:
            raise ConfigError(
                [
                    ConfigProblem(
                        key,
                        f"no {versions} address of this host ({socket.gethostname()}) is in {net} "
                        f"(its addresses: {_describe(found)})",
                    )
                ]
            )
        name, iface = inside[0]
        return BindAddress(str(iface.ip), name, iface.ip.is_loopback)
    names = list(dict.fromkeys(n for n, _ in found))
    mine = [i for n, i in usable if n == spec]
    if not mine:
        exists = spec in {name for _, name in socket.if_nameindex()}
        why = f"interface {spec!r} has no {versions} address" if exists else f"no interface {spec!r}"
        raise ConfigError(
            [
                ConfigProblem(
                    key,
                    f"{why} on this host ({socket.gethostname()}; interfaces with addresses: "
                    f"{', '.join(names) or 'none'})",
                )
            ]
        )
    first = min(mine, key=lambda i: i.version)  # IPv4 first
    return BindAddress(str(first.ip), spec, first.ip.is_loopback)


def network_host() -> str:
    """Which loopback this process sees: the same value on two processes iff they share one
    (one kernel, one network namespace). Different cluster nodes never do."""
    parts = []
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
        parts.append(str(os.stat("/proc/self/ns/net").st_ino))
    except OSError:  # not Linux: the host's name is the best there is
        parts = [socket.gethostname()]
    return ":".join(parts)


def reachability_problems(found: list[dict[str, Any]], spec: str, key: str) -> list[ConfigProblem]:
    """``found``: per rank, {"net": network_host(), "host": name, "address": str | None,
    "loopback": bool, "error": str | None}. Problems: ranks that could not resolve ``spec``, and
    a loopback address announced while the ranks are on more than one host."""
    problems: list[ConfigProblem] = []
    errors: dict[str, list[int]] = {}
    for r, f in enumerate(found):
        if f["error"]:
            errors.setdefault(f["error"], []).append(r)
    for message, ranks in errors.items():
        problems.append(ConfigProblem(key, f"rank(s) {_ranks(ranks)}: {message}"))
    hosts: dict[str, list[int]] = {}
    for r, f in enumerate(found):
        hosts.setdefault(f["net"], []).append(r)
    loop = [r for r, f in enumerate(found) if f["loopback"]]
    if len(hosts) > 1 and loop:
        where = "; ".join(f"{found[rs[0]]['host']}: rank(s) {_ranks(rs)}" for rs in hosts.values())
        problems.append(
            ConfigProblem(
                key,
                f"{spec!r} resolves to loopback ({found[loop[0]]['address']}) on rank(s) {_ranks(loop)}, but the "
                f"job's ranks are on {len(hosts)} hosts ({where}) and no other host can reach a loopback "
                "address: set it to the cluster network, an interface (eth0, ib0) or a CIDR network (10.0.0.0/8)",
            )
        )
    return problems


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def use_interface_for_collectives(bind: BindAddress) -> dict[str, str]:
    """Point gloo's and NCCL's sockets at the interface the trainer group binds (unless the job's
    environment names one already): gloo otherwise takes whatever this host's name resolves to,
    which on a cluster can be another network, and falls back to loopback when the name does not
    resolve. Returns what it set."""
    if bind.interface is None:
        return {}
    set_now = {}
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if var not in os.environ:
            os.environ[var] = set_now[var] = bind.interface
    return set_now
