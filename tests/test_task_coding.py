"""The coding task (task=coding): problems and their tests, and attempts scored through the REAL path.

A right program scores 1 and a wrong one 0 through the task config's rollout worker, CodeAgent,
CodeEnvironment, the guarded reward and ``code_reward_fn`` in the real sandbox: only the model
is a double (scripted completions through the task's char tokenizer and chat template).
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from nexrl_hpc.agents.coding import CodeAgent, CodeEnvironment, failure_feedback
from nexrl_hpc.agents.rewards.code import code_reward_fn
from nexrl_hpc.models.tokenizer import build_char_tokenizer
from nexrl_hpc.rollout.agent import AgentRolloutWorker
from nexrl_hpc.tasks import coding
from tests.conftest import compose_config, run_train
from tests.test_agents_rollout_worker import ScriptedChatClient, Sink

TASK = {
    "prompt": "Read an integer n. Print n*3.\n",
    "tests": [{"input": "7\n", "output": "21\n"}, {"input": "-2\n", "output": "-6\n"}],
    "answer": "print(int(input())*3)",
    "uid": "u0",
    "group_id": "g0",
}


def run_worker(
    completions: list[str], task: dict[str, Any] = TASK
) -> tuple[dict[str, Any], ScriptedChatClient]:
    cfg = compose_config(["task=coding"])
    tok_cfg = cfg["model"]["tiny"]["tokenizer"]
    tokenizer = build_char_tokenizer(tok_cfg["alphabet"], tok_cfg["chat_template"])
    worker = AgentRolloutWorker(cfg)
    client = ScriptedChatClient(tokenizer, completions)
    pool = Sink()
    worker.set_llm_client(client)
    worker._trajectory_pool, worker._validator = pool, Sink()
    assert asyncio.run(worker.step(dict(task))) == "success"
    (traj,) = pool.items
    return traj, client


def test_a_right_program_scores_one_in_one_turn() -> None:
    traj, client = run_worker(["print(int(input())*3)"])
    assert traj["reward"] == 1.0 and traj["step_rewards"] == [1.0]
    assert traj["scores"]["is_correct"] == 1.0 and traj["scores"]["num_turns"] == 1.0
    assert traj["scores"]["termination/env_done"] == 1.0 and traj["scores"]["reward/errors"] == 0.0
    assert len(client.requests) == 1


def test_a_wrong_program_scores_zero_and_the_model_sees_why_then_fixes_it() -> None:
    traj, client = run_worker(["print(int(input())*2)", "print(int(input())*3)"])
    assert traj["step_rewards"] == [0.0, 1.0] and traj["reward"] == 1.0
    assert traj["scores"]["is_correct"] == 1.0 and traj["scores"]["num_turns"] == 2.0
    feedback = client.requests[1]["messages"][-1]
    assert feedback["role"] == "user"
    assert feedback["content"] == "test 1 of 2 failed: wrong output: expected '21\\n', got '14\\n'\n"


def test_two_wrong_programs_score_zero_within_max_turns() -> None:
    traj, client = run_worker(["print(int(input())*3", "print(n*3)"])
    assert traj["step_rewards"] == [0.0, 0.0] and traj["reward"] == 0.0
    assert traj["scores"]["is_correct"] == 0.0 and traj["scores"]["num_turns"] == 2.0
    assert traj["scores"]["termination/env_done"] == 1.0  # the environment's max_turns ended it
    assert "SyntaxError" in client.requests[1]["messages"][-1]["content"]
    # the model's programs train, the problem and the feedback do not
    mask, response = traj["loss_mask"], traj["response_ids"]
    first = len("print(int(input())*3") + 1  # the program and EOS
    assert sum(mask) == first + len("print(n*3)") + 1
    assert mask[:first] == [1] * first and mask[first] == 0
    assert len(response) > sum(mask)


def test_a_program_that_passes_some_tests_is_still_wrong() -> None:
    traj, client = run_worker(["print(21)", "print(int(input())*3)"])
    assert traj["step_rewards"] == [0.0, 1.0]
    assert client.requests[1]["messages"][-1]["content"].startswith("test 2 of 2 failed: wrong output")


def test_environment_and_agent_directly() -> None:
    env = CodeEnvironment(reward_fn=code_reward_fn, max_turns=3, max_feedback_chars=40)
    agent = CodeAgent(instruction="Answer with Python.\n", feedback_suffix="Fix it.\n")
    observation, _ = env.reset(dict(TASK))
    agent.update_from_env(observation, 0.0, False, {})
    assert agent.chat_completions == [{"role": "user", "content": TASK["prompt"] + "Answer with Python.\n"}]
    action = agent.update_from_model("```python\nprint(undefined_name_that_is_long)\n```").action
    observation, reward, done, info = env.step(action)
    assert (reward, done, info["is_correct"], info["attempt"]) == (0.0, False, False, 1)
    assert info["reward_metadata"]["status"] == "error" and "NameError" in info["reward_metadata"]["error"]
    assert observation["attempt"] == 1 and len(observation["feedback"]) == 40  # cut
    assert observation["feedback"].endswith("...")
    agent.update_from_env(observation, reward, done, info)
    assert agent.chat_completions[-1]["content"] == observation["feedback"] + "\nFix it.\n"
    observation, reward, done, info = env.step("```python\nprint(int(input())*3)\n```")  # a fenced block
    assert (observation, reward, done, info["is_correct"]) == ({}, 1.0, True, True)
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("print(1)")
    with pytest.raises(KeyError, match="tests"):
        env.reset({"prompt": "no tests"})
    with pytest.raises(ValueError, match="needs a reward_fn"):
        CodeEnvironment(max_turns=1)


def test_failure_feedback_lines() -> None:
    meta = {"passed": 1, "total": 3, "failed_test": 1, "status": "error", "error": "exited with code 1: E\nx"}
    assert failure_feedback(meta) == "test 2 of 3 failed: exited with code 1: E x"  # one line
    assert failure_feedback({"error": "no code in the response"}) == "no code in the response"
    assert failure_feedback({"reward/errors": 1.0, "reward/timeouts": 0.0}) == "the tests could not be run"
    assert failure_feedback(meta, max_chars=10) == "test 2 ..."


def test_problem_rows_tests_are_right_for_the_reference_solution() -> None:
    """Every family's expected outputs, checked by running its solution in the sandbox."""
    params = compose_config(["task=coding"])["task"]["params"]
    splits = coding.generate_splits(params, seed=1)
    assert splits == coding.generate_splits(params, seed=1)
    rows = {row["family"]: row for row in splits["train"]}
    assert set(rows) == set(coding.FAMILIES)  # every family trains
    for row in rows.values():
        assert len(row["tests"]) == params["num_tests"] == len({t["input"] for t in row["tests"]})
        assert code_reward_fn(row, row["answer"]).reward == 1.0, row
    train = {(r["family"], r["k"]) for r in splits["train"]}
    held_out = {(r["family"], r["k"]) for r in splits["validation"]}
    assert len(held_out) == 4 * params["val_per_family"] and not held_out & train
    assert len(splits["validation"]) == len(held_out) * params["val_repeats"]
    alphabet = set(compose_config(["task=coding"])["task"]["alphabet"])
    for row in splits["train"] + splits["validation"]:
        assert set(row["prompt"] + row["answer"]) <= alphabet


