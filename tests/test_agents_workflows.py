"""Agents, environments, workflows and engines driven by a scripted test double (tests/helpers/scripted_model.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from nexrl_hpc.agents.agent import FINISH_TOOL, TOOL_CALL_ERROR, MathAgent, ToolAgent
from nexrl_hpc.agents.environments import (
    BaseEnv,
    MultiTurnEnvironment,
    SingleTurnEnvironment,
    ToolEnvironment,
)
from nexrl_hpc.agents.rewards.types import RewardOutput
from nexrl_hpc.agents.rollout_engine import ClientRolloutEngine
from nexrl_hpc.agents.runners import AgentRunner, NotThreadSafeError, WorkflowRunner
from nexrl_hpc.agents.types import Episode, Step, TerminationReason, ToolCall, Trajectory
from nexrl_hpc.agents.workflow import (
    MultiTurnWorkflow,
    SingleTurnWorkflow,
    TerminationEvent,
    Workflow,
    adjust_step_rewards,
)
from nexrl_hpc.config.validate import ConfigError
from tests.helpers.scripted_model import ScriptedModel

TASK = {"question": "3+4?", "answer": "7", "uid": "t0"}


def exact_answer(task_info: dict[str, Any], action: Any) -> RewardOutput:
    correct = str(action).strip() == str(task_info["answer"])
    return RewardOutput(1.0 if correct else 0.0, {"answer": str(action).strip()}, correct)


def tool_workflow(model: ScriptedModel, **kw: Any) -> MultiTurnWorkflow:
    return MultiTurnWorkflow(
        model,
        agent_cls=ToolAgent,
        agent_args={"tools": ["calculator"]},
        env_cls=ToolEnvironment,
        env_args={"tools": ["calculator"], "reward_fn": exact_answer, **kw.pop("env_args", {})},
        **kw,
    )


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# --- agents and environments -------------------------------------------------------------------------
def test_tool_agent_turns_calls_errors_and_answers_into_actions() -> None:
    agent = ToolAgent(tools=["calculator"])
    agent.update_from_env(TASK, 0.0, False, {})
    assert agent.chat_completions == [{"role": "user", "content": "3+4?"}]
    action = agent.update_from_model("<calculator>3+4</calculator>").action
    assert action == [ToolCall("calculator", {"expression": "3+4"})]
    assert agent.get_current_state() is agent.trajectory.steps[0]
    with pytest.raises(RuntimeError, match="twice without update_from_env"):
        agent.update_from_model("x")
    agent.update_from_env({"tool_outputs": [{"name": "calculator", "output": "7"}]}, 0.0, False, {"k": 1})
    assert agent.chat_completions[-1] == {"role": "user", "content": "<result>7</result>"}
    assert agent.trajectory.steps[0].info["k"] == 1
    bad = agent.update_from_model("<calculator>3+4").action  # unclosed: an error call, not an exception
    assert [c.name for c in bad] == [TOOL_CALL_ERROR]
    assert "not closed" in bad[0].arguments["message"]
    agent.update_from_env({}, 0.0, False, {})
    final = agent.update_from_model(" 7 ").action
    assert final == [ToolCall(FINISH_TOOL, {"response": "7"})]
    assert len(agent.trajectory.steps) == 3
    agent.reset()
    assert agent.chat_completions == [] and agent.trajectory.steps == []


def test_tool_environment_runs_calls_reports_errors_and_scores_the_answer() -> None:
    env = ToolEnvironment(tools=["calculator"], reward_fn=exact_answer, max_tool_calls=2)
    obs, _ = env.reset(TASK)
    assert obs == TASK
    obs, reward, done, info = env.step(
        [
            ToolCall("calculator", {"expression": "3+4"}),
            ToolCall(TOOL_CALL_ERROR, {"message": "<calculator> call not closed", "tool": "calculator"}),
            {"function": {"name": "nope", "arguments": "{}"}},  # the OpenAI tool-call shape
        ]
    )
    outs = obs["tool_outputs"]
    assert (reward, done) == (0.0, False)
    assert outs[0]["output"] == "7" and outs[0]["error"] is None
    assert outs[1]["error"] == "<calculator> call not closed"
    assert "unknown tool 'nope'" in outs[2]["error"]
    assert info == {"num_tool_calls": 2, "num_tool_errors": 2}
    obs, reward, done, info = env.step([ToolCall("calculator", {"expression": "1"})])  # third real call
    assert (obs, reward, done) == ({}, 0.0, True) and info["max_tool_calls_exceeded"] is True
    env.reset(TASK)
    _, reward, done, info = env.step("7")
    assert (reward, done, info["is_correct"], info["answer"]) == (1.0, True, True, "7")


def test_single_turn_env_from_dict_and_reward_type_errors() -> None:
    env = SingleTurnEnvironment.from_dict({"reward_fn": exact_answer, "question": "q", "answer": "7"})
    assert env.reset() == ({"question": "q", "answer": "7"}, {})
    assert env.step("7")[1:3] == (1.0, True)
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("7")
    with pytest.raises(ConfigError, match="env_args.reward_fn"):
        SingleTurnEnvironment(reward_fn="no.such.module:fn")
    # any signature of the one reward API; a float result is the reward
    floaty = SingleTurnEnvironment(TASK, reward_fn=lambda task, response: 1.0)
    floaty.reset()
    assert floaty.step("7")[1:3] == (1.0, True)
    with pytest.raises(ConfigError, match="env_args.reward_fn"):
        SingleTurnEnvironment(reward_fn=lambda: 1.0)


# --- workflows --------------------------------------------------------------------------------------
def test_single_turn_math_workflow() -> None:
    model = ScriptedModel(["7"])
    wf = SingleTurnWorkflow(
        model, agent_cls=MathAgent, env_cls=SingleTurnEnvironment, env_args={"reward_fn": exact_answer}
    )
    episode = run(wf.run_with_termination_handling(TASK, "t0"))
    assert episode.termination_reason == TerminationReason.ENV_DONE
    assert episode.is_correct and episode.id == "t0"
    (traj,) = episode.trajectories
    assert traj.name == "agent" and traj.reward == 1.0 and traj.steps[0].mc_return == 1.0
    assert model.calls == [[{"role": "user", "content": "3+4?"}]]
    with pytest.raises(ValueError, match="max_steps=3"):
        SingleTurnWorkflow(model, agent_cls=MathAgent, env_cls=SingleTurnEnvironment, max_steps=3)


def test_a_length_cut_turn_earns_nothing_unless_score_truncated() -> None:
    """A single-token answer task served with max_tokens=1 always ends by length: by default the
    cut-off turn is not scored; ``score_truncated=True`` still lets the env score it."""
    for score_truncated, reward in ((False, 0.0), (True, 1.0)):
        wf = SingleTurnWorkflow(
            ScriptedModel([("7", "length")]),
            agent_cls=MathAgent,
            env_cls=SingleTurnEnvironment,
            env_args={"reward_fn": exact_answer},
            score_truncated=score_truncated,
        )
        episode = run(wf.run_with_termination_handling(TASK, "t0"))
        assert episode.termination_reason == TerminationReason.MAX_RESPONSE_LENGTH_EXCEEDED
        assert episode.trajectories[0].reward == reward and bool(episode.is_correct) == bool(reward)


def test_two_turn_tool_episode() -> None:
    model = ScriptedModel(["<calculator>3+4</calculator>", "7"])
    episode = run(tool_workflow(model).run_with_termination_handling(TASK, "t0"))
    assert episode.termination_reason == TerminationReason.ENV_DONE and episode.error is None
    steps = episode.trajectories[0].steps
    assert [s.reward for s in steps] == [0.0, 1.0] and [s.done for s in steps] == [False, True]
    assert model.calls[1][-2:] == [
        {"role": "assistant", "content": "<calculator>3+4</calculator>"},
        {"role": "user", "content": "<result>7</result>"},
    ]
    assert episode.metrics == {
        "num_steps": 2,
        "reward": 1.0,
        "is_correct": 1.0,
        "num_tool_calls": 1,
        "num_tool_errors": 0,
        "agent/reward": 1.0,
    }


def test_malformed_call_is_an_error_observation_and_the_episode_continues() -> None:
    model = ScriptedModel(["<calculator>3+4", "<calculator>3+4</calculator>", "7"])
    episode = run(tool_workflow(model).run_with_termination_handling(TASK, "t0"))
    assert episode.termination_reason == TerminationReason.ENV_DONE and episode.is_correct
    assert model.calls[1][-1]["content"] == (
        "<result>Error: <calculator> call not closed: expected </calculator> before the end of the output</result>"
    )
    assert episode.metrics["num_tool_errors"] == 1 and episode.metrics["num_steps"] == 3


@pytest.mark.parametrize(
    ("script", "kwargs", "reason", "n_steps"),
    [
        (["<calculator>1</calculator>"] * 5, {"max_steps": 2}, TerminationReason.MAX_TURNS_EXCEEDED, 2),
        ([("<calculator>1+", "length")], {}, TerminationReason.MAX_RESPONSE_LENGTH_EXCEEDED, 1),
        # turn 1's response is 28+1 model ids; turn 2 adds 32 env ids + 2 model ids: 63 > 40
        (
            ["<calculator>3+4</calculator>", "7"],
            {"max_response_length": 40},
            TerminationReason.MAX_RESPONSE_LENGTH_EXCEEDED,
            2,
        ),
        (["7"], {"max_prompt_length": 10}, TerminationReason.MAX_PROMPT_LENGTH_EXCEEDED, 1),
        ([RuntimeError("server exploded")], {}, TerminationReason.ERROR, 0),
        (
            ["<calculator>1</calculator>", "<calculator>2</calculator>"],
            {"env_args": {"max_tool_calls": 1}},
            TerminationReason.ENV_DONE,
            2,
        ),
    ],
)
def test_termination_reasons(
    script: list[Any], kwargs: dict[str, Any], reason: TerminationReason, n_steps: int
) -> None:
    episode = run(tool_workflow(ScriptedModel(script), **kwargs).run_with_termination_handling(TASK, "t0"))
    assert episode.termination_reason == reason
    assert sum(len(t.steps) for t in episode.trajectories) == n_steps
    if reason == TerminationReason.ERROR:
        assert episode.error is not None and episode.error["message"] == "server exploded"
        assert episode.error["type"] == "RuntimeError"
    else:
        assert episode.error is None
    assert episode.trajectories == [] or episode.trajectories[0].reward == 0.0


def test_timeout_termination() -> None:
    wf = tool_workflow(ScriptedModel(["7"], delay_s=5.0), timeout=0.2)
    episode = run(wf.run_with_termination_handling(TASK, "t0"))
    assert episode.termination_reason == TerminationReason.TIMEOUT


def test_custom_workflow_commit_and_termination_event() -> None:
    class TwoAgents(Workflow):
        async def run(self, task: dict[str, Any], uid: str, **kwargs: Any) -> Episode | None:
            self.reset(task, uid)
            self.solver, self.judge = MathAgent(), MathAgent()
            for agent in (self.solver, self.judge):
                agent.update_from_env(task, 0.0, False, {})
                out = await self.get_model_response(agent.chat_completions)
                agent.update_from_model(out)
                agent.update_from_env({}, 1.0, True, {"is_correct": True})
            self.commit(name="solver", agent=self.solver)
            self.commit(name="solver_again", agent=self.solver)  # ignored: committed once
            raise TerminationEvent(TerminationReason.ENV_DONE)

    episode = run(TwoAgents(ScriptedModel(["7", "yes"])).run_with_termination_handling(TASK, "u"))
    assert [t.name for t in episode.trajectories] == ["solver", "judge"]  # judge auto-collected
    assert episode.is_correct and episode.metrics["solver/reward"] == 1.0
    assert episode.trajectories[1].steps[0].model_response == "yes"


# --- rewards and returns -----------------------------------------------------------------------------
def test_mc_returns_and_reward_bonus() -> None:
    traj = Trajectory(steps=[Step(reward=r) for r in (0.0, 0.0, 1.0)])
    adjust_step_rewards(traj, gamma=0.5)
    assert [s.mc_return for s in traj.steps] == [0.25, 0.5, 1.0]
    traj = Trajectory(steps=[Step(reward=r) for r in (0.0, 1.0, 1.0)])
    adjust_step_rewards(traj, gamma=0.0, reward_bonus_coeff=0.5)
    assert [s.reward for s in traj.steps] == [0.0, 1.5, 1.0]  # bonus on raw differences: 0.5*(1-0), 0.5*(1-1)
    assert [s.mc_return for s in traj.steps] == [0.0, 1.5, 1.0]
    with pytest.raises(ValueError, match="gamma"):
        adjust_step_rewards(traj, gamma=1.5)


def test_execution_engine_gamma_and_parallel_pairs() -> None:
    def script(messages: list[dict[str, Any]], i: int) -> str:
        return "<calculator>3+4</calculator>" if len(messages) == 1 else "7"

    engine = AgentRunner(
        agent_class=ToolAgent,
        agent_args={"tools": ["calculator"]},
        env_class=ToolEnvironment,
        env_args={"tools": ["calculator"], "reward_fn": exact_answer},
        rollout_engine=ScriptedModel(script, delay_s=0.01),
        n_parallel_agents=2,
        gamma=0.2,
    )
    tasks = [dict(TASK, uid=f"t{i}", answer="7" if i % 2 == 0 else "8") for i in range(4)]
    episodes = run(engine.execute_tasks(tasks))
    engine.shutdown()
    assert [e.id for e in episodes] == ["t0", "t1", "t2", "t3"]
    assert [e.is_correct for e in episodes] == [True, False, True, False]
    returns = [s.mc_return for s in episodes[0].trajectories[0].steps]
    assert returns == pytest.approx([0.2, 1.0])  # G_0 = 0 + 0.2 * 1
    assert [s.mc_return for s in episodes[1].trajectories[0].steps] == [0.0, 0.0]


# --- the workflow engine --------------------------------------------------------------------------------
def test_workflow_runner_retries_only_on_error() -> None:
    failures = {"a": 2, "b": 5}  # a fails twice then succeeds; b always fails; c runs out of turns

    def script(messages: list[dict[str, Any]], i: int) -> Any:
        q = messages[0]["content"]
        if failures.get(q, 0) > 0:
            failures[q] -= 1
            return ConnectionError(f"flaky for {q}")
        return "<calculator>1</calculator>" if q == "c" else "7"

    model = ScriptedModel(script)
    engine = WorkflowRunner(
        MultiTurnWorkflow,
        {
            "agent_cls": ToolAgent,
            "agent_args": {"tools": ["calculator"]},
            "env_cls": ToolEnvironment,
            "env_args": {"tools": ["calculator"], "reward_fn": exact_answer},
            "max_steps": 2,
        },
        model,
        n_parallel_tasks=2,
        retry_limit=3,
    )
    tasks = [{"question": q, "answer": "7"} for q in ("a", "b", "c")]
    episodes = run(engine.execute_tasks(tasks, task_ids=["a", "b", "c"]))
    engine.shutdown()
    a, b, c = episodes
    assert (a.termination_reason, a.info["attempts"], a.is_correct) == (TerminationReason.ENV_DONE, 3, True)
    assert (b.termination_reason, b.info["attempts"]) == (TerminationReason.ERROR, 3)
    assert "flaky for b" in b.error["message"]
    assert (c.termination_reason, c.info["attempts"]) == (TerminationReason.MAX_TURNS_EXCEEDED, 1)
    per_question = {q: sum(1 for call in model.calls if call[0]["content"] == q) for q in "abc"}
    assert per_question == {"a": 3, "b": 3, "c": 2}  # c: two turns, never retried
    assert [e.id for e in episodes] == ["a:0", "b:0", "c:0"]


def test_workflow_runner_groups_and_pool_bound() -> None:
    model = ScriptedModel(lambda m, i: "7", delay_s=0.05)
    engine = WorkflowRunner(
        SingleTurnWorkflow,
        {"agent_cls": MathAgent, "env_cls": SingleTurnEnvironment, "env_args": {"reward_fn": exact_answer}},
        model,
        n_parallel_tasks=3,
    )
    in_flight, peak = 0, 0
    original = model.get_model_response

    async def counting(messages: list[dict[str, Any]], **kwargs: Any) -> Any:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            return await original(messages, **kwargs)
        finally:
            in_flight -= 1

    model.get_model_response = counting  # type: ignore[method-assign]
    episodes = run(engine.execute_tasks([TASK], n=8))
    engine.shutdown()
    assert [e.id for e in episodes] == [f"t0:{k}" for k in range(8)]
    assert all(e.is_correct for e in episodes) and peak == 3


class SharedStateEnv(MultiTurnEnvironment):
    def get_reward_and_next_obs(self, task: Any, action: Any) -> tuple[float, Any, dict[str, Any]]:
        return 0.0, {}, {}

    @staticmethod
    def is_multithread_safe() -> bool:
        return False


def test_engines_refuse_non_thread_safe_envs_in_parallel() -> None:
    args = {"agent_cls": MathAgent, "env_cls": SharedStateEnv}
    with pytest.raises(NotThreadSafeError, match="SharedStateEnv is not multithread-safe"):
        WorkflowRunner(MultiTurnWorkflow, args, ScriptedModel([]), n_parallel_tasks=2)
    WorkflowRunner(MultiTurnWorkflow, args, ScriptedModel([]), n_parallel_tasks=1).shutdown()
    with pytest.raises(NotThreadSafeError, match="n_parallel_agents"):
        AgentRunner(MathAgent, SharedStateEnv, ScriptedModel([]), n_parallel_agents=2)
    assert BaseEnv.is_multithread_safe() is False and ToolEnvironment.is_multithread_safe() is True


def test_episode_round_trips_through_json() -> None:
    model = ScriptedModel(["<calculator>3+4", "<calculator>3+4</calculator>", "7"])
    episode = run(tool_workflow(model, gamma=0.5).run_with_termination_handling(TASK, "t0"))
    loaded = Episode.from_dict(json.loads(json.dumps(episode.to_dict())))
    assert loaded.to_dict() == episode.to_dict()
    actions = [s.action for s in loaded.trajectories[0].steps]
    assert actions[1] == [ToolCall("calculator", {"expression": "3+4"})]
    assert loaded.trajectories[0].steps[2].model_output.completion_ids == [ord("7"), 2]


def test_server_context_length_refusal_is_max_prompt_length_not_error() -> None:
    refusal = RuntimeError(
        "http://x/v1 rejected the request: This model's maximum context length is 64 tokens"
    )
    episode = run(tool_workflow(ScriptedModel([refusal])).run_with_termination_handling(TASK, "t0"))
    assert episode.termination_reason == TerminationReason.MAX_PROMPT_LENGTH_EXCEEDED
    assert episode.error is None


def test_custom_workflow_env_cls_is_checked_for_thread_safety() -> None:
    class MakesEnvInRun(Workflow):
        def __init__(self, rollout_engine: Any, env_cls: type[BaseEnv], **kw: Any) -> None:
            super().__init__(rollout_engine, **kw)
            self.env_cls = env_cls

        async def run(self, task: dict[str, Any], uid: str, **kwargs: Any) -> Episode | None:
            raise TerminationEvent(TerminationReason.ENV_DONE)

    with pytest.raises(NotThreadSafeError, match="SharedStateEnv"):
        WorkflowRunner(MakesEnvInRun, {"env_cls": SharedStateEnv}, ScriptedModel([]), n_parallel_tasks=2)


class FakeClient:
    """TEST DOUBLE for LLMServiceClient.agenerate: returns a fixed server-shaped result dict."""

    def __init__(self, tool_calls: list[dict[str, Any]]) -> None:
        self.tool_calls = tool_calls
        self.kwargs: list[dict[str, Any]] = []

    async def agenerate(self, messages: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        self.kwargs.append(kwargs)
        return {
            "response": "",
            "tool_calls": self.tool_calls,
            "prompt_ids": [1, 5],
            "response_ids": [7, 2],
            "logprobs": [-0.5, -0.25],
            "finish_reason": "tool_calls",
            "weight_version": 3,
        }


def test_client_engine_turns_malformed_openai_tool_calls_into_error_observations() -> None:
    client = FakeClient(
        [
            {"id": "a", "function": {"name": "calculator", "arguments": '{"expression": "2*3"}'}},
            {"id": "b", "function": {"name": "calculator", "arguments": "{not json"}},
        ]
    )
    engine = ClientRolloutEngine(client, temperature=0.5, max_tokens=8)
    out = run(engine.get_model_response([{"role": "user", "content": "q"}], max_tokens=4))
    assert client.kwargs == [{"temperature": 0.5, "max_tokens": 4}]
    assert (out.prompt_ids, out.completion_ids, out.logprobs) == ([1, 5], [7, 2], [-0.5, -0.25])
    assert out.weight_version == 3 and out.tool_calls[0] == ToolCall("calculator", {"expression": "2*3"}, "a")
    assert (
        out.tool_calls[1].name == TOOL_CALL_ERROR
        and "not valid JSON" in out.tool_calls[1].arguments["message"]
    )
    agent, env = ToolAgent(tools=["calculator"]), ToolEnvironment(tools=["calculator"])
    agent.update_from_env(env.reset(TASK)[0], 0.0, False, {})
    obs, _, done, info = env.step(agent.update_from_model(out).action)
    assert not done and info == {"num_tool_calls": 1, "num_tool_errors": 1}
    assert [o["output"] for o in obs["tool_outputs"]] == ["6", None]
    assert obs["tool_outputs"][0]["metadata"] == {"tool_call_id": "a"}
