"""The local OpenAI-compatible server, spoken to by the real ``openai`` client (and by LLMServiceClient)."""

from __future__ import annotations

import asyncio
import os
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from nexrl_hpc.checkpoint.hf import write_hf_model_dir
from nexrl_hpc.inference.client import InferenceServiceError, LLMServiceClient
from nexrl_hpc.inference.local_server import LocalInferenceServer
from nexrl_hpc.models.tiny import build_tiny_model, load_model
from tests.conftest import compose_config

CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    cfg = compose_config(["seed=3"])["model"]["tiny"]
    cfg = dict(cfg, tokenizer=dict(cfg["tokenizer"], alphabet="abcdefghijklmnopqrstuvwxyz0123456789 :=\n"))
    model, tok = build_tiny_model(cfg)
    tok.chat_template = CHAT_TEMPLATE
    out = tmp_path_factory.mktemp("chat") / "model"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def server(chat_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalInferenceServer]:
    cfg = compose_config()["service"]["inference_service"]["local"]
    srv = LocalInferenceServer(chat_model_dir, cfg, str(tmp_path_factory.mktemp("logs")), "policy")
    srv.start()
    yield srv
    srv.stop()


def oai(server: LocalInferenceServer, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key or server.api_key, max_retries=0)


def hf_logprobs(model_dir: str, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    model = load_model(model_dir).eval()
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [lp[len(prompt_ids) - 1 + i, t].item() for i, t in enumerate(completion_ids)]


def test_completion_returns_engine_token_ids_and_logprobs(
    server: LocalInferenceServer, chat_model_dir: str
) -> None:
    resp = oai(server).completions.create(
        model="policy",
        prompt="abc 12=",
        max_tokens=6,
        temperature=1.0,
        logprobs=1,
        extra_body={"return_token_ids": True},
    )
    choice = resp.choices[0]
    extra = choice.model_extra or {}
    prompt_ids, token_ids = extra["prompt_token_ids"], extra["token_ids"]
    assert prompt_ids[0] == 1 and len(prompt_ids) == 1 + len("abc 12=")  # BOS + one token per char
    assert 1 <= len(token_ids) <= 6 and choice.finish_reason in ("stop", "length")
    lps = choice.logprobs.token_logprobs
    assert len(lps) == len(token_ids)
    expected = hf_logprobs(chat_model_dir, prompt_ids, token_ids)
    assert max(abs(a - b) for a, b in zip(lps, expected)) < 1e-4  # what the trainer will compute
    assert resp.usage.completion_tokens == len(token_ids)


def test_greedy_matches_transformers_argmax(server: LocalInferenceServer, chat_model_dir: str) -> None:
    resp = oai(server).completions.create(
        model="policy", prompt="hello", max_tokens=4, temperature=0.0, extra_body={"return_token_ids": True}
    )
    extra = resp.choices[0].model_extra or {}
    model = load_model(chat_model_dir).eval()
    ids = list(extra["prompt_token_ids"])
    for tok in extra["token_ids"]:
        with torch.no_grad():
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        assert tok == nxt
        ids.append(nxt)


def test_n_samples_and_list_of_prompts(server: LocalInferenceServer) -> None:
    resp = oai(server).completions.create(
        model="policy", prompt=["ab", "cd", "ef"], n=2, max_tokens=3, extra_body={"return_token_ids": True}
    )
    assert [c.index for c in resp.choices] == list(range(6))
    prompts = [tuple((c.model_extra or {})["prompt_token_ids"]) for c in resp.choices]
    assert prompts[0] == prompts[1] and prompts[2] == prompts[3] and prompts[0] != prompts[2]


def test_a_seeded_request_samples_the_same_tokens_again_and_another_seed_others(
    server: LocalInferenceServer,
) -> None:
    """OpenAI's ``seed`` (vLLM honours it): the same request with the same seed gets the same
    samples, its ``n`` samples are not copies of one another, another seed samples others."""

    def sampled(seed: int) -> list[tuple[int, ...]]:
        resp = oai(server).completions.create(
            model="policy",
            prompt=["ab", "cd"],
            n=3,
            max_tokens=8,
            temperature=1.0,
            seed=seed,
            extra_body={"return_token_ids": True, "stop_token_ids": [10**6]},
        )
        return [tuple((c.model_extra or {})["token_ids"]) for c in resp.choices]

    first = sampled(7)
    assert sampled(7) == first
    assert len(set(first[:3])) == 3 and len(set(first[3:])) == 3
    assert sampled(8) != first


def test_prompt_as_token_ids(server: LocalInferenceServer) -> None:
    resp = oai(server).completions.create(
        model="policy", prompt=[1, 5, 6, 7], max_tokens=2, extra_body={"return_token_ids": True}
    )
    assert (resp.choices[0].model_extra or {})["prompt_token_ids"] == [1, 5, 6, 7]


def generate(server: LocalInferenceServer, body: dict[str, Any]) -> httpx.Response:
    headers = {"Authorization": f"Bearer {server.api_key}"}
    return httpx.post(f"{server.base_url}/inference/v1/generate", json=body, headers=headers, timeout=60)


def test_token_in_token_out_generate_answers_in_vllms_shape_with_the_engines_logprobs(
    server: LocalInferenceServer, chat_model_dir: str
) -> None:
    """vLLM's ``/inference/v1/generate``, which verifiers' training client (``renderers``) calls:
    token ids in; each sample's token ids and log-probs out, the log-probs the model's own."""
    prompt = [1, 5, 6, 7, 8]
    sampling = {"max_tokens": 6, "temperature": 1.0, "logprobs": 1, "n": 2, "seed": 11}
    sampling |= {"stop_token_ids": [2], "skip_special_tokens": False}
    body = {"model": "policy", "token_ids": prompt, "sampling_params": sampling, "return_token_ids": True}
    r = generate(server, body | {"request_id": "req-1"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["request_id"] == "req-1" and out["prompt_token_ids"] == prompt
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for choice in out["choices"]:
        ids, content = choice["token_ids"], choice["logprobs"]["content"]
        assert 1 <= len(ids) <= 6 and choice["finish_reason"] in ("stop", "length")
        assert [e["token_id"] for e in content] == ids  # vLLM's key
        assert [e["token"] for e in content] == [f"token_id:{t}" for t in ids]  # renderers' key
        expected = hf_logprobs(chat_model_dir, prompt, ids)
        assert max(abs(e["logprob"] - x) for e, x in zip(content, expected)) < 1e-4
    assert out["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in out["choices"])
    again = generate(server, body).json()  # the same seed: the same samples
    assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"] for c in out["choices"]]
    assert again["request_id"] != "req-1" and again["choices"][0]["token_ids"]
    plain = generate(server, {"token_ids": prompt, "sampling_params": {"max_tokens": 3}}).json()
    assert plain["choices"][0]["logprobs"] is None and "prompt_token_ids" not in plain


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"sampling_params": {"repetition_penalty": 1.1}}, "sampling_params.repetition_penalty"),
        ({"sampling_params": {"logprobs": 5}}, "sampling_params.logprobs"),
        ({"sampling_params": {"top_k": 20}}, "sampling_params.top_k"),
        ({"output_mode": "text"}, "output_mode"),
        ({"stream": True}, "stream"),
        ({"features": {}}, "features"),
        ({"token_ids": []}, "token_ids"),
        ({"token_ids": [1, 10**6]}, "outside the model's vocabulary"),
        ({"sampling_params": {"n": 10**4}}, "max_n"),
    ],
)
def test_generate_refuses_what_it_does_not_do_by_name(
    server: LocalInferenceServer, body: dict[str, Any], named: str
) -> None:
    r = generate(server, {"token_ids": [1, 5, 6]} | body)
    assert r.status_code == 400 and named in r.json()["error"]["message"], r.text


