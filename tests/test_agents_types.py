"""Episode data: round trips through JSON, and ModelOutput from what the inference client returns."""

from __future__ import annotations

import json
from typing import Any

import pytest

from nexrl_hpc.agents.rollout_engine import model_output_from_result
from nexrl_hpc.agents.types import Episode, ModelOutput, Step, TerminationReason, ToolCall, Trajectory
from nexrl_hpc.inference.client import LLMServiceClient
from tests.conftest import compose_config


def _client() -> LLMServiceClient:
    """The real client with the run's config; only its result builders (and engine adapter) are used."""
    config = compose_config(["service.inference_service.base_url=http://127.0.0.1:9/v1"])
    return LLMServiceClient(config["service"]["inference_service"])


def _chat_payload() -> dict[str, Any]:
    """A vLLM chat response with return_token_ids and logprobs, as the server sends it."""
    return {
        "prompt_token_ids": [1, 5, 6, 7],
        "weight_version": 3,
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "token_ids": [8, 9, 2],
                "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.25}, {"logprob": -0.125}]},
                "message": {
                    "content": "let me add",
                    "reasoning_content": "think:",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "calculator", "arguments": '{"expression": "3+4"}'},
                        }
                    ],
                },
            }
        ],
    }


def test_model_output_from_chat_result_keeps_engine_tokens_and_parses_tool_calls() -> None:
    client = _client()
    choice = client._adapter.chat_choice(_chat_payload())
    result = client._chat_result([{"role": "user", "content": "3+4?"}], choice, None, {})
    out = model_output_from_result(result)
    assert out.prompt_ids == [1, 5, 6, 7]
    assert out.completion_ids == [8, 9, 2]
    assert out.logprobs == [-0.5, -0.25, -0.125]
    assert (out.prompt_length, out.completion_length) == (4, 3)
    assert out.content == "let me add"
    assert out.reasoning == "think:"
    assert out.text == "think:let me add"
    assert out.finish_reason == "tool_calls"
    assert out.weight_version == 3
    assert out.tool_calls == [ToolCall("calculator", {"expression": "3+4"}, id="call_1")]


def test_model_output_from_completion_result() -> None:
    choice = {
        "index": 0,
        "text": "7",
        "finish_reason": "stop",
        "prompt_token_ids": [1, 4],
        "token_ids": [11, 2],
        "logprobs": {"token_logprobs": [-1.0, -0.5]},
    }
    client = _client()
    (engine_choice,) = client._adapter.completion_choices({"choices": [choice]}, 1, 1)
    result = client._completion_result("m372=", engine_choice, 5, {})
    out = model_output_from_result(result)
    assert (out.text, out.content, out.reasoning, out.tool_calls) == ("7", "7", "", [])
    assert (out.prompt_ids, out.completion_ids, out.logprobs) == ([1, 4], [11, 2], [-1.0, -0.5])
    assert (out.finish_reason, out.weight_version) == ("stop", 5)


def test_model_output_rejects_inconsistent_or_malformed_results() -> None:
    base = {"response": "x", "prompt_ids": [1], "response_ids": [5, 2], "logprobs": [-1.0, -2.0]}
    with pytest.raises(KeyError, match="response_ids"):
        model_output_from_result({k: v for k, v in base.items() if k != "response_ids"})
    with pytest.raises(ValueError, match="1 logprobs for 2 completion tokens"):
        model_output_from_result({**base, "logprobs": [-1.0]})
    bad_call = [{"id": "c9", "function": {"name": "calculator", "arguments": "{not json"}}]
    with pytest.raises(
        ValueError, match=r"tool_calls\[0\] \('calculator', id 'c9'\): arguments are not valid JSON"
    ):
        model_output_from_result({**base, "tool_calls": bad_call})


def _episode() -> Episode:
    output = ModelOutput(
        text="<calculator>3+4</calculator>",
        content="<calculator>3+4</calculator>",
        tool_calls=[ToolCall("calculator", {"expression": "3+4"}, id="c1")],
        prompt_ids=[1, 2, 3],
        completion_ids=[4, 5],
        logprobs=[-0.1, -0.2],
        finish_reason="stop",
        weight_version=7,
    )
    messages = [{"role": "user", "content": "3+4?"}]
    step1 = Step(
        chat_completions=messages,
        observation="3+4?",
        action=[ToolCall("calculator", {"expression": "3+4"}, id="c1")],
        model_response=output.text,
        model_output=output,
        info={"tool": "calculator"},
        reward=0.0,
        mc_return=0.5,
    )
    step2 = Step(
        chat_completions=[
            *messages,
            {"role": "assistant", "content": output.text},
            {"role": "tool", "content": "7"},
        ],
        observation="7",
        action="7",
        model_response="7",
        reward=1.0,
        done=True,
        mc_return=1.0,
    )
    traj = Trajectory(
        name="solver", task={"question": "3+4?", "answer": "7"}, steps=[step1, step2], reward=1.0
    )
    return Episode(
        id="task-1:0",
        task={"question": "3+4?", "answer": "7"},
        termination_reason=TerminationReason.ENV_DONE,
        is_correct=True,
        trajectories=[traj],
        metrics={"solver_acc": 1.0},
        info={"turns": 2},
    )


def test_episode_round_trips_through_json() -> None:
    episode = _episode()
    data = json.loads(json.dumps(episode.to_dict()))
    back = Episode.from_dict(data)
    assert back == episode
    assert back.termination_reason is TerminationReason.ENV_DONE
    step = back.trajectories[0].steps[0]
    assert step.action == [ToolCall("calculator", {"expression": "3+4"}, id="c1")]
    assert step.model_output is not None and step.model_output.completion_ids == [4, 5]
    assert back.to_dict() == episode.to_dict()


def test_step_and_trajectory_round_trip_each_action_kind() -> None:
    for action in ["text", ToolCall("python", {"code": "print(1)"}), {"k": [1, 2]}, None, []]:
        step = Step(action=action, reward=0.25, done=True)
        assert Step.from_dict(json.loads(json.dumps(step.to_dict()))) == step
    traj = _episode().trajectories[0]
    assert Trajectory.from_dict(traj.to_dict()) == traj


def test_trajectory_is_cumulative_only_when_prompts_extend() -> None:
    traj = _episode().trajectories[0]
    assert traj.is_cumulative()
    traj.steps[1].chat_completions = [{"role": "user", "content": "something else"}]
    assert not traj.is_cumulative()


def test_episode_from_dict_rejects_unknown_termination_reason() -> None:
    data = _episode().to_dict()
    data["termination_reason"] = "gave_up"
    with pytest.raises(ValueError, match="gave_up"):
        Episode.from_dict(data)
