"""Issue 21, rows 4-6: model-written code in the sandbox cannot reach the run, and cannot fake a pass.

Each test plays the hostile code against the real sandbox (real namespaces, real processes) and
checks the host side too: the file is still there and unchanged, nothing was left behind, the
listening socket saw no connection. As root (CI) the code runs as uid 65534; the victim processes
and files are made the way the attack needs (world-readable, or owned by that same uid).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from nexrl_hpc.agents import sandbox, sandbox_view
from nexrl_hpc.agents.rewards import assert_harness
from nexrl_hpc.agents.rewards.code import code_reward_fn
from nexrl_hpc.agents.sandbox import SandboxLimits, SandboxUnavailableError, run_python
from tests.conftest import compose_config

LIMITS = SandboxLimits(wall_time_s=15.0, cpu_time_s=10, memory_mb=256)  # generous: a shared machine
NOBODY = 65534


def test_run_dir_files_are_out_of_reach(tmp_path: Path) -> None:
    """Row 4: a world-readable file and a pickle submitit unpickles on requeue, in the run dir."""
    run_dir = tmp_path / "run"
    (run_dir / "slurm").mkdir(parents=True)
    os.chmod(tmp_path, 0o755)
    for d in (run_dir, run_dir / "slurm"):
        os.chmod(d, 0o777)  # even a directory anyone may write into
    secret = run_dir / "config.yaml"
    secret.write_text("api_key: s3cret\n")
    os.chmod(secret, 0o644)
    pickle = run_dir / "slurm" / "job_0_submitted.pkl"
    pickle.write_bytes(b"original")
    os.chmod(pickle, 0o666)
    code = (
        "import os\n"
        f"for path in ({str(secret)!r}, {str(pickle)!r}):\n"
        "    try:\n"
        "        print(open(path).read())\n"
        "    except OSError as exc:\n"
        "        print(type(exc).__name__)\n"
        f"try:\n    open({str(pickle)!r}, 'wb').write(b'pwned')\nexcept OSError as exc:\n    print(type(exc).__name__)\n"
        "print(sorted(os.listdir('/')))\n"
    )
    result = run_python(code, "", LIMITS)
    assert result.status == "ok" and result.isolated, result.stderr
    read_secret, read_pickle, write_pickle, root = result.stdout.splitlines()
    assert (read_secret, read_pickle, write_pickle) == ("FileNotFoundError",) * 3
    assert "s3cret" not in result.stdout
    assert pickle.read_bytes() == b"original"
    # the view: system dirs, its own /proc, /dev, /tmp, and the interpreter's prefix (its top directory)
    system = {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp", "usr"}
    prefixes = {Path(p).parts[1] for p in sandbox_view.interpreter_prefixes(sys.executable)}
    assert set(eval(root)) <= system | prefixes


def test_home_and_other_users_files_are_out_of_reach(tmp_path: Path) -> None:
    home = Path(os.path.expanduser("~"))
    probe = home / f".nexrl_probe_{uuid.uuid4().hex}"
    probe.write_text("mine")
    os.chmod(probe, 0o644)
    try:
        result = run_python(f"import os\nprint(os.path.exists({str(probe)!r}))\n", "", LIMITS)
    finally:
        probe.unlink()
    assert result.stdout.strip() == "False", result.stderr


def test_nothing_written_outlives_the_call() -> None:
    """Row 4: files in /tmp and /dev/shm, and System V shared memory, are gone with the run."""
    name = f"nexrl_left_{uuid.uuid4().hex}"
    code = (
        "import ctypes, os\n"
        f"for d in ('/tmp', '/dev/shm', os.getcwd()):\n"
        f"    open(os.path.join(d, {name!r}), 'w').write('left behind')\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.shmget(0x4e58524c, 4096, 0o1666))\n"  # IPC_CREAT | 0666 under a fixed key
        "print(sorted(os.listdir('/tmp')))\n"
    )
    result = run_python(code, "", LIMITS)
    assert result.status == "ok", result.stderr
    shmid, listing = result.stdout.splitlines()
    assert int(shmid) >= 0 and name in listing  # it did write them, inside its own view
    assert not Path("/tmp", name).exists() and not Path("/dev/shm", name).exists()
    ipcs = subprocess.run(["ipcs", "-m"], capture_output=True, text=True, check=True).stdout
    assert "0x4e58524c" not in ipcs
    again = run_python(
        f"import os\nprint(os.path.exists('/tmp/{name}'), os.listdir('/dev/shm'))\n", "", LIMITS
    )
    assert again.stdout.strip() == "False []", again.stderr


def test_no_unix_socket_and_no_loopback(tmp_path: Path) -> None:
    """Row 4/5: a server on a path-based Unix socket (world-writable) and one on 127.0.0.1."""
    os.chmod(tmp_path, 0o755)
    path = str(tmp_path / "server.sock")
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(path)
    os.chmod(path, 0o777)
    unix.listen(1)
    tcp = socket.create_server(("127.0.0.1", 0))
    port = tcp.getsockname()[1]
    accepted: list[str] = []

    def accept(server: socket.socket, kind: str) -> None:
        server.settimeout(8)
        try:
            conn, _ = server.accept()
            accepted.append(kind)
            conn.close()
        except OSError:
            pass

    threads = [threading.Thread(target=accept, args=(s, k)) for s, k in ((unix, "unix"), (tcp, "tcp"))]
    for t in threads:
        t.start()
    code = (
        "import errno, socket\n"
        f"for family, address in ((socket.AF_UNIX, {path!r}), (socket.AF_INET, ('127.0.0.1', {port}))):\n"
        "    s = socket.socket(family)\n"
        "    s.settimeout(3)\n"
        "    try:\n"
        "        s.connect(address)\n"
        "        print('connected')\n"
        "    except OSError as exc:\n"
        "        print(errno.errorcode[exc.errno])\n"
    )
    try:
        result = run_python(code, "", LIMITS)
        assert result.status == "ok", result.stderr
        unix_error, tcp_error = result.stdout.split()
        assert unix_error == "ENOENT"  # no such path in its view
        assert tcp_error == "ENETUNREACH"  # its own network namespace: loopback down, no host
        # both servers work from outside: the failures are the sandbox's
        with socket.socket(socket.AF_UNIX) as c:
            c.connect(path)
        socket.create_connection(("127.0.0.1", port), timeout=3).close()
        for t in threads:
            t.join(timeout=10)
        assert sorted(accepted) == ["tcp", "unix"]
    finally:
        unix.close()
        tcp.close()


def test_a_same_uid_process_environment_is_out_of_reach() -> None:
    """Row 5: the inference server's key in /proc/<pid>/environ of a process of the code's own uid."""
    key = f"key-{uuid.uuid4().hex}"
    drop = (
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"] if os.geteuid() == 0 else []
    )
    victim = subprocess.Popen([*drop, "/bin/sleep", "60"], env={"NEXRL_INFERENCE_API_KEY": key})
    try:
        code = (
            "import os\n"
            "seen = []\n"
            "for pid in os.listdir('/proc'):\n"
            "    if pid.isdigit():\n"
            "        try:\n"
            "            seen.append(open(f'/proc/{pid}/environ', 'rb').read())\n"
            "        except OSError:\n"
            "            pass\n"
            f"print(any({key.encode()!r} in e for e in seen), sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
        )
        result = run_python(code, "", LIMITS)
        assert result.status == "ok", result.stderr
        assert result.stdout.strip() == "False [1, 2]"  # only its launcher and itself exist
        # the same read from a process of that uid outside the sandbox finds it: the attack is real
        outside = subprocess.run(
            [*drop, "/bin/sh", "-c", f"tr '\\0' '\\n' < /proc/{victim.pid}/environ"],
            capture_output=True,
            text=True,
        )
        assert key in outside.stdout
    finally:
        victim.kill()
        victim.wait()


def test_isolation_is_required_by_default_naming_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Row 5: where namespaces are unavailable the code does not run, and the run stops at start-up."""
    from nexrl_hpc.rollout.single_turn import SingleTurnRolloutWorker

    real_which = sandbox_view.shutil.which
    monkeypatch.setattr(
        sandbox_view.shutil, "which", lambda name: None if name == "unshare" else real_which(name)
    )
    sandbox._isolation_problem.cache_clear()
    try:
        marker = f"/tmp/nexrl_ran_{uuid.uuid4().hex}"
        with pytest.raises(SandboxUnavailableError, match=r"rollout_worker\.sandbox\.require_isolation=true"):
            run_python(f"open({marker!r}, 'w')\n", "", LIMITS)
        assert not os.path.exists(marker)
        cfg = compose_config(["rollout_worker.reward_fn=nexrl_hpc.agents.rewards.code:code_reward_fn"])
        assert cfg["rollout_worker"]["sandbox"]["require_isolation"] is True
        with pytest.raises(SandboxUnavailableError, match="no unshare binary"):
            SingleTurnRolloutWorker(cfg)
    finally:
        sandbox._isolation_problem.cache_clear()
        sandbox.set_default_limits(SandboxLimits())


