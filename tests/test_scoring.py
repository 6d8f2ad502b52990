"""Model rewards behind the one reward API: the judge's score parser on real-looking answers, a tiny
sequence classifier built offline (batched scores equal one-at-a-time ones), an LLM judge served
by the local engine server (its score through the reward runner; its server killed: counted
errors, never a raise), and the ``reward_model`` config checks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from nexrl_hpc.config.validate import ConfigError
from nexrl_hpc.inference.local_server import LocalInferenceServer
from nexrl_hpc.rewards.combined import RewardSet
from nexrl_hpc.rewards.loader import SKIPPED
from nexrl_hpc.rewards.runner import ERRORS, TIMEOUTS, RewardRunner
from nexrl_hpc.scoring.checks import reward_model_problems
from nexrl_hpc.scoring.classifier import ClassifierScorer, pair_text
from nexrl_hpc.scoring.judge import JUDGE_ERRORS, JUDGE_PARSE_ERRORS, JudgeScorer
from nexrl_hpc.scoring.judge_parse import JudgeParseError, parse_judge_score
from nexrl_hpc.scoring.reward import run_reward
from tests.conftest import compose_config
from tests.helpers.reward_models import JUDGE_ANSWER, RUBRIC, build_judge_dir

# --- the parser --------------------------------------------------------------------------------

PARSED = [
    ("Score: 7/10", 10.0, 0.7),
    ("**Rating:** 4", 5.0, 0.8),
    ('{"score": 0.8}', 1.0, 0.8),
    ('```json\n{"reasoning": "mostly right", "score": 8}\n```', 10.0, 0.8),
    ("The answer adds the digits correctly but skips a step.\n\nFinal score: 6 out of 10", 10.0, 0.6),
    ("Rating: [[9]]", 10.0, 0.9),
    ("Step 1 looks fine (score 2/5 on style).\nOverall, Score: 9/10", 10.0, 0.9),
    ("score=0", 10.0, 0.0),
    ("Score - 5", 10.0, 0.5),
    ("Grade: 10/10 - perfect", 1.0, 1.0),
    ('{"score": "3/4"}', 10.0, 0.75),
]

UNPARSEABLE = [
    "I'm sorry, but I can't help with grading this response.",
    "As an AI language model, I cannot evaluate this.",
    "",
    "m=3=7m==",
    "Score: 12/10",
    "Rating: -3",
    '{"score": "high"}',
]


@pytest.mark.parametrize(("text", "score_max", "expected"), PARSED)
def test_judge_answers_parse_to_their_score(text: str, score_max: float, expected: float) -> None:
    assert parse_judge_score(text, score_max) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("text", UNPARSEABLE)
def test_refusals_garbage_and_out_of_range_scores_are_parse_errors(text: str) -> None:
    with pytest.raises(JudgeParseError):
        parse_judge_score(text, 10.0)


# --- the classifier ----------------------------------------------------------------------------


@pytest.fixture
def classifier_dir(classifier_model_dir: str) -> str:
    return classifier_model_dir


def classifier_config(path: str, *more: str) -> dict[str, Any]:
    return compose_config(["reward_model.type=classifier", f"reward_model.classifier.path={path}", *more])


PAIRS = [("m=372=", "7m"), ("m=105=", "5"), ("m=999=", "99m=="), ("m=4=", "")]


def test_classifier_batches_score_as_one_pair_at_a_time(classifier_dir: str) -> None:
    """Padding changes no score: a batch of mixed lengths gives each pair's own logit, the one the
    model gives the chat-templated pair alone."""
    cfg = classifier_config(classifier_dir, "reward_model.classifier.micro_batch_size=3")
    scorer = ClassifierScorer(cfg["reward_model"]["classifier"])
    prompts, responses = [p for p, _ in PAIRS], [r for _, r in PAIRS]
    batched = [s["reward"] for s in scorer.score_batch(prompts, responses, [None] * len(PAIRS))]
    tokenizer = AutoTokenizer.from_pretrained(classifier_dir)
    model = AutoModelForSequenceClassification.from_pretrained(classifier_dir).eval()
    alone = []
    for prompt, response in PAIRS:
        text = pair_text(tokenizer, prompt, response, chat=True)
        assert text.startswith("<|im_start|>user\n" + prompt) and response + "<|im_end|>" in text
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            alone.append(model(**ids).logits[0, 0].item())
    assert batched == pytest.approx(alone, abs=1e-5)
    assert len({round(s, 3) for s in alone}) == len(alone)  # the pairs score differently


def test_classifier_reward_through_the_reward_runner(classifier_dir: str) -> None:
    """run_reward's replace: the classifier's logit is the reward; add: the task reward plus weight x it."""
    scorer = ClassifierScorer(classifier_config(classifier_dir)["reward_model"]["classifier"])
    expected = [
        s["reward"] for s in scorer.score_batch([p for p, _ in PAIRS], [r for _, r in PAIRS], [None] * 4)
    ]
    tasks = [{"prompt": p, "answer": "7"} for p, _ in PAIRS]
    reward, model = run_reward(classifier_config(classifier_dir))  # type: ignore[arg-type]
    assert model is not None and reward.batched
    runner = RewardRunner(reward, timeout_s=30, num_threads=2)
    try:
        scores = [f.result() for f in runner.submit_many([(t, r) for t, (_, r) in zip(tasks, PAIRS)])]
    finally:
        runner.close()
    assert [s["reward"] for s in scores] == pytest.approx(expected, abs=1e-6)
    assert all((s[ERRORS], s[TIMEOUTS], s[SKIPPED]) == (0, 0, 0) for s in scores)

    added, _ = run_reward(
        classifier_config(classifier_dir, "reward_model.combine=add", "reward_model.weight=0.5")
    )  # type: ignore[arg-type]
    assert isinstance(added, RewardSet) and added.names == ("prefix_match", "reward_model")
    outcomes = added.score_batch(tasks, [r for _, r in PAIRS])
    task_reward = [1.0, 0.0, 0.0, 0.0]  # prefix_match: the response starts with the answer "7"
    assert [o["reward"] for o in outcomes] == pytest.approx(  # type: ignore[index]
        [t + 0.5 * e for t, e in zip(task_reward, expected)], abs=1e-6
    )


def refused_keys(*overrides: str) -> list[str]:
    """The keys the config checks name (pre-flight: exit 2) for ``overrides``."""
    with pytest.raises(ConfigError) as refused:
        compose_config(list(overrides))
    return sorted(p.path for p in refused.value.problems)


def test_reward_model_config_problems_name_the_key(tmp_path: Path, classifier_dir: str) -> None:
    assert refused_keys("reward_model.type=classifier") == ["reward_model.classifier.path"]
    with pytest.raises(ConfigError, match="no config.json"):
        compose_config(["reward_model.type=classifier", f"reward_model.classifier.path={tmp_path}"])
    with pytest.raises(ConfigError, match="reward_model.classifier.label_index"):
        ClassifierScorer(
            classifier_config(classifier_dir, "reward_model.classifier.label_index=3")["reward_model"][
                "classifier"
            ]
        )
    assert refused_keys(
        "reward_model.type=judge", "reward_model.judge.prompt_template='Rate {prompt} {score}'"
    ) == [
        "reward_model.judge.base_url",
        "reward_model.judge.prompt_template",
    ]
    assert refused_keys(
        "reward_model.type=judge",
        "reward_model.placement=own_ranks",
        f"reward_model.judge.model_path={tmp_path}",
    ) == ["reward_model.judge.model_path"]
    judge_elsewhere = ["reward_model.type=judge", "reward_model.judge.base_url=http://127.0.0.1:1"]
    assert "reward_model.type" in refused_keys(*judge_elsewhere, "rollout_worker.type=agent")
    assert reward_model_problems(compose_config(judge_elsewhere)) == []


# --- the judge ---------------------------------------------------------------------------------


@pytest.fixture
def judge_dir(judge_model_dir: str) -> str:
    return judge_model_dir


def serve(model_dir: str, log_dir: Path, name: str = "judge") -> LocalInferenceServer:
    cfg = compose_config()["service"]["inference_service"]["local"]
    server = LocalInferenceServer(model_dir, cfg, str(log_dir), name)
    server.start()
    return server


@pytest.fixture
def judge_server(judge_dir: str, tmp_path: Path) -> Iterator[LocalInferenceServer]:
    server = serve(judge_dir, tmp_path)
    yield server
    server.stop()


def judge_config(base_url: str, *more: str) -> dict[str, Any]:
    return compose_config(
        [
            "reward_model.type=judge",
            f"reward_model.judge.base_url={base_url}",
            f'reward_model.judge.prompt_template="{RUBRIC}"',
            "reward_model.judge.request_timeout_s=20",
            "reward_model.judge.max_retries=0",
            *more,
        ]
    )


def test_judge_scores_through_the_reward_runner_and_a_killed_server_is_counted(
    judge_server: LocalInferenceServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The served judge answers JUDGE_ANSWER (7/10): every sample scores 0.7. Its server killed, the
    next samples are skipped and counted as judge errors: no raise, no reward error."""
    assert judge_server.base_url is not None
    monkeypatch.setenv("NEXRL_JUDGE_API_KEY", judge_server.api_key)
    reward, model = run_reward(judge_config(judge_server.base_url))  # type: ignore[arg-type]
    assert model is not None and model.__name__ == "judge"
    scorer = model._scorer
    assert isinstance(scorer, JudgeScorer)
    assert scorer.judge_text("m=372=", "7", None) == JUDGE_ANSWER
    runner = RewardRunner(reward, timeout_s=60, num_threads=2)
    pairs = [({"prompt": p, "answer": p[2]}, r) for p, r in PAIRS]
    try:
        before = [f.result() for f in runner.submit_many(pairs)]
        judge_server.kill()
        after = [f.result() for f in runner.submit_many(pairs)]
    finally:
        runner.close()
    assert [s["reward"] for s in before] == pytest.approx([0.7] * 4)
    assert all(
        (s[SKIPPED], s[JUDGE_ERRORS], s[JUDGE_PARSE_ERRORS], s[ERRORS]) == (0, 0, 0, 0) for s in before
    )
    assert all(
        (s["reward"], s[SKIPPED], s[JUDGE_ERRORS], s[ERRORS], s[TIMEOUTS]) == (0, 1, 1, 0, 0) for s in after
    )
    assert scorer.num_errors == 4 and runner.num_errors == 0


