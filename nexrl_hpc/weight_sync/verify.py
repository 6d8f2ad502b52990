"""Verified delivery: after a sync, every engine must compute with the weights the trainer published.

A version label proves nothing about the tensors an engine computes with (an engine that keeps
serving old or base weights while training "succeeds" is the worst failure of weight sync). So
after every ``weight.verify_every``-th sync, whatever the transport, a fixed canary — the first
``weight.verify_prompts`` prompts of the validation set (of the training set when the run has
none), tokenized once — is scored twice: by the trainer, with the weights of the version it just
published (``trainer_canary_log_probs``, taken by the train worker before the next update can run),
and by every inference engine (prompt log-probs: vLLM's ``prompt_logprobs`` on ``/v1/completions``,
which the local server implements too). The largest |Δ log p| over the canary's tokens must stay
≤ ``weight.verify_tolerance`` on every engine, else ``WeightVerificationError`` names the server,
the version and the disagreement, and the run stops as on a failed reload (exit 1).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypedDict

import httpx

from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.core.execute import execute, execute_async
from nexrl_hpc.weight_sync.lost import removed_of
from nexrl_hpc.weight_sync.transport import WeightSyncError

if TYPE_CHECKING:
    from nexrl_hpc.inference.interfaces import InferenceServiceRef
    from nexrl_hpc.trainer.backend import TrainBackend

logger = logging.getLogger(__name__)

VERIFIED_BACKENDS = ("local", "vllm")  # engines that answer prompt log-probs (SGLang: not yet)
FP32_TOLERANCE = 1e-4  # trainer and engine both in float32: the same math, summed in other orders
HALF_TOLERANCE = 1.0  # either in bfloat16/float16: catches base or garbled weights, not one small step


class WeightVerificationError(WeightSyncError):
    """An engine does not compute with the weights the trainer published: the run must stop."""


class CanaryReference(TypedDict):
    """The trainer's side of one verification: the canary and its log-probs under ``version``."""

    version: int
    prompts: list[list[int]]  # token ids of each canary prompt
    log_probs: list[list[float]]  # log p(token i | tokens < i), i >= 1, per prompt


def verification_applies(config: RLTrainConfig) -> bool:
    """Whether this run verifies syncs at all (``weight.verify_every`` > 0 and an engine that can)."""
    backend = config["service"]["inference_service"]["backend"]
    return config["weight"]["verify_every"] > 0 and backend in VERIFIED_BACKENDS


def verify_due(config: RLTrainConfig, version: int) -> bool:
    """Whether the sync of ``version`` is verified (version 0, the initial weights, always is)."""
    return verification_applies(config) and version % config["weight"]["verify_every"] == 0


def verify_tolerance(config: RLTrainConfig) -> float:
    """``weight.verify_tolerance``, or by dtype when null: ``FP32_TOLERANCE`` when the trainer and
    the engine both compute in float32, else ``HALF_TOLERANCE``."""
    set_tolerance = config["weight"]["verify_tolerance"]
    if set_tolerance is not None:
        return float(set_tolerance)
    service = config["service"]["inference_service"]
    train_dtype = config["service"]["train_service"]["dtype"]
    engine_dtype = service["vllm"]["dtype"] if service["backend"] == "vllm" else train_dtype
    return FP32_TOLERANCE if train_dtype == engine_dtype == "float32" else HALF_TOLERANCE


def canary_prompts(
    config: RLTrainConfig, tokenizer: Any, validation_files: Sequence[str], train_files: Sequence[str]
) -> list[list[int]]:
    """The first ``weight.verify_prompts`` prompts (of 2 tokens or more) of the validation files, or
    of the training files when there are none, as the token ids the rollout workers send."""
    from nexrl_hpc.data.prompts import engine_prompt
    from nexrl_hpc.data.rows import load_rows

    if validation_files:
        data, files, split = config["validate"]["data"], list(validation_files), "validation"
    else:
        data, files, split = config["data"], list(train_files), "train"
        logger.info("weight verification: no validation set, the canary is the first training prompts")
    wanted = config["weight"]["verify_prompts"]
    max_len = config["rollout_worker"]["max_prompt_length"]
    prompts: list[list[int]] = []
    for task in load_rows(data, files, split).tasks:
        sent = engine_prompt(
            tokenizer, task["prompt"], data["apply_chat_template"], data["add_generation_prompt"]
        )
        ids = list(sent) if isinstance(sent, list) else list(tokenizer(sent).input_ids)
        ids = ids[:max_len] if max_len else ids
        if len(ids) >= 2:
            prompts.append([int(t) for t in ids])
        if len(prompts) == wanted:
            break
    if not prompts:
        raise ValueError(
            f"weight.verify_prompts: no prompt of 2 tokens or more in {files} to verify weights with"
        )
    return prompts


