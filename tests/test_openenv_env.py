"""An OpenEnv environment trained through the adapter (``rollout_worker.type=openenv``).

The environment is written as a user writes one for the hub (tests/helpers/openenv_envs/: an OpenEnv
``Environment`` served by OpenEnv's own ``create_app``, its WebSocket ``EnvClient``), wrapped in the
class a TRL user passes as ``environment_factory``, with a TRL reward function reading
``environments``. It runs in OpenEnv's own venv (``scripts/install_openenv.sh``, installed by the
README's test command); the worker serves the environment's app on loopback and the class's client
talks to it, as it would to a Space.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from nexrl_hpc.agents.agent import ToolAgent
from nexrl_hpc.agents.types import TerminationReason
from nexrl_hpc.config.validate import ConfigError
from nexrl_hpc.hub.openenv_env import (
    OpenEnvEnvironment,
    OpenEnvError,
    OpenEnvProcess,
    OpenEnvWorkflow,
    tool_stubs,
    tools_system_prompt,
)
from nexrl_hpc.rollout.agent import AgentRolloutWorker
from tests.conftest import REPO, compose_config, run_train
from tests.helpers.scripted_model import EOS, ScriptedModel, ids, logprob

ENVS = REPO / "tests" / "helpers" / "openenv_envs"
PACKAGE = "nexrl_openenv_lookup"
OPENENV = [
    "task=tool_lookup",
    "rollout_worker.type=openenv",
    f"rollout_worker.openenv.env_factory={PACKAGE}.trl_env:LookupToolEnv",
    f"rollout_worker.openenv.reward_fn={PACKAGE}.trl_env:reward_func",
    f"rollout_worker.openenv.server_app={PACKAGE}.server:app",
    f"rollout_worker.openenv.python_path=[{ENVS}]",
    "rollout_worker.openenv.describe_tools=false",  # the tiny char model knows the syntax already
]
ROW = {"uid": "r0", "prompt": "c", "key": "c", "table": {"a": "5", "c": "3"}, "answer": "3"}


def openenv_cfg(**overrides: Any) -> dict[str, Any]:
    cfg = dict(compose_config(OPENENV)["rollout_worker"]["openenv"])
    cfg.update(overrides)
    return cfg


@pytest.fixture(scope="module")
def process(tmp_path_factory: pytest.TempPathFactory) -> Any:
    log = tmp_path_factory.mktemp("openenv") / "worker.log"
    proc = OpenEnvProcess(openenv_cfg(), str(log))  # type: ignore[arg-type]
    proc.start()
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def briefed(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A class whose reset returns an observation (the table's keys)."""
    log = tmp_path_factory.mktemp("openenv") / "worker.log"
    proc = OpenEnvProcess(openenv_cfg(env_factory=f"{PACKAGE}.trl_env:BriefedLookupEnv"), str(log))  # type: ignore[arg-type]
    proc.start()
    yield proc
    proc.close()


def test_the_worker_serves_the_class_tools_and_reward(process: OpenEnvProcess) -> None:
    ready = process.ready
    assert ready["env_class"] == f"{PACKAGE}.trl_env:LookupToolEnv"
    assert ready["server_url"].startswith("http://127.0.0.1:")
    assert ready["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "k",
                "description": "Look up the digit stored under a key.",
                "parameters": {
                    "type": "object",
                    "properties": {"key": {"type": "string", "description": "a key, e.g. c"}},
                    "required": ["key"],
                },
            },
        }
    ]
    prompt = tools_system_prompt(ready["tools"])  # describe_tools: what the model is told
    assert '{"name": "k", "description": "Look up the digit stored under a key."' in prompt
    assert '<NAME>{"argument": "value"}</NAME>' in prompt
    assert process.call("open", slot="s", row=ROW)["observation"] is None
    assert process.call("call", slot="s", name="k", arguments={"key": "c"})["output"] == "3"
    # a tool that raises answers with its error (TRL's rule); an unknown tool likewise
    assert (
        process.call("call", slot="s", name="k", arguments={"key": "z"})["tool_error"]
        == "KeyError: \"no key 'z'\""
    )
    assert "unknown tool 'x'" in process.call("call", slot="s", name="x", arguments={})["tool_error"]
    prompts = [[{"role": "user", "content": "c"}]]
    good = [
        [
            {"role": "assistant", "content": "<k>c</k>"},
            {"role": "user", "content": "=3"},
            {"role": "assistant", "content": "3"},
        ]
    ]
    # the calls so far: c then z (first call right: 0.5) and the answer 3 is the looked-up value (0.5)
    assert process.call("reward", slot="s", row=ROW, prompts=prompts, completions=good)["reward"] == 1.0
    process.call("open", slot="s", row={**ROW, "key": "a"})  # the slot's instance is reset and reused
    assert (
        process.call("reward", slot="s", row={**ROW, "key": "a"}, prompts=prompts, completions=good)["reward"]
        == 0.0
    )


