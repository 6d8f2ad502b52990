"""FrozenLake (task=frozenlake): maps, the environment's step semantics, the agent's parsing, the
data rows, the random-policy baseline and one episode through the real rollout worker.

Hand-made maps give exact expectations; generated maps are checked for the properties every map
must have (solvable, one start, one goal). The model in the worker test is a double that answers
with scripted moves through the task's real char tokenizer and chat template (the learning run is
test_frozenlake_run_plays_real_episodes below and bench/frozenlake.py).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from nexrl_hpc.agents.types import ModelOutput, TerminationReason
from nexrl_hpc.agents.workflow import MultiTurnWorkflow
from nexrl_hpc.models.tokenizer import build_char_tokenizer
from nexrl_hpc.rollout.agent import AgentRolloutWorker
from nexrl_hpc.tasks import frozenlake as fl
from tests.conftest import compose_config, run_train
from tests.helpers.scripted_model import ScriptedModel
from tests.test_agents_rollout_worker import ScriptedChatClient, Sink

# S at the top left, a hole right of it and one in the middle, the goal at the bottom right:
#   P O _        rendered: "PO_\n_O_\n__G\n"
#   _ O _
#   _ _ G
DESC = ["SHF", "FHF", "FFG"]


def env_for(desc: list[str] = DESC, max_steps: int = 6, **task: Any) -> tuple[fl.FrozenLakeEnv, str]:
    env = fl.FrozenLakeEnv(max_steps=max_steps)
    observation, info = env.reset({"desc": desc, **task})
    assert info == {"size": len(desc), "is_slippery": bool(task.get("is_slippery", False))}
    return env, observation


def test_render_shows_player_holes_goal_one_row_a_line() -> None:
    env, observation = env_for()
    assert observation == "PO_\n_O_\n__G\n"
    assert set(observation) <= set(fl.ALPHABET)  # what the char model can read


@pytest.mark.parametrize("size", [2, 3, 4, 6])
def test_generated_maps_are_solvable_with_one_start_and_goal_and_reproducible(size: int) -> None:
    for seed in range(60):
        desc = fl.generate_map(seed, size, 0.6)
        assert desc == fl.generate_map(seed, size, 0.6)  # the row's seed is the map
        assert len(desc) == size and all(len(row) == size and set(row) <= set("SFHG") for row in desc)
        text = "".join(desc)
        assert text.count("S") == 1 and text.count("G") == 1
        path = fl.shortest_path(desc)
        assert path and fl.plan_reward({"desc": desc}, path) == 1.0  # walking it reaches the goal
        # the path is shortest: no shorter walk of the same moves reaches the goal
        assert fl.plan_reward({"desc": desc}, path[:-1]) == 0.0
    assert fl.generate_map(1, 3, 1.0).count("H") == 0  # p=1: no holes
    assert len({tuple(fl.generate_map(s, 4, 0.8)) for s in range(50)}) == 50  # seeds give different maps


def test_bad_map_parameters_are_errors() -> None:
    with pytest.raises(ValueError, match="size >= 2"):
        fl.generate_map(0, 1, 0.8)
    with pytest.raises(ValueError, match="p must be"):
        fl.generate_map(0, 3, 0.0)
    with pytest.raises(KeyError, match="missing"):
        fl.FrozenLakeEnv(max_steps=3).reset({"seed": 1})
    with pytest.raises(ValueError, match="square rows"):
        fl.FrozenLakeEnv(max_steps=3).reset({"desc": ["SF", "FGH"]})
    with pytest.raises(ValueError, match="max_steps"):
        fl.FrozenLakeEnv(max_steps=0)


def test_walking_to_the_goal_rewards_one_and_ends() -> None:
    env, _ = env_for()
    observations, rewards, dones = [], [], []
    for move in "DDRR":
        observation, reward, done, info = env.step(move)
        observations.append(observation)
        rewards.append(reward)
        dones.append(done)
        assert info["action_is_valid"] and info["action_is_effective"]
    assert observations == ["_O_\nPO_\n__G\n", "_O_\n_O_\nP_G\n", "_O_\n_O_\n_PG\n", "_O_\n_O_\n__√\n"]
    assert rewards == [0.0, 0.0, 0.0, 1.0] and dones == [False, False, False, True]
    assert info == {
        "action_is_valid": True,
        "action_is_effective": True,
        "is_correct": True,
        "fell_in_hole": False,
        "steps": 4,
    }
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("L")


def test_a_hole_ends_the_episode_with_nothing() -> None:
    env, _ = env_for()
    observation, reward, done, info = env.step(3)  # Right, into the hole (ints are rLLM's action ids)
    assert observation == "_X_\n_O_\n__G\n"
    assert (reward, done, info["fell_in_hole"], info["is_correct"]) == (0.0, True, True, False)


def test_walls_and_invalid_actions_use_up_a_step_without_moving() -> None:
    env, start = env_for(max_steps=3)
    observation, reward, done, info = env.step("Up")  # a wall
    assert observation == start and (reward, done) == (0.0, False)
    assert info["action_is_valid"] and not info["action_is_effective"]
    observation, reward, done, info = env.step("jump")  # no action: the player stays
    assert observation == start and (reward, done) == (0.0, False)
    assert not info["action_is_valid"] and not info["action_is_effective"] and info["steps"] == 2
    observation, reward, done, info = env.step(0)  # rLLM's "None" action: invalid
    assert (reward, done, info["steps"], info["is_correct"]) == (0.0, True, 3, False)  # max_steps reached


def test_slippery_moves_go_sideways_two_thirds_of_the_time_and_replay_by_identity() -> None:
    open_map = ["FFF", "FSF", "FFG"]
    outcomes: Counter[str] = Counter()
    for i in range(900):
        env, _ = env_for(open_map, is_slippery=True, seed=7, group_id="g", sample_index=i)
        observation, *_ = env.step("U")
        outcomes[observation] += 1
    up, left, right = "_P_\n___\n__G\n", "___\nP__\n__G\n", "___\n__P\n__G\n"
    assert set(outcomes) == {up, left, right}  # never down: the opposite of the intended move
    assert all(250 <= outcomes[o] <= 350 for o in (up, left, right)), outcomes

    # the same task identity replays the same slips
    def walk(sample_index: int) -> list[str]:
        env, _ = env_for(
            open_map, max_steps=8, is_slippery=True, seed=7, group_id="g", sample_index=sample_index
        )
        seen = []
        for move in "ULDRULDR":
            if env.done:
                break
            seen.append(env.step(move)[0])
        return seen

    assert walk(5) == walk(5) == walk(5)
    assert len({tuple(walk(i)) for i in range(10)}) > 1  # the group's samples slip differently


@pytest.mark.parametrize(
    "text,action",
    [
        ("L", 1),
        ("D", 2),
        ("R", 3),
        ("U", 4),
        ("Left", 1),
        ("down", 2),
        (" RIGHT \n", 3),
        ("4", 4),
        ("```Up```", 4),
        ("I will go ```\nLeft\n```", 1),
        ("```python\nd\n```", 2),
        ("", 0),
        ("LR", 0),
        ("Move left", 0),
        ("5", 0),
        ("```Up``` then ```Sideways```", 0),
    ],
)
def test_agent_parses_letters_names_numbers_and_blocks(text: str, action: int) -> None:
    assert fl.parse_action(text) == action
    agent = fl.FrozenLakeAgent()
    agent.update_from_env("P_\n_G\n", 0.0, False, {})
    assert agent.update_from_model(text).action == action


def test_agent_keeps_the_history_and_reads_reasoning_models_answer_part() -> None:
    agent = fl.FrozenLakeAgent(system_prompt="rules", instruction="Reach G. ")
    agent.update_from_env("P_\n_G\n", 0.0, False, {})
    assert agent.update_from_model("R").action == 3
    agent.update_from_env("_P\n_G\n", 0.0, False, {"steps": 1})
    output = ModelOutput(text="think: go down```Down```", content="```Down```", reasoning="think: go down")
    action = agent.update_from_model(output)
    assert action.action == 2 and agent.trajectory.steps[-1].thought == "think: go down"
    assert [(m["role"], m["content"]) for m in agent.chat_completions] == [
        ("system", "rules"),
        ("user", "Reach G. P_\n_G\n"),  # the instruction only before the first grid
        ("assistant", "R"),
        ("user", "_P\n_G\n"),
        ("assistant", "```Down```"),
    ]
    with pytest.raises(TypeError, match="rendered grids"):
        fl.FrozenLakeAgent().update_from_env({"grid": 1}, 0.0, False, {})


def test_random_policy_success_by_hand_and_by_sampling() -> None:
    # 2x2, goal right of start: one move reaches it with probability 1/4; with two moves also after
    # a wall bump (Left or Up, 1/2) then Right (1/4); Down leads to (1,0), from where no move reaches G
    desc = ["SG", "FF"]
    assert fl.random_policy_success(desc, 1) == pytest.approx(0.25)
    assert fl.random_policy_success(desc, 2) == pytest.approx(0.25 + 0.5 * 0.25)
    assert fl.random_policy_success(["SH", "FG"], 2) == pytest.approx(0.25 * 0.25)  # Down, then Right
    for slippery in (False, True):
        desc = fl.generate_map(11, 4, 0.7)
        exact = fl.random_policy_success(desc, 6, slippery)
        rng, wins, n = random.Random(0), 0, 4000
        for i in range(n):
            env = fl.FrozenLakeEnv(max_steps=6)
            env.reset({"desc": desc, "is_slippery": slippery, "sample_index": i})
            done, reward = False, 0.0
            while not done:
                _, reward, done, _ = env.step(rng.randrange(1, 5))
            wins += int(reward)
        assert abs(wins / n - exact) < 0.03, (slippery, wins / n, exact)


def test_rows_hold_out_maps_and_rebuild_as_the_environment_plays_them() -> None:
    params = {"size": 3, "p": 0.8, "is_slippery": False, "max_steps": 4, "train_size": 300, "val_size": 40}
    splits = fl.generate_splits(params, seed=5)
    assert splits == fl.generate_splits(params, seed=5)
    assert len(splits["train"]) == 300 and len(splits["validation"]) == 40
    maps = {split: {tuple(fl.task_map(r)) for r in rows} for split, rows in splits.items()}
    assert len(maps["validation"]) == 40 and not maps["validation"] & maps["train"]  # held out
    for row in splits["validation"]:
        env = fl.FrozenLakeEnv(max_steps=4)
        assert env.reset(row)[0] == row["prompt"]  # the row's first grid is what the env shows
        assert fl.plan_reward(row, row["answer"]) == 1.0
        assert row["random_success"] == fl.random_policy_success(fl.task_map(row), 4)
        assert set(row) == {"prompt", "seed", "size", "p", "is_slippery", "answer", "random_success"}


def test_plan_reward_replays_the_moves() -> None:
    task = {"desc": DESC}
    assert fl.plan_reward(task, "DDRR") == 1.0
    assert fl.plan_reward(task, " DDRR\n") == 1.0
    assert fl.plan_reward(task, "DDRRL") == 1.0  # the goal ends the walk
    assert fl.plan_reward(task, "R") == 0.0  # a hole
    assert fl.plan_reward(task, "DDR") == 0.0  # short of the goal
    assert fl.plan_reward(task, "DDxRR") == 0.0  # not a move


def test_episodes_through_the_multi_turn_workflow() -> None:
    def workflow(moves: list[str], max_steps: int = 4) -> MultiTurnWorkflow:
        return MultiTurnWorkflow(
            ScriptedModel(moves),
            agent_cls=fl.FrozenLakeAgent,
            env_cls=fl.FrozenLakeEnv,
            env_args={"max_steps": max_steps},
            max_steps=max_steps,
        )

    task = {"desc": DESC}
    won = asyncio.run(workflow(["D", "D", "R", "R"]).run_with_termination_handling(task, "u"))
    assert won.termination_reason == TerminationReason.ENV_DONE and won.is_correct
    assert [s.reward for s in won.trajectories[0].steps] == [0.0, 0.0, 0.0, 1.0]
    assert won.metrics["reward"] == 1.0 and won.metrics["num_steps"] == 4
    fell = asyncio.run(workflow(["D", "R"]).run_with_termination_handling(task, "u"))
    assert fell.termination_reason == TerminationReason.ENV_DONE and not fell.is_correct
    assert fell.metrics["reward"] == 0.0 and fell.metrics["num_steps"] == 2
    lost = asyncio.run(workflow(["hm", "U", "L", "?"]).run_with_termination_handling(task, "u"))
    assert lost.termination_reason == TerminationReason.ENV_DONE  # the env's step budget ended it
    assert not lost.is_correct and lost.metrics["num_steps"] == 4
    assert [s.info["action_is_valid"] for s in lost.trajectories[0].steps] == [False, True, True, False]


def test_one_episode_through_the_rollout_worker_on_the_task_config() -> None:
    """The task config's worker, tokenizer and template: ids, loss mask, rewards, scores exactly."""
    cfg = compose_config(["task=frozenlake"])
    tok_cfg = cfg["model"]["tiny"]["tokenizer"]
    tokenizer = build_char_tokenizer(tok_cfg["alphabet"], tok_cfg["chat_template"])
    worker = AgentRolloutWorker(cfg)
    client = ScriptedChatClient(tokenizer, ["D", "D", "R", "R"])
    pool = Sink()
    worker.set_llm_client(client)
    worker._trajectory_pool, worker._validator = pool, Sink()
    task = {"desc": DESC, "prompt": "PO_\n_O_\n__G\n", "uid": "u0", "group_id": "g0"}
    assert asyncio.run(worker.step(task)) == "success"
    (traj,) = pool.items
    ids = lambda s: tokenizer(s, add_special_tokens=False).input_ids  # noqa: E731
    eos = tokenizer.eos_token_id
    grids = ["_O_\nPO_\n__G\n", "_O_\n_O_\nP_G\n", "_O_\n_O_\n_PG\n"]
    assert traj["prompt_ids"] == ids("PO_\n_O_\n__G\n")
    assert traj["response_ids"] == (
        ids("D")
        + [eos]
        + ids(grids[0])
        + ids("D")
        + [eos]
        + ids(grids[1])
        + ids("R")
        + [eos]
        + ids(grids[2])
        + ids("R")
        + [eos]
    )
    assert traj["loss_mask"] == ([1, 1] + [0] * 12) * 3 + [1, 1]  # moves train, grids do not
    assert traj["reward"] == 1.0 and traj["step_rewards"] == [0.0, 0.0, 0.0, 1.0]
    scores = traj["scores"]
    assert scores["is_correct"] == 1.0 and scores["num_turns"] == 4.0
    assert scores["termination/env_done"] == 1.0 and scores["context_mismatch"] == 0.0
    # per turn: a move and EOS at most (rollout_worker.max_response_length)
    assert [r["max_tokens"] for r in client.requests] == [2] * 4


