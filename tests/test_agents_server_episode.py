"""A 2-turn ToolAgent/ToolEnvironment episode against the real local inference server (tiny model, CPU).

An untrained tiny model never writes a tool call, so the fixture first memorises one episode
(``<c>1+2</c>``, then ``3``) by a few seconds of supervised steps: the model, the server, the chat
template and the token ids are all real. The test checks the bookkeeping invariants on what the
server returned, and that re-scoring the single training sequence with the model gives the
server's behaviour logprobs on every loss-mask-1 token (the trainer sees the sampling context).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from nexrl_hpc.agents.agent import ToolAgent
from nexrl_hpc.agents.environments import ToolEnvironment
from nexrl_hpc.agents.rewards.types import RewardOutput
from nexrl_hpc.agents.rollout_engine import ClientRolloutEngine
from nexrl_hpc.agents.sequence import trajectory_to_sequence
from nexrl_hpc.agents.tools.calculator import CalculatorTool
from nexrl_hpc.agents.types import TerminationReason
from nexrl_hpc.agents.workflow import MultiTurnWorkflow
from nexrl_hpc.inference.client import LLMServiceClient
from nexrl_hpc.inference.local_server import LocalInferenceServer
from nexrl_hpc.models.tiny import build_tiny_model, load_model, load_tokenizer
from tests.conftest import compose_config

# assistant turns end with </s> (the EOS id): a completion that stopped on EOS is reproduced token
# for token, so each prompt extends the previous prompt + completion. Newlines are written as
# {{ '\\n' }}: transformers renders chat templates with trim_blocks (a newline after a tag is dropped)
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}</s>{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
TASK = {"question": "1+2?", "answer": "3"}
TOOLS = {"c": CalculatorTool}  # the calculator under a one-letter name


def exact_answer(task_info: dict[str, Any], action: Any) -> RewardOutput:
    correct = str(action).strip() == task_info["answer"]
    return RewardOutput(float(correct), {}, correct)


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    cfg = compose_config(["seed=5"])["model"]["tiny"]
    cfg = dict(
        cfg,
        max_position_embeddings=128,
        tokenizer=dict(cfg["tokenizer"], alphabet="abcdefghijklmnopqrstuvwxyz0123456789 :+?<>/\n"),
    )
    model, tok = build_tiny_model(cfg)
    tok.chat_template = CHAT_TEMPLATE
    turns = [
        ([{"role": "user", "content": "1+2?"}], "<c>1+2</c>"),
        (
            [
                {"role": "user", "content": "1+2?"},
                {"role": "assistant", "content": "<c>1+2</c>"},
                {"role": "user", "content": "<result>3</result>"},
            ],
            "3",
        ),
    ]
    rows = []
    for messages, target in turns:
        prompt = list(
            tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
        )
        answer = tok(target, add_special_tokens=False).input_ids + [tok.eos_token_id]
        rows.append((torch.tensor([prompt + answer]), len(prompt)))
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _step in range(400):
        opt.zero_grad()
        loss = torch.zeros(())
        correct = True
        for ids, n_prompt in rows:
            logits = model(ids).logits[0, n_prompt - 1 : -1]
            targets = ids[0, n_prompt:]
            loss = loss + torch.nn.functional.cross_entropy(logits, targets)
            correct &= bool((logits.argmax(-1) == targets).all())
        if correct and loss.item() < 0.05:
            break
        loss.backward()
        opt.step()
    assert correct, f"the tiny model did not memorise the episode in {_step} steps (loss {loss.item():.3f})"
    out = tmp_path_factory.mktemp("tool_model") / "model"
    model.eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def server(tool_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalInferenceServer]:
    cfg = compose_config()["service"]["inference_service"]["local"]
    srv = LocalInferenceServer(tool_model_dir, cfg, str(tmp_path_factory.mktemp("logs")), "policy")
    srv.start()
    yield srv
    srv.stop()


def test_two_turn_calculator_episode_on_the_real_server(
    server: LocalInferenceServer, tool_model_dir: str
) -> None:
    cfg = dict(
        compose_config()["service"]["inference_service"], base_url=server.base_url, api_key=server.api_key
    )
    client = LLMServiceClient(cfg)
    workflow = MultiTurnWorkflow(
        ClientRolloutEngine(client, temperature=0.0, max_tokens=16),
        agent=ToolAgent(tool_map=TOOLS),
        env=ToolEnvironment(tool_map=TOOLS, reward_fn=exact_answer),
        max_steps=3,
    )

    async def go() -> Any:
        try:
            return await workflow.run_with_termination_handling(TASK, "t0")
        finally:
            await client.aclose()

    episode = asyncio.run(go())
    assert episode.error is None, episode.error
    assert episode.termination_reason == TerminationReason.ENV_DONE
    (traj,) = episode.trajectories
    assert len(traj.steps) == 2 and episode.metrics["num_tool_calls"] == 1
    assert workflow.agent.trajectory.steps[1].chat_completions[-1] == {
        "role": "user",
        "content": "<result>3</result>",
    }  # the calculator ran

    tok = load_tokenizer(tool_model_dir)
    outputs = [s.model_output for s in traj.steps]
    for step, out in zip(traj.steps, outputs):
        assert out is not None and len(out.logprobs) == len(out.completion_ids) > 0
        assert tok.decode(out.completion_ids, skip_special_tokens=True) == step.model_response
        assert out.weight_version == 0
    # turn 2's prompt is what the server's template rendered: it extends turn 1's prompt + completion
    assert outputs[1].prompt_ids[: outputs[0].prompt_length + outputs[0].completion_length] == (
        outputs[0].prompt_ids + outputs[0].completion_ids
    )

    seq = trajectory_to_sequence(traj)
    n = len(seq.response_ids)
    assert len(seq.loss_mask) == len(seq.logprobs) == len(seq.token_rewards) == n
    assert seq.prompt_ids == outputs[0].prompt_ids
    assert seq.prompt_ids + seq.response_ids == outputs[1].prompt_ids + outputs[1].completion_ids
    trained = [t for t, m in zip(seq.response_ids, seq.loss_mask) if m]
    assert trained == outputs[0].completion_ids + outputs[1].completion_ids
    assert [lp for lp, m in zip(seq.logprobs, seq.loss_mask) if m] == outputs[0].logprobs + outputs[
        1
    ].logprobs
    assert all(lp == 0.0 for lp, m in zip(seq.logprobs, seq.loss_mask) if not m)
    masked_text = tok.decode([t for t, m in zip(seq.response_ids, seq.loss_mask) if not m])
    assert masked_text == "\nuser: <result>3</result>\nassistant: "  # only template + tool tokens are masked
    assert seq.step_rewards == [0.0, 1.0] and seq.reward == 1.0

    # the trainer's view: one forward pass over the sequence gives the behaviour logprobs
    model = load_model(tool_model_dir).eval()
    full = torch.tensor([seq.prompt_ids + seq.response_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(full).logits[0].float(), -1)
    p = len(seq.prompt_ids)
    rescored = [logp[p - 1 + i, t].item() for i, t in enumerate(seq.response_ids)]
    diffs = [abs(a - b) for a, b, m in zip(rescored, seq.logprobs, seq.loss_mask) if m]
    assert max(diffs) < 1e-4