def test_chat_completion_applies_template_and_returns_ids(server: LocalInferenceServer) -> None:
    resp = oai(server).chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    extra = resp.model_extra or {}
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert len(choice.logprobs.content) == len((choice.model_extra or {})["token_ids"])
    assert len(extra["prompt_token_ids"]) == len("user: hi\nassistant: ")  # the template adds no BOS


def test_requests_without_the_key_are_refused(server: LocalInferenceServer) -> None:
    with pytest.raises(openai.AuthenticationError):
        oai(server, key="wrong").completions.create(model="policy", prompt="a", max_tokens=1)
    r = httpx.post(f"{server.base_url}/update_weights_from_disk", json={"model_path": "/tmp"})
    assert r.status_code == 401
    r = httpx.post(f"{server.base_url}/inference/v1/generate", json={"token_ids": [1]})
    assert r.status_code == 401
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_too_long_prompt_is_a_bad_request(server: LocalInferenceServer) -> None:
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        oai(server).completions.create(model="policy", prompt="a" * 70, max_tokens=1)


def test_reload_from_disk_changes_outputs_and_version(
    server: LocalInferenceServer, chat_model_dir: str, tmp_path: Path
) -> None:
    headers = {"Authorization": f"Bearer {server.api_key}"}
    state = dict(load_model(chat_model_dir).state_dict())
    state["lm_head.weight"] = torch.zeros_like(state["lm_head.weight"])  # all logits 0: a uniform policy
    new_dir = tmp_path / "v7"
    write_hf_model_dir(state, chat_model_dir, str(new_dir), max_shard_bytes=1 << 30)
    r = httpx.post(
        f"{server.base_url}/update_weights_from_disk",
        json={"model_path": str(new_dir), "weight_version": 7},
        headers=headers,
    )
    assert r.status_code == 200 and r.json()["success"] and r.json()["weight_version"] == 7
    resp = oai(server).completions.create(
        model="policy",
        prompt="abc",
        max_tokens=3,
        temperature=0.0,
        logprobs=1,
        extra_body={"return_token_ids": True},
    )
    # all-zero logits: uniform distribution, greedy picks token 0 every time
    assert (resp.choices[0].model_extra or {})["token_ids"] == [0, 0, 0]
    assert resp.model_extra["weight_version"] == 7
    vocab = load_model(chat_model_dir).config.vocab_size
    assert resp.choices[0].logprobs.token_logprobs[0] == pytest.approx(
        -torch.log(torch.tensor(float(vocab))).item(), abs=1e-5
    )

    bad = httpx.post(
        f"{server.base_url}/update_weights_from_disk",
        json={"model_path": str(tmp_path / "nope"), "weight_version": 8},
        headers=headers,
    )
    assert bad.status_code == 400 and not bad.json()["success"]
    assert (
        httpx.get(f"{server.base_url}/health").json()["weight_version"] == 7
    )  # a failed reload bumps nothing
    restore = httpx.post(
        f"{server.base_url}/update_weights_from_disk",
        json={"model_path": chat_model_dir, "weight_version": 0},
        headers=headers,
    )
    assert restore.json()["success"]


