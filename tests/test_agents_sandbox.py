"""The sandbox with real subprocesses: each limit stops what it should and the caller gets a status."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nexrl_hpc.agents import sandbox, sandbox_view
from nexrl_hpc.agents.sandbox import SandboxLimits, SandboxUnavailableError, run_python

# generous wall time: other jobs share this machine's 2 cores; tests of the wall limit set their own
FAST = SandboxLimits(wall_time_s=10.0, cpu_time_s=10, memory_mb=256, max_processes=16, max_output_bytes=4096)
SHORT = SandboxLimits(wall_time_s=2.0, cpu_time_s=10, memory_mb=256, max_processes=16)


NS = "import os\nprint(os.readlink('/proc/self/ns/pid'), flush=True)\n"  # the run's PID namespace, first line


def _processes_in(pid_ns: str) -> list[int]:
    """Live processes in the sandbox's PID namespace (``pid:[inode]``): leftovers of a run."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            link = os.readlink(entry / "ns" / "pid")
        except OSError:
            continue
        if link == pid_ns:
            found.append(int(entry.name))
    return found


def test_correct_program_reads_stdin_and_runs_isolated() -> None:
    code = (
        "import os, sys\n"
        "n = int(sys.stdin.read())\n"
        "print(n * 2)\n"
        "print(sorted(k for k in os.environ if k != 'LC_CTYPE'))\n"
        "print(os.getcwd())\n"
        "print(os.getuid())\n"
    )
    result = run_python(code, "21", FAST)
    assert result.status == "ok", result.stderr
    assert result.ok and result.returncode == 0 and result.error_message() == ""
    doubled, env, cwd, uid = result.stdout.splitlines()
    assert doubled == "42"
    assert env == "[]"  # no PATH, HOME, tokens... from the parent
    assert cwd == "/tmp"  # the private tmpfs of its own view
    if os.geteuid() == 0:
        assert uid == "65534"  # root drops to nobody: RLIMIT_NPROC is not enforced for uid 0
    assert result.isolated  # unshare works on this machine (root and non-root)


def test_infinite_loop_is_killed_at_the_wall_time_limit() -> None:
    start = time.monotonic()
    result = run_python("while True:\n    pass\n", "", SHORT)
    elapsed = time.monotonic() - start
    assert result.status == "timeout"
    assert "wall-time limit" in result.error_message()
    assert 2.0 <= result.wall_time_s < 4.0 and elapsed < 6.0


def test_sleeping_program_is_killed_at_the_wall_time_limit() -> None:
    result = run_python("import time\ntime.sleep(60)\n", "", SandboxLimits(wall_time_s=1.0))
    assert result.status == "timeout" and 1.0 <= result.wall_time_s < 3.0


def test_busy_loop_hits_the_cpu_limit_before_a_long_wall_limit() -> None:
    result = run_python("while True:\n    pass\n", "", SandboxLimits(wall_time_s=20.0, cpu_time_s=1))
    assert result.status == "cpu_limit", (result.returncode, result.stderr)
    assert "CPU-time limit" in result.error_message()
    assert result.wall_time_s < 10.0


def test_memory_bomb_fails_with_memory_limit() -> None:
    result = run_python("x = bytearray(2 << 30)\n", "", FAST)
    assert result.status == "memory_limit"
    assert "MemoryError" in result.error_message()
    grow = run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n", "", FAST)
    assert grow.status == "memory_limit", grow.stderr[-300:]


def test_fork_bomb_is_bounded_and_leaves_no_process_behind() -> None:
    code = NS + (
        "import os, sys, time\n"
        "made = 0\n"
        "for _ in range(500):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        "        time.sleep(60)\n"
        "        os._exit(0)\n"
        "    made += 1\n"
        "print(made, flush=True)\n"
        "time.sleep(60)\n"
    )
    result = run_python(code, "", SHORT)
    pid_ns, made = result.stdout.split()
    assert result.status == "timeout"
    assert int(made) < SHORT.max_processes  # RLIMIT_NPROC stopped it
    assert _processes_in(pid_ns) == []  # everything it forked died with it


def test_real_fork_bomb_is_stopped() -> None:
    code = NS + "while True:\n    os.fork()\n"
    result = run_python(code, "", SandboxLimits(wall_time_s=1.5, max_processes=16))
    assert result.status in ("timeout", "error")  # killed, or died of fork's BlockingIOError
    assert not result.ok
    assert _processes_in(result.stdout.splitlines()[0]) == []


def test_concurrent_runs_are_independent() -> None:
    results: dict[int, str] = {}

    def run(i: int) -> None:
        results[i] = run_python(f"print({i} * 3)", "", FAST).stdout.strip()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert results == {0: "0", 1: "3", 2: "6", 3: "9"}


SYSTEM_PYTHON = "/usr/bin/python3"
FORK_COUNT = """\
import os, time
n = 0
for _ in range(100):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(5)
        os._exit(0)
    n += 1
print(n)
"""
UNPRIVILEGED_CASES = [
    "print(6 * 7)",
    "while True: pass",
    "x = bytearray(1 << 30)",
    FORK_COUNT,
    "import socket; socket.create_connection(('151.101.0.223', 443), timeout=2)",
]


REPO = Path(__file__).resolve().parents[1]


