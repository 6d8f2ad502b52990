"""A LoRA policy served by a real vLLM server (CPU build, its own venv): each weight sync's adapter
(PEFT layout, as the trainer exports it) replaces the last in place, the server holds one adapter
whatever the number of syncs, scores the canary as peft does, and a server that missed an adapter
is named by verification. The whole-run test learns through it.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from nexrl_hpc.config.validate import ConfigError
from nexrl_hpc.inference.vllm_server import VLLMServer
from nexrl_hpc.models.tiny import materialize_base_model
from nexrl_hpc.trainer.logprobs import response_log_probs
from nexrl_hpc.weight_sync.transport import VLLMReloadTransport, WeightSyncError
from nexrl_hpc.weight_sync.verify import (
    CanaryReference,
    WeightVerificationError,
    WeightVerifier,
    canary_batch,
    engine_prompt_log_probs,
    max_abs_diff,
)
from tests.conftest import compose_config, run_train
from tests.helpers.vllm_canary import CanaryOnServer
from tests.helpers.vllm_venv import vllm_config
from tests.test_policy_trainer import make_batch, trainer

VLLM = ["seed=1", "service.inference_service.backend=vllm"]
LORA = ["service.train_service.actor.lora.rank=8", "service.train_service.actor.lora.alpha=16"]
CANARY = [[1, 5, 7, 9, 4, 6, 8, 5, 11], [1, 12, 4, 4, 9, 3]]


@pytest.fixture(scope="module")
def cfg() -> dict[str, Any]:
    return vllm_config([*VLLM, *LORA])


@pytest.fixture(scope="module")
def model_dir(cfg: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> str:
    return materialize_base_model(cfg["model"], str(tmp_path_factory.mktemp("vllm_lora") / "base_model"))


@pytest.fixture(scope="module")
def server(
    cfg: dict[str, Any], model_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VLLMServer]:
    svc = cfg["service"]["inference_service"]
    logs = str(tmp_path_factory.mktemp("vllm_lora_logs"))
    srv = VLLMServer(model_dir, svc["vllm"], logs, svc["model"], lora_max_rank=8)
    srv.start()
    yield srv
    srv.stop()


def _auth(server: VLLMServer) -> dict[str, str]:
    return {"Authorization": f"Bearer {server.api_key}"}


def _served(server: VLLMServer) -> list[str]:
    models = httpx.get(f"{server.base_url}/v1/models", headers=_auth(server), timeout=10).json()
    return sorted(m["id"] for m in models["data"])


def _score(server: VLLMServer, model: str) -> list[list[float]]:
    return engine_prompt_log_probs(httpx.Client(), str(server.base_url), _auth(server), model, CANARY, 60.0)


def _peft_scores(model_dir: str, adapter_dir: str | None) -> list[list[float]]:
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    with torch.no_grad():
        rows = response_log_probs(model.eval(), canary_batch(CANARY)).tolist()
    return [row[: len(p) - 1] for row, p in zip(rows, CANARY)]


def test_fifty_adapter_syncs_leave_one_adapter_that_scores_like_peft_and_a_missed_one_is_named(
    cfg: dict[str, Any], model_dir: str, server: VLLMServer, tmp_path: Path
) -> None:
    """The trainer's adapters (each after an update), published 50 times: vLLM lists its base (under
    ``policy:base``) and one adapter (``policy``), scores the canary as peft does with the last one,
    and verification of a version it was not sent names the server."""
    svc = cfg["service"]["inference_service"]
    assert _served(server) == ["policy:base"]  # no adapter before the first sync
    eng = trainer(model_dir, [*VLLM, *LORA])
    transport = VLLMReloadTransport(60.0, svc["vllm"]["pause_mode"], lora_adapter_name=svc["model"])
    transport.set_endpoint(str(server.base_url), server.api_key)
    for version in range(1, 51):
        if version % 10 == 1:  # an update every few versions: distinct adapters, a short test
            eng.update_actor({"batch": make_batch(8, version)})
        path = str(tmp_path / f"version_{version}")
        eng.export_weights(path)
        transport.publish(path, version)
        assert _served(server) == ["policy", "policy:base"], version
    # a peer without the run's key loads nothing (vLLM's key on /v1, the run's guard elsewhere)
    outsider = {"lora_name": "policy", "lora_path": str(tmp_path / "version_1"), "load_inplace": True}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        refused = httpx.post(
            f"{server.base_url}/v1/load_lora_adapter", json=outsider, headers=headers, timeout=10
        )
        assert refused.status_code == 401, refused.text
    info = httpx.get(f"{server.base_url}/weight_info", headers=_auth(server), timeout=10).json()
    assert info["weight_version"] == "50"
    expected = _peft_scores(model_dir, path)
    assert max_abs_diff(expected, _score(server, "policy")) <= 1e-4
    # the adapter changes what the engine computes (vLLM's own base under "policy:base" is not
    # asked: the run never requests it)
    assert max_abs_diff(expected, _peft_scores(model_dir, None)) > 1e-3

    verifier = WeightVerifier(cfg)  # type: ignore[arg-type]
    verifier.set_inference_services([CanaryOnServer(server, svc["model"])])
    assert verifier.verify(CanaryReference(version=50, prompts=CANARY, log_probs=expected)) <= 1e-4
    eng.update_actor({"batch": make_batch(8, 99)})
    eng.export_weights(str(tmp_path / "version_51"))  # trained, exported, never sent
    with pytest.raises(
        WeightVerificationError,
        match=rf"version 51 failed verification: inference_service_1 \({re.escape(str(server.base_url))}\)",
    ):
        verifier.verify(
            CanaryReference(
                version=51, prompts=CANARY, log_probs=_peft_scores(model_dir, str(tmp_path / "version_51"))
            )
        )


def test_an_adapter_for_a_server_started_without_lora_is_refused_naming_it(tmp_path: Path) -> None:
    eng_dir = tmp_path / "adapter"
    eng_dir.mkdir()
    (eng_dir / "adapter_config.json").write_text("{}")
    transport = VLLMReloadTransport(5.0, "wait")
    transport.set_endpoint("http://127.0.0.1:9", None)
    with pytest.raises(WeightSyncError, match="was not started for one"):
        transport.publish(str(eng_dir), 1)


@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        (
            ["service.inference_service.base_url=http://127.0.0.1:9"],
            "service.inference_service.base_url",
            "unset",
        ),
        (
            ["service.inference_service.vllm.max_lora_rank=8", "service.train_service.actor.lora.rank=16"],
            "service.inference_service.vllm.max_lora_rank",
            "above",
        ),
        (["service.train_service.actor.lora.rank=600"], "service.train_service.actor.lora.rank", "above"),
        (
            ["service.train_service.actor.lora.modules_to_save=[lm_head]"],
            "service.train_service.actor.lora.modules_to_save",
            "vLLM serves no module",
        ),
        (
            ["service.inference_service.vllm.max_lora_rank=12"],
            "service.inference_service.vllm.max_lora_rank",
            "12",
        ),
    ],
)
def test_preflight_refuses_what_vllm_lora_cannot_serve(overrides: list[str], key: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        compose_config([*VLLM, "service.train_service.actor.lora.rank=8", *overrides])
    assert key in str(err.value) and words in str(err.value), str(err.value)


@pytest.mark.e2e
def test_a_lora_run_through_vllm_learns_and_every_sync_is_verified(tmp_path: Path) -> None:
    """python -m launch.train backend=vllm lora.rank=16: the adapters reach vLLM, verification
    finds the trainer's adapted model on it at every version, and the policy learns."""
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    proc = run_train(
        [
            f"run_dir={run_dir}",
            "seed=7",
            "service.inference_service.backend=vllm",
            "service.train_service.actor.lora.rank=16",
            "train_worker.total_train_steps=20",
        ],
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    print(f"vLLM LoRA run: {time.monotonic() - t0:.0f}s, val/accuracy {val}")
    verified = {r["step"]: r["weight_sync/verify_max_abs_diff"] for r in rows if "weight_sync/seconds" in r}
    assert sorted(verified) == list(range(21)) and max(verified.values()) <= 1e-4, verified
    assert sorted(os.listdir(run_dir / "weights" / "version_20")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert val[0] <= 0.3 and val[-1] - val[0] >= 0.3, val
