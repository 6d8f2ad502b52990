"""Shared helpers: compose the real Hydra config, build the real tiny model once per session."""

from __future__ import annotations

import functools
import getpass
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from nexrl_hpc.assembly import validate_config
from nexrl_hpc.config import register_resolvers
from nexrl_hpc.config.location import config_dir
from tests.helpers.hosts import DevHosts, Outsider, dev_hosts

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = config_dir()

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def compose_raw(overrides: list[str] | tuple[str, ...] = ()) -> Any:
    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3", job_name="test"):
        return compose("rl_train", overrides=list(overrides))


def compose_config(overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The validated, resolved config the launcher would run with."""
    return validate_config(compose_raw(overrides))  # type: ignore[return-value]


@functools.cache
def _shipped_wire_limits() -> Any:
    from nexrl_hpc.rpc.preauth import WireLimits

    return WireLimits.from_config(compose_config()["runtime"]["rpc"])


def wire_limits(**changes: Any) -> Any:
    """A run's pre-authentication limits (``runtime.rpc``, a ``WireLimits``), with ``changes``."""
    import dataclasses

    return dataclasses.replace(_shipped_wire_limits(), **changes)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from nexrl_hpc.models.tiny import materialize_base_model

    cfg = compose_config(["seed=1"])
    return materialize_base_model(cfg["model"], str(tmp_path_factory.mktemp("model") / "base_model"))


# The user's model the tests bring: Qwen2 architecture, tied embeddings, grouped-query attention
# (4 heads, 2 kv heads), a byte-level BPE tokenizer trained on these texts, a ChatML template.
CHATML_TEXTS = [
    f"Question: what is {a} + {b}? Let's think. {a} + {b} = {a + b}. The answer is \\boxed{{{a + b}}}. #### {a + b}"
    for a in range(40)
    for b in range(40)
]


@pytest.fixture(scope="session")
def chatml_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from nexrl_hpc.models.chatml import build_chatml_model_dir

    return build_chatml_model_dir(str(tmp_path_factory.mktemp("chatml") / "qwen2_tied"), CHATML_TEXTS, 512)


# the same model with its embedding padded past the tokenizer, as Qwen's is (151,936 rows for ~151,665
# tokens), a third of it: the random weights sample ids without a token at every step
PADDED_MODEL_VOCAB = 768


@pytest.fixture(scope="session")
def chatml_padded_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from nexrl_hpc.models.chatml import build_chatml_model_dir

    out = str(tmp_path_factory.mktemp("chatml_padded") / "qwen2_padded")
    return build_chatml_model_dir(out, CHATML_TEXTS, 512, model_vocab_size=PADDED_MODEL_VOCAB)


def last_trained_step(run_dir: Path) -> int:
    """The last step a run trained, by its metrics.jsonl (0 before the first; a line still being
    written is left out)."""
    import json

    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    rows = [json.loads(line) for line in lines if line.endswith("}")]
    return max((r["step"] for r in rows if "train/reward_mean" in r), default=0)


def run_train(
    args: list[str], timeout: float = 600, env: dict[str, str] | None = None, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    """``python -m launch.train ARGS`` as a user runs it (from ``cwd``: relative paths, as typed)."""
    full_env = dict(os.environ, PYTHONPATH=str(REPO)) if cwd != REPO else dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "launch.train", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )


def independent_eval(run_dir: Path) -> dict[str, Any]:
    """``scripts/independent_eval.py RUN_DIR``: the run's last checkpoint scored by plain transformers
    (greedy, the held-out prompts) — ``{"checkpoint", "accuracy", "n"}``; a failure fails the test."""
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "independent_eval.py"), str(run_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture(scope="session")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """The embedded default run with only run_dir and seed=7 set, once per session: (run dir, the
    finished command). tests/test_e2e.py checks it; on-policy distillation uses its model as teacher."""
    run_dir = tmp_path_factory.mktemp("default_run") / "default"
    return run_dir, run_train([f"run_dir={run_dir}", "seed=7"], timeout=900)


@pytest.fixture
def slurm_env(slurm_cluster: dict[str, str]) -> Iterator[dict[str, str]]:
    """The dev cluster's environment for one test; afterwards no job of the test is left behind.

    Why: a job cancelled while it was requeueing itself stayed in the queue and kept requeueing
    (49 restarts of a 2-minute job in one suite run), eating the CPU the later tests were timed on.
    """
    yield slurm_cluster
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        subprocess.run(["scancel", "--user", getpass.getuser()], env=slurm_cluster, capture_output=True)
        queue = subprocess.run(
            ["squeue", "--noheader", "--user", getpass.getuser()],
            env=slurm_cluster,
            capture_output=True,
            text=True,
        )
        if queue.returncode == 0 and not queue.stdout.strip():
            return
        time.sleep(1.0)
    raise RuntimeError(f"jobs still queued 60 s after the test cancelled them:\n{queue.stdout}")


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[dict[str, str]]:
    """Start the dev cluster (slurm/dev/start.sh) once; the environment that points clients at it."""
    if os.geteuid() != 0:
        pytest.fail("the Slurm dev cluster needs root (it runs its daemons as root)")
    start = subprocess.run(
        ["bash", str(REPO / "slurm" / "dev" / "start.sh")], capture_output=True, text=True, timeout=600
    )
    assert start.returncode == 0, start.stdout + start.stderr
    env = dict(os.environ)
    env["NEXRL_SLURM_DIR"] = env.get("NEXRL_SLURM_DIR", "/tmp/nexrl-slurm-dev")
    env["SLURM_CONF"] = f"{env['NEXRL_SLURM_DIR']}/etc/slurm.conf"
    assert shutil.which("srun")
    yield env


@pytest.fixture(scope="session")
def slurm_hosts(slurm_cluster: dict[str, str]) -> DevHosts:
    """The dev cluster's hosts: two network namespaces, or one host (loopback) and the reason."""
    return dev_hosts(slurm_cluster)


@pytest.fixture
def two_hosts(slurm_hosts: DevHosts) -> DevHosts:
    """For tests whose point is a job across hosts: they fail (not skip) on a one-host dev cluster."""
    if not slurm_hosts.two_hosts:
        pytest.fail(f"this test needs the dev cluster's two hosts, but it runs on one: {slurm_hosts.reason}")
    return slurm_hosts


@pytest.fixture
def outsider(two_hosts: DevHosts) -> Outsider:
    """A host on the dev cluster's network that is in no job (tests/helpers/hosts.py)."""
    return Outsider(two_hosts)


@pytest.fixture(scope="session")
def classifier_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny sequence classifier (reward model), built offline: tests/helpers/reward_models.py."""
    from tests.helpers.reward_models import build_classifier_dir

    return build_classifier_dir(str(tmp_path_factory.mktemp("reward_model") / "classifier"))


@pytest.fixture(scope="session")
def judge_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny chat model trained to grade the tests' rubric with JUDGE_ANSWER: tests/helpers/reward_models.py."""
    from tests.helpers.reward_models import build_judge_dir

    return build_judge_dir(str(tmp_path_factory.mktemp("judge") / "judge"))