def test_an_untrained_judge_s_garbage_is_counted_as_parse_errors(tmp_path: Path) -> None:
    untrained = build_judge_dir(str(tmp_path / "untrained"), train_steps=0)
    server = serve(untrained, tmp_path)
    try:
        assert server.base_url is not None
        scorer = JudgeScorer(
            judge_config(server.base_url)["reward_model"]["judge"], server.base_url, server.api_key
        )
        scores = scorer.score_batch([p for p, _ in PAIRS], [r for _, r in PAIRS], [None] * 4)
        texts = [scorer.judge_text(p, r, None) for p, r in PAIRS]
    finally:
        server.stop()
    for text, score in zip(texts, scores):
        try:
            parse_judge_score(text, 10.0)
        except JudgeParseError:
            assert (score["reward"], score[SKIPPED], score[JUDGE_PARSE_ERRORS], score[JUDGE_ERRORS]) == (
                0,
                1,
                1,
                0,
            )
        else:  # a random model may emit a number by chance: then it is a score, never an error
            assert score[JUDGE_PARSE_ERRORS] == 0
    assert scorer.num_parse_errors == sum(int(s[JUDGE_PARSE_ERRORS]) for s in scores) >= 1


# --- placement ---------------------------------------------------------------------------------


def served_classifier(path: str, *more: str) -> list[str]:
    return [
        "launch_mode=mpi",
        "reward_model.type=classifier",
        f"reward_model.classifier.path={path}",
        "reward_model.placement=own_ranks",
        *more,
    ]


