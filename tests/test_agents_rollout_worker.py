"""AgentRolloutWorker (rollout_worker.type=agent): the trajectory it puts, config errors naming keys.

The worker runs on the tool_lookup task's real config, tokenizer and chat template. The model is
a DOUBLE: ``ScriptedChatClient`` answers chat requests with scripted completions, rendering the
prompt with the real char tokenizer + chat template exactly as the inference server does, so
ids, loss mask and logprob bookkeeping can be checked value by value. (The learning test in
tests/test_agents_tool_task.py runs the same worker against the real local server.)
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from nexrl_hpc.config.validate import ConfigError
from nexrl_hpc.models.tokenizer import build_char_tokenizer
from nexrl_hpc.rewards.types import RewardOutput
from nexrl_hpc.rollout.agent import AgentRolloutWorker
from nexrl_hpc.rollout.base import _IS_VALIDATE
from nexrl_hpc.rollout.factory import rollout_worker_class
from tests.conftest import compose_config

TASK = {
    "prompt": "c",
    "key": "c",
    "table": {"a": "1", "b": "0", "c": "3", "d": "0"},
    "answer": "3",
    "uid": "u0",
    "group_id": "g0",
}


class ScriptedChatClient:
    """Test double of LLMServiceClient.agenerate: scripted completion texts, real template + token ids."""

    def __init__(self, tokenizer: Any, completions: list[str], weight_version: int = 3) -> None:
        self.tokenizer = tokenizer
        self.completions = list(completions)
        self.weight_version = weight_version
        self.requests: list[dict[str, Any]] = []

    async def agenerate(self, messages: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        self.requests.append(dict(kwargs, messages=[dict(m) for m in messages]))
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompt_ids = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        text = self.completions.pop(0)
        ids = self.tokenizer(text, add_special_tokens=False).input_ids + [self.tokenizer.eos_token_id]
        # distinct, recognisable logprobs: -(turn + 1) / 10 - position / 100
        turn = len(self.requests) - 1
        logprobs = [-(turn + 1) / 10 - i / 100 for i in range(len(ids))]
        return {
            "response": text,
            "reasoning": None,
            "tool_calls": [],
            "finish_reason": "stop",
            "prompt_ids": prompt_ids,
            "response_ids": ids,
            "logprobs": logprobs,
            "weight_version": self.weight_version,
            "model_tag": "default",
        }


class Sink:
    """Stands in for the TrajectoryPool / Validator: records what was put."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []

    def put_trajectories(self, trajectories: list[dict[str, Any]]) -> list[str]:
        self.items += trajectories
        return ["success"] * len(trajectories)


def make_worker(
    completions: list[str], overrides: tuple[str, ...] = ()
) -> tuple[AgentRolloutWorker, ScriptedChatClient, Sink, Sink, Any]:
    cfg = compose_config(["task=tool_lookup", *overrides])
    assert rollout_worker_class(cfg) is AgentRolloutWorker
    tok_cfg = cfg["model"]["tiny"]["tokenizer"]
    tokenizer = build_char_tokenizer(tok_cfg["alphabet"], tok_cfg["chat_template"])
    worker = AgentRolloutWorker(cfg)
    client = ScriptedChatClient(tokenizer, completions)
    pool, validator = Sink(), Sink()
    worker.set_llm_client(client)
    worker._trajectory_pool, worker._validator = pool, validator
    return worker, client, pool, validator, tokenizer