TESTS = "assert add(1, 2) == 3\nassert add(2, 2) == 5\n"  # the second fails for a correct add


@pytest.mark.parametrize(
    "exit_early",
    ["import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n", "raise SystemExit\n"],
    ids=["sys.exit", "os._exit", "SystemExit"],
)
def test_exiting_before_the_tests_scores_zero(exit_early: str) -> None:
    """Row 6: a solution that exits before failing tests run scored 1.0 when the exit status decided."""
    solution = "def add(a, b):\n    return a + b\n" + exit_early
    out = code_reward_fn({"tests": TESTS}, solution, limits=LIMITS)
    assert out.reward == 0.0 and out.is_correct is False
    assert "before the tests" in out.metadata["error"] or "did not run to their end" in out.metadata["error"]
    # a solution that exits from inside the function the tests call does not pass either
    inside = "import os\ndef add(a, b):\n    os._exit(0)\n"
    assert code_reward_fn({"tests": "assert add(1, 2) == 3\n"}, inside, limits=LIMITS).reward == 0.0
    # and the honest solution still passes the tests it can pass
    honest = code_reward_fn(
        {"tests": "assert add(1, 2) == 3\n"}, solution.split("\n")[0] + "\n    return a + b\n", limits=LIMITS
    )
    assert honest.reward == 1.0, honest.metadata


