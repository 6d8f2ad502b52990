"""An OpenEnv environment served to one rollout worker of the run, in OpenEnv's own venv.

Started by ``nexrl_hpc.hub.openenv_env.OpenEnvProcess`` as ``<venv python> worker.py``. The user's
environment is a class with TRL's ``environment_factory`` contract: no-argument ``__init__``,
``reset(**row) -> str | None``, and every other public method a tool the model may call (its docstring's
``Args:`` describe the arguments). Such a class usually holds an OpenEnv client of the environment's
server: with ``server_app`` this worker serves that FastAPI app (OpenEnv's ``create_app``) on a free
loopback port first, and sets ``OPENENV_BASE_URL`` before the class's module is imported. The
reward is TRL's: ``reward_fn(environments=[env], prompts=..., completions=..., **columns)``, or the
instance's ``reward`` attribute when there is no reward function.

Instances are kept per slot and reused, as TRL keeps one per generation: ``open`` makes the slot's
instance on first use and resets it for every episode (so a client's connection is not reopened).

Protocol: JSON lines (``../venv_shared/jsonl_protocol.py``):

    init     {env_factory, reward_fn, server_app, python_path, max_concurrent}
    -> ready {tools: [OpenAI function schemas], env_class, openenv_version, server_url}
    {"id", "op": "open", "slot", "row"}                       -> {"id", "observation": str | null}
    {"id", "op": "call", "slot", "name", "arguments"}         -> {"id", "output": str} | {"id", "tool_error": str}
    {"id", "op": "reward", "slot", "prompts", "completions", "row"} -> {"id", "reward": float}
    a request that fails                                       -> {"id", "error": "<type>: <message>"}
    the environment cannot load                                -> {"fatal": "<traceback>"}, exit 1
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import os
import re
import socket
import sys
import threading
import time
import traceback
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the same module, as the type checker finds it
    from nexrl_hpc.hub.venv_shared.jsonl_protocol import Answers, add_python_path, read_requests, run_worker
else:  # the venv has no nexrl_hpc: the module is imported from its directory
    sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "venv_shared"))
    from jsonl_protocol import Answers, add_python_path, read_requests, run_worker

BASE_URL_ENV = "OPENENV_BASE_URL"
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def load(spec: str, key: str) -> Any:
    """``module:attribute``; the error names the config key."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ValueError(f"{key}={spec!r} is not of the form module:attribute")
    return getattr(importlib.import_module(module), attr)


def _json_type(annotation: Any) -> dict[str, Any]:
    origin = typing.get_origin(annotation) or annotation
    if origin in _JSON_TYPES:
        return {"type": _JSON_TYPES[origin]}
    if origin is typing.Union or type(annotation).__name__ == "UnionType":
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _json_type(kinds[0]) if len(kinds) == 1 else {}
    return {}


def _docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """(description, {argument: description}) of a Google-style docstring (``Args:`` section)."""
    lines = inspect.cleandoc(doc).splitlines()
    description: list[str] = []
    args: dict[str, str] = {}
    section = None
    current = None
    for line in lines:
        header = line.strip().rstrip(":").lower()
        if line.strip().endswith(":") and header in {"args", "arguments", "parameters", "returns", "raises"}:
            section = header
            continue
        if section is None:
            description.append(line.strip())
        elif section in {"args", "arguments", "parameters"}:
            match = re.match(r"^\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", line)
            if match and (current is None or len(line) - len(line.lstrip()) <= 4):
                current = match.group(1)
                args[current] = match.group(2).strip()
            elif current is not None and line.strip():
                args[current] = f"{args[current]} {line.strip()}"
    return " ".join(x for x in description if x).strip(), args


def tool_schema(cls: type, name: str, fn: Any) -> dict[str, Any]:
    """The OpenAI function schema of a tool method, from its signature and docstring; a method without
    a docstring, or an argument its ``Args:`` does not describe, is refused (as TRL refuses it)."""
    where = f"{cls.__module__}.{cls.__qualname__}.{name}"
    if not fn.__doc__:
        raise ValueError(f"tool method {where} has no docstring: the model needs its description")
    description, described = _docstring_parts(fn.__doc__)
    hints = typing.get_type_hints(fn)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in list(inspect.signature(fn).parameters.values())[1:]:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if param.name not in described:
            raise ValueError(f"tool method {where}: its docstring's Args: does not describe {param.name!r}")
        properties[param.name] = {**_json_type(hints.get(param.name)), "description": described[param.name]}
        if param.default is inspect.Parameter.empty:
            required.append(param.name)
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def tool_methods(cls: type) -> dict[str, Any]:
    """Every public method but ``reset`` (TRL's rule), by name."""
    return {
        name: fn
        for name, fn in inspect.getmembers(cls, predicate=inspect.isfunction)
        if not name.startswith("_") and name != "reset"
    }


