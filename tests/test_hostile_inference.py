"""Issue 21, row 10: one request to the local inference server cannot blow up its batch or its engine.

The real server app (``create_app``) around the real engine on the tiny model, spoken to over
HTTP by Starlette's test client; the engine's batches are observed by wrapping its generate step.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from nexrl_hpc.inference.engine import HFEngine
from nexrl_hpc.inference.server import RequestLimits, create_app
from tests.conftest import compose_config

KEY = "k3y"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMITS = RequestLimits(max_n=8, max_prompts=64, max_body_bytes=1 << 20)


@pytest.fixture(scope="module")
def served(tiny_model_dir: str) -> Iterator[tuple[TestClient, HFEngine, list[int]]]:
    cfg = compose_config()["service"]["inference_service"]["local"]
    assert (cfg["max_n"], cfg["max_prompts_per_request"], cfg["max_request_mb"]) == (64, 4096, 64)
    engine = HFEngine(tiny_model_dir, max_batch_size=4, batch_wait_ms=1.0, seed=0, stop_timeout_s=10.0)
    batches: list[int] = []
    generate = engine._generate

    def observed(batch: list[Any]) -> Any:
        batches.append(sum(r.num_sequences for r in batch))
        return generate(batch)

    engine._generate = observed  # type: ignore[method-assign]
    with TestClient(create_app(engine, "policy", KEY, LIMITS)) as client:
        yield client, engine, batches


def completion(client: TestClient, body: dict[str, Any]) -> Any:
    return client.post("/v1/completions", json={"model": "policy", "max_tokens": 2, **body}, headers=AUTH)


def test_a_big_request_runs_in_batches_of_the_engine_size(
    served: tuple[TestClient, HFEngine, list[int]],
) -> None:
    client, _, batches = served
    batches.clear()
    resp = completion(client, {"prompt": [[1, 5, 6]] * 10 + [[1, 7]] * 5, "n": 3, "return_token_ids": True})
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    assert len(choices) == 45  # 15 prompts x n=3, in order
    assert [c["prompt_token_ids"] for c in choices[::3]] == [[1, 5, 6]] * 10 + [[1, 7]] * 5
    assert batches and max(batches) <= 4 and sum(batches) == 45  # was one batch of 45 rows
    batches.clear()
    resp = completion(client, {"prompt": [1, 5], "n": 7})  # n alone above the batch size
    assert resp.status_code == 200 and len(resp.json()["choices"]) == 7
    assert max(batches) <= 4 and sum(batches) == 7


@pytest.mark.parametrize(
    ("body", "named"),
    [
        (
            {"prompt": [1, 5], "n": 9},
            "n=9 is over this server's limit of 8 (service.inference_service.local.max_n)",
        ),
        (
            {"prompt": [[1, 5]] * 65},
            "65 prompts in one request, over this server's limit of 64 (service.inference_service.local.max_prompts_per_request)",
        ),
        ({"prompt": ["ab"] * 65}, "(service.inference_service.local.max_prompts_per_request)"),
    ],
    ids=["n", "prompts", "text-prompts"],
)
def test_requests_over_a_limit_get_400_naming_it(
    served: tuple[TestClient, HFEngine, list[int]], body: dict[str, Any], named: str
) -> None:
    client, _, batches = served
    batches.clear()
    resp = completion(client, body)
    assert resp.status_code == 400
    assert named in resp.json()["error"]["message"]
    assert batches == []  # nothing reached the engine
    chat = client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}], "n": 9}, headers=AUTH
    )
    assert chat.status_code == 400  # the tiny model has no chat template, or n is over: refused either way


def test_an_oversize_body_gets_400_naming_the_limit(served: tuple[TestClient, HFEngine, list[int]]) -> None:
    client, _, batches = served
    batches.clear()
    big = {"model": "policy", "prompt": [1] * 700_000, "max_tokens": 1}  # >= 1.4 MB of JSON
    resp = client.post("/v1/completions", json=big, headers=AUTH)
    assert resp.status_code == 400
    assert "request body over 1 MiB (service.inference_service.local.max_request_mb)" in resp.text
    # streamed without a Content-Length: counted as it arrives
    chunks = (b"x" * 65536 for _ in range(20))
    resp = client.post(
        "/v1/completions", content=chunks, headers={**AUTH, "content-type": "application/json"}
    )
    assert resp.status_code == 400 and "max_request_mb" in resp.text
    # without the key the body is not even read
    resp = client.post("/v1/completions", json=big)
    assert resp.status_code == 401
    assert batches == []


def test_token_ids_outside_the_vocabulary_are_a_400_and_the_engine_lives(
    served: tuple[TestClient, HFEngine, list[int]],
) -> None:
    client, engine, batches = served
    batches.clear()
    for bad in (engine.vocab_size, 10**9, -1):
        resp = completion(client, {"prompt": [[1, 5], [1, bad, 5]]})
        assert resp.status_code == 400, resp.text  # was a 500 on CPU, a device assert on CUDA
        message = resp.json()["error"]["message"]
        assert (
            message == f"prompt 1: token id {bad} is outside the model's vocabulary [0, {engine.vocab_size})"
        )
    assert batches == []  # checked before anything was queued
    assert completion(client, {"prompt": [1, engine.vocab_size - 1]}).status_code == 200


@pytest.mark.parametrize(
    ("route", "body", "named"),
    [
        ("/v1/completions", {"prompt": [1, 5], "max_tokens": float("nan")}, "invalid request: max_tokens: "),
        ("/v1/completions", {"prompt": [1, 5], "max_tokens": "many"}, "invalid request: max_tokens: "),
        (
            "/v1/completions",
            {"prompt": [1, 5], "temperature": float("nan")},
            "invalid request: temperature: ",
        ),
        ("/v1/chat/completions", {"messages": "a", "n": float("inf")}, "invalid request: messages: "),
    ],
    ids=["max_tokens-nan", "max_tokens-text", "temperature-nan", "chat-fields"],
)
def test_fields_of_the_wrong_type_or_value_are_a_400_naming_the_field(
    served: tuple[TestClient, HFEngine, list[int]], route: str, body: dict[str, Any], named: str
) -> None:
    """Was a 500: FastAPI's validation answer echoes the input, and JSON has no NaN."""
    client, _, batches = served
    batches.clear()
    raw = json.dumps({"model": "policy", **body})  # NaN and Infinity as Python writes them
    resp = client.post(route, content=raw, headers={**AUTH, "content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"].startswith(named)
    assert batches == []


def test_a_weight_version_that_is_no_integer_is_a_400_naming_it(
    served: tuple[TestClient, HFEngine, list[int]], tiny_model_dir: str
) -> None:
    client, engine, _ = served
    version = engine.weight_version
    resp = client.post(
        "/update_weights_from_disk",
        json={"model_path": tiny_model_dir, "weight_version": "abc"},
        headers=AUTH,
    )
    assert resp.status_code == 400, resp.text
    assert resp.json() == {"success": False, "message": "weight_version: 'abc' is not an integer"}
    resp = client.post(
        "/update_weights_from_disk", json={"model_path": tiny_model_dir, "weight_version": 1.5}, headers=AUTH
    )
    assert resp.status_code == 400 and "weight_version" in resp.json()["error"]["message"]
    assert engine.weight_version == version  # nothing loaded
    resp = client.post(
        "/update_weights_from_disk", json={"model_path": tiny_model_dir, "weight_version": "12"}, headers=AUTH
    )
    assert resp.status_code == 200 and resp.json()["weight_version"] == 12