def client_config(**kw: Any) -> dict[str, Any]:
    cfg = dict(compose_config()["service"]["inference_service"])
    cfg.update(kw)
    return cfg


def test_service_client_coalesces_concurrent_calls(server: LocalInferenceServer) -> None:
    client = LLMServiceClient(client_config(base_url=server.base_url, api_key=server.api_key))
    prompts = [f"q{i}=" for i in range(40)]

    async def many() -> list[dict[str, Any]]:
        out = await asyncio.gather(*[client.acompletion(p, max_tokens=2, temperature=0.0) for p in prompts])
        await client.aclose()
        return out

    single = [client.completion(p, max_tokens=2, temperature=0.0) for p in prompts[:3]]
    results = asyncio.run(many())
    for r, p in zip(results, prompts):
        assert r["prompt"] == p and len(r["logprobs"]) == len(r["response_ids"]) and r["weight_version"] == 0
    assert [r["response_ids"] for r in results[:3]] == [
        s["response_ids"] for s in single
    ]  # greedy: same answer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_retries_then_names_the_url() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    client = LLMServiceClient(client_config(base_url=url, max_retries=2, retry_backoff_s=0.01))
    with pytest.raises(
        InferenceServiceError, match=f"inference service at {url}/v1 unreachable after 3 attempts"
    ):
        client.completion("abc", max_tokens=1)
    with pytest.raises(InferenceServiceError, match="unreachable after 3 attempts"):
        asyncio.run(client.acompletion("abc", max_tokens=1))