def serve_app(spec: str) -> str:
    """Serve the OpenEnv FastAPI app ``spec`` on a free loopback port in a thread; its base URL."""
    import uvicorn

    app = load(spec, "rollout_worker.openenv.server_app")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="openenv-server", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the OpenEnv server app {spec!r} did not start (see the log above)")
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}"


def accepted(fn: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments ``fn`` takes (all of them when it has ``**kwargs``)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def finite(value: Any) -> float:
    """A reward as a float; None, NaN and infinities are errors (JSON carries none of them)."""
    if value is None or not math.isfinite(float(value)):
        raise ValueError(f"the reward is {value!r}, not a finite number")
    return float(value)


class Slots:
    """The environment class's instances, one per slot, made on first use and reused."""

    def __init__(self, cls: type, reward_fn: Any) -> None:
        self.cls = cls
        self.methods = tool_methods(cls)
        if not self.methods:
            raise ValueError(f"{cls.__qualname__} has no public method besides reset: the model has no tool")
        self.tools = [tool_schema(cls, name, fn) for name, fn in self.methods.items()]
        self.reward_fn = reward_fn
        self.instances: dict[str, Any] = {}

    def open(self, request: dict[str, Any]) -> dict[str, Any]:
        env = self.instances.get(request["slot"])
        if env is None:
            env = self.instances[request["slot"]] = self.cls()
        observation = env.reset(**request.get("row", {}))
        if observation is not None and not isinstance(observation, str):
            name = self.cls.__qualname__
            raise TypeError(f"{name}.reset returned {type(observation).__name__}, not str or None")
        return {"observation": observation}

    def call(self, request: dict[str, Any]) -> dict[str, Any]:
        env = self.instances[request["slot"]]
        name = request["name"]
        if name not in self.methods:
            return {"tool_error": f"unknown tool {name!r}; the tools are {sorted(self.methods)}"}
        try:
            output = getattr(env, name)(**request.get("arguments", {}))
        except Exception as exc:  # TRL's rule: the error is the tool's answer, the episode goes on
            return {"tool_error": f"{type(exc).__name__}: {exc}"}
        return {"output": "" if output is None else str(output)}

    def reward(self, request: dict[str, Any]) -> dict[str, Any]:
        env = self.instances[request["slot"]]
        if self.reward_fn is None:
            value = getattr(env, "reward", None)
            if value is None:
                raise AttributeError(
                    f"{self.cls.__qualname__} has no `reward` attribute and no "
                    "rollout_worker.openenv.reward_fn is set"
                )
            return {"reward": finite(value)}
        columns = {k: [v] for k, v in request.get("row", {}).items()}
        kwargs = {
            **columns,
            "prompts": request["prompts"],
            "completions": request["completions"],
            "environments": [env],
        }
        values = list(self.reward_fn(**accepted(self.reward_fn, kwargs)))
        if len(values) != 1:
            raise ValueError(f"the reward function returned {len(values)} rewards for 1 environment")
        return {"reward": finite(values[0])}


async def serve(init: dict[str, Any], answers: Answers) -> None:
    add_python_path(list(init.get("python_path") or []))
    server_url = None
    if init.get("server_app"):
        server_url = serve_app(init["server_app"])
        os.environ[BASE_URL_ENV] = server_url
    cls = load(init["env_factory"], "rollout_worker.openenv.env_factory")
    if not isinstance(cls, type):
        raise TypeError(f"rollout_worker.openenv.env_factory={init['env_factory']!r} is not a class")
    reward_fn = load(init["reward_fn"], "rollout_worker.openenv.reward_fn") if init.get("reward_fn") else None
    slots = Slots(cls, reward_fn)
    ops = {"open": slots.open, "call": slots.call, "reward": slots.reward}
    limit = asyncio.Semaphore(int(init.get("max_concurrent") or 64))

    async def answer(request: dict[str, Any]) -> None:
        try:
            op = ops.get(request.get("op", ""))
            if op is None:
                raise ValueError(f"unknown op {request.get('op')!r}")
            async with limit:
                result = await asyncio.to_thread(op, request)
        except Exception as exc:
            traceback.print_exc()
            result = {"error": f"{type(exc).__name__}: {exc}"}
        answers.send({"id": request.get("id"), **result})

    try:
        version = importlib.import_module("openenv").__version__
    except Exception:
        version = "unknown"
    ready = {
        "tools": slots.tools,
        "env_class": f"{cls.__module__}:{cls.__qualname__}",
        "openenv_version": version,
        "server_url": server_url,
    }
    answers.send({"ready": ready})
    await read_requests(answer)


if __name__ == "__main__":
    sys.exit(run_worker(serve))
