"""A verifiers (v1) environment trained through the adapter (``rollout_worker.type=verifiers``).

Each taskset trains on both engines: the local server answers the token route itself; vLLM serves
it with --enable-scale-out (the run adds it) and names each log-prob's token ``token_id``, which the
worker gives renderers' ``token`` name.

The environment is written as a user writes one for the hub (tests/helpers/verifiers_envs/), runs in
verifiers' own venv (``scripts/install_verifiers.sh``, installed by the README's test command) and
calls the run's engine through verifiers' own training client, which renders each conversation and
calls the engine's token-in/token-out route. The trainer recomputes the log-probs of the token ids
the episodes hand back: a mismatch with what the engine reported would show any id that is not the
one the engine sampled.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from nexrl_hpc.config.validate import ConfigError
from nexrl_hpc.hub.verifiers_env import (
    VerifiersEnvError,
    VerifiersEnvProcess,
    episode_trajectory,
    verifiers_python,
    worker_init,
)
from nexrl_hpc.inference.local_server import LocalInferenceServer
from nexrl_hpc.models.tiny import load_model, materialize_base_model
from tests.conftest import REPO, compose_config, run_train

ENVS = REPO / "tests" / "helpers" / "verifiers_envs"
CONTENT_TEMPLATE = "'{% for m in messages %}{{ m[\"content\"] }}{% endfor %}'"
VERIFIERS = [
    "task=max_digit",
    "rollout_worker.type=verifiers",
    "data.type=verifiers",
    "rollout_worker.verifiers.taskset.id=nexrl_max_digit",
    f"rollout_worker.verifiers.python_path=[{ENVS}]",
    f"model.tiny.tokenizer.chat_template={CONTENT_TEMPLATE}",
]


def max_digit_tasks() -> list[tuple[str, str]]:
    """The helper taskset's tasks, in its order: (prompt, answer)."""
    digits = list(itertools.product(range(10), repeat=3))
    random.Random(0).shuffle(digits)
    return [("m" + "".join(map(str, t)) + "=", str(max(t))) for t in digits]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalInferenceServer, dict]]:
    """The local engine serving the tiny policy (with a chat template), and the run config."""
    root = tmp_path_factory.mktemp("verifiers")
    cfg = compose_config([*VERIFIERS, f"run_dir={root}"])
    model_dir = materialize_base_model(cfg["model"], str(root / "base_model"))
    local = cfg["service"]["inference_service"]["local"]
    server = LocalInferenceServer(
        model_dir, local, str(root / "logs"), cfg["service"]["inference_service"]["model"]
    )
    server.start()
    yield server, cfg
    server.stop()


def start_env(cfg: dict, server: LocalInferenceServer, log: Path) -> VerifiersEnvProcess:
    env = VerifiersEnvProcess(
        cfg["rollout_worker"]["verifiers"], worker_init(cfg, server.base_url), str(log), server.api_key
    )
    env.start()
    return env


def test_an_episode_holds_the_engines_tokens_and_its_rubric_scores_it(
    served: tuple[LocalInferenceServer, dict], tmp_path: Path
) -> None:
    server, cfg = served
    env = start_env(cfg, server, tmp_path / "worker.log")
    try:
        assert env.ready["num_tasks"] == 1000 and env.ready["env_class"] == "SingleAgentEnv"
        assert [(t["prompt"], t["data"]["answer"]) for t in env.tasks(60)] == max_digit_tasks()
        sampling = {"temperature": 1.0, "max_tokens": 2, "seed": 5}
        first = env.request("episode", task_index=3, sampling=sampling).result(timeout=120)["episode"]
        again = env.request("episode", task_index=3, sampling=sampling).result(timeout=120)["episode"]
        with pytest.raises(VerifiersEnvError, match="task_index 1000 is outside the taskset's 1000 tasks"):
            env.request("episode", task_index=1000, sampling=sampling).result(timeout=60)
    finally:
        env.close()
    trajectory = episode_trajectory(first)
    assert trajectory is not None
    prompt, answer = max_digit_tasks()[3]
    tokenizer = load_model_tokenizer(cfg)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True
    )
    assert trajectory["prompt_ids"] == list(getattr(rendered, "input_ids", rendered))  # the model's template
    response = trajectory["response_ids"]
    assert 1 <= len(response) <= 2 and trajectory["loss_mask"] == [1] * len(response)
    expected = model_logprobs(cfg, trajectory["prompt_ids"], response)
    assert max(abs(a - b) for a, b in zip(trajectory["behaviour_log_probs"], expected)) < 1e-4
    reply = tokenizer.decode(response, skip_special_tokens=True)
    assert trajectory["reward"] == float(reply.startswith(answer))
    assert trajectory["scores"]["verifiers/reward/starts_with_the_answer"] == trajectory["reward"]
    assert trajectory["scores"]["verifiers/metric/reply_chars"] == len(reply)
    assert episode_trajectory(again) == trajectory  # the request's seed: the same sample