def test_server_binds_loopback_by_default(server: LocalInferenceServer) -> None:
    assert server.base_url.startswith("http://127.0.0.1:")
    assert os.path.exists(server.log_path)


# --- a server process started with the run, before its model exists (nexrl_hpc.inference.prewarm) ---
def test_a_prewarmed_process_serves_what_launch_hands_it(chat_model_dir: str, tmp_path: Path) -> None:
    """launch.train starts the server's process first (its imports overlap the run's); the launch
    hands it the command line, key, umask and log: it serves the model with the key, its early
    output lands in the log, and a second launch starts a fresh process."""
    from nexrl_hpc.inference import prewarm

    config = compose_config()
    cfg, runtime = config["service"]["inference_service"]["local"], config["runtime"]
    prewarm.prewarm(cfg["num_threads"], runtime["gc_thresholds"])
    waiting = prewarm._prewarmed[0] if prewarm._prewarmed else None
    assert waiting is not None and waiting.poll() is None
    srv = LocalInferenceServer(chat_model_dir, cfg, str(tmp_path / "logs"), "policy", runtime=runtime)
    old_umask = os.umask(0o027)
    try:
        srv.start()
    finally:
        os.umask(old_umask)
    try:
        assert srv.process is waiting and prewarm._prewarmed is None  # taken, not started anew
        out = oai(srv).completions.create(model="policy", prompt="ab", max_tokens=2, temperature=0.0)
        assert len(out.choices) == 1
        with pytest.raises(openai.AuthenticationError):
            oai(srv, key="wrong").completions.create(model="policy", prompt="a", max_tokens=1)
        log = Path(srv.log_path).read_text()
        assert f"serving {chat_model_dir}" in log
        # the run's GC settings: set before the server's imports, its start-up objects frozen
        found = re.search(r"garbage collector: thresholds (\(.*?\)), (\d+) start-up objects frozen", log)
        assert found is not None, log[-2000:]
        assert found[1] == str(tuple(runtime["gc_thresholds"])) and int(found[2]) > 100_000, found[0]
        assert (
            Path(srv.log_path).stat().st_mode & 0o777 == 0o640
        )  # the run's umask, not the parent's at spawn
        assert prewarm.API_KEY_ENV.encode() not in Path(f"/proc/{waiting.pid}/cmdline").read_bytes()
        assert srv.api_key.encode() not in Path(f"/proc/{waiting.pid}/cmdline").read_bytes()
    finally:
        srv.stop()
    fresh = LocalInferenceServer(chat_model_dir, cfg, str(tmp_path / "logs2"), "policy")
    fresh.launch()
    try:
        assert fresh.process is not None and fresh.process is not waiting
    finally:
        fresh.kill()


def test_an_unused_prewarmed_process_leaves_when_the_run_lets_go() -> None:
    """A run that fails before starting its server, or wants another thread count, leaves no process."""
    from nexrl_hpc.inference import prewarm

    prewarm.prewarm(1, [])
    assert prewarm._prewarmed is not None
    waiting = prewarm._prewarmed[0]
    assert prewarm.take_prewarmed(2, []) is None  # another thread count: stopped, not handed out
    assert waiting.poll() is not None
    prewarm.prewarm(1, [])
    waiting = prewarm._prewarmed[0]
    assert prewarm.take_prewarmed(1, [700, 10, 10]) is None  # other GC thresholds: the same
    assert waiting.poll() is not None
    prewarm.prewarm(1, [])
    waiting = prewarm._prewarmed[0]
    prewarm.discard_prewarmed()
    assert waiting.poll() is not None and prewarm._prewarmed is None
    # a run that dies without a word: the pipe closes, the process reads no spec and leaves on its own
    prewarm.prewarm(1, [])
    waiting = prewarm._prewarmed[0]
    assert waiting.stdin is not None
    waiting.stdin.close()
    prewarm._prewarmed = None
    assert waiting.wait(timeout=120) == 0