def run_episode(process: OpenEnvProcess, script: list[Any], max_steps: int = 3) -> Any:
    workflow = OpenEnvWorkflow(
        ScriptedModel(script),
        agent_cls=ToolAgent,
        env_cls=OpenEnvEnvironment,
        agent_args={"tool_map": tool_stubs(process.ready["tools"]), "result_tag": "r"},
        env_args={"process": process, "max_tool_calls": 4},
        max_steps=max_steps,
    )
    return asyncio.run(workflow.run_with_termination_handling(dict(ROW), "r0:0"))


def test_an_episode_calls_the_tool_in_the_worker_and_trains_as_one_sequence(process: OpenEnvProcess) -> None:
    episode = run_episode(process, ["<k>c</k>", "3"])
    assert episode.termination_reason == TerminationReason.ENV_DONE
    (trajectory,) = episode.trajectories
    assert [s.reward for s in trajectory.steps] == [0.0, 1.0]  # read once, at the end, on the last turn
    assert trajectory.reward == 1.0 and episode.metrics["num_tool_calls"] == 1
    assert trajectory.steps[0].info["next_observation"]["tool_outputs"][0]["output"] == "3"
    fields = AgentRolloutWorker.episode_to_trajectory(dict(ROW), episode, "policy")
    assert fields is not None and fields["reward"] == 1.0 and "reward_error" not in fields
    # the model's tokens train with its log-probs; the tool's result (rendered by the template) is masked
    call, answer = ids("<k>c</k>") + [EOS], ids("3") + [EOS]
    response = fields["response_ids"]
    assert response[: len(call)] == call and response[-len(answer) :] == answer
    mask = fields["loss_mask"]
    assert mask[: len(call)] == [1] * len(call) and mask[-len(answer) :] == [1] * len(answer)
    assert sum(mask) == len(call) + len(answer)
    assert fields["behaviour_log_probs"][: len(call)] == [logprob(t) for t in call]


@pytest.mark.parametrize(
    ("prompt", "first_messages"),
    [
        ("c", [{"role": "user", "content": "c\nKeys: ac."}]),
        (
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "c"}],
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "c\nKeys: ac."}],
        ),
    ],
)
def test_what_reset_returns_is_appended_to_the_prompt(
    briefed: OpenEnvProcess, prompt: Any, first_messages: list[dict[str, str]]
) -> None:
    model = ScriptedModel(["<k>c</k>", "3"])
    workflow = OpenEnvWorkflow(
        model,
        agent_cls=ToolAgent,
        env_cls=OpenEnvEnvironment,
        agent_args={"tool_map": tool_stubs(briefed.ready["tools"]), "result_tag": "r"},
        env_args={"process": briefed},
        max_steps=3,
    )
    episode = asyncio.run(workflow.run_with_termination_handling({**ROW, "prompt": prompt}, "r0:0"))
    assert model.calls[0] == first_messages
    assert episode.trajectories[0].reward == 1.0


def test_the_reward_is_read_when_the_turn_limit_ends_the_episode(process: OpenEnvProcess) -> None:
    episode = run_episode(process, ["<k>c</k>", "<k>a</k>"], max_steps=2)
    assert episode.termination_reason == TerminationReason.MAX_TURNS_EXCEEDED
    (trajectory,) = episode.trajectories
    # the first call was the row's key (0.5); no answer turn: nothing for the answer
    assert [s.reward for s in trajectory.steps] == [0.0, 0.5]


@pytest.mark.parametrize(
    ("reward_fn", "message"),
    [("broken_reward", "KeyError: 'answer_v2'"), ("nan_reward", "the reward is nan, not a finite number")],
)
def test_a_reward_function_that_fails_scores_zero_and_is_counted(
    tmp_path: Path, reward_fn: str, message: str
) -> None:
    cfg = openenv_cfg(reward_fn=f"{PACKAGE}.trl_env:{reward_fn}")
    proc = OpenEnvProcess(cfg, str(tmp_path / "worker.log"))  # type: ignore[arg-type]
    proc.start()
    try:
        episode = run_episode(proc, ["<k>c</k>", "3"])
    finally:
        proc.close()
    assert episode.termination_reason == TerminationReason.ENV_DONE
    assert episode.metrics["reward/errors"] == 1.0
    fields = AgentRolloutWorker.episode_to_trajectory(dict(ROW), episode, "policy")
    assert fields is not None and fields["reward"] == 0.0
    assert message in fields["reward_error"]


def test_a_tool_without_a_docstring_stops_the_start_naming_it(tmp_path: Path) -> None:
    cfg = openenv_cfg(env_factory=f"{PACKAGE}.trl_env:NoDocEnv")
    proc = OpenEnvProcess(cfg, str(tmp_path / "worker.log"))  # type: ignore[arg-type]
    with pytest.raises(
        OpenEnvError, match=r"tool method nexrl_openenv_lookup\.trl_env\.NoDocEnv\.peek has no docstring"
    ):
        proc.start()