def load_model_tokenizer(cfg: dict):  # noqa: ANN201 (a transformers tokenizer)
    from nexrl_hpc.models.run_tokenizer import load_run_tokenizer

    return load_run_tokenizer(cfg["model"])


def model_logprobs(cfg: dict, prompt: list[int], response: list[int]) -> list[float]:
    model = load_model(os.path.join(cfg["run_dir"], "base_model")).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(response)]


def test_an_episode_on_a_users_model_dir_keeps_the_ids_the_tokenizer_has_no_token_for(
    chatml_padded_model_dir: str, tmp_path: Path
) -> None:
    """What users bring: a Qwen2 model directory (tied embeddings, GQA, a byte-level BPE tokenizer
    with its ChatML template) whose embedding is padded past its tokenizer, as every Qwen's is. The
    random model samples ids without a token; the episode keeps them and the engine's log-probs."""
    cfg = compose_config([*VERIFIERS, f"model.path={chatml_padded_model_dir}", f"run_dir={tmp_path}"])
    local = cfg["service"]["inference_service"]["local"]
    name = cfg["service"]["inference_service"]["model"]
    server = LocalInferenceServer(chatml_padded_model_dir, local, str(tmp_path / "logs"), name)
    server.start()
    try:
        env = start_env(cfg, server, tmp_path / "worker.log")
        try:
            sampling = {"temperature": 1.0, "max_tokens": 24, "seed": 3}
            record = env.request("episode", task_index=0, sampling=sampling).result(timeout=120)["episode"]
        finally:
            env.close()
    finally:
        server.stop()
    trajectory = episode_trajectory(record)
    assert trajectory is not None, record
    tokenizer = load_model_tokenizer(cfg)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": max_digit_tasks()[0][0]}], add_generation_prompt=True
    )
    assert trajectory["prompt_ids"] == list(
        getattr(rendered, "input_ids", rendered)
    )  # ChatML, as the run renders
    response = trajectory["response_ids"]
    assert any(t >= len(tokenizer) for t in response), response  # ids past the tokenizer, kept as sampled
    model = load_model(chatml_padded_model_dir).eval()
    ids = trajectory["prompt_ids"] + response
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    start = len(trajectory["prompt_ids"])
    expected = [lp[start + i - 1, t].item() for i, t in enumerate(response)]
    assert max(abs(a - b) for a, b in zip(trajectory["behaviour_log_probs"], expected)) < 1e-4


def test_a_broken_environment_or_a_dead_worker_is_an_error_naming_it(
    served: tuple[LocalInferenceServer, dict], tmp_path: Path
) -> None:
    server, cfg = served
    broken = dict(cfg, rollout_worker=dict(cfg["rollout_worker"]))
    broken["rollout_worker"]["verifiers"] = dict(
        cfg["rollout_worker"]["verifiers"], taskset={"id": "no_such_env"}
    )
    with pytest.raises(VerifiersEnvError, match="'no_such_env' failed in its worker.*no_such_env"):
        start_env(broken, server, tmp_path / "broken.log")
    env = start_env(cfg, server, tmp_path / "killed.log")
    try:
        assert env._proc is not None
        os.kill(env._proc.pid, signal.SIGKILL)
        with pytest.raises(VerifiersEnvError, match="exited with code -9"):
            env.request("episode", task_index=0, sampling={"max_tokens": 2}).result(timeout=60)
    finally:
        env.close()