def test_unprivileged_caller_path() -> None:
    """The sandbox called by a non-root user (a user namespace instead of dropping to nobody)."""
    repo = str(REPO)
    # as root (CI): become nobody first, with the system's python (root's may sit in a private /root)
    become = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", SYSTEM_PYTHON]
    script = (
        "from nexrl_hpc.agents.sandbox import run_python, SandboxLimits\n"
        # wall >> cpu: on a loaded machine the busy loop must still hit the CPU limit first
        "limits = SandboxLimits(wall_time_s=20, cpu_time_s=1, memory_mb=256, max_processes=16)\n"
        f"for code in {UNPRIVILEGED_CASES!r}:\n"
        "    r = run_python(code, '', limits)\n"
        "    print(r.status, r.isolated, r.stdout.strip() or '-')\n"
    )
    proc = subprocess.run(
        [*(become if os.geteuid() == 0 else [sys.executable]), "-c", script],
        capture_output=True,
        text=True,
        cwd="/tmp",
        env={"PYTHONPATH": repo, "PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    ok, loop, memory, fork, network = (line.split() for line in proc.stdout.splitlines())
    assert ok == ["ok", "True", "42"]
    assert loop[:2] == ["cpu_limit", "True"]
    assert memory[:2] == ["memory_limit", "True"]
    assert fork[:2] == ["ok", "True"] and int(fork[2]) < 16
    assert network[:2] == ["error", "True"]


def test_orphans_are_reaped_so_they_do_not_eat_the_process_limit() -> None:
    code = (
        "import os, time\n"
        "failures = 0\n"
        "for _ in range(40):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        try:\n"
        "            if os.fork() == 0:\n"
        "                os._exit(0)  # grandchild: an orphan, reparented to the namespace's init\n"
        "        except OSError:\n"
        "            os._exit(1)\n"
        "        os._exit(0)\n"
        "    failures += os.waitpid(pid, 0)[1] != 0\n"
        "    time.sleep(0.01)\n"
        "print(failures)\n"
    )
    result = run_python(code, "", FAST)  # 40 orphans > max_processes=16
    assert result.status == "ok", result.stderr
    assert result.stdout.strip() == "0"


def test_detached_child_does_not_outlive_the_run() -> None:
    code = NS + (
        "import os, subprocess, sys\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
    )
    result = run_python(code, "", FAST)
    assert result.status == "ok", result.stderr
    time.sleep(0.2)
    assert _processes_in(result.stdout.strip()) == []


def test_no_network_not_even_the_hosts_loopback() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted: list[bool] = []

    def accept() -> None:
        server.settimeout(5)
        try:
            conn, _ = server.accept()
            accepted.append(True)
            conn.close()
        except OSError:
            pass

    thread = threading.Thread(target=accept)
    thread.start()
    try:
        code = (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')\n"
        )
        result = run_python(code, "", FAST)
        assert result.status == "error"
        assert "connected" not in result.stdout
        assert "OSError" in result.stderr or "ConnectionRefusedError" in result.stderr
        # the same connection from outside the sandbox works: the failure is the isolation
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        thread.join(timeout=5)
        assert accepted == [True]
    finally:
        server.close()
    external = run_python(
        "import socket\nsocket.create_connection(('151.101.0.223', 443), timeout=2)\n", "", FAST
    )
    assert external.status == "error" and "unreachable" in external.stderr


def test_output_is_capped() -> None:
    result = run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 1000)\n", "", FAST)
    assert result.status == "output_limit"
    assert len(result.stdout) <= FAST.max_output_bytes


def test_exit_code_and_traceback_are_reported() -> None:
    result = run_python("raise ValueError('bad input 17')\n", "", FAST)
    assert result.status == "error" and result.returncode == 1
    assert result.error_message() == "exited with code 1: ValueError: bad input 17"


def test_missing_namespaces_are_refused_naming_the_setting_or_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_which = sandbox_view.shutil.which
    monkeypatch.setattr(
        sandbox_view.shutil, "which", lambda name: None if name == "unshare" else real_which(name)
    )
    sandbox._isolation_problem.cache_clear()
    try:
        with pytest.raises(SandboxUnavailableError, match=r"require_isolation=true.*no unshare binary"):
            run_python("print(1)\n", "", FAST)  # required by default
        # unisolated, root's code runs as nobody in the host's tree: with a python nobody can read
        lax = SandboxLimits(wall_time_s=10.0, require_isolation=False, python_executable=SYSTEM_PYTHON)
        result = run_python("import os\nprint(os.getuid())\n", "", lax)
        assert result.ok and not result.isolated, result.stderr
        assert result.notes == ["not isolated: no unshare binary (util-linux)"]
        if os.geteuid() == 0:  # still not root
            assert result.stdout.strip() == "65534"
    finally:
        sandbox._isolation_problem.cache_clear()


def test_private_proc_and_stdio_survive_a_vandalised_cwd() -> None:
    code = (
        "import os\n"
        "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
        "for name in os.listdir('.'):\n"
        "    os.remove(name)\n"
        "print('still here')\n"
    )
    result = run_python(code, "", FAST)
    assert result.status == "ok", result.stderr
    pids, still = result.stdout.splitlines()
    assert pids == "[1, 2]"  # the launcher and the program: no host process is visible
    assert still == "still here"


def test_code_runs_unprivileged_and_sees_no_host_file(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    os.chmod(secret, 0o644)  # world-readable: only the view keeps it out
    code = f"import os\nprint(os.getuid(), os.path.exists({str(secret)!r}), os.path.exists({str(REPO)!r}))"
    result = run_python(code, "", FAST)
    assert result.status == "ok", result.stderr
    uid, secret_seen, repo_seen = result.stdout.split()
    assert uid == ("65534" if os.geteuid() == 0 else "0")  # nobody; or uid 0 of its user namespace
    assert (secret_seen, repo_seen) == ("False", "False")
    assert result.notes == []


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="SandboxLimits.cpu_time_s must be > 0"):
        SandboxLimits(cpu_time_s=0)
