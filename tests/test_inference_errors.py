"""How a failed inference request ends: the client tells the server's own error from a network one.

A stdlib HTTP server answers every request the way a test sets (a status and a body, after a
delay) and counts them: the server's error is raised after one request with its message; an
unavailable gateway or a timeout is retried; a request's timeout grows with the tokens it asks
for. Then the real server: an engine that raises answers 500 with the error, and a whole run
whose server fails every generation stops at its first request, the server's message in the
console, ``status.json`` and ``launch.status``. And a server that answers 200 with a malformed body:
the inference error naming the server and the field, never a bare KeyError/TypeError.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from nexrl_hpc.inference.adapters import OpenAITokenIdsAdapter, SGLangAdapter
from nexrl_hpc.inference.client import (
    InferenceResponseError,
    InferenceServerError,
    InferenceServiceError,
    InferenceTimeoutError,
    InferenceUnreachableError,
    LLMServiceClient,
)
from tests.conftest import REPO, compose_config, run_train

ENGINE_ERROR = "CUDA error: an illegal memory access was encountered (engine step 17)"


@dataclass
class Answer:
    """What the server answers next: a status, a body (JSON or text), after ``delay_s``."""

    status: int = 200
    body: Any = None  # None with 200: a well-formed completion; a callable: body(request) is sent
    delay_s: float = 0.0
    requests: list[dict[str, Any]] = field(default_factory=list)


def ok_body(body: dict[str, Any]) -> dict[str, Any]:
    """A vLLM-shaped completion of every prompt: one token id 5, log-prob -1."""
    prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
    choice = {"text": "x", "finish_reason": "length", "prompt_token_ids": [1], "token_ids": [5]}
    choice["logprobs"] = {"token_logprobs": [-1.0]}
    return {"choices": [dict(choice, index=i) for i in range(len(prompts))]}


@pytest.fixture
def scripted() -> Iterator[tuple[str, Answer]]:
    answer = Answer()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            answer.requests.append(body)
            time.sleep(answer.delay_s)
            payload = ok_body(body) if answer.status == 200 and answer.body is None else answer.body
            payload = payload(body) if callable(payload) else payload
            is_text = isinstance(payload, str)
            data = payload.encode() if is_text else json.dumps(payload).encode()
            try:
                self.send_response(answer.status)
                self.send_header("Content-Type", "text/plain" if is_text else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:
                pass  # the client gave up waiting

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", answer
    server.shutdown()


def client(url: str, **service: Any) -> LLMServiceClient:
    cfg = dict(compose_config()["service"]["inference_service"], base_url=url, retry_backoff_s=0.01)
    cfg.update(service)
    return LLMServiceClient(cfg)  # type: ignore[arg-type]


def both_ways(llm: LLMServiceClient, **kwargs: Any) -> list[BaseException]:
    """The error of a blocking and of a coalesced async call."""
    errors: list[BaseException] = []
    try:
        llm.completion("abc", **kwargs)
    except Exception as exc:
        errors.append(exc)

    async def coalesced() -> None:
        try:
            await asyncio.gather(*(llm.acompletion(p, **kwargs) for p in ("a", "b")))
        finally:
            await llm.aclose()

    try:
        asyncio.run(coalesced())
    except Exception as exc:
        errors.append(exc)
    return errors


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (500, {"error": {"message": ENGINE_ERROR, "type": "InternalServerError", "code": 500}}, ENGINE_ERROR),
        (500, {"object": "error", "message": ENGINE_ERROR, "code": 500}, ENGINE_ERROR),  # older vLLM
        (500, "Internal Server Error", "Internal Server Error"),  # a bare framework page
        (400, {"error": {"message": "max_tokens is too large"}}, "max_tokens is too large"),
        (422, {"detail": [{"msg": "field required"}]}, "field required"),  # FastAPI validation
    ],
    ids=["openai-shape", "old-vllm-shape", "text", "400", "422"],
)
def test_the_servers_own_error_fails_at_once_with_its_message(
    scripted: tuple[str, Answer], status: int, body: Any, expected: str
) -> None:
    url, answer = scripted
    answer.status, answer.body = status, body
    errors = both_ways(client(url, max_retries=3), max_tokens=4)
    assert len(errors) == 2 and len(answer.requests) == 2  # one request each: nothing retried
    verb = "failed the request" if status >= 500 else "rejected the request"
    for exc in errors:
        assert isinstance(exc, InferenceServerError) and exc.status_code == status
        assert str(exc).startswith(f"{url}/v1 {verb} (HTTP {status}): ")
        assert expected in str(exc) and expected in exc.server_message


@pytest.mark.parametrize("status", [502, 503, 504, 429])
def test_an_unavailable_gateway_is_retried_like_a_refused_connection(
    scripted: tuple[str, Answer], status: int
) -> None:
    url, answer = scripted
    answer.status, answer.body = status, {"error": {"message": "upstream down"}}
    with pytest.raises(InferenceUnreachableError, match=f"{url}/v1 unreachable after 3 attempts"):
        client(url, max_retries=2).completion("abc", max_tokens=1)
    assert len(answer.requests) == 3


def test_a_timeout_is_retried_then_named_with_its_keys(scripted: tuple[str, Answer]) -> None:
    url, answer = scripted
    answer.delay_s = 1.0
    llm = client(url, max_retries=1, request_timeout_s=0.2, request_timeout_per_token_s=0.0)
    t0 = time.monotonic()
    with pytest.raises(InferenceTimeoutError) as caught:
        llm.completion("abc", max_tokens=4)
    assert time.monotonic() - t0 < 1.5  # two attempts of 0.2 s, not of the server's 1 s
    assert len(answer.requests) == 2
    assert str(caught.value) == (
        f"inference service at {url}/v1 did not answer within 0.2s, 2 attempts "
        "(service.inference_service.request_timeout_s + request_timeout_per_token_s x tokens asked)"
    )
    assert isinstance(caught.value, InferenceServiceError)


def test_the_timeout_grows_with_the_tokens_asked(scripted: tuple[str, Answer]) -> None:
    """0.2 s base + 0.01 s x 8 tokens x 3 prompts x n=2 = 0.68 s: a 0.5 s generation is waited for."""
    url, answer = scripted
    llm = client(url, max_retries=0, request_timeout_s=0.2, request_timeout_per_token_s=0.01)
    assert llm._request_timeout(3, {"max_tokens": 8, "n": 2}) == pytest.approx(0.68)
    assert llm._request_timeout(1, {"max_completion_tokens": 10}) == pytest.approx(0.3)
    assert llm._request_timeout(1, {}) == pytest.approx(0.2)  # no max_tokens: the base alone
    answer.delay_s = 0.5
    assert llm.completion("abc", max_tokens=40)["response_ids"] == [5]  # 0.6 s allowed
    with pytest.raises(InferenceTimeoutError):
        llm.completion("abc", max_tokens=1)  # 0.21 s allowed
    assert len(answer.requests) == 2


def _malformed(change: Any) -> Any:
    """A well-formed answer to the request, then ``change(answer)`` applied to it."""

    def answer(request: dict[str, Any]) -> Any:
        payload = ok_body(request)
        return change(payload) or payload

    return answer


def _each_choice(**fields: Any) -> Any:
    return _malformed(lambda p: [c.update(fields) for c in p["choices"]] and None)


MALFORMED = {  # (answer, what the error names)
    "no-index": (
        _malformed(lambda p: [c.pop("index") for c in p["choices"]] and None),
        "choices[0] has no 'index'",
    ),
    "index-a-string": (_each_choice(index="0"), "choices[0].index is str '0', not an integer"),
    "index-out-of-range": (_each_choice(index=1), ".index is 1: each of 0.."),
    "no-token-ids": (_each_choice(token_ids=None), "returned no token ids"),
    "token-ids-strings": (
        _each_choice(token_ids=["5"]),
        "choices[0].token_ids[0] is str '5', not an integer",
    ),
    "prompt-ids-an-object": (_each_choice(prompt_token_ids={"a": 1}), "choices[0].prompt_token_ids is dict"),
    "logprobs-a-string": (_each_choice(logprobs="x"), "choices[0].logprobs is str 'x', not an object"),
    "logprob-null": (_each_choice(logprobs={"token_logprobs": [None]}), "token_logprobs[0] is NoneType"),
    "no-text": (
        _malformed(lambda p: [c.pop("text") for c in p["choices"]] and None),
        "choices[0] has no 'text'",
    ),
    "finish-reason-a-number": (
        _each_choice(finish_reason=7),
        "choices[0].finish_reason is int 7, not a string",
    ),
    "choices-an-object": (_malformed(lambda p: {"choices": {"0": p["choices"][0]}}), "choices is dict"),
    "choice-a-string": (
        _malformed(lambda p: {"choices": ["x"] * len(p["choices"])}),
        "choices[0] is str 'x'",
    ),
    "answer-a-list": (_malformed(lambda p: [p]), "the answer is list"),
    "version-a-string": (_malformed(lambda p: dict(p, weight_version="abc")), "weight_version is str 'abc'"),
    "not-json": (lambda request: "<html>oops</html>", "malformed answer to /v1/completions: not JSON"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_completion_is_the_inference_error_naming_the_server_and_field(
    scripted: tuple[str, Answer], case: str
) -> None:
    """Was: ``KeyError: 'index'`` (or an AttributeError/TypeError) with no word of the server."""
    url, answer = scripted
    answer.body, names = MALFORMED[case]
    errors = both_ways(client(url, max_retries=2), max_tokens=4)
    assert len(errors) == 2 and len(answer.requests) == 2  # one request each: not retried
    for exc in errors:
        assert isinstance(exc, InferenceResponseError), repr(exc)
        assert str(exc).startswith(f"{url}/v1") and names in str(exc), str(exc)


def test_a_choice_index_given_twice_names_the_choice() -> None:
    payload = ok_body({"prompt": ["a", "b"]})
    payload["choices"][1]["index"] = 0
    with pytest.raises(InferenceResponseError, match=r"choices\[1\]\.index is 0: each of 0\.\.1 once"):
        OpenAITokenIdsAdapter("http://node7:8000/v1").completion_choices(payload, 2, 1)


CHAT_OK = {
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "hi"},
            "finish_reason": "stop",
            "token_ids": [5],
            "logprobs": {"content": [{"token": "hi", "logprob": -0.5}]},
        }
    ],
    "prompt_token_ids": [1, 2],
}


@pytest.mark.parametrize(
    ("change", "names"),
    [
        (lambda p: p.update(choices=[]), "choices is empty"),
        (lambda p: p["choices"][0].pop("message"), "choices[0] has no 'message'"),
        (lambda p: p["choices"][0]["message"].update(content=["hi"]), "choices[0].message.content is list"),
        (lambda p: p["choices"][0]["logprobs"]["content"][0].pop("logprob"), "content[0] has no 'logprob'"),
        (lambda p: p["choices"][0].update(token_ids="5"), "choices[0].token_ids is str '5'"),
        (lambda p: p["choices"][0]["message"].update(tool_calls="x"), "tool_calls is str 'x'"),
    ],
)
def test_a_malformed_chat_completion_names_the_field(change: Any, names: str) -> None:
    adapter = OpenAITokenIdsAdapter("http://node7:8000/v1")
    assert adapter.chat_choice(json.loads(json.dumps(CHAT_OK))).logprobs == [-0.5]
    payload = json.loads(json.dumps(CHAT_OK))
    change(payload)
    with pytest.raises(InferenceResponseError, match="^http://node7:8000/v1: ") as caught:
        adapter.chat_choice(payload)
    assert names in str(caught.value)


@pytest.mark.parametrize(
    ("item", "names"),
    [
        ("text", "the answer is str 'text', not an object"),
        (
            {"prompt_token_ids": [1], "meta_info": {"output_token_logprobs": [[-1.0]]}},
            "[0] is [-1.0], not [logprob",
        ),
        (
            {"prompt_token_ids": [1], "meta_info": {"output_token_logprobs": [[-1.0, "5"]]}},
            "[0][1] is str '5'",
        ),
        (
            {"prompt_token_ids": "1", "meta_info": {"output_token_logprobs": []}},
            "prompt_token_ids is str '1'",
        ),
        ({"prompt_token_ids": [1], "meta_info": "x"}, "meta_info is str 'x'"),
    ],
)
def test_a_malformed_sglang_answer_names_the_field(item: Any, names: str) -> None:
    with pytest.raises(InferenceResponseError, match="^http://node7:30000: ") as caught:
        SGLangAdapter("http://node7:30000").completion_choices(item, 1, 1)
    assert names in str(caught.value)


def test_a_failing_engine_is_a_500_with_its_error(tiny_model_dir: str) -> None:
    """The local server's answer when generation raises: the error's type and text, not a bare page."""
    from fastapi.testclient import TestClient

    from nexrl_hpc.inference.engine import HFEngine
    from nexrl_hpc.inference.server import RequestLimits, create_app

    engine = HFEngine(tiny_model_dir, max_batch_size=4, batch_wait_ms=1.0, seed=0, stop_timeout_s=10.0)

    def explode(batch: Any) -> Any:
        raise RuntimeError(ENGINE_ERROR)

    engine._generate = explode  # type: ignore[method-assign]
    app = create_app(engine, "policy", None, RequestLimits(8, 8, 1 << 20))
    with TestClient(app, raise_server_exceptions=False) as http:
        resp = http.post("/v1/completions", json={"prompt": [1, 5], "max_tokens": 2})
        assert resp.status_code == 500
        assert resp.json()["error"] == {
            "message": f"RuntimeError: {ENGINE_ERROR}",
            "type": "InternalServerError",
            "code": 500,
        }
        assert http.get("/health").status_code == 200  # the server lives on


def _diverged_run(chatml_model_dir: str, tmp_path: Path, *overrides: str) -> tuple[Path, float, Any]:
    """A run of a diverged checkpoint (NaN in the final norm: every logit NaN)."""
    from safetensors.torch import load_file, save_file

    model = tmp_path / "diverged"
    shutil.copytree(chatml_model_dir, model)
    weights = load_file(str(model / "model.safetensors"))
    weights["model.norm.weight"].fill_(float("nan"))
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"what is {i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(16))
    )
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    proc = run_train(
        [
            f"model.path={model}",
            "data.type=jsonl",
            f"data.data_files=[{data}]",
            f"validate.data.data_files=[{data}]",
            "validate.validate_before_train=false",
            "validate.validate_at_end=false",
            "validate.eval.validate_freq=0",
            "rollout_worker.reward_fn=nexrl_hpc.rewards.match:exact_match",
            "rollout_worker.max_response_length=4",
            "data.batch_size=4",
            "train_worker.total_train_steps=3",
            "logger.backend=[]",
            f"run_dir={run_dir}",
            *overrides,
        ],
        timeout=600,
    )
    return run_dir, time.monotonic() - t0, proc


@pytest.mark.e2e
def test_a_diverged_checkpoint_stops_at_the_first_weight_verification(
    chatml_model_dir: str, tmp_path: Path
) -> None:
    """With weight verification on (the default), the trainer's own canary log-probs of version 0 are
    NaN: the run stops before any rollout, saying the weights are broken, not their delivery."""
    run_dir, _, proc = _diverged_run(chatml_model_dir, tmp_path)
    console = proc.stdout + proc.stderr
    assert proc.returncode == 1, console[-3000:]
    says = "weight version 0: the trainer's own log-probs of the canary are not finite"
    failed = [line for line in proc.stderr.splitlines() if "run failed" in line]
    assert failed and says in failed[-1], console[-3000:]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed" and says in status["reason"], status


@pytest.mark.e2e
def test_a_run_whose_server_fails_every_generation_stops_at_once_with_its_message(
    chatml_model_dir: str, tmp_path: Path
) -> None:
    """A diverged checkpoint, verification off: the default server's sampler raises on the first
    training request. The run fails after that one request (it used to be retried for ~9 minutes
    and reported as "unreachable: timed out"), and says what the server said."""
    run_dir, elapsed, proc = _diverged_run(chatml_model_dir, tmp_path, "weight.verify_every=0")
    console = proc.stdout + proc.stderr
    assert proc.returncode == 1, console[-3000:]
    server_says = "probability tensor contains either `inf`, `nan` or element < 0"
    failed = [line for line in proc.stderr.splitlines() if "run failed" in line]
    assert failed and server_says in failed[-1] and "(HTTP 500)" in failed[-1], console[-3000:]
    assert "retry 1/" not in console  # not retried as if it were the network
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed" and server_says in status["reason"], status
    shown = subprocess.run(
        [sys.executable, "-m", "launch.status", str(run_dir)], cwd=REPO, capture_output=True, text=True
    )
    assert server_says in shown.stdout, shown.stdout + shown.stderr
    print(f"failed run in {elapsed:.0f}s (start-up included): {failed[-1][:300]}")
    assert elapsed < 240
