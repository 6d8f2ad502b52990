"""From an agent trajectory to what the trainer consumes: token ids, loss mask, behaviour logprobs, rewards.

Every id comes from the server (``ModelOutput.prompt_ids`` / ``completion_ids``); nothing is
re-tokenised. A multi-turn trajectory trains as ONE sequence when it is cumulative at the token
level: turn k+1's prompt ids start with turn k's prompt ids + completion ids. Then

    prompt_ids   = turn 0's prompt
    response_ids = c_0 + e_1 + c_1 + e_2 + ... + c_{n-1}

where ``c_k`` are turn k's completion ids (model tokens: loss mask 1, the server's logprobs) and
``e_k`` are the tokens turn k's prompt adds after turn k-1's completion (chat-template glue, tool
results, environment text: loss mask 0, logprob 0). Because the trainer re-scores this exact
sequence, every model token is conditioned on exactly the context the server sampled it from.

When a server's turn k+1 prompt does not extend turn k's prompt + completion (a chat template that
drops the EOS token or reasoning text, a truncated history, re-tokenised text), one sequence would
train on contexts the model never saw; ``trajectory_to_sequence`` raises
``NonCumulativeTrajectoryError`` naming the turn and the first differing position, and
``trajectory_to_step_sequences`` gives one sequence per turn instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nexrl_hpc.agents.types import Step, Trajectory


class NonCumulativeTrajectoryError(ValueError):
    """Turn k+1's prompt ids do not start with turn k's prompt + completion ids."""


@dataclass
class TrainingSequence:
    """One training sequence; all per-token lists are aligned with ``response_ids``.

    ``step_spans[k] = (start, end)``: turn k's completion is ``response_ids[start:end]``.
    ``step_rewards`` / ``step_returns`` are per turn (Step.reward / Step.mc_return);
    ``token_rewards`` puts each turn's reward on its last completion token (0 elsewhere), the
    usual shape for per-token returns. ``weight_version`` is the oldest version any turn was
    sampled with (what staleness is measured against); ``weight_versions`` has all of them.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    step_spans: list[tuple[int, int]] = field(default_factory=list)
    step_rewards: list[float] = field(default_factory=list)
    step_returns: list[float] = field(default_factory=list)
    token_rewards: list[float] = field(default_factory=list)
    reward: float = 0.0
    finish_reason: str | None = None
    weight_version: int | None = None
    weight_versions: list[int | None] = field(default_factory=list)

    def to_trajectory_fields(self) -> dict[str, Any]:
        """The keys a rollout worker's trajectory dict carries (``BaseRolloutWorker.make_trajectory``'s names)."""
        return {
            "prompt_ids": list(self.prompt_ids),
            "response_ids": list(self.response_ids),
            "loss_mask": list(self.loss_mask),
            "behaviour_log_probs": list(self.logprobs),
            "finish_reason": self.finish_reason,
            "weight_version": self.weight_version,
            "reward": self.reward,
            "step_rewards": list(self.step_rewards),
            "step_returns": list(self.step_returns),
            "token_rewards": list(self.token_rewards),
            "step_spans": [list(s) for s in self.step_spans],
        }


def step_token_ids(trajectory: Trajectory) -> list[tuple[list[int], list[int]]]:
    """Per turn, (prompt ids, completion ids) exactly as the server returned them."""
    out = []
    for k, step in enumerate(trajectory.steps):
        output = step.model_output
        if output is None:
            raise ValueError(
                f"trajectory {trajectory.name!r} step {k} has no model_output: it was not produced "
                "through a rollout engine, so it has no token ids to train on"
            )
        if len(output.logprobs) != len(output.completion_ids):
            raise ValueError(
                f"trajectory {trajectory.name!r} step {k}: {len(output.logprobs)} logprobs for "
                f"{len(output.completion_ids)} completion ids"
            )
        out.append((list(output.prompt_ids), list(output.completion_ids)))
    return out


def _first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def _oldest(versions: list[int | None]) -> int | None:
    known = [v for v in versions if v is not None]
    return min(known) if known else None


