"""Start and stop a vLLM OpenAI server (its own venv) as a child of the run.

Why a separate interpreter: vLLM pins its own torch and transformers; the project's environment
must not follow them (scripts/install_vllm.sh builds the venv). The server runs in its own process
group under ``nexrl_hpc.inference.supervise``, so ``stop`` ends vLLM's engine processes too and a
run that dies without cleaning up does not leave it behind. A fresh API key per start (vLLM's
``--api-key``, passed as ``VLLM_API_KEY`` so it is not visible in ``ps``); the weight-reload
endpoints need ``VLLM_SERVER_DEV_MODE=1``, which is always set. vLLM's own key covers only ``/v1``,
so ``nexrl_hpc.inference.vllm_guard`` (copied into a private directory on the server's
``PYTHONPATH``, loaded with ``--middleware``) requires the key on every path but ``/health``: only
the run can pause the server or load weights into it.

What a peer without the key costs is bounded only as far as vLLM lets a run bound it (its port is
uvicorn's, behind vLLM's own launcher): an idle keep-alive connection ends ``keep_alive_s`` after
its last response (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``: ``runtime.rpc.preauth_timeout_s``), and the
server starts with its soft descriptor limit at the hard one (the supervisor raises it; vLLM raises
its own towards 65535 as well). Not bounded: a connection that never completes its first request
head, and how many such connections wait at once (docs/security.md).

A LoRA policy (``lora_max_rank`` > 0): LoRA is enabled for one adapter at a time, the base model is
served as ``<name>:base`` and the policy's adapter, loaded at each weight sync, as ``<name>`` (the
name every request of the run gives), so a request is never answered by the bare base by mistake.
"""

from __future__ import annotations

import json
import logging
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from nexrl_hpc.config.schema import VLLMInferenceConfig
from nexrl_hpc.inference import vllm_guard, vllm_weight_plugin
from nexrl_hpc.inference.local_server import InferenceServerStartError, kill_process_group, log_tail
from nexrl_hpc.runtime.network import resolve_bind_address

logger = logging.getLogger(__name__)

CONFIG_KEY = "service.inference_service.vllm"
GUARD_MODULE = "nexrl_vllm_guard"  # vllm_guard.py under this name in the server's private PYTHONPATH dir
BASE_SUFFIX = ":base"  # with LoRA, the base model's served name is the run's model name with this


def base_model_name(served_model_name: str, lora: bool) -> str:
    """The name the server gives the base model (the adapter takes ``served_model_name`` with LoRA)."""
    return f"{served_model_name}{BASE_SUFFIX}" if lora else served_model_name


def free_port(host: str) -> int:
    """A port that is free on ``host`` now (vLLM cannot report the port it bound for port 0).

    Chosen below the kernel's ephemeral range when there is room: vLLM binds it seconds later, and
    a port from that range can meanwhile become the local end of any outgoing connection."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low = _ephemeral_low()
    candidates = random.sample(range(10000, low), k=min(64, max(0, low - 10000)))
    for port in [*candidates, 0]:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError(f"no free port on {host}")


def _ephemeral_low() -> int:
    """The first port the kernel hands out to outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


