"""Trajectory -> training sequence: ids from the (scripted) server, loss mask, logprobs, rewards, prefix check."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from nexrl_hpc.agents.agent import ToolAgent
from nexrl_hpc.agents.environments import ToolEnvironment
from nexrl_hpc.agents.rewards.types import RewardOutput
from nexrl_hpc.agents.sequence import (
    NonCumulativeTrajectoryError,
    step_token_ids,
    trajectory_to_sequence,
    trajectory_to_step_sequences,
)
from nexrl_hpc.agents.types import Episode, Step, Trajectory
from nexrl_hpc.agents.workflow import MultiTurnWorkflow
from tests.helpers.scripted_model import EOS, ScriptedModel, ids, logprob

TASK = {"question": "3+4?", "answer": "7"}
CALL = "<calculator>3+4</calculator>"


def exact_answer(task_info: dict[str, Any], action: Any) -> RewardOutput:
    correct = str(action).strip() == task_info["answer"]
    return RewardOutput(float(correct), {}, correct)


def episode(script: list[Any], eos_in_template: bool = True, gamma: float = 0.0) -> Episode:
    wf = MultiTurnWorkflow(
        ScriptedModel(script, eos_in_template=eos_in_template),
        agent_cls=ToolAgent,
        agent_args={"tools": ["calculator"]},
        env_cls=ToolEnvironment,
        env_args={"tools": ["calculator"], "reward_fn": exact_answer},
        gamma=gamma,
    )
    return asyncio.run(wf.run_with_termination_handling(TASK, "t0"))


def test_two_turn_tool_episode_exact_ids_mask_and_logprobs() -> None:
    ep = episode([CALL, "7"], gamma=0.5)
    seq = trajectory_to_sequence(ep.trajectories[0])
    prompt0 = "user: 3+4?\nassistant: "
    glue = "\nuser: <result>7</result>\nassistant: "  # after turn 1's EOS: template text + tool result
    assert seq.prompt_ids == ids(prompt0)
    assert seq.response_ids == ids(CALL) + [EOS] + ids(glue) + ids("7") + [EOS]
    n1, ng = len(CALL) + 1, len(glue)
    assert seq.loss_mask == [1] * n1 + [0] * ng + [1, 1]
    assert seq.logprobs == [logprob(t) for t in ids(CALL) + [EOS]] + [0.0] * ng + [logprob(55), logprob(EOS)]
    assert seq.step_spans == [(0, n1), (n1 + ng, n1 + ng + 2)]
    assert seq.step_rewards == [0.0, 1.0] and seq.step_returns == [0.5, 1.0] and seq.reward == 1.0
    assert seq.token_rewards == [0.0] * (n1 + ng + 1) + [1.0]
    assert (seq.finish_reason, seq.weight_version, seq.weight_versions) == ("stop", 0, [0, 0])
    # the sequence is exactly the context the server saw at the last turn plus its completion
    (p0, c0), (p1, c1) = step_token_ids(ep.trajectories[0])
    assert seq.prompt_ids + seq.response_ids == p1 + c1
    fields = seq.to_trajectory_fields()
    assert fields["behaviour_log_probs"] == seq.logprobs and fields["loss_mask"] == seq.loss_mask
    assert fields["step_spans"] == [[0, n1], [n1 + ng, n1 + ng + 2]]


def test_truncated_turn_gets_template_eos_as_environment_token() -> None:
    """A turn cut off without EOS: the EOS the template then adds was not generated, so it is masked."""
    model = ScriptedModel([(CALL, "length"), "7"])
    agent = ToolAgent(tools=["calculator"])
    env = ToolEnvironment(tools=["calculator"], reward_fn=exact_answer)

    async def drive() -> None:
        obs, info = env.reset(TASK)
        agent.update_from_env(obs, 0.0, False, info)
        for _ in range(2):
            out = await model.get_model_response(agent.chat_completions)
            obs, reward, done, info = env.step(agent.update_from_model(out).action)
            agent.update_from_env(obs, reward, done, info)

    asyncio.run(drive())
    traj = agent.trajectory
    seq = trajectory_to_sequence(traj)
    n1 = len(CALL)
    assert seq.response_ids[n1] == EOS and seq.loss_mask[n1] == 0 and seq.logprobs[n1] == 0.0
    assert seq.loss_mask[:n1] == [1] * n1 and seq.loss_mask[-2:] == [1, 1]


def test_template_that_drops_eos_is_not_cumulative() -> None:
    ep = episode([CALL, "7"], eos_in_template=False)
    with pytest.raises(
        NonCumulativeTrajectoryError, match=r"turn 1's prompt .* first difference at id position 50"
    ):
        trajectory_to_sequence(ep.trajectories[0])  # 22 prompt ids + 28 call ids, then EOS vs "\n"
    per_step = trajectory_to_step_sequences(ep.trajectories[0])
    assert [s.response_ids for s in per_step] == [ids(CALL) + [EOS], ids("7") + [EOS]]
    assert all(s.loss_mask == [1] * len(s.response_ids) for s in per_step)
    assert [s.reward for s in per_step] == [0.0, 1.0]
    assert per_step[1].prompt_ids == ep.trajectories[0].steps[1].model_output.prompt_ids


def test_bad_trajectories_are_named() -> None:
    with pytest.raises(ValueError, match="has no steps"):
        trajectory_to_sequence(Trajectory(name="solver"))
    with pytest.raises(ValueError, match="'solver' step 0 has no model_output"):
        trajectory_to_sequence(Trajectory(name="solver", steps=[Step(model_response="hi")]))
    ep = episode([CALL, "7"])
    ep.trajectories[0].steps[1].model_output.logprobs.pop()
    with pytest.raises(ValueError, match="step 1: 1 logprobs for 2 completion ids"):
        trajectory_to_sequence(ep.trajectories[0])


def test_sequence_survives_a_json_round_trip_of_the_episode() -> None:
    ep = episode(["<calculator>3+4", CALL, "7"])
    loaded = Episode.from_dict(ep.to_dict())
    a, b = trajectory_to_sequence(ep.trajectories[0]), trajectory_to_sequence(loaded.trajectories[0])
    assert a == b
    assert sum(a.loss_mask) == sum(len(s.model_output.completion_ids) for s in ep.trajectories[0].steps)


def test_masked_tokens_carry_no_gradient_in_the_ppo_loss() -> None:
    """The repo's ppo_clip_loss with this mask: changing anything at mask-0 positions changes nothing.

    (The full trainer path should show this too; that needs the pipeline integration.)
    """
    import torch

    from nexrl_hpc.algorithm.core_algos import ppo_clip_loss

    seq = trajectory_to_sequence(episode([CALL, "7"], gamma=1.0).trajectories[0])
    mask = torch.tensor([seq.loss_mask], dtype=torch.float32)
    old = torch.tensor([seq.logprobs])
    adv = torch.tensor([seq.token_rewards]).flip(-1).cumsum(-1).flip(-1)  # reward-to-go per token
    new = (old + 0.05).requires_grad_(True)

    def loss(new_lp: torch.Tensor, old_lp: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
        return ppo_clip_loss(new_lp, old_lp, advantages, mask, 0.2, 0.2, "token-mean")[0]

    base = loss(new, old, adv)
    base.backward()
    grad = new.grad[0]
    assert all(g == 0.0 for g, m in zip(grad.tolist(), seq.loss_mask) if not m)
    assert any(g != 0.0 for g, m in zip(grad.tolist(), seq.loss_mask) if m)
    off = 1.0 - mask  # perturb every masked position of every input
    with torch.no_grad():
        perturbed = loss(new + 3.0 * off, old - 2.0 * off, adv + 5.0 * off)
        on_model_tokens = loss(new + 3.0 * mask, old, adv)
    assert perturbed.item() == base.item()
    assert on_model_tokens.item() != base.item()