def test_tool_episode_trajectory_fields_exactly() -> None:
    worker, client, pool, validator, tok = make_worker(["<k>c</k>", "3"])
    assert asyncio.run(worker.step(dict(TASK))) == "success"
    assert validator.items == []
    (traj,) = pool.items
    eos = tok.eos_token_id
    ids = lambda s: tok(s, add_special_tokens=False).input_ids  # noqa: E731
    assert traj["prompt_ids"] == ids("c")
    assert traj["response_ids"] == ids("<k>c</k>") + [eos] + ids("=3") + ids("3") + [eos]
    # model tokens (call + EOS, answer + EOS) train; the tool result does not
    assert traj["loss_mask"] == [1] * 9 + [0] * 2 + [1] * 2
    assert traj["behaviour_log_probs"] == pytest.approx(
        [-0.1 - i / 100 for i in range(9)] + [0.0] * 2 + [-0.2, -0.21]
    )
    assert traj["weight_version"] == 3 and traj["model_tag"] == "default"
    assert traj["reward"] == pytest.approx(1.0)  # the task config: 0.5 right call + 0.5 faithful answer
    assert traj["step_rewards"] == pytest.approx([0.5, 0.5])
    assert traj["step_returns"] == pytest.approx([0.5, 0.5])  # gamma 0: each step's own reward
    assert traj["step_spans"] == [[0, 9], [11, 13]]
    assert traj["token_rewards"] == [0.0] * 8 + [0.5] + [0.0] * 3 + [0.5]
    assert traj["termination_reason"] == "env_done" and traj["finish_reason"] == "stop"
    scores = traj["scores"]
    assert scores["is_correct"] == 1.0 and scores["num_turns"] == 2.0
    assert scores["num_tool_calls"] == 1.0 and scores["num_tool_errors"] == 0.0
    assert scores["termination/env_done"] == 1.0 and scores["termination/max_turns_exceeded"] == 0.0
    assert traj["uid"] == "u0" and traj["group_id"] == "g0" and traj["answer"] == "3"  # task fields kept
    # training sampling (temperature 1, per-turn max_tokens 9) reached the client
    assert [(r["temperature"], r["max_tokens"]) for r in client.requests] == [(1.0, 9), (1.0, 9)]
    assert client.requests[1]["messages"][-1] == {"role": "user", "content": "=3"}


def test_call_reward_split_and_discounted_returns() -> None:
    overrides = ("rollout_worker.agent.env_args.call_reward=0.3", "rollout_worker.agent.gamma=0.5")
    worker, _, pool, _, _ = make_worker(["<k>c</k>", "3"], overrides)
    asyncio.run(worker.step(dict(TASK)))
    (traj,) = pool.items
    assert traj["step_rewards"] == pytest.approx([0.3, 0.7]) and traj["reward"] == pytest.approx(1.0)
    assert traj["step_returns"] == pytest.approx([0.3 + 0.5 * 0.7, 0.7])
    assert traj["token_rewards"][8] == pytest.approx(0.3) and traj["token_rewards"][12] == pytest.approx(0.7)


def test_malformed_call_ends_the_episode_with_no_reward() -> None:
    worker, _, pool, _, _ = make_worker(["<k>c>"])  # unclosed call, EOS too early
    asyncio.run(worker.step(dict(TASK)))
    (traj,) = pool.items
    assert traj["loss_mask"] == [1] * 6
    assert traj["reward"] == 0.0 and traj["step_rewards"] == [0.0]
    assert traj["scores"]["is_correct"] == 0.0 and traj["scores"]["num_tool_calls"] == 0.0
    assert traj["scores"]["num_tool_errors"] == 1.0  # the unclosed call


def test_a_lookup_error_comes_back_in_the_tag_syntax() -> None:
    worker, client, pool, _, _ = make_worker(["<k>z</k>", "1"])  # no key z in the table
    asyncio.run(worker.step(dict(TASK)))
    (traj,) = pool.items
    observation = client.requests[1]["messages"][-1]["content"]
    assert observation.startswith("<r>") and "no key 'z'" in observation, observation
    assert traj["reward"] == 0.0 and traj["scores"]["is_correct"] == 0.0


