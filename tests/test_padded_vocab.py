"""A model whose embedding is larger than its tokenizer, as every Qwen model's (151,936 rows for
~151,665 tokens): the engines sample ids that have no token.

The ``chatml_padded_model_dir`` fixture: the user's tied Qwen2 with 768 embedding rows for a
512-id tokenizer, random weights, so a third of the sampled ids have no token. The local server
answers with them (log-probs asked: that indexed a table of the tokenizer's ids and crashed),
decoded as the tokenizer decodes them (to nothing); a whole run trains on them with either engine
and counts them per step (``rollout/undecodable_tokens``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from nexrl_hpc.algorithm.advantage_processor import score_means
from nexrl_hpc.config.validate import ConfigError
from nexrl_hpc.inference.engine import HFEngine
from nexrl_hpc.inference.server import RequestLimits, create_app
from tests.conftest import PADDED_MODEL_VOCAB, compose_config, run_train


@pytest.fixture(scope="module")
def served(chatml_padded_model_dir: str) -> Iterator[tuple[TestClient, Any]]:
    engine = HFEngine(
        chatml_padded_model_dir, max_batch_size=16, batch_wait_ms=1.0, seed=0, stop_timeout_s=10.0
    )
    app = create_app(engine, "policy", None, RequestLimits(max_n=16, max_prompts=16, max_body_bytes=1 << 20))
    with TestClient(app) as client:
        yield client, AutoTokenizer.from_pretrained(chatml_padded_model_dir)


def test_the_fixture_pads_the_embedding_past_the_tokenizer(chatml_padded_model_dir: str) -> None:
    config = json.loads((Path(chatml_padded_model_dir) / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(chatml_padded_model_dir)
    assert config["vocab_size"] == PADDED_MODEL_VOCAB > len(tokenizer) and config["tie_word_embeddings"]
    assert tokenizer.convert_ids_to_tokens([len(tokenizer)]) == [None]


def test_completions_with_logprobs_answer_ids_without_a_token(served: tuple[TestClient, Any]) -> None:
    client, tokenizer = served
    prompt = tokenizer("Question: what is 3 + 4?").input_ids
    body = {"prompt": prompt, "max_tokens": 16, "n": 8, "logprobs": 1, "return_token_ids": True}
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text  # was a 500: IndexError in the id -> token table
    padded = 0
    for choice in resp.json()["choices"]:
        ids, tokens = choice["token_ids"], choice["logprobs"]["tokens"]
        assert len(tokens) == len(ids) == len(choice["logprobs"]["token_logprobs"])
        assert choice["text"] == tokenizer.decode(ids, skip_special_tokens=True)  # as the tokenizer decodes
        for token_id, token in zip(ids, tokens):
            assert 0 <= token_id < PADDED_MODEL_VOCAB
            if token_id >= len(tokenizer):
                padded += 1
                assert token == ""
            else:
                assert token == tokenizer.convert_ids_to_tokens(token_id)
    assert padded >= 8  # of 128 sampled ids, a third without a token


def test_chat_completions_with_logprobs_answer_ids_without_a_token(served: tuple[TestClient, Any]) -> None:
    client, tokenizer = served
    body = {
        "messages": [{"role": "user", "content": "what is 3 + 4?"}],
        "max_tokens": 24,
        "logprobs": True,
        "return_token_ids": True,
    }
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text  # was a 500: None.encode() for an id without a token
    choice = resp.json()["choices"][0]
    ids, content = choice["token_ids"], choice["logprobs"]["content"]
    assert any(t >= len(tokenizer) for t in ids)
    assert [c["token"] for c in content if c["bytes"] == []] == [""] * sum(t >= len(tokenizer) for t in ids)
    assert choice["message"]["content"] == tokenizer.decode(ids, skip_special_tokens=True)


def test_undecodable_counts_are_summed_per_step() -> None:
    scores = [
        {"reward": 1.0, "rollout/undecodable_tokens": 3},
        {"reward": 0.0, "rollout/undecodable_tokens": 2},
    ]
    assert score_means(scores, "train/") == {"rollout/undecodable_tokens": 5}


def test_a_teacher_must_score_the_ids_a_padded_student_samples(
    chatml_padded_model_dir: str, chatml_model_dir: str
) -> None:
    """On-policy distillation: the teacher gathers its log-prob of every sampled id; a teacher with
    the student's tokenizer but no padding would index past its output layer."""
    overrides = ["algorithm=opd", f"model.path={chatml_padded_model_dir}"]
    with pytest.raises(ConfigError) as err:
        compose_config([*overrides, f"algorithm.teacher_model_path={chatml_model_dir}"])
    rows = len(AutoTokenizer.from_pretrained(chatml_model_dir))
    assert (
        f"its output layer has {rows} rows (config.json vocab_size) but the student's has "
        f"{PADDED_MODEL_VOCAB}: the student samples ids up to {PADDED_MODEL_VOCAB - 1}"
    ) in str(err.value)
    compose_config([*overrides, f"algorithm.teacher_model_path={chatml_padded_model_dir}"])  # padded alike
    # the unpadded student with the padded teacher: a bigger output layer is fine
    compose_config(
        [
            "algorithm=opd",
            f"model.path={chatml_model_dir}",
            f"algorithm.teacher_model_path={chatml_padded_model_dir}",
        ]
    )


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["local", "vllm"])
def test_a_padded_vocabulary_trains_and_counts_undecodable_tokens(
    backend: str, chatml_padded_model_dir: str, tmp_path: Path
) -> None:
    """Three steps with either engine; each step's count is the ids past the tokenizer in the
    responses it trained on (``rollouts/step_N.h5``)."""
    rows = [
        {"prompt": [{"role": "user", "content": f"what is {i} + {i % 7}?"}], "answer": str(i + i % 7)}
        for i in range(24)
    ]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    proc = run_train(
        [
            f"model.path={chatml_padded_model_dir}",
            "data.type=jsonl",
            f"data.data_files=[{data}]",
            f"validate.data.data_files=[{data}]",
            "validate.validate_before_train=false",
            "validate.validate_at_end=false",
            "validate.eval.validate_freq=0",
            "rollout_worker.reward_fn=nexrl_hpc.rewards.match:prefix_match",
            "rollout_worker.max_prompt_length=64",
            "rollout_worker.max_response_length=8",
            "data.batch_size=4",
            "data.rollout_repeat_n=4",
            "train_worker.total_train_steps=3",
            "logger.dump_rollouts=true",
            "logger.backend=[]",
            f"service.inference_service.backend={backend}",
            f"run_dir={run_dir}",
            "seed=3",
        ],
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in metrics if "train/reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    vocab = len(AutoTokenizer.from_pretrained(chatml_padded_model_dir))
    for r in steps:
        with h5py.File(run_dir / "rollouts" / f"step_{r['step']}.h5") as f:
            responses = f["responses"][()]  # right-padded with the pad token, which has a token
        padded = int((responses >= vocab).sum())
        assert padded > 0 and r["rollout/undecodable_tokens"] == padded, (r, padded)
        assert int(np.max(responses)) < PADDED_MODEL_VOCAB