def test_a_fake_verdict_on_stdout_does_not_pass() -> None:
    """The verdict is the supervisor's stdout only: the tests' process printing it counts for nothing."""
    solution = "import os\nprint('PASS', flush=True)\nos.write(1, b'PASS\\n')\nos._exit(0)\n"
    out = code_reward_fn({"tests": TESTS}, solution, limits=LIMITS)
    assert out.reward == 0.0, out.metadata


ALWAYS_EQUAL = (
    "class Same:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\n"
)
GAMES = {
    # an always-equal return value, the function returns it for every input
    "always-equal": ALWAYS_EQUAL + "def add(a, b):\n    return Same()\n",
    # ... and the same, its ordering too, for a tolerance test
    "always-equal-ordered": ALWAYS_EQUAL.replace("class Same:", "class Same(int):")
    + "    __lt__ = __le__ = __gt__ = __ge__ = __eq__\n    __sub__ = __rsub__ = lambda s, o: s\n"
    + "    __abs__ = lambda s: s\ndef add(a, b):\n    return Same()\n",
    # the tests never run: the harness's exec or compile replaced by a no-op
    "exec": "import builtins\nbuiltins.exec = lambda *a, **k: None\ndef add(a, b):\n    return 0\n",
    "compile": "import builtins\nbuiltins.compile = lambda *a, **k: compile('pass', 'x', 'exec')\n"
    "def add(a, b):\n    return 0\n",
    # a builtin the tests use, shadowed by the solution's own name
    "shadowed-abs": "abs = lambda x: 0\ndef add(a, b):\n    return a + b if type(a) is int else 0.0\n",
}
GAMED_TESTS = "assert add(1, 2) == 3\nassert add(2, 2) == 4\nassert abs(add(0.5, 0.25) - 0.75) < 1e-9\n"


@pytest.mark.parametrize("game", sorted(GAMES))
def test_generic_reward_games_score_zero(game: str) -> None:
    """Always-equal values and a replaced exec/compile scored 1.0: the tests now run in a namespace of
    their own, with what they need bound before the solution ran, and compare type-strictly."""
    out = code_reward_fn({"tests": GAMED_TESTS}, GAMES[game], limits=LIMITS)
    assert (out.reward, out.is_correct) == (0.0, False), out.metadata
    assert "AssertionError" in out.metadata["error"], out.metadata


@pytest.mark.parametrize(
    "solution",
    [
        "def add(a, b):\n    return a + b\n",
        # the solution's own imports, helpers and globals reach the tests; builtins it rebinds for itself
        "import math\nOFFSET = 0\nexec = print\ndef _plus(a, b):\n    return math.fsum([a, b]) + OFFSET\n"
        "def add(a, b):\n    r = _plus(a, b)\n    return int(r) if r == int(r) else r\n",
    ],
    ids=["plain", "helpers"],
)
def test_honest_solutions_still_pass_the_strict_tests(solution: str) -> None:
    tests = GAMED_TESTS + "assert add(1, 1) in [2, 3] and 1 < add(1, 1) <= 2.0\nassert [add(1, 1)] == [2.0]\n"
    # HumanEval's form: the asserts inside a function the tests call, and a None compared by ==
    tests += (
        "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert print() == None\ncheck(add)\n"
    )
    out = code_reward_fn({"tests": tests}, solution, limits=LIMITS)
    assert (out.reward, out.is_correct) == (1.0, True), out.metadata


def test_strict_comparisons_of_the_harness() -> None:
    """The rewritten asserts' comparison, in process: numbers by value, everything else by type too."""

    class Same(int):
        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = int.__hash__

    same = Same(3)
    assert same == 4 and not assert_harness.strict_equal(same, 4) and not assert_harness.strict_equal(4, same)
    assert assert_harness.strict_equal(2, 2.0) and assert_harness.strict_equal(
        {"a": [1, (2,)]}, {"a": [1.0, (2,)]}
    )
    assert not assert_harness.strict_equal([1], (1,)) and not assert_harness.strict_equal({same: 1}, {3: 1})
    assert not assert_harness.compare(("in",), same, [4]) and assert_harness.compare(("<", "<="), 1, 2, 2.0)
    assert assert_harness.compare(("!=",), same, 4) and not assert_harness.compare((">",), same, 1)
    scope = {assert_harness.COMPARE_NAME: assert_harness.compare, "x": same}
    for source in ("assert x == 4\n", "def check():\n    assert x == 4\ncheck()\n"):
        code = compile(assert_harness.strict_asserts(source, "t.py"), "t.py", "exec")
        with pytest.raises(AssertionError):
            exec(code, scope)
