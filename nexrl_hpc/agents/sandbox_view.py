"""The sandbox's private view of the host and how a child is launched into it.

Which namespaces ``unshare`` creates, which host paths the private root shows read-only (system
directories, the dynamic linker's files, the interpreter's prefix — never the caller's home or
working directory), and the small launcher script that runs first in the child to build that root,
drop privileges, set the limits and exec the untrusted program. ``sandbox.run_python`` uses them.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

SETUP_EXIT = 125  # the launcher could not build the sandbox (its stderr line starts with SETUP_TAG)
SETUP_TAG = "nexrl-sandbox: "

# pivot_root has no libc wrapper: its syscall number per architecture
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "arm64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
# what the code sees of the host, read-only (when present); symlinks (merged /usr) are recreated
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
_ETC_FILES = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/alternatives",
)
DEVICES = ("null", "zero", "full", "random", "urandom")

# Runs first in the child, as root (of the machine, or of a fresh user namespace): build the
# private root, pivot into it, then (as PID 1 of the namespace) fork the program, which drops every
# privilege, sets the limits and becomes the untrusted program. Kept dependency-free (ctypes for
# mount/prctl): it runs inside the limits and the view it sets up. As PID 1 the kernel would not
# deliver SIGXCPU/SIGKILL from RLIMIT_CPU to it, so it reports the program's fate as its own exit
# status (128 + signal, like a shell).
LAUNCHER = r"""
import ctypes, os, resource, sys
cfg = {cfg!r}
libc = ctypes.CDLL(None, use_errno=True)

def fail(what):
    os.write(2, ({tag!r} + what + "\n").encode())
    os._exit({setup_exit})

def check(ret, what):
    if ret != 0:
        fail(what + ": " + os.strerror(ctypes.get_errno()))

def mount(src, dst, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    check(libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)), "mount " + dst)

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18

def bind_ro(src, dst):
    if os.path.isdir(src):
        os.makedirs(dst, mode=0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), mode=0o755, exist_ok=True)
        open(dst, "a").close()
    mount(src, dst, None, MS_BIND)
    f = os.statvfs(src).f_flag  # flags a user namespace may not clear: keep them
    keep = f & (MS_NOEXEC | 1024 | 2048) | ((1 << 21) if f & 4096 else 0)
    mount(None, dst, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | keep)