def cumulative_turns(trajectory: Trajectory) -> int:
    """How many leading turns train as one sequence: each prompt among them extends the previous
    turn's prompt + completion (all of them when the trajectory is cumulative)."""
    context: list[int] | None = None
    for k, (prompt, completion) in enumerate(step_token_ids(trajectory)):
        if context is not None and prompt[: len(context)] != context:
            return k
        context = list(prompt) + list(completion)
    return len(trajectory.steps)


def trajectory_to_sequence(trajectory: Trajectory) -> TrainingSequence:
    """The whole trajectory as one sequence (see the module docstring); raises if it is not cumulative."""
    ids = step_token_ids(trajectory)
    if not ids:
        raise ValueError(f"trajectory {trajectory.name!r} has no steps")
    prompt0 = ids[0][0]
    response: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    spans: list[tuple[int, int]] = []
    context = list(prompt0)  # what the server has seen + generated so far
    for k, (step, (prompt, completion)) in enumerate(zip(trajectory.steps, ids)):
        if k > 0:
            if prompt[: len(context)] != context:
                at = _first_difference(prompt, context)
                raise NonCumulativeTrajectoryError(
                    f"trajectory {trajectory.name!r}: turn {k}'s prompt ({len(prompt)} ids) does not extend "
                    f"turn {k - 1}'s prompt + completion ({len(context)} ids); first difference at id "
                    f"position {at}: prompt has {prompt[at : at + 8]}, previous context has "
                    f"{context[at : at + 8]}. The chat template does not reproduce the model's "
                    "completion (e.g. drops EOS or reasoning); train per step with "
                    "trajectory_to_step_sequences, or render prompts that keep the completion verbatim"
                )
            glue = prompt[len(context) :]
            response += glue
            mask += [0] * len(glue)
            logprobs += [0.0] * len(glue)
            context = list(prompt)
        start = len(response)
        response += completion
        mask += [1] * len(completion)
        logprobs += [float(x) for x in step.model_output.logprobs]  # type: ignore[union-attr]
        spans.append((start, len(response)))
        context += completion
    return _with_rewards(trajectory, prompt0, response, mask, logprobs, spans)


def _with_rewards(
    trajectory: Trajectory,
    prompt: list[int],
    response: list[int],
    mask: list[int],
    logprobs: list[float],
    spans: list[tuple[int, int]],
) -> TrainingSequence:
    steps: list[Step] = trajectory.steps
    token_rewards = [0.0] * len(response)
    for (start, end), step in zip(spans, steps):
        if end > start:
            token_rewards[end - 1] += float(step.reward)
    versions = [s.model_output.weight_version for s in steps]  # type: ignore[union-attr]
    return TrainingSequence(
        prompt_ids=list(prompt),
        response_ids=response,
        loss_mask=mask,
        logprobs=logprobs,
        step_spans=spans,
        step_rewards=[float(s.reward) for s in steps],
        step_returns=[float(s.mc_return) for s in steps],
        token_rewards=token_rewards,
        reward=float(trajectory.reward),
        finish_reason=steps[-1].model_output.finish_reason,  # type: ignore[union-attr]
        weight_version=_oldest(versions),
        weight_versions=versions,
    )


def trajectory_to_step_sequences(trajectory: Trajectory) -> list[TrainingSequence]:
    """One sequence per turn (prompt = that turn's prompt, response = its completion, all mask 1).

    For trajectories that are not cumulative; each sequence's reward is its step's mc_return.
    """
    out = []
    for k, (prompt, completion) in enumerate(step_token_ids(trajectory)):
        step = trajectory.steps[k]
        single = Trajectory(name=trajectory.name, task=trajectory.task, steps=[step], reward=step.mc_return)
        out.append(
            _with_rewards(
                single,
                prompt,
                completion,
                [1] * len(completion),
                [float(x) for x in step.model_output.logprobs],  # type: ignore[union-attr]
                [(0, len(completion))],
            )
        )
    return out