@pytest.mark.parametrize(
    ("overrides", "key", "message"),
    [
        (["rollout_worker.type=verifiers"], "data.type", "set data.type=verifiers"),
        (["data.type=verifiers"], "data.type", "needs rollout_worker.type=verifiers"),
        (
            [*VERIFIERS, "rollout_worker.verifiers.taskset.id=null"],
            "rollout_worker.verifiers.taskset.id",
            "name",
        ),
        (
            [*VERIFIERS, "rollout_worker.verifiers.python=/nonexistent/python"],
            "rollout_worker.verifiers.python",
            "install_verifiers.sh",
        ),
        (
            [*VERIFIERS, "rollout_worker.verifiers.python_path=[/nonexistent]"],
            "rollout_worker.verifiers.python_path[0]",
            "not a directory",
        ),
        ([*VERIFIERS, "rollout_worker.verifiers.val_size=0"], "rollout_worker.verifiers.val_size", ">= 1"),
        (["rollout_worker.reward_fn=null"], "rollout_worker.reward_fn", "set it to your reward function"),
    ],
)
def test_the_config_check_names_the_key(overrides: list[str], key: str, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        compose_config(overrides)
    assert any(p.path == key and message in p.message for p in raised.value.problems), raised.value.problems


def test_a_verifiers_run_needs_no_reward_function() -> None:
    cfg = compose_config([*VERIFIERS, "rollout_worker.reward_fn=null"])
    assert cfg["rollout_worker"]["reward_fn"] is None
    assert verifiers_python(None).endswith("/bin/python")


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["local", "vllm"])
def test_a_single_turn_taskset_trains_through_the_adapter(backend: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    steps = 2
    proc = run_train(
        [
            *VERIFIERS,
            f"service.inference_service.backend={backend}",
            "rollout_worker.verifiers.val_size=16",
            "data.batch_size=4",
            "data.rollout_repeat_n=4",
            f"train_worker.total_train_steps={steps}",
            f"validate.eval.validate_freq={steps}",
            f"run_dir={run_dir}",
            "logger.backend=[]",
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    tasks = max_digit_tasks()
    train = [json.loads(line) for line in (run_dir / "data" / "train.jsonl").read_text().splitlines()]
    val = [json.loads(line) for line in (run_dir / "data" / "validation.jsonl").read_text().splitlines()]
    assert [(r["prompt"], r["answer"]) for r in train + val] == tasks
    assert [r["verifiers_task"] for r in val] == list(range(1000 - 16, 1000))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/reward_mean" in r]
    assert [r["step"] for r in trained] == list(range(1, steps + 1))
    for r in trained:
        assert r["train/reward_mean"] == r["train/verifiers/reward/starts_with_the_answer"], r
        assert r["actor/optimizer_steps"] == 1 and r["train/context_mismatch"] == 0.0, r
        # the ids the trainer scored are the ones the engine sampled, with the engine's log-probs
        assert r["train/logprob_mismatch_max"] <= 1e-4, r
    validations = [r for r in rows if "val/num_samples" in r]
    assert [(r["step"], r["val/num_samples"]) for r in validations] == [(0, 16), (steps, 16)]
    assert (run_dir / "logs" / "verifiers_rollout_worker.log").exists()


@pytest.mark.e2e
def test_a_run_whose_rubric_fails_stops_with_its_error(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_train(
        [
            *VERIFIERS,
            "rollout_worker.verifiers.taskset.id=nexrl_broken_rubric",  # 64 tasks, the last 32 validate
            "data.batch_size=4",
            "data.rollout_repeat_n=4",
            "train_worker.total_train_steps=2",
            "validate.eval.validate_freq=0",
            f"run_dir={run_dir}",
            "logger.backend=[]",
        ]
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "the reward function failed for 16 of the 16 samples" in proc.stderr, proc.stderr[-3000:]
    assert "the verifiers episode failed" in proc.stderr and "answer_v2" in proc.stderr, proc.stderr[-3000:]


LOOKUP = {"a": "3", "b": "7", "c": "1", "d": "5", "e": "0", "f": "6", "g": "2", "h": "4"}  # nexrl_lookup's


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.helpers.tool_call_model import build_tool_call_model

    return str(build_tool_call_model(tmp_path_factory.mktemp("tool_model") / "model", LOOKUP))


def lookup_overrides(model_dir: str, run_dir: Path) -> list[str]:
    return [
        "task=max_digit",
        "rollout_worker.type=verifiers",
        "data.type=verifiers",
        "rollout_worker.verifiers.taskset.id=nexrl_lookup",
        f"rollout_worker.verifiers.python_path=[{ENVS}]",
        "rollout_worker.verifiers.renderer.tool_parser=qwen3",  # <tool_call>{json}</tool_call>
        f"model.path={model_dir}",
        "rollout_worker.max_response_length=64",  # per turn: the call is 45 tokens
        "rollout_worker.max_prompt_length=64",
        f"run_dir={run_dir}",
    ]


def test_a_multi_turn_episode_calls_the_environments_tool_and_trains_only_the_models_tokens(
    tool_model: str, tmp_path: Path
) -> None:
    """Turn 1 calls the taskset's MCP tool, turn 2 answers with its result; one sequence: the
    model's tokens trained with the engine's log-probs, the tool's result masked."""
    from transformers import PreTrainedTokenizerFast

    cfg = compose_config(lookup_overrides(tool_model, tmp_path))
    local = cfg["service"]["inference_service"]["local"]
    server = LocalInferenceServer(
        tool_model, local, str(tmp_path / "logs"), cfg["service"]["inference_service"]["model"]
    )
    server.start()
    try:
        env = start_env(cfg, server, tmp_path / "worker.log")
        try:
            greedy = {"temperature": 0.0, "max_tokens": 64}
            record = env.request("episode", task_index=0, sampling=greedy).result(timeout=120)["episode"]
        finally:
            env.close()
    finally:
        server.stop()
    (trace,) = record["traces"]
    assert trace["finish_reasons"] == ["tool_calls", "stop"] and len(trace["branches"]) == 1
    assert trace["metrics"]["tool_calls"] == 1.0 and trace["reward"] == 1.0  # task 0: key "a" -> "3"
    trajectory = episode_trajectory(record)
    assert trajectory is not None and trajectory["scores"]["context_mismatch"] == 0.0
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tool_model)
    text = tokenizer.decode(trajectory["prompt_ids"] + trajectory["response_ids"])
    assert text == 'a<tool_call>{"name":"lookup","arguments":{"key":"a"}}</tool_call></s>=33</s>'
    mask = trajectory["loss_mask"]
    result = len(tokenizer.encode("=3", add_special_tokens=False))
    assert mask == [1] * (len(mask) - result - 2) + [0] * result + [1, 1]  # call+EOS, "=3", "3"+EOS
    ids = trajectory["prompt_ids"] + trajectory["response_ids"]
    model = load_model(tool_model).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    start = len(trajectory["prompt_ids"])
    for i, (m, got) in enumerate(zip(mask, trajectory["behaviour_log_probs"])):
        if m:  # each sampled token: the engine's log-prob of it, at greedy the model's own
            assert abs(got - lp[start + i - 1, ids[start + i]].item()) < 1e-4


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["local", "vllm"])
def test_a_multi_turn_taskset_with_a_tool_trains_through_the_adapter(
    backend: str, tool_model: str, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    steps = 2
    proc = run_train(
        [
            *lookup_overrides(tool_model, run_dir),
            f"service.inference_service.backend={backend}",
            "rollout_worker.verifiers.val_size=8",
            "data.batch_size=4",
            "data.rollout_repeat_n=4",
            f"train_worker.total_train_steps={steps}",
            f"validate.eval.validate_freq={steps}",
            "logger.backend=[]",
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/reward_mean" in r]
    assert [r["step"] for r in trained] == list(range(1, steps + 1))
    # the warmed-up model calls the tool in about half its sampled episodes (one vLLM run: 7 of 16):
    # at least 4 of 16 make the steps multi-turn without betting on a sampling draw
    assert trained[0]["train/verifiers/metric/tool_calls"] >= 0.25
    for r in trained:
        assert r["train/reward_mean"] == r["train/verifiers/reward/answered_the_value"], r
        assert r["train/logprob_mismatch_max"] <= 1e-4, r  # every sampled id, every turn: vLLM's
    assert [r["val/num_samples"] for r in rows if "val/num_samples" in r] == [8, 8]
