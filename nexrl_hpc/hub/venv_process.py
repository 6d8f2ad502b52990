"""A worker process in a hub's own venv, spoken to in JSON lines over its stdin/stdout.

A hub's package (verifiers, OpenEnv) pins what the run must not be pinned to, so it lives in a venv of
its own and runs in a child process of the rollout worker. The pipes are private to the two processes:
nothing listens on a port. The worker's first line answers the init message (``{"ready": ...}`` or
``{"fatal": ...}``); after that each answer carries the ``id`` of its request and answers come in
completion order. The worker ends when its stdin closes (``close``, or this process's death).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
from concurrent.futures import Future
from typing import IO, Any

logger = logging.getLogger(__name__)


class VenvWorkerError(RuntimeError):
    """The worker could not load its environment, died, or answered a request with an error."""


class VenvWorkerProcess:
    """One worker process. ``request`` may be called from any thread; answers are matched to requests
    by id. Subclasses name the hub (``what``, ``key``) and add their requests."""

    what = "hub"  # in messages: "the <what> worker ..."
    key = "rollout_worker"  # the config section whose start_timeout_s bounds the start
    error: type[VenvWorkerError] = VenvWorkerError

    def __init__(
        self,
        python: str,
        worker: str,
        init: dict[str, Any],
        log_path: str,
        start_timeout_s: float,
        env: dict[str, str] | None = None,
    ) -> None:
        self.python = python
        self.worker = worker
        self.init = init
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self.extra_env = dict(env or {})
        self.ready: dict[str, Any] = {}
        self._proc: subprocess.Popen[str] | None = None
        self._log: IO[str] | None = None
        self._pending: dict[int, Future[dict[str, Any]]] = {}
        self._next_id = 0
        self._lock = threading.Lock()
        self._dead: str | None = None

    def start(self) -> dict[str, Any]:
        """Start the worker and wait for it to load its environment; its ``ready`` message."""
        timeout_s = self.start_timeout_s
        os.makedirs(os.path.dirname(self.log_path) or ".", exist_ok=True)
        self._log = open(self.log_path, "a")  # noqa: SIM115 (held by the process until close)
        env = {**os.environ, **self.extra_env, "HF_HUB_OFFLINE": "1"}
        env.pop("PYTHONPATH", None)  # the run's packages are not the worker's (python_path adds the user's)
        self._proc = subprocess.Popen(
            [self.python, self.worker],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(self.init) + "\n")
        self._proc.stdin.flush()
        first: Future[dict[str, Any]] = Future()
        reader = threading.Thread(
            target=self._read, args=(self._proc, first), name=f"{self.what}-worker-reader", daemon=True
        )
        reader.start()
        try:
            message = first.result(timeout=timeout_s)
        except TimeoutError:
            self.close()
            raise self.error(
                f"the {self.what} worker did not load its environment within {timeout_s:.0f} s "
                f"({self.key}.start_timeout_s); its log: {self.log_path}"
            ) from None
        if "ready" not in message:
            self.close()
            raise self.error(self.failure(message.get("fatal") or str(message)))
        self.ready = message["ready"]
        return self.ready

    def environment_name(self) -> str:
        """The user's environment, as messages name it (a subclass names it from its init)."""
        return f"the {self.what} environment"

    def failure(self, detail: str) -> str:
        """The message of a worker that could not load its environment (``detail``: its traceback)."""
        last = detail.strip().splitlines()[-1] if detail.strip() else "no message"
        return (
            f"{self.environment_name()} failed in its worker ({self.python}): {last}\n{detail}\n"
            f"(log: {self.log_path})"
        )

    def _read(self, proc: subprocess.Popen[str], first: Future[dict[str, Any]]) -> None:
        """Answers from the worker's stdout, each to the future of its request id."""
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                message = json.loads(line)
            except json.JSONDecodeError:
                logger.warning("%s worker wrote a line that is not JSON: %.200s", self.what, line)
                continue
            if not first.done():
                first.set_result(message)
                continue
            with self._lock:
                future = self._pending.pop(message.get("id"), None)
            if future is not None and not future.done():
                future.set_result(message)
        code = proc.wait()
        self._dead = f"the {self.what} worker exited with code {code} (log: {self.log_path})"
        if not first.done():
            first.set_result({"fatal": self._dead})
        with self._lock:
            pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(self.error(self._dead))

    def request(self, op: str, **fields: Any) -> Future[dict[str, Any]]:
        """Send one request; a future of its answer (``self.error`` for an error answer)."""
        answer: Future[dict[str, Any]] = Future()
        if self._dead is not None or self._proc is None or self._proc.stdin is None:
            answer.set_exception(self.error(self._dead or f"the {self.what} worker is not running"))
            return answer
        with self._lock:
            self._next_id += 1
            request_id = self._next_id
            raw: Future[dict[str, Any]] = Future()
            self._pending[request_id] = raw
            try:
                self._proc.stdin.write(json.dumps({"id": request_id, "op": op, **fields}) + "\n")
                self._proc.stdin.flush()
            except OSError as exc:  # the worker is gone: say how it ended when it has
                self._pending.pop(request_id, None)
                code = self._proc.poll()
                gone = (
                    f"the {self.what} worker exited with code {code} (log: {self.log_path})"
                    if code is not None
                    else f"the {self.what} worker is not reading: {exc}"
                )
                answer.set_exception(self.error(gone))
                return answer

        def done(f: Future[dict[str, Any]]) -> None:
            exc = f.exception()
            if exc is not None:
                answer.set_exception(exc)
            elif "error" in f.result():
                answer.set_exception(self.error(f"{op}: {f.result()['error']}"))
            else:
                answer.set_result(f.result())

        raw.add_done_callback(done)
        return answer

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.stdin is not None:
                try:
                    proc.stdin.close()  # the worker finishes what it was asked, then exits
                except OSError:
                    pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


def venv_python(configured: str | None, venv_env_var: str, default_venv: str) -> str:
    """The configured python, else ``$<venv_env_var>/bin/python``, else ``<default_venv>/bin/python``
    (where the hub's install script puts it)."""
    if configured:
        return configured
    venv = os.environ.get(venv_env_var) or os.path.expanduser(default_venv)
    return os.path.join(venv, "bin", "python")
