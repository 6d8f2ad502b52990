"""The broadcast transport into a real vLLM server (CPU build, its own venv) through vLLM's own
weight-transfer API and the run's engine plugin: FSDP2 and ZeRO-3 trainer groups of two gloo ranks
send a tied GQA Qwen2 bucket by bucket; the engine's log-probs are the trainer's (fp32)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from nexrl_hpc.inference.vllm_server import VLLMServer
from nexrl_hpc.weight_sync.broadcast import BroadcastRendezvous
from nexrl_hpc.weight_sync.transport import VLLMBroadcastTransport
from tests.conftest import REPO
from tests.helpers.vllm_venv import vllm_config

OVERRIDES = ["service.inference_service.backend=vllm"]


@pytest.fixture(scope="module")
def cfg() -> dict[str, Any]:
    return vllm_config(OVERRIDES)


@pytest.fixture(scope="module")
def server(
    cfg: dict[str, Any], chatml_model_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VLLMServer]:
    svc = cfg["service"]["inference_service"]
    logs = str(tmp_path_factory.mktemp("vllm_logs"))
    srv = VLLMServer(chatml_model_dir, svc["vllm"], logs, svc["model"], weight_broadcast=True)
    srv.start()
    yield srv
    srv.stop()


def _prompt_log_probs(cfg: dict[str, Any], server: VLLMServer, prompt: list[int]) -> list[float]:
    """The engine's log-prob of each prompt token after the first."""
    resp = httpx.post(
        f"{server.base_url}/v1/completions",
        headers={"Authorization": f"Bearer {server.api_key}"},
        json={
            "model": cfg["service"]["inference_service"]["model"],
            "prompt": prompt,
            "max_tokens": 1,
            "prompt_logprobs": 0,
        },
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    scored = resp.json()["choices"][0]["prompt_logprobs"][1:]
    return [float(entry[str(token)]["logprob"]) for entry, token in zip(scored, prompt[1:])]


def _trainer_prompt_log_probs(model_dir: str, prompt: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert (
        model.config.tie_word_embeddings
        and model.config.num_key_value_heads < model.config.num_attention_heads
    )
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0].float(), dim=-1)
    return [float(logp[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]


@pytest.mark.parametrize("engine", ["fsdp", "deepspeed"])
def test_tied_model_from_a_two_rank_trainer_group_reaches_vllm_by_broadcast(
    cfg: dict[str, Any], server: VLLMServer, chatml_model_dir: str, tmp_path: Path, engine: str
) -> None:
    if engine == "deepspeed":
        pytest.importorskip("deepspeed", reason="engine=deepspeed needs the deepspeed extra")
    version = 1 if engine == "fsdp" else 2  # also the trainer's batch seed: each version its own weights
    rendezvous = BroadcastRendezvous("127.0.0.1", "gloo", timeout_s=240.0, bucket_mb=1)
    spec = rendezvous.spec(world_size=2, version=version)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [
        "-m",
        "tests.helpers.broadcast_trainer",
        chatml_model_dir,
        str(tmp_path),
        engine,
        json.dumps(spec),
        str(version),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    trainer = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    transport = VLLMBroadcastTransport(60.0, cfg["service"]["inference_service"]["vllm"]["pause_mode"], 1)
    assert server.base_url is not None
    transport.set_endpoint(server.base_url, server.api_key)
    errors: list[BaseException] = []

    def receive() -> None:
        try:
            transport.receive(spec, 1, version)
        except BaseException as exc:
            errors.append(exc)

    receiver = threading.Thread(target=receive)
    receiver.start()
    out, err = trainer.communicate(timeout=420)
    receiver.join(timeout=120)
    assert trainer.returncode == 0, err[-4000:]
    assert not errors and not receiver.is_alive(), errors
    sent = json.loads((tmp_path / "sent.json").read_text())
    assert sent["buckets"] >= 2  # 1 MiB buckets: gathered and sent one at a time
    assert transport.served_version == version
    # ids the tokenizer has (its 301 tokens; vLLM refuses others)
    prompt = [int(t) for t in torch.randint(3, 290, (24,), generator=torch.Generator().manual_seed(version))]
    started = time.monotonic()
    engine_lp = _prompt_log_probs(cfg, server, prompt)
    trainer_lp = _trainer_prompt_log_probs(str(tmp_path / "weights"), prompt)
    gap = max(abs(a - b) for a, b in zip(engine_lp, trainer_lp))
    assert gap <= 1e-4, (engine, gap, time.monotonic() - started)
    # the weights did move away from what vLLM started with (a stale engine would not pass above)
    base_lp = _trainer_prompt_log_probs(chatml_model_dir, prompt)
    assert max(abs(a - b) for a, b in zip(base_lp, trainer_lp)) > 1e-3


def test_a_server_of_two_tensor_parallel_workers_receives_every_shard_by_broadcast(
    cfg: dict[str, Any], chatml_model_dir: str, tmp_path: Path
) -> None:
    """vLLM with ``tensor_parallel_size=2``: both workers join the sync's group (ranks 1 and 2)
    and each loads its own shards of the full tensors it receives (the vocabulary split between
    them: each shard holds real rows of the tied embedding and head). The engine's log-probs are
    the sender's perturbed weights'. CPU vLLM binds one worker per NUMA node, so on a one-node
    machine the workers are bound to cores through ``vllm.env`` (VLLM_CPU_OMP_THREADS_BIND)."""
    from transformers import AutoModelForCausalLM

    from nexrl_hpc.checkpoint.trainer_io import tied_weight_names
    from nexrl_hpc.trainer.parallel import SingleProcess
    from nexrl_hpc.trainer.weight_broadcast import broadcast_weights

    svc = cfg["service"]["inference_service"]
    cores = sorted(os.sched_getaffinity(0))
    binding = f"{cores[0]}|{cores[-1]}"
    vllm = dict(
        svc["vllm"], tensor_parallel_size=2, env=dict(svc["vllm"]["env"], VLLM_CPU_OMP_THREADS_BIND=binding)
    )
    server = VLLMServer(chatml_model_dir, vllm, str(tmp_path / "logs"), svc["model"], weight_broadcast=True)
    server.start()
    try:
        model = AutoModelForCausalLM.from_pretrained(chatml_model_dir, dtype=torch.float32).eval()
        generator = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.05 * torch.randn(param.shape, generator=generator))
        assert model.config.vocab_size > 64 * 2  # vLLM pads to 64 a shard: the second one has real rows
        rendezvous = BroadcastRendezvous("127.0.0.1", "gloo", timeout_s=120.0, bucket_mb=1)
        spec = rendezvous.spec(world_size=3, version=1)
        transport = VLLMBroadcastTransport(60.0, vllm["pause_mode"], vllm["tensor_parallel_size"])
        assert transport.receivers() == 2 and server.base_url is not None
        transport.set_endpoint(server.base_url, server.api_key)
        errors: list[BaseException] = []

        def receive() -> None:
            try:
                transport.receive(spec, 1, 1)
            except BaseException as exc:
                errors.append(exc)

        receiver = threading.Thread(target=receive)
        receiver.start()
        sent = broadcast_weights(SingleProcess(), model, spec, set(tied_weight_names(model)))
        receiver.join(timeout=120)
        assert not errors and not receiver.is_alive(), errors
        assert sent["buckets"] >= 2 and transport.served_version == 1
        prompt = [int(t) for t in torch.randint(3, 290, (24,), generator=torch.Generator().manual_seed(1))]
        engine_lp = _prompt_log_probs(cfg, server, prompt)
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0], dim=-1)
        sender_lp = [float(logp[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
        assert max(abs(a - b) for a, b in zip(engine_lp, sender_lp)) <= 1e-4
        base_lp = _trainer_prompt_log_probs(chatml_model_dir, prompt)
        assert max(abs(a - b) for a, b in zip(base_lp, sender_lp)) > 1e-2  # the weights moved
        # vLLM's reload names each layer that received nothing: only the rotary embedding may (its
        # cos/sin cache is computed, not loaded); an embedding shard that got no rows would be here
        log = "".join(p.read_text() for p in (tmp_path / "logs").glob("*.log"))
        unloaded = set(re.findall(r"\] (\w+): Failed to load weights", log))
        assert unloaded <= {"RotaryEmbedding"}, unloaded
    finally:
        server.stop()