class SpecialTokenClient(ScriptedChatClient):
    """The first completion is BOS then EOS, as a sampled run produced it: its text ("") drops the BOS."""

    async def agenerate(self, messages: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        out = await super().agenerate(messages, **kwargs)
        if len(self.requests) == 1:
            out["response_ids"] = [self.tokenizer.bos_token_id, self.tokenizer.eos_token_id]
            out["logprobs"] = [-5.0, -0.1]
        return out


def test_a_completion_the_next_prompt_does_not_reproduce_trains_the_exact_prefix() -> None:
    """A sampled special token is left out of the decoded text, so the next prompt (rendered from
    the text) does not extend the sampled ids: the run goes on, the prefix trains, it is counted."""
    cfg = compose_config(["task=frozenlake"])
    tok_cfg = cfg["model"]["tiny"]["tokenizer"]
    tokenizer = build_char_tokenizer(tok_cfg["alphabet"], tok_cfg["chat_template"])
    worker = AgentRolloutWorker(cfg)
    client = SpecialTokenClient(tokenizer, ["", "R"])  # an invalid turn, then onto the goal
    pool = Sink()
    worker.set_llm_client(client)
    worker._trajectory_pool, worker._validator = pool, Sink()
    task = {"desc": ["SGH", "FFF", "HFF"], "prompt": "PGO\n___\nO__\n", "uid": "u0", "group_id": "g0"}
    assert asyncio.run(worker.step(task)) == "success"
    (traj,) = pool.items
    assert traj["response_ids"] == [tokenizer.bos_token_id, tokenizer.eos_token_id]  # turn 0 only
    assert traj["loss_mask"] == [1, 1] and traj["behaviour_log_probs"] == [-5.0, -0.1]
    assert traj["scores"]["context_mismatch"] == 1.0
    assert traj["scores"]["num_turns"] == 2.0 and traj["scores"]["termination/env_done"] == 1.0
    assert traj["reward"] == 1.0 and traj["scores"]["is_correct"] == 1.0  # the episode's outcome


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_frozenlake_run_plays_real_episodes(tmp_path: Path) -> None:
    """``python -m launch.train task=frozenlake`` for 3 steps: every trained episode is replayed.

    Learning takes ~30 steps (several minutes on 2 cores: bench/frozenlake.py), more than CI can
    spend, so this run proves the episodes instead: each dumped sequence, decoded with the run's
    tokenizer, replays move by move through FrozenLakeEnv on its row's map: the grids between the
    moves are the environment's, the reward is what the walk earns, the turns stop where it ends.
    """
    import h5py
    from transformers import PreTrainedTokenizerFast

    run_dir = tmp_path / "fl"
    steps = 3
    proc = run_train(
        [
            "task=frozenlake",
            f"run_dir={run_dir}",
            "seed=1",
            f"train_worker.total_train_steps={steps}",
            f"validate.eval.validate_freq={steps}",
            "data.batch_size=8",
            "task.params.val_size=32",
            "logger.backend=[]",
            "logger.dump_rollouts=true",
        ],
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/reward_mean" in r] == [1, 2, 3]
    val = [r for r in rows if "val/reward" in r]
    assert [r["step"] for r in val] == [0, steps]
    for r in val:  # the reward is 1 exactly on the goal; 32 held-out maps, greedy
        assert r["val/reward"] == r["val/is_correct"] and r["val/num_samples"] == 32
    assert val[0]["val/termination/env_done"] == 1.0  # the warmed-up model writes a move + EOS each turn

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(run_dir / "base_model"))
    eos = tokenizer.eos_token_id
    train_rows = [json.loads(line) for line in (run_dir / "data" / "train.jsonl").read_text().splitlines()]
    first_moves: Counter[str] = Counter()
    replayed = 0
    for step in range(1, steps + 1):
        with h5py.File(run_dir / "rollouts" / f"step_{step}.h5") as f:
            uids = [u.decode() if isinstance(u, bytes) else str(u) for u in f["uid"][:]]
            assert sorted(Counter(uids).values()) == [8] * 8  # 8 maps x 8 samples
            for i, uid in enumerate(uids):
                row = train_rows[int(uid.split("-")[1])]
                env = fl.FrozenLakeEnv(max_steps=4)
                observation, _ = env.reset(row)
                width = f["input_ids"].shape[1] - f["responses"].shape[1]  # the (left-padded) prompt
                prompt = [
                    int(t) for t, a in zip(f["input_ids"][i][:width], f["attention_mask"][i][:width]) if a
                ]
                assert tokenizer.decode(prompt) == observation == row["prompt"], uid
                response, mask = list(f["responses"][i]), list(f["response_mask"][i])
                end = max(j for j, m in enumerate(mask) if m) + 1
                segments: list[tuple[int, list[int]]] = []  # (mask, ids) runs
                for token, m in zip(response[:end], mask[:end]):
                    if segments and segments[-1][0] == m:
                        segments[-1][1].append(int(token))
                    else:
                        segments.append((int(m), [int(token)]))
                total, done = 0.0, False
                for k, (m, ids) in enumerate(segments):
                    if m == 0:  # what the model was shown after its move: the environment's grid
                        assert tokenizer.decode(ids) == observation, (uid, k)
                        continue
                    assert not done, (uid, "a move after the episode ended")
                    if set(ids) & (set(tokenizer.all_special_ids) - {eos}):
                        break  # a sampled special token: the sequence is the exact prefix (context_mismatch)
                    text = tokenizer.decode(ids, skip_special_tokens=True)
                    if k == 0:
                        first_moves[text] += 1
                    if ids[-1] != eos:  # cut at max_response_length: the episode ends, reward 0
                        done = True
                        continue
                    observation, reward, done, _ = env.step(text)
                    total += reward
                else:
                    assert done, (uid, "the episode stopped before the environment ended it")
                    assert float(f["rewards"][i]) == total, (uid, segments)
                    replayed += 1
    assert replayed >= 180  # of 192 (a few may end on a sampled special token)
    # the warm-up left the move at chance: every move is sampled first about a quarter of the time
    assert all(first_moves[c] >= 25 for c in fl.LETTERS), first_moves