def test_bad_split_parameters_are_errors() -> None:
    with pytest.raises(ValueError, match="val_per_family"):
        coding.split_problems({"ks": [2, 3], "val_per_family": 2}, 0)


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_coding_run_scores_real_programs_in_the_sandbox(tmp_path: Path) -> None:
    """``python -m launch.train task=coding`` for 2 steps: rollouts through the real server, agent,
    environment and sandbox, rewards recorded, training steps taken. Every dumped episode is
    checked against the sandbox again: each program is re-scored with ``code_reward_fn``, the
    feedback the model saw is that verdict, the reward is 1 exactly when the last program passed.
    (The warmed-up tiny model writes some right programs, mostly for training problems; learning
    to solve held-out ones is not claimed.)
    """
    import h5py
    from transformers import PreTrainedTokenizerFast

    run_dir = tmp_path / "code"
    steps = 2
    proc = run_train(
        [
            "task=coding",
            f"run_dir={run_dir}",
            "seed=1",
            f"train_worker.total_train_steps={steps}",
            f"validate.eval.validate_freq={steps}",
            "validate.validate_before_train=false",
            "data.batch_size=4",
            "task.params.val_repeats=1",
            "logger.backend=[]",
            "logger.dump_rollouts=true",
        ],
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/reward_mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert all(r["actor/optimizer_steps"] >= 1 for r in train)  # the trainer stepped on them
    assert all(r["reward/errors"] == 0 and r["reward/timeouts"] == 0 for r in train)  # every attempt ran
    val = [r for r in rows if "val/reward" in r]
    assert [r["step"] for r in val] == [steps] and all(r["val/num_samples"] == 8 for r in val)
    assert all(r["val/reward"] == r["val/is_correct"] for r in val)

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(run_dir / "base_model"))
    eos = tokenizer.eos_token_id
    train_rows = [json.loads(line) for line in (run_dir / "data" / "train.jsonl").read_text().splitlines()]
    episodes = []  # (uid, row, programs, feedback lines, the program ended with EOS, dumped reward)
    for step in range(1, steps + 1):
        with h5py.File(run_dir / "rollouts" / f"step_{step}.h5") as f:
            for i, raw_uid in enumerate(f["uid"][:]):
                uid = raw_uid.decode() if isinstance(raw_uid, bytes) else str(raw_uid)
                response, mask = list(f["responses"][i]), list(f["response_mask"][i])
                end = max(j for j, m in enumerate(mask) if m) + 1
                segments: list[tuple[int, list[int]]] = []
                for token, m in zip(response[:end], mask[:end]):
                    if segments and segments[-1][0] == m:
                        segments[-1][1].append(int(token))
                    else:
                        segments.append((int(m), [int(token)]))
                programs = [ids for m, ids in segments if m == 1]
                if any(set(ids) & (set(tokenizer.all_special_ids) - {eos}) for ids in programs):
                    continue  # a sampled special token: the exact prefix trained (context_mismatch)
                episodes.append(
                    (
                        uid,
                        train_rows[int(uid.split("-")[1])],
                        [tokenizer.decode(ids, skip_special_tokens=True) for ids in programs],
                        [tokenizer.decode(ids) for m, ids in segments if m == 0],
                        programs[-1][-1] == eos,
                        float(f["rewards"][i]),
                    )
                )
    attempts = {(uid, program): row for uid, row, programs, *_ in episodes for program in programs}
    with ThreadPoolExecutor(4) as pool:  # each verdict is a sandbox process (or a few)
        verdicts = dict(zip(attempts, pool.map(lambda a: code_reward_fn(attempts[a], a[1]), attempts)))
    rewards: list[float] = []
    retried = 0
    for uid, _, programs, feedback, stopped, reward in episodes:
        assert len(programs) <= 2 and len(feedback) == len(programs) - 1
        for program, shown in zip(programs, feedback):  # a retry follows a failed attempt ...
            verdict = verdicts[(uid, program)]
            assert verdict.reward == 0.0
            assert shown == failure_feedback(verdict.metadata, 120) + "\n"  # ... and shows why
        # the sandbox's verdict on the last program, unless it was cut at max_response_length
        assert reward == (verdicts[(uid, programs[-1])].reward if stopped else 0.0), (uid, programs)
        rewards.append(reward)
        retried += len(programs) == 2
    assert len(rewards) >= 28  # of 32 episodes
    assert 1.0 in rewards and 0.0 in rewards and retried > 0  # both outcomes, and the feedback path