class VLLMServer:
    """One ``vllm.entrypoints.openai.api_server`` process serving ``model_dir`` as ``served_model_name``."""

    def __init__(
        self,
        model_dir: str,
        config: VLLMInferenceConfig,
        log_dir: str,
        served_model_name: str,
        log_name: str = "vllm_server.log",
        keep_alive_s: float = 5.0,
        weight_broadcast: bool = False,
        lora_max_rank: int = 0,
        token_route: bool = False,
    ):
        self.model_dir = model_dir
        self.config = config
        self.log_dir = log_dir
        self.served_model_name = served_model_name
        self.api_key = secrets.token_urlsafe(24)
        self.process: subprocess.Popen | None = None
        self.base_url: str | None = None
        self.log_path = os.path.join(log_dir, log_name)
        self._deadline = 0.0
        self._guard_dir: str | None = None
        self.keep_alive_s = keep_alive_s  # runtime.rpc.preauth_timeout_s of the run
        self.weight_broadcast = (
            weight_broadcast  # weight.transport=broadcast: the run's weight-transfer engine
        )
        self.lora_max_rank = lora_max_rank  # > 0: adapters up to this rank, one at a time
        # /inference/v1/generate (token ids in and out; verifiers' training client): vLLM serves it
        # only with --enable-scale-out, behind the guard's key like every other route
        self.token_route = token_route
        self.listed_name = base_model_name(served_model_name, lora_max_rank > 0)  # up when it lists this

    def command(self, port: int, host: str | None = None) -> list[str]:
        """The server's command line; ``host``: the address ``host`` resolved to (default: as configured)."""
        cfg = self.config
        cmd = [
            cfg["python"],
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model_dir,
            "--served-model-name",
            self.listed_name,
            "--host",
            host or cfg["host"],
            "--port",
            str(port),
            "--dtype",
            cfg["dtype"],
            # vLLM's neutral sampling defaults, not the model's generation_config.json (an instruct
            # model's top_k, repetition_penalty, ...): samples come from the policy the trainer
            # scores, with only the run's own sampling settings; its EOS tokens still stop a response
            "--generation-config",
            "vllm",
            # each sampled token's log-prob under the distribution it was drawn from (logits /
            # temperature, top-k/top-p renormalised), the policy the trainer scores at that temperature
            "--logprobs-mode",
            "processed_logprobs",
            # every path but /health needs the key (vLLM's own covers /v1 only): see vllm_guard
            "--middleware",
            f"{GUARD_MODULE}.RequireKey",
        ]
        if self.weight_broadcast:  # registered by the plugin in the private PYTHONPATH directory
            cmd += ["--weight-transfer-config", json.dumps({"backend": vllm_weight_plugin.ENGINE_NAME})]
        if self.lora_max_rank:  # one adapter in use and one held: each sync's replaces the last in place
            cmd += ["--enable-lora", "--max-lora-rank", str(self.lora_max_rank)]
            cmd += ["--max-loras", "1", "--max-cpu-loras", "1"]
        if cfg["max_model_len"] is not None:
            cmd += ["--max-model-len", str(cfg["max_model_len"])]
        if cfg["tensor_parallel_size"] != 1:
            cmd += ["--tensor-parallel-size", str(cfg["tensor_parallel_size"])]
        if cfg["gpu_memory_utilization"] is not None:  # the config check allows it only with device=cuda
            cmd += ["--gpu-memory-utilization", str(cfg["gpu_memory_utilization"])]
        if self.token_route:
            cmd += ["--enable-scale-out"]
        return cmd + [str(a) for a in cfg["extra_args"]]

    def environment(self, base: dict[str, str], guard_dir: str) -> dict[str, str]:
        """The server's environment: ``base``, the configured ``env``, the platform from ``device``
        (vLLM picks CPU or CUDA by VLLM_TARGET_DEVICE at run time), and the run's own settings
        (the key, and ``guard_dir`` first on PYTHONPATH for the key-checking middleware)."""
        env = dict(base)
        # idle keep-alive connections end this long after their last response (vLLM's uvicorn)
        env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] = str(max(1, int(self.keep_alive_s)))
        env.update({k: str(v) for k, v in self.config["env"].items()})
        env["PYTHONPATH"] = os.pathsep.join(p for p in (guard_dir, env.get("PYTHONPATH", "")) if p)
        env.update(
            VLLM_TARGET_DEVICE=self.config["device"],
            VLLM_API_KEY=self.api_key,
            VLLM_SERVER_DEV_MODE="1",  # /pause, /collective_rpc, /reset_prefix_cache, /resume
            HF_HUB_OFFLINE="1",  # never download: the model is a local directory
        )
        if self.lora_max_rank:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # /v1/load_lora_adapter
        return env

    def start(self) -> str:
        """Launch, wait until it serves the model, return its base URL."""
        self.launch()
        return self.wait_ready()

    def launch(self) -> None:
        """Start the process without waiting (its long start-up overlaps with the trainer's)."""
        python = self.config["python"]
        if not os.access(python, os.X_OK):
            raise InferenceServerStartError(
                f"{CONFIG_KEY}.python={python!r} is not an executable: run `bash scripts/install_vllm.sh`"
            )
        os.makedirs(self.log_dir, exist_ok=True)
        host = resolve_bind_address(
            self.config["host"], f"{CONFIG_KEY}.host", ipv6=True, allow_unspecified=True
        ).address
        port = self.config["port"] or free_port(host)
        url_host = f"[{host}]" if ":" in host else host
        self.base_url = f"http://{url_host}:{port}"
        self._guard_dir = tempfile.mkdtemp(prefix="nexrl_vllm_guard_")  # 0700: only this user reads it
        shutil.copyfile(vllm_guard.__file__, os.path.join(self._guard_dir, f"{GUARD_MODULE}.py"))
        if self.weight_broadcast:
            install_weight_plugin(self._guard_dir)
        env = self.environment(dict(os.environ), self._guard_dir)
        cmd = [sys.executable, "-m", "nexrl_hpc.inference.supervise", str(os.getpid()), "--"]
        cmd += self.command(port, host)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self._deadline = time.monotonic() + self.config["startup_timeout_s"]
        logger.info(
            "vLLM server starting at %s (pid %d, log %s)", self.base_url, self.process.pid, self.log_path
        )

    def wait_ready(self) -> str:
        """Block until the server lists the model under our key; return its base URL."""
        assert self.process is not None and self.base_url is not None, "launch() first"
        headers = {"Authorization": f"Bearer {self.api_key}"}
        while time.monotonic() < self._deadline:
            if self.process.poll() is not None:
                raise InferenceServerStartError(
                    f"vLLM server ({self.base_url}) exited with code {self.process.returncode} during "
                    f"start-up; last lines of {self.log_path}:\n{log_tail(self.log_path, 30)}"
                )
            try:
                resp = httpx.get(f"{self.base_url}/v1/models", headers=headers, timeout=2.0)
                if resp.status_code == 200:
                    served = [m.get("id") for m in resp.json().get("data", [])]
                    if self.listed_name not in served:
                        self.stop()
                        raise InferenceServerStartError(
                            f"{self.base_url} serves {served}, not {self.listed_name!r}: another "
                            f"server holds the port ({CONFIG_KEY}.port)"
                        )
                    logger.info("vLLM server up at %s (pid %d)", self.base_url, self.process.pid)
                    return self.base_url
            except httpx.HTTPError:
                pass
            time.sleep(self.config["startup_poll_s"])
        self.stop()
        raise InferenceServerStartError(
            f"vLLM server at {self.base_url} not ready after {self.config['startup_timeout_s']}s "
            f"({CONFIG_KEY}.startup_timeout_s); see {self.log_path}"
        )

    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """No graceful stop: the supervisor, the API server and the engine processes get SIGKILL."""
        kill_process_group(self.process)
        self._remove_guard_dir()

    def _remove_guard_dir(self) -> None:
        if self._guard_dir is not None:
            shutil.rmtree(self._guard_dir, ignore_errors=True)
            self._guard_dir = None

    def stop(self) -> None:
        """SIGTERM the server's process group (supervisor, API server, engine), SIGKILL if it lingers."""
        if self.process is None:
            return
        self._remove_guard_dir()  # imported at start-up: the server no longer needs it
        timeout = self.config["stop_timeout_s"]
        pgid = self.process.pid  # session leader: its pid is the group id
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.process.poll()  # reap the supervisor, or the group never looks empty
            if not _signal_group(pgid, 0):
                return
            time.sleep(self.config["stop_poll_s"])
        logger.warning("vLLM server group %d still running after %.0fs: SIGKILL", pgid, timeout)
        _signal_group(pgid, signal.SIGKILL)
        self.process.wait(timeout=timeout)


def install_weight_plugin(directory: str) -> None:
    """The broadcast weight-transfer plugin, its wire and its entry point into ``directory`` (on the
    server's PYTHONPATH): vLLM finds the entry point there in each of its processes."""
    from nexrl_hpc.weight_sync import wire

    plugin = vllm_weight_plugin
    shutil.copyfile(plugin.__file__, os.path.join(directory, f"{plugin.PLUGIN_MODULE}.py"))
    shutil.copyfile(wire.__file__, os.path.join(directory, f"{plugin.WIRE_MODULE}.py"))
    dist_info = os.path.join(directory, "nexrl_vllm_weight_plugin-0.dist-info")
    os.makedirs(dist_info, exist_ok=True)
    for name, text in plugin.dist_info_files().items():
        with open(os.path.join(dist_info, name), "w") as f:
            f.write(text)


def _signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to the group; False if it has no process left."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True