def test_validation_goes_to_the_validator_with_greedy_sampling() -> None:
    worker, client, pool, validator, _ = make_worker(["<k>a</k>", "1"])  # looked up the wrong key

    async def validate() -> str | None:
        _IS_VALIDATE.set(True)
        return await worker.step(dict(TASK))

    assert asyncio.run(validate()) == "success"
    assert pool.items == [] and len(validator.items) == 1
    # the wrong key's value, answered faithfully: the answer's half of the reward, not correct
    assert validator.items[0]["reward"] == pytest.approx(0.5)
    assert validator.items[0]["scores"]["is_correct"] == 0.0
    assert [r["temperature"] for r in client.requests] == [0.0, 0.0]


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("rollout_worker.agent.agent_cls=no.such.module:Agent", "rollout_worker.agent.agent_cls"),
        ("rollout_worker.agent.env_cls=nexrl_hpc.agents.agent:ToolAgent", "rollout_worker.agent.env_cls"),
        ("rollout_worker.agent.workflow=nexrl_hpc.agents.workflow:Nope", "rollout_worker.agent.workflow"),
        (
            "rollout_worker.agent.tool_map.k=nexrl_hpc.tasks.tool_lookup:Missing",
            "rollout_worker.agent.tool_map.k",
        ),
        ("rollout_worker.agent.tools=[no_such_tool]", "rollout_worker.agent.tools[0]"),
        (
            "+rollout_worker.agent.env_args.reward_fn=os:getcwd",  # fits no reward signature
            "rollout_worker.agent.env_args.reward_fn",
        ),
        ("model.tiny.tokenizer.chat_template=null", "model.tiny.tokenizer.chat_template"),
        ("model.tiny.warmup=nexrl_hpc.tasks.tool_lookup:no_such_fn", "model.tiny.warmup"),
        ("+model.tiny.warmup_args.bogus=1", "model.tiny.warmup"),  # a keyword it does not take
        ("rollout_worker.agent.max_turns=0", "rollout_worker.agent.max_turns"),
    ],
)
def test_bad_agent_config_is_an_error_naming_the_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        compose_config(["task=tool_lookup", override])
    assert key in [p.path for p in info.value.problems], str(info.value)


def test_unknown_workflow_argument_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        compose_config(["task=tool_lookup", "+rollout_worker.agent.workflow_args.bogus=1"])
    assert [p.path for p in info.value.problems] == ["rollout_worker.agent"]
    assert "bogus" in str(info.value)


def raising_reward(task: dict[str, Any], response: str) -> float:
    raise ZeroDivisionError("a broken scorer")


def slow_reward(data_source: Any, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    import time

    time.sleep(2.0)
    return 1.0


@pytest.mark.parametrize(
    "reward,counted", [("raising_reward", "reward/errors"), ("slow_reward", "reward/timeouts")]
)
def test_an_episode_whose_reward_fails_scores_zero_and_counts_it(reward: str, counted: str) -> None:
    """The environment's reward (rollout_worker.reward_fn) runs as the single-turn worker's does:
    raising or past reward_timeout_s, the episode still ends normally with reward 0, counted."""
    overrides = (
        f"rollout_worker.reward_fn=tests.test_agents_rollout_worker:{reward}",
        "rollout_worker.reward_timeout_s=0.3",
        "rollout_worker.agent.env_cls=nexrl_hpc.agents.environments:SingleTurnEnvironment",
        "rollout_worker.agent.env_args={}",
        "rollout_worker.agent.tool_map={}",
        "rollout_worker.agent.max_turns=1",
        "algorithm.advantage_granularity=episode",
    )
    worker, _, pool, _, _ = make_worker(["3"], overrides)
    assert asyncio.run(worker.step(dict(TASK))) == "success"
    (traj,) = pool.items
    assert traj["reward"] == 0.0 and traj["termination_reason"] == "env_done"
    other = "reward/timeouts" if counted == "reward/errors" else "reward/errors"
    assert traj["scores"][counted] == 1.0 and traj["scores"][other] == 0.0


def lookup_answer_reward(task_info: dict[str, Any], action: Any) -> RewardOutput:
    """The agent stack's form: the LookupAgent's action is a dict; its text is the answer."""
    correct = str(action["text"]).strip() == task_info["answer"]
    return RewardOutput(float(correct), {"checked": "text"}, correct)


def test_an_episode_whose_reward_works_counts_no_failures() -> None:
    overrides = (
        "rollout_worker.reward_fn=tests.test_agents_rollout_worker:lookup_answer_reward",
        "rollout_worker.agent.env_cls=nexrl_hpc.agents.environments:SingleTurnEnvironment",
        "rollout_worker.agent.env_args={}",
        "rollout_worker.agent.tool_map={}",
        "rollout_worker.agent.max_turns=1",
        "algorithm.advantage_granularity=episode",
    )
    worker, _, pool, _, _ = make_worker(["3"], overrides)
    asyncio.run(worker.step(dict(TASK)))
    (traj,) = pool.items
    assert traj["reward"] == 1.0 and traj["scores"]["is_correct"] == 1.0
    assert traj["scores"]["reward/errors"] == 0.0 and traj["scores"]["reward/timeouts"] == 0.0