def test_a_killed_worker_fails_the_episode_with_its_exit(tmp_path: Path) -> None:
    proc = OpenEnvProcess(openenv_cfg(), str(tmp_path / "worker.log"))  # type: ignore[arg-type]
    proc.start()
    assert proc._proc is not None
    proc._proc.kill()
    proc._proc.wait()
    with pytest.raises(OpenEnvError, match="exited with code -9"):
        proc.call("open", slot="s", row=ROW)
    proc.close()


@pytest.mark.parametrize(
    ("overrides", "key", "message"),
    [
        (["rollout_worker.openenv.env_factory=null"], "rollout_worker.openenv.env_factory", "module:Class"),
        (
            ["rollout_worker.openenv.python=/nonexistent/python"],
            "rollout_worker.openenv.python",
            "install_openenv.sh",
        ),
        (
            ["rollout_worker.openenv.python_path=[/nonexistent]"],
            "rollout_worker.openenv.python_path[0]",
            "not a directory",
        ),
        (
            ["rollout_worker.agent.agent_cls=nexrl_hpc.agents.agent:MathAgent"],
            "rollout_worker.agent.agent_cls",
            "not a subclass of ToolAgent",
        ),
        (["data.type=verifiers"], "data.type", "needs rollout_worker.type=verifiers"),
    ],
)
def test_the_config_check_names_the_key(overrides: list[str], key: str, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        compose_config([*OPENENV, *overrides])
    assert any(p.path == key and message in p.message for p in raised.value.problems), raised.value.problems


def test_an_openenv_run_needs_no_rollout_reward_function() -> None:
    cfg = compose_config([*OPENENV, "rollout_worker.reward_fn=null"])
    assert cfg["rollout_worker"]["reward_fn"] is None


@pytest.mark.e2e
def test_the_lookup_environment_trains_through_the_adapter(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    steps = 2
    proc = run_train(
        [
            *OPENENV,
            "data.batch_size=8",
            "data.rollout_repeat_n=4",
            "task.params.val_size=16",
            f"train_worker.total_train_steps={steps}",
            f"validate.eval.validate_freq={steps}",
            f"run_dir={run_dir}",
            "seed=1",
            "logger.backend=[]",
        ],
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/reward_mean" in r]
    assert [r["step"] for r in trained] == list(range(1, steps + 1))
    for r in trained:
        # the warmed-up model writes the call: the tool ran in the environment's server, then it answered
        assert r["train/num_tool_calls"] >= 0.9 and r["train/num_turns"] >= 1.9, r
        assert 0.0 <= r["train/reward_mean"] <= 1.0 and r["reward/errors"] == 0, r
        assert r["actor/optimizer_steps"] == 1 and r["train/context_mismatch"] == 0.0, r
        # the ids the trainer scored are the ones the engine sampled, with the engine's log-probs
        assert r["train/logprob_mismatch_max"] <= 1e-4, r
    validations = [r for r in rows if "val/reward" in r]
    assert [r["step"] for r in validations] == [0, steps]
    assert (run_dir / "logs" / "openenv_rollout_worker.log").exists()


@pytest.mark.e2e
def test_a_users_qwen2_model_dir_runs_openenv_episodes_with_chat_prompts(
    chatml_padded_model_dir: str, tmp_path: Path
) -> None:
    """What users bring: a Qwen2 directory (tied, GQA, byte-level BPE, ChatML, an embedding padded past
    its tokenizer) and chat-message prompts. Its random weights rarely call the tool; the episodes
    still run through the environment and train with the engine's ids and log-probs."""
    rows = tmp_path / "rows.jsonl"
    with open(rows, "w") as f:
        for i, key in enumerate("abcdefgh" * 4):
            table = {k: str((j + i) % 8) for j, k in enumerate("abcdefgh")}
            prompt = [{"role": "system", "content": "Look it up."}, {"role": "user", "content": key}]
            f.write(json.dumps({"prompt": prompt, "key": key, "table": table, "answer": table[key]}) + "\n")
    run_dir = tmp_path / "run"
    proc = run_train(
        [
            *OPENENV,
            f"rollout_worker.openenv.env_factory={PACKAGE}.trl_env:BriefedLookupEnv",
            f"model.path={chatml_padded_model_dir}",
            "model.tiny.warmup=null",
            "data.type=jsonl",
            f"data.data_files=[{rows}]",
            f"validate.data.data_files=[{rows}]",
            "rollout_worker.max_prompt_length=96",
            "rollout_worker.max_response_length=8",
            "data.batch_size=4",
            "data.rollout_repeat_n=2",
            "train_worker.total_train_steps=1",
            "validate.eval.validate_freq=0",
            f"run_dir={run_dir}",
            "logger.backend=[]",
        ],
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows_out = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (step,) = [r for r in rows_out if "train/reward_mean" in r]
    assert step["train/logprob_mismatch_max"] <= 1e-4, step
    assert step["reward/errors"] == 0 and step["train/termination/error"] == 0.0, step