def test_the_reward_service_gets_ranks_of_its_own(classifier_model_dir: str) -> None:
    from nexrl_hpc.runtime.placement import PlacementError, plan_placement

    cfg = compose_config(served_classifier(classifier_model_dir, "reward_model.world_size=2"))
    placement = plan_placement(cfg, 5)
    assert [r.group for r in placement.ranks] == ["driver", "trainer", "reward", "reward", "rollout"]
    assert [r.module_names for r in placement.ranks if r.group == "reward"] == [
        ["reward_service_0"],
        ["reward_service_1"],
    ]
    with pytest.raises(PlacementError) as err:
        plan_placement(cfg, 4)
    assert "2 reward (reward_model.world_size)" in str(err.value) and "at least 5 ranks" in str(err.value)
    colocated = compose_config(
        [
            "launch_mode=mpi",
            "reward_model.type=classifier",
            f"reward_model.classifier.path={classifier_model_dir}",
        ]
    )
    assert [r.group for r in plan_placement(colocated, 3).ranks] == ["driver", "trainer", "rollout"]


MANUAL_ROLES = {
    **dict.fromkeys(
        [
            "data_loader",
            "validate_dataloader",
            "trajectory_pool",
            "algorithm_processor",
            "train_batch_pool",
            "weight_sync_controller",
            "validator",
            "train_worker",
        ],
        "driver",
    ),
    "rollout_worker": "rollout",
    "inference_service": "rollout",
}


