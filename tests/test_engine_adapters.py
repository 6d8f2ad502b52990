"""Engine adapters: the SGLang adapter and transport against a recorded-shape fake server.

SGLang cannot be installed on this project's CPU machines (its wheels need CUDA), so these tests
check the client's SGLang path against a stdlib HTTP server that answers ``/generate`` and
``/update_weights_from_disk`` with the shapes SGLang's own server produces (top-level ``text``,
``output_ids``, ``prompt_token_ids``; ``meta_info.output_token_logprobs`` rows
``[logprob, token_id, text]``, ``meta_info.finish_reason.type``, ``meta_info.weight_version`` as a
string; a list for a batch). vLLM is tested for real in tests/test_vllm.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from nexrl_hpc.inference.adapters import OpenAITokenIdsAdapter, SGLangAdapter, create_engine_adapter
from nexrl_hpc.inference.client import InferenceServiceError, LLMServiceClient, MissingTokenIdsError
from nexrl_hpc.weight_sync.transport import (
    SGLangDiskTransport,
    VLLMReloadTransport,
    WeightSyncError,
    create_weight_transport,
)
from tests.conftest import compose_config


def _tokenize(text: str) -> list[int]:
    return [4 + (ord(c) % 50) for c in text]


class _FakeSGLang:
    """Answers like SGLang 0.5's HTTP server; records every request body."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.weight_version = "default"
        self.old_server = False  # an SGLang without return_prompt_token_ids

    def generate(self, body: dict[str, Any]) -> Any:
        sp = body.get("sampling_params", {})
        n = sp.get("n", 1)
        max_new = sp.get("max_new_tokens", 2)
        prompts = body["text"] if "text" in body else body["input_ids"]
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        items = [prompts] if single else prompts
        outs = []
        for p in items:
            ids = _tokenize(p) if isinstance(p, str) else list(p)
            for j in range(n):
                out_ids = [5 + (sum(ids) + j + k) % 7 for k in range(max_new)]
                meta = {
                    "id": f"req-{len(self.requests)}",
                    "finish_reason": {"type": "length", "length": max_new},
                    "prompt_tokens": len(ids),
                    "completion_tokens": max_new,
                    "cached_tokens": 0,
                    "weight_version": self.weight_version,
                    "e2e_latency": 0.01,
                }
                if body.get("return_logprob"):
                    meta["input_token_logprobs"] = [[None, ids[0], None]] + [[-1.0, t, None] for t in ids[1:]]
                    meta["output_token_logprobs"] = [[-0.1 * (k + 1), t, None] for k, t in enumerate(out_ids)]
                out = {
                    "text": "".join(chr(60 + t) for t in out_ids),
                    "output_ids": out_ids,
                    "meta_info": meta,
                }
                if body.get("return_prompt_token_ids") and not self.old_server:
                    out["prompt_token_ids"] = ids
                outs.append(out)
        return outs[0] if single and n == 1 else outs

    def update_weights_from_disk(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if "bad" in body["model_path"]:
            return 400, {"success": False, "message": f"Failed to load {body['model_path']}"}
        self.weight_version = str(body.get("weight_version"))
        return 200, {"success": True, "message": "Succeeded", "num_paused_requests": 0}


@pytest.fixture(scope="module")
def fake_sglang() -> Iterator[tuple[str, _FakeSGLang]]:
    state = _FakeSGLang()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state.requests.append((self.path, body))
            if self.path == "/generate":
                code, payload = 200, state.generate(body)
            elif self.path == "/update_weights_from_disk":
                code, payload = state.update_weights_from_disk(body)
            else:
                code, payload = 404, {"detail": "Not Found"}
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", state
    server.shutdown()


def _client(url: str, *overrides: str) -> LLMServiceClient:
    cfg = compose_config(
        ["service.inference_service.backend=sglang", f"service.inference_service.base_url={url}", *overrides]
    )
    return LLMServiceClient(cfg["service"]["inference_service"])


def test_factory_picks_the_adapter_per_backend() -> None:
    assert type(create_engine_adapter("vllm", "u")) is OpenAITokenIdsAdapter
    assert type(create_engine_adapter("local", "u")) is OpenAITokenIdsAdapter
    assert type(create_engine_adapter("sglang", "u")) is SGLangAdapter
    with pytest.raises(ValueError, match="service.inference_service.backend='nope'"):
        create_engine_adapter("nope", "u")
    assert isinstance(create_weight_transport("sglang", 5.0, "wait"), SGLangDiskTransport)
    assert isinstance(create_weight_transport("vllm", 5.0, "wait"), VLLMReloadTransport)


def test_sglang_completion_uses_native_generate_fields(fake_sglang: tuple[str, _FakeSGLang]) -> None:
    url, state = fake_sglang
    client = _client(url)
    out = client.completion("m372=", max_tokens=2, temperature=0.0, seed=3)
    path, body = state.requests[-1]
    assert path == "/generate"
    assert (
        body["text"] == "m372=" and body["return_logprob"] is True and body["return_prompt_token_ids"] is True
    )
    assert body["sampling_params"] == {"max_new_tokens": 2, "temperature": 0.0, "sampling_seed": 3}
    ids = _tokenize("m372=")
    assert out["prompt_ids"] == ids
    assert out["response_ids"] == [5 + (sum(ids) + k) % 7 for k in range(2)]
    assert out["logprobs"] == pytest.approx([-0.1, -0.2])
    assert out["finish_reason"] == "length"
    assert out["weight_version"] is None  # "default": SGLang never got a version
    client.completion([1, 2, 3], max_tokens=2)
    assert state.requests[-1][1]["input_ids"] == [1, 2, 3]


def test_sglang_batched_and_n_samples_keep_prompt_order(fake_sglang: tuple[str, _FakeSGLang]) -> None:
    url, state = fake_sglang
    client = _client(url)

    async def run() -> list[Any]:
        outs = await asyncio.gather(*(client.acompletion(p, max_tokens=1, n=2) for p in ["a", "bb", "ccc"]))
        await client.aclose()
        return outs

    outs = asyncio.run(run())
    _, body = state.requests[-1]
    assert body["text"] == ["a", "bb", "ccc"]  # one coalesced request
    for prompt, group in zip(["a", "bb", "ccc"], outs, strict=True):
        assert [g["prompt_ids"] for g in group] == [_tokenize(prompt)] * 2
        assert [g["response_ids"] for g in group] == [
            [5 + (sum(_tokenize(prompt)) + j) % 7] for j in range(2)
        ]


def test_calls_that_keep_joining_go_out_together_until_quiet_or_the_cap(
    fake_sglang: tuple[str, _FakeSGLang],
) -> None:
    """A batch's steps start over a few milliseconds: calls arriving closer together than
    coalesce_wait_ms share one request however long the stream lasts (up to coalesce_max_wait_ms
    after its first call); a call after a quiet gap starts a new one."""
    url, state = fake_sglang

    async def waves(client: LLMServiceClient, count: int, gap_s: float, tag: str) -> list[Any]:
        calls = []
        for i in range(count):
            calls.append(asyncio.ensure_future(client.acompletion(f"{tag}{i}", max_tokens=1)))
            await asyncio.sleep(gap_s)
        return await asyncio.gather(*calls)

    async def run(client: LLMServiceClient) -> None:
        await waves(client, 10, 0.03, "a")  # 300 ms of calls, 30 ms apart: one request
        await asyncio.sleep(0.4)
        await waves(client, 2, 0.0, "b")  # after a quiet gap: a request of its own
        await client.aclose()

    state.requests.clear()
    quiet = (
        "service.inference_service.coalesce_wait_ms=100",
        "service.inference_service.coalesce_max_wait_ms=2000",
    )
    asyncio.run(run(_client(url, *quiet)))
    assert [body["text"] for _, body in state.requests] == [[f"a{i}" for i in range(10)], ["b0", "b1"]]

    async def capped(client: LLMServiceClient) -> None:
        await waves(client, 12, 0.05, "c")  # 600 ms of calls 50 ms apart, never quiet for 150 ms
        await client.aclose()

    state.requests.clear()
    overrides = (
        "service.inference_service.coalesce_wait_ms=150",
        "service.inference_service.coalesce_max_wait_ms=250",
    )
    asyncio.run(capped(_client(url, *overrides)))
    sent = [body["text"] if isinstance(body["text"], list) else [body["text"]] for _, body in state.requests]
    assert [p for batch in sent for p in batch] == [f"c{i}" for i in range(12)]  # all, in order
    assert 2 <= len(sent) <= 4  # cut by the cap (~250 ms each), not one request per call


def test_sglang_without_prompt_token_ids_is_an_error_naming_the_server(
    fake_sglang: tuple[str, _FakeSGLang],
) -> None:
    url, state = fake_sglang
    state.old_server = True
    try:
        with pytest.raises(MissingTokenIdsError, match=f"{url}/v1 returned no token ids"):
            _client(url).completion("x", max_tokens=1)
    finally:
        state.old_server = False
    with pytest.raises(InferenceServiceError, match="completions through /generate only"):
        _client(url).generate([{"role": "user", "content": "hi"}])


def test_sglang_disk_transport_and_reported_version(fake_sglang: tuple[str, _FakeSGLang]) -> None:
    url, state = fake_sglang
    transport = create_weight_transport("sglang", 5.0, "wait")
    transport.set_endpoint(url, None)
    transport.publish("/tmp/weights/version_7", 7)
    assert state.requests[-1] == (
        "/update_weights_from_disk",
        {"model_path": "/tmp/weights/version_7", "weight_version": 7},
    )
    assert _client(url).completion("x", max_tokens=1)["weight_version"] == 7
    with pytest.raises(WeightSyncError, match=f"{url}/update_weights_from_disk refused"):
        transport.publish("/tmp/bad", 8)
    assert state.weight_version == "7"


def test_sglang_needs_a_base_url() -> None:
    from nexrl_hpc.config.validate import ConfigError

    with pytest.raises(ConfigError, match="service.inference_service.base_url"):
        compose_config(["service.inference_service.backend=sglang"])