def build_root():
    root = cfg["root"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=755")
    for path, target in cfg["links"]:
        os.makedirs(os.path.dirname(root + path), mode=0o755, exist_ok=True)
        os.symlink(target, root + path)
    for src, dst in cfg["binds"]:
        bind_ro(src, root + dst)
    os.makedirs(root + "/proc", mode=0o555)
    mount("/proc", root + "/proc", None, MS_BIND | MS_REC)  # unshare --mount-proc's: this PID namespace
    os.makedirs(root + "/dev", mode=0o755)
    mount("tmpfs", root + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,nr_inodes=64,mode=755")
    for name in cfg["devices"]:
        open(root + "/dev/" + name, "w").close()
        mount("/dev/" + name, root + "/dev/" + name, None, MS_BIND)
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink("/proc/self/fd/%d" % i, root + "/dev/" + name)
    os.symlink("/proc/self/fd", root + "/dev/fd")
    size = "size=%d,nr_inodes=%d,mode=1777" % (cfg["tmp_bytes"], cfg["tmp_inodes"])
    for tmp in ("/tmp", "/dev/shm"):
        os.makedirs(root + tmp, mode=0o755, exist_ok=True)
        mount("tmpfs", root + tmp, "tmpfs", MS_NOSUID | MS_NODEV, size)
    for name in os.listdir(cfg["inputs"]):
        with open(os.path.join(cfg["inputs"], name), "rb") as src, open(root + "/tmp/" + name, "wb") as dst:
            dst.write(src.read())
        if cfg["uid"] is not None:
            os.chown(root + "/tmp/" + name, cfg["uid"], cfg["uid"])
    mount(None, root + "/dev", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(root)
    check(libc.syscall(cfg["pivot_root"], b".", b"."), "pivot_root")
    check(libc.umount2(b".", 2), "detach the old root")  # MNT_DETACH: the host's tree is gone
    os.chdir("/tmp")

def drop_privileges():
    for cap in range(64):  # the bounding set: no capability can come back, not even via exec as uid 0
        if libc.prctl(24, cap, 0, 0, 0) != 0 and ctypes.get_errno() not in (22,):  # PR_CAPBSET_DROP; EINVAL: past the last
            fail("drop capability %d: %s" % (cap, os.strerror(ctypes.get_errno())))
    if cfg["uid"] is not None:  # root of the machine: become nobody (clears every capability)
        os.setgroups([])
        os.setresgid(cfg["uid"], cfg["uid"], cfg["uid"])
        os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
    elif cfg["isolate"]:  # root of a user namespace: stay uid 0 there, powerless (SECBIT_NOROOT locked)
        check(libc.prctl(28, 1 | 2 | 8 | 32 | 64 | 128, 0, 0, 0), "securebits")
        check(libc.prctl(47, 4, 0, 0, 0), "clear ambient capabilities")
    check(libc.prctl(38, 1, 0, 0, 0), "no_new_privs")

os.umask(0o022)
if cfg["isolate"]:
    build_root()
if os.getpid() == 1:
    pid = os.fork()
    while pid:  # as init, reap orphans too (zombies would count against RLIMIT_NPROC)
        done, status = os.wait()
        if done == pid:
            os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
if cfg["drop"]:
    drop_privileges()
for name, (soft, hard) in cfg["rlimits"].items():
    resource.setrlimit(getattr(resource, name), (soft, hard))
os.execv(cfg["python"], [cfg["python"], "-I", "-B", cfg["main"]])
"""


class SandboxUnavailableError(RuntimeError):
    """Isolation is required (``rollout_worker.sandbox.require_isolation``) but this machine cannot provide it."""


@dataclass(frozen=True)
class LaunchPlan:
    """How the child is started: the command prefix, the launcher's settings, what that buys."""

    prefix: tuple[str, ...]
    isolated: bool
    run_as_uid: int | None
    binds: tuple[tuple[str, str], ...]
    links: tuple[tuple[str, str], ...]
    pivot_root: int
    notes: tuple[str, ...] = ()


def interpreter_prefixes(python: str) -> list[str]:
    """The interpreter's installation directories (its libraries; a venv's and its base's)."""
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        return sorted({sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix})
    given = Path(os.path.abspath(python))
    return sorted({str(given.parents[1]), str(Path(os.path.realpath(python)).parents[1])})


def _covered(path: str, by: list[str]) -> bool:
    return any(path == b or path.startswith(b.rstrip("/") + "/") for b in by)


def private_view(python: str) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
    """(read-only binds (host path, path in the view), symlinks (path, target)) of the private root.

    An interpreter prefix that is "/" or holds the caller's home or working directory would put the
    run's files into the view: refused, naming the setting."""
    binds: list[tuple[str, str]] = []
    links: list[tuple[str, str]] = []
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):
            links.append((path, os.readlink(path)))
        elif os.path.isdir(path):
            binds.append((path, path))
    bound = [dst for _, dst in binds] + [p for p, _ in links]
    cwd, home = os.path.realpath(os.getcwd()), os.path.realpath(os.path.expanduser("~"))
    for prefix in interpreter_prefixes(python):
        real = os.path.realpath(prefix)
        for place in sorted({os.path.abspath(prefix), real}):
            if place == "/" or _covered(cwd, [place]) or _covered(home, [place]):
                raise SandboxUnavailableError(
                    f"the interpreter's prefix {place} holds {'/' if place == '/' else 'the home or working directory'}"
                    f" (rollout_worker.sandbox.python_executable={python!r}): the sandbox would show the run's files;"
                    " use a Python installed in a directory of its own"
                )
            # a prefix under a bound or linked system dir is in the view already
            resolved = os.path.realpath(place)
            if not _covered(place, bound) and not _covered(resolved, [d for d, _ in binds]):
                binds.append((real, place))
                bound.append(place)
    for path in _ETC_FILES:
        if os.path.exists(path):
            binds.append((os.path.realpath(path), path))
    return tuple(binds), tuple(links)


def plan_launch(unprivileged_uid: int, python: str, isolate: bool) -> LaunchPlan:
    """How to start ``python`` isolated (when ``isolate`` and the machine allows) or not."""
    root = os.geteuid() == 0
    uid = unprivileged_uid if root else None
    if not isolate:
        return LaunchPlan((), False, uid, (), (), 0)
    unshare = shutil.which("unshare")
    pivot = _PIVOT_ROOT.get(platform.machine(), 0)
    if unshare is None:
        return LaunchPlan((), False, uid, (), (), 0, ("no unshare binary (util-linux)",))
    if not pivot:
        return LaunchPlan(
            (), False, uid, (), (), 0, (f"pivot_root's syscall number unknown on {platform.machine()}",)
        )
    user = () if root else ("-r",)  # root creates namespaces directly; others through a user namespace
    prefix = (
        unshare,
        *user,
        "--net",
        "--pid",
        "--ipc",
        "--uts",
        "--mount",
        "--fork",
        "--kill-child",
        "--mount-proc",
    )
    binds, links = private_view(python)
    return LaunchPlan(prefix, True, uid, binds, links, pivot)
