"""Start and stop the local inference server as a child process of the run."""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time

import httpx

from nexrl_hpc.config.location import default_section
from nexrl_hpc.config.schema import LocalInferenceConfig, RuntimeConfig
from nexrl_hpc.inference.prewarm import API_KEY_ENV, send_spec, server_env, take_prewarmed
from nexrl_hpc.inference.server_process import threshold_args
from nexrl_hpc.runtime.network import resolve_bind_address

logger = logging.getLogger(__name__)

HOST_KEY = "service.inference_service.local.host"


class InferenceServerStartError(RuntimeError):
    pass


class LocalInferenceServer:
    """One ``nexrl_hpc.inference.server`` process bound to ``config.host`` (an IP, an interface, a
    CIDR network or 'hostname', resolved on this host); a fresh API key per start."""

    def __init__(
        self,
        model_dir: str,
        config: LocalInferenceConfig,
        log_dir: str,
        served_model_name: str,
        device: str = "cpu",
        dtype: str = "float32",
        weight_version: int = 0,
        attn_implementation: str | None = None,
        log_name: str = "inference_server.log",
        runtime: RuntimeConfig | None = None,
    ):
        self.model_dir = model_dir
        self.config = config
        self.log_dir = log_dir
        self.served_model_name = served_model_name
        self.device = device
        self.dtype = dtype
        self.weight_version = weight_version
        self.attn_implementation = attn_implementation
        self.runtime = runtime  # the run's gc_* settings for the server process (None: Python's defaults)
        self.api_key = secrets.token_urlsafe(24)
        self.process: subprocess.Popen | None = None
        self._ready_file = ""
        self._deadline = 0.0
        self.base_url: str | None = None
        self.log_path = os.path.join(log_dir, log_name)

    def start(self) -> str:
        """Launch, wait until it answers /health, return its base URL."""
        self.launch()
        return self.wait_ready()

    def launch(self) -> None:
        """Start the process without waiting (start-up overlaps with the trainer's)."""
        host = resolve_bind_address(self.config["host"], HOST_KEY, ipv6=True, allow_unspecified=True).address
        os.makedirs(self.log_dir, exist_ok=True)
        # the port's pre-authentication limits: the run's runtime.rpc (the shipped ones without a run)
        rpc = self.runtime["rpc"] if self.runtime is not None else default_section("runtime.rpc")
        ready_file = self._ready_file = f"{self.log_path}.{os.getpid()}.ready"
        if os.path.exists(ready_file):
            os.remove(ready_file)
        args = [
            "--model",
            self.model_dir,
            "--served-model-name",
            self.served_model_name,
            "--host",
            host,
            "--port",
            str(self.config["port"]),
            "--ready-file",
            ready_file,
            "--max-batch-size",
            str(self.config["max_batch_size"]),
            "--batch-wait-ms",
            str(self.config["batch_wait_ms"]),
            "--num-threads",
            str(self.config["num_threads"]),
            "--seed",
            str(self.config["seed"]),
            "--device",
            self.device,
            "--dtype",
            self.dtype,
            "--weight-version",
            str(self.weight_version),
            "--parent-pid",
            str(os.getpid()),
            "--engine-stop-timeout-s",
            str(self.config["engine_stop_timeout_s"]),
            "--max-n",
            str(self.config["max_n"]),
            "--max-prompts-per-request",
            str(self.config["max_prompts_per_request"]),
            "--max-request-mb",
            str(self.config["max_request_mb"]),
            "--preauth-timeout-s",
            str(rpc["preauth_timeout_s"]),
            "--preauth-max-connections",
            str(rpc["preauth_max_connections"]),
        ]
        if self.attn_implementation:
            args += ["--attn-implementation", self.attn_implementation]
        thresholds: list[int] = []
        if self.runtime is not None:
            thresholds = self.runtime["gc_thresholds"]
            args += ["--gc-freeze-after-setup"] if self.runtime["gc_freeze_after_setup"] else []
        self._deadline = time.monotonic() + self.config["startup_timeout_s"]
        # started with the run (launch.train), with the same threads and GC thresholds
        waiting = take_prewarmed(self.config["num_threads"], thresholds)
        if waiting is not None and send_spec(waiting, args, self.api_key, self.log_path):
            self.process = waiting
            return
        cmd = [sys.executable, "-m", "nexrl_hpc.inference.server_process", *threshold_args(thresholds), *args]
        env = server_env(self.config["num_threads"])
        env[API_KEY_ENV] = self.api_key
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def wait_ready(self) -> str:
        """Block until the launched server answers /health; return its base URL."""
        assert self.process is not None, "launch() first"
        ready_file, deadline = self._ready_file, self._deadline
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise InferenceServerStartError(
                    f"local inference server exited with code {self.process.returncode} during start-up; "
                    f"last lines of {self.log_path}:\n{log_tail(self.log_path, 20)}"
                )
            if os.path.exists(ready_file):
                with open(ready_file) as f:
                    info = json.load(f)
                os.remove(ready_file)
                host = info["host"]
                host = f"[{host}]" if ":" in host else host
                self.base_url = f"http://{host}:{info['port']}"
                self._wait_healthy(deadline)
                logger.info("local inference server up at %s (pid %d)", self.base_url, self.process.pid)
                return self.base_url
            time.sleep(self.config["startup_poll_s"])
        self.stop()
        raise InferenceServerStartError(
            f"local inference server not ready after {self.config['startup_timeout_s']}s "
            f"(service.inference_service.local.startup_timeout_s); see {self.log_path}"
        )

    def _wait_healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(self.config["startup_poll_s"])
        raise InferenceServerStartError(f"{self.base_url}/health did not answer; see {self.log_path}")

    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        kill_process_group(self.process)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        timeout = self.config["stop_timeout_s"]
        self.process.terminate()
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=timeout)


def kill_process_group(process: subprocess.Popen | None, reap_timeout_s: float = 5.0) -> None:
    """SIGKILL a server started in a session of its own (its pid is the group id: the server and
    every process it spawned) and reap it."""
    if process is None or process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        process.wait(timeout=reap_timeout_s)
    except subprocess.TimeoutExpired:
        logger.warning("server pid %d not gone %.0fs after SIGKILL", process.pid, reap_timeout_s)


def log_tail(path: str, lines: int) -> str:
    """The last ``lines`` lines of a server's log, for start-up errors."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "<no log>"