def test_manual_placement_places_the_reward_service_only_when_served(classifier_model_dir: str) -> None:
    manual = ["placement.mode=manual"] + [
        f"+placement.roles.{role}={{count:1,colocation_group:{group}}}"
        for role, group in MANUAL_ROLES.items()
    ]
    reward_service = "+placement.roles.reward_service={count:1,colocation_group:null}"
    assert refused_keys(*served_classifier(classifier_model_dir), *manual) == [
        "placement.roles.reward_service"
    ]
    compose_config([*served_classifier(classifier_model_dir), *manual, reward_service])  # placed: accepted
    assert refused_keys("launch_mode=mpi", *manual, reward_service) == ["placement.roles.reward_service"]
    compose_config(["launch_mode=mpi", *manual])  # no model reward, not placed: accepted


def test_a_slurm_job_counts_the_reward_ranks(classifier_model_dir: str) -> None:
    from nexrl_hpc.launcher.slurm import plan_components

    cfg = compose_config(
        [
            *served_classifier(classifier_model_dir, "placement.resources.reward.gpus_per_rank=1")[1:],
            "launcher=slurm",
            "launcher.rollout_ranks=2",
        ]
    )
    world, components = plan_components(cfg)
    assert world == 5
    assert [(c.groups, c.ntasks, c.gpus_per_task) for c in components] == [
        (["driver", "trainer"], 2, 0),
        (["reward"], 1, 1),
        (["rollout"], 2, 0),
    ]


# --- failures of the call as a whole: counted as any reward's ----------------------------------


def test_a_silent_judge_times_out_and_a_missing_service_errors_both_counted(
    classifier_model_dir: str,
) -> None:
    """A judge that accepts the connection and never answers: the call runs past
    rollout_worker.reward_timeout_s and every sample of it is a reward/timeouts. A served reward
    whose service was never wired: the call raises, every sample a reward/errors. Nothing raises."""
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        reward, _ = run_reward(judge_config(url, "reward_model.judge.request_timeout_s=600"))  # type: ignore[arg-type]
        runner = RewardRunner(reward, timeout_s=1.0, num_threads=1)
        try:
            scores = [
                f.result(timeout=60) for f in runner.submit_many([({"prompt": p}, r) for p, r in PAIRS])
            ]
        finally:
            runner.close()
    assert all((s["reward"], s[TIMEOUTS], s[ERRORS]) == (0, 1, 0) for s in scores)
    assert runner.num_timeouts == 4

    served = classifier_config(classifier_model_dir, "reward_model.placement=own_ranks")
    reward, model = run_reward(served)  # type: ignore[arg-type]
    runner = RewardRunner(reward, timeout_s=30, num_threads=1)
    try:
        scores = [f.result(timeout=60) for f in runner.submit_many([({"prompt": p}, r) for p, r in PAIRS])]
    finally:
        runner.close()
    assert all((s["reward"], s[ERRORS], s[TIMEOUTS]) == (0, 1, 0) for s in scores)
    assert runner.first_error is not None and "no reward service was wired" in runner.first_error