def canary_batch(prompts: list[list[int]]) -> dict[str, Any]:
    """The canary as a trainer batch (the layout of ``algorithm.batching``): each prompt's first
    token as its prompt, the rest as its response, right-padded, so ``compute_log_prob`` returns
    log p of every token after the first."""
    import torch

    width = max(len(p) for p in prompts)
    input_ids = torch.zeros((len(prompts), width), dtype=torch.long)  # padding after every real token
    attention_mask = torch.zeros_like(input_ids)
    for i, ids in enumerate(prompts):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention_mask[i, : len(ids)] = 1
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": input_ids[:, 1:].clone(),
        "response_mask": attention_mask[:, 1:].float(),
        "logit_temperature": torch.ones(len(prompts)),  # engines score prompts at temperature 1
    }


def trainer_canary_log_probs(client: TrainBackend, prompts: list[list[int]], version: int) -> CanaryReference:
    """The trainer's log-probs of the canary with the weights it holds now (those of ``version``)."""
    answer = client.compute_log_prob({"batch": canary_batch(prompts), "meta_info": {}})
    rows = answer["batch"]["old_log_probs"].float().tolist()
    log_probs = [row[: len(p) - 1] for row, p in zip(rows, prompts)]
    return CanaryReference(version=version, prompts=prompts, log_probs=log_probs)


def engine_prompt_log_probs(
    http: httpx.Client,
    base_url: str,
    headers: dict[str, str],
    model: str,
    prompts: list[list[int]],
    timeout_s: float,
) -> list[list[float]]:
    """Each prompt's log-probs from an OpenAI-compatible server with vLLM's ``prompt_logprobs``."""
    url = f"{base_url.rstrip('/').removesuffix('/v1')}/v1/completions"
    out: list[list[float]] = []
    for ids in prompts:
        body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
        resp = http.post(url, json=body, headers=headers, timeout=timeout_s)
        if resp.status_code != 200:
            raise WeightVerificationError(
                f"{url} answered {resp.status_code} to the canary: {resp.text[:300]}"
            )
        entries = (resp.json().get("choices") or [{}])[0].get("prompt_logprobs")
        if not isinstance(entries, list) or len(entries) != len(ids):
            raise WeightVerificationError(f"{url}: no prompt_logprobs for the {len(ids)} canary tokens")
        out.append([float(entry[str(t)]["logprob"]) for t, entry in zip(ids[1:], entries[1:])])
    return out


def max_abs_diff(reference: list[list[float]], scored: list[list[float]]) -> float:
    """max |a - b| over every token (inf when the shapes differ, NaN when either is NaN)."""
    if [len(r) for r in reference] != [len(s) for s in scored]:
        return math.inf
    worst = 0.0
    for row_a, row_b in zip(reference, scored):
        for a, b in zip(row_a, row_b):
            diff = abs(a - b)
            if math.isnan(diff):
                return math.nan
            worst = max(worst, diff)
    return worst


class WeightVerifier:
    """Has every inference service score the trainer's canary; any disagreement stops the run."""

    def __init__(self, config: RLTrainConfig):
        self.tolerance = verify_tolerance(config)
        self._inference_services: list[InferenceServiceRef] = []

    def set_inference_services(self, services: Sequence[InferenceServiceRef]) -> None:
        self._inference_services = list(services)

    def verify(
        self, reference: CanaryReference, services: Sequence[InferenceServiceRef] | None = None
    ) -> float:
        """The largest |Δ log p| over the engines (``services``, those the version was published
        to; default: all); raises ``WeightVerificationError`` naming each engine over
        ``tolerance`` (or that could not score the canary)."""
        version, prompts = reference["version"], reference["prompts"]
        if not all(math.isfinite(v) for row in reference["log_probs"] for v in row):
            raise WeightVerificationError(
                f"weight version {version}: the trainer's own log-probs of the canary are not finite: "
                "the weights are broken (NaN or inf), whatever the engines serve"
            )
        services = list(self._inference_services if services is None else services)
        futures = [(s, execute_async(s.score_canary, prompts)) for s in services]
        tokens = sum(len(p) - 1 for p in prompts)
        worst, failures = 0.0, []
        for service, future in futures:
            name = execute(service.get_module_name)
            try:
                diff = max_abs_diff(reference["log_probs"], future.result())
            except Exception as exc:
                if removed_of(
                    {name: exc}, lambda: [execute(s.get_module_name) for s in self._inference_services]
                ):
                    logger.warning("%s was lost while scoring the canary of version %d", name, version)
                    continue  # lost meanwhile (policy continue), as in the publisher
                failures.append(f"{name}: the canary could not be scored ({exc})")
                continue
            worst = diff if math.isnan(diff) else max(worst, diff)
            if not diff <= self.tolerance:
                failures.append(
                    f"{name} ({execute(service.describe)}) does not compute with the trainer's weights of "
                    f"version {version}: max |delta log p| = {diff:.3g} over {tokens} canary tokens, "
                    f"over weight.verify_tolerance = {self.tolerance:.3g}"
                )
        if failures:
            raise WeightVerificationError(
                f"weight version {version} failed verification: " + "; ".join(failures)
            )
        logger.info(
            "weight version %d verified on %d engine(s): max |delta log p| %.3g", version, len(futures), worst
        )
        return worst
