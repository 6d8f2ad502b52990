"""Ulysses sequence parallelism: SP=2 computes what SP=1 computes, and the settings it cannot run
are refused before a run starts, naming the key.

The equality runs on two real gloo ranks (torchrun) with FSDP2 over both: SP=1 (two data-parallel
ranks) against SP=2 (one group of two ranks splitting every sequence), on tiny GQA Qwen2 models
with 1 K/V head (replicated to each rank) and 2, padded and packed, eager and sdpa, with activation
checkpointing, a KL reference model and an entropy bonus in some cases.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from nexrl_hpc.config.location import config_dir
from nexrl_hpc.config.validate import ConfigError
from nexrl_hpc.launcher.preflight import preflight
from nexrl_hpc.trainer.batch_plan import data_parallel_rows, plan_batch
from nexrl_hpc.trainer.checks import sequence_parallel_problems
from nexrl_hpc.trainer.sequence_parallel import (
    KEY,
    emulate_sequence_parallel,
    enable_sequence_parallel,
    kv_repeat,
    tokens_per_rank,
    whole_sequence_mask,
)
from tests.conftest import REPO, compose_config, compose_raw
from tests.helpers.sequence_parallel_numerics import make_long_batch

PACKED = (
    "service.train_service.actor.packing=true",
    "service.train_service.actor.ppo_max_token_len_per_gpu=40",
)
CASES: dict[str, tuple[int, tuple[str, ...]]] = {  # name: (K/V heads, overrides)
    "kv1_padded_eager": (1, ()),
    "kv1_packed_sdpa_checkpointed": (
        1,
        (*PACKED, "model.attn_implementation=sdpa", "model.gradient_checkpointing=true"),
    ),
    "kv2_padded_sdpa_kl_entropy": (
        2,
        (
            "model.attn_implementation=sdpa",
            "algorithm.kl_loss_coef=0.1",
            "service.train_service.actor.entropy_coeff=0.01",
        ),
    ),
    "kv2_packed_eager": (2, PACKED),
    "kv2_padded_sdpa_lora_kl": (
        2,
        (
            "model.attn_implementation=sdpa",
            "service.train_service.actor.lora.rank=8",
            "algorithm.kl_loss_coef=0.1",  # LoRA's reference: the same model with the adapter off
        ),
    ),
}


@pytest.fixture(scope="module")
def gqa_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """Tiny Qwen2 models with 4 query heads and 1 or 2 K/V heads."""
    from nexrl_hpc.models.tiny import materialize_base_model

    root = tmp_path_factory.mktemp("gqa")
    dirs = {}
    for kv in (1, 2):
        cfg = compose_config(
            ["seed=1", "model.tiny.architecture=qwen2", f"model.tiny.num_key_value_heads={kv}"]
        )
        dirs[kv] = materialize_base_model(cfg["model"], str(root / f"qwen2_kv{kv}"))
    return dirs


@pytest.fixture(scope="module")
def sp_runs(gqa_model_dirs: dict[int, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every case at SP=1 and SP=2, in one launch of two ranks."""
    root = tmp_path_factory.mktemp("sp")
    args: list[str] = []
    for name, (kv, overrides) in CASES.items():
        for sp in (1, 2):
            args += [*(["::"] if args else []), gqa_model_dirs[kv], str(root / f"{name}_sp{sp}.pt"), str(sp)]
            args += overrides
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += ["-m", "tests.helpers.sequence_parallel_numerics", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {
        name: [torch.load(root / f"{name}_sp{sp}.pt", weights_only=False) for sp in (1, 2)] for name in CASES
    }


@pytest.mark.e2e
@pytest.mark.parametrize("case", list(CASES))
def test_sp2_equals_sp1_loss_gradients_and_log_probs(sp_runs: dict[str, Any], case: str) -> None:
    one, two = sp_runs[case]
    assert torch.allclose(one["logp"], two["logp"], atol=1e-5, rtol=0), (
        (one["logp"] - two["logp"]).abs().max()
    )
    for key in (
        "actor/loss",
        "actor/pg_loss",
        "actor/kl_loss",
        "actor/entropy",
        "actor/grad_norm",
        "actor/ppo_kl",
    ):
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], abs=1e-5), key
    assert one["metrics"]["actor/optimizer_steps"] == two["metrics"]["actor/optimizer_steps"] == 1
    assert one["grads"].keys() == two["grads"].keys()
    worst = max(float((one["grads"][k] - two["grads"][k]).abs().max()) for k in one["grads"])
    assert worst <= 1e-5, worst
    assert max(float(g.abs().max()) for g in one["grads"].values()) > 1e-3  # a gradient that could differ


@pytest.mark.e2e
def test_mpi_trainer_group_with_sequence_parallelism_trains(tmp_path: Path) -> None:
    """mpirun -n 5 (driver, 2 trainer ranks, 2 rollout ranks), the rank-0-centric protocol with
    SP=2: the log-probs the group recomputes (scattered, computed split, gathered without the
    copies) and those it trains with are the inference engine's for the same tokens. (Step-by-step
    equality with SP=1 is not asked here: which samples a step gets depends on the timing of the
    rollout ranks; the equality is ``test_sp2_equals_sp1_loss_gradients_and_log_probs``'s.)"""
    run_dir = tmp_path / "sp2"
    args = [
        f"run_dir={run_dir}",
        "seed=2",
        "service.train_service.engine=fsdp",
        "service.train_service.world_size=2",
        f"{KEY}=2",
        "train_worker.total_train_steps=2",
        "validate.validate_before_train=false",
        "validate.validate_at_end=false",
        "validate.eval.validate_freq=0",
        "logger.backend=[]",
    ]
    cmd = ["mpirun", "-n", "5", sys.executable, "-m", "launch.train", "launch_mode=mpi", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for rank in (1, 2):
        log = (run_dir / "logs" / f"rank_{rank}.log").read_text()
        assert (
            f"sequence parallelism: 2 ranks split each sequence (this rank: {rank - 1} of its group)" in log
        )
    with open(run_dir / "metrics.jsonl") as f:
        steps = [json.loads(line) for line in f if "actor/pg_loss" in line]
    assert [r["step"] for r in steps] == [1, 2]
    first = steps[0]  # the weights the engines sampled with
    assert first["train/logprob_mismatch_max"] <= 1e-4, first["train/logprob_mismatch_max"]
    assert first["actor/logprob_mismatch_max"] <= 1e-4, first["actor/logprob_mismatch_max"]
    assert all(math.isfinite(r["actor/pg_loss"]) and r["actor/grad_norm"] > 0 for r in steps)


def test_plan_gives_a_sequence_parallel_group_one_data_parallel_shard() -> None:
    """World 4, SP 2: the batch is planned for 2 data-parallel ranks; ranks 0-1 and 2-3 get the
    same rows and micro-batches, and the gathered rows drop the copies."""
    batch = make_long_batch(11, seed=3)
    overrides = [
        "service.train_service.actor.ppo_micro_batch_size=2",
        "service.train_service.actor.share_prompt=false",
    ]
    actor = compose_config(overrides)["service"]["train_service"]["actor"]
    dp_plan, dp_shards = plan_batch("compute_log_prob", batch, actor, 2, None)
    plan, shards = plan_batch("compute_log_prob", batch, actor, 4, None, sequence_parallel=2)
    assert plan["sequence_parallel"] == 2 and dp_plan["sequence_parallel"] == 1
    assert plan["counts"] == [[6, 6, 5, 5]] and dp_plan["counts"] == [[6, 5]]
    assert plan["micro"][0] == [dp_plan["micro"][0][r // 2] for r in range(4)]
    assert plan["passes"] == dp_plan["passes"] and plan["normalizers"] == dp_plan["normalizers"]
    for r in range(4):
        assert all(torch.equal(shards[r][k], dp_shards[r // 2][k]) for k in dp_shards[0])
    rows = torch.arange(22).reshape(22, 1)  # 6 + 6 + 5 + 5 rows gathered in rank order
    assert data_parallel_rows(rows, [6, 6, 5, 5], 2).flatten().tolist() == [*range(6), *range(12, 17)]
    assert torch.equal(data_parallel_rows(rows[:11], [6, 5], 1), rows[:11])


def test_kv_heads_are_replicated_to_a_multiple_of_the_group() -> None:
    assert [kv_repeat(kv, 2) for kv in (1, 2, 4)] == [2, 1, 1]
    assert [kv_repeat(kv, 4) for kv in (1, 2, 3, 4, 8)] == [4, 2, 4, 1, 1]
    assert kv_repeat(2, 8) * 2 == 8  # 14 heads / 2 K/V heads (Qwen2.5-0.5B) is refused at SP 8 by its heads
    assert [tokens_per_rank(4096, p) for p in (1, 2, 3)] == [4096, 2048, 1366]


def test_whole_sequence_mask_packed_and_padded() -> None:
    """Packed: causal within each sequence (positions restarting); padded: causal over the real keys;
    the diagonal always (a padding row is never fully masked)."""
    packed = whole_sequence_mask(torch.tensor([[0, 1, 2, 0, 1, 0]]), None)[0]
    blocks = torch.block_diag(torch.ones(3, 3), torch.ones(2, 2), torch.ones(1, 1)).bool()
    assert torch.equal(packed, blocks & torch.ones(6, 6, dtype=torch.bool).tril())
    padded = whole_sequence_mask(torch.tensor([[0, 0, 0, 1, 2]]), torch.tensor([[0, 0, 1, 1, 1]]))[0]
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [0, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]],
        dtype=torch.bool,
    )
    assert torch.equal(padded, expected)


def _problems(overrides: list[str]) -> list[tuple[str, str]]:
    return [(p.path, p.message) for p in sequence_parallel_problems(compose_raw(overrides))]


MPI_FSDP = ["launch_mode=mpi", "service.train_service.engine=fsdp", "service.train_service.world_size=4"]


def test_preflight_refuses_what_sequence_parallelism_cannot_run() -> None:
    ok = [*MPI_FSDP, f"{KEY}=2", "service.train_service.actor.share_prompt=auto"]
    assert _problems(ok) == []
    assert _problems(["service.train_service.world_size=1", f"{KEY}=1"]) == []  # the default
    refusals = {
        "2 must divide service.train_service.world_size=3": [
            *MPI_FSDP,
            "service.train_service.world_size=3",
            f"{KEY}=2",
        ],
        "needs service.train_service.engine=fsdp (not deepspeed)": [
            *ok,
            "service.train_service.engine=deepspeed",
        ],
        "share_prompt": [*ok, "service.train_service.actor.share_prompt=true"],
        "must divide the model's 4 attention heads": [
            *MPI_FSDP,
            "service.train_service.world_size=8",
            f"{KEY}=8",
        ],
    }
    for needle, overrides in refusals.items():
        got = _problems(overrides)
        assert len(got) == 1 and got[0][0] == KEY and needle in got[0][1], (needle, got)
    # the launcher's pre-flight: the key named, exit code 2, before anything starts
    with pytest.raises(ConfigError) as err:
        preflight(config_dir(), "rl_train", [*MPI_FSDP, f"{KEY}=8"])
    assert err.value.exit_code == 2 and KEY in str(err.value)


def test_model_path_heads_are_read_from_its_config(tmp_path: Path) -> None:
    """``model.path``: the heads come from its config.json (3 heads cannot split over 2 ranks)."""
    from transformers import Qwen2Config

    Qwen2Config(hidden_size=48, num_attention_heads=3, num_key_value_heads=1).save_pretrained(tmp_path)
    got = _problems([*MPI_FSDP, f"{KEY}=2", f"model.path={tmp_path}"])
    assert got == [(KEY, "2 must divide the model's 3 attention heads (each rank attends with heads / size)")]


def test_the_trainer_refuses_heads_that_do_not_split(tiny_model_dir: str) -> None:
    """Defence behind the pre-flight (a standalone service's torchrun world is its own): the model's
    heads are checked when sequence parallelism is enabled, naming the key."""
    from nexrl_hpc.models.tiny import load_model

    model = load_model(tiny_model_dir)
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match=f"{KEY}=3 must divide the model's 4 attention heads"):
        enable_sequence_parallel(model, None, 3, 0)
    assert model.config._attn_implementation == before  # left as it was


def test_one_rank_emulated_in_one_process_has_a_real_ranks_shapes(tiny_model_dir: str) -> None:
    """For a per-rank memory measurement without torch.distributed: rank 0 of an SP=2 group, the
    other rank's data stood in; the decoder runs on half of each row, the logits cover whole rows
    (odd widths padded), and the backward pass runs."""
    from nexrl_hpc.models.tiny import load_model

    model = load_model(tiny_model_dir, attn_implementation="sdpa")
    emulate_sequence_parallel(model, 2)
    seen: list[tuple[int, ...]] = []
    model.model.layers[0].mlp.register_forward_hook(lambda _m, _a, out: seen.append(tuple(out.shape)))
    tokens = torch.randint(4, 16, (3, 11))
    out = model(input_ids=tokens, position_ids=torch.arange(11).expand(3, 11), use_cache=False)
    assert seen == [(3, 6, 128)]  # 11 tokens padded to 12, 6 on this rank
    assert out.logits.shape == (3, 11, model.config.vocab_size)
    out.logits.float().logsumexp(-1).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert tokens_per_rank(11, 2) == 6


def test_flash_attention_gets_its_own_name_and_the_whole_rows_positions(
    tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """flash_attention_2 (GPU only) through the wrapper, its kernel stood in by sdpa: it sees its own
    name in the config (it picks its kernel by it), the whole rows' position ids (varlen packing)
    and the 2-D padding mask when the rows are padded, none when packed."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from nexrl_hpc.models.tiny import load_model

    seen: list[tuple[str, tuple[int, ...], Any]] = []

    def fake_flash(module: Any, query: Any, key: Any, value: Any, mask: Any, **kwargs: Any) -> Any:
        seen.append((module.config._attn_implementation, tuple(kwargs["position_ids"].shape), mask))
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "flash_attention_2", fake_flash)
    model = load_model(tiny_model_dir, attn_implementation="sdpa")
    model.config._attn_implementation = "flash_attention_2"
    emulate_sequence_parallel(model, 2)
    assert model.config._attn_implementation == "nexrl_ulysses_flash_attention_2"
    tokens = torch.randint(4, 16, (2, 7))
    model(input_ids=tokens, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3]] * 2), use_cache=False)
    assert [(name, shape) for name, shape, _ in seen] == [("flash_attention_2", (2, 8))] * 2  # 2 layers
    assert all(mask is None for _, _, mask in seen)
    seen.clear()
    padding = torch.tensor([[0, 0, 1, 1, 1, 1, 1]] * 2)
    model(
        input_ids=tokens, attention_mask=padding, position_ids=torch.arange(7).expand(2, 7), use_cache=False
    )
    assert seen[0][2].tolist() == [[0, 0, 1, 1, 1, 1, 1, 0]] * 2  # padded to 8: the tail masked


@pytest.mark.parametrize("kind", ["eager", "sdpa"])
def test_the_wrapper_on_a_group_of_one_is_the_model(tiny_model_dir: str, kind: str) -> None:
    """P=1 (the exchanges are identities): the wrapper's own masks give the model's logits, for
    padded rows (2-D mask), packed rows (sequences restarting their positions) and whole rows
    (sdpa: its causal kernel, no mask)."""
    from nexrl_hpc.models.tiny import load_model

    plain, wrapped = load_model(tiny_model_dir, attn_implementation=kind), load_model(tiny_model_dir)
    wrapped.config._attn_implementation = kind
    sp = emulate_sequence_parallel(wrapped, 1)
    tokens = torch.randint(4, 16, (2, 9))
    padding = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 9])
    layouts = {
        "padded": (padding, (padding.cumsum(-1) - 1).clamp(min=0), padding.bool()),
        "packed": (None, torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1], [0, 1, 0, 1, 2, 3, 4, 5, 6]]), None),
        "whole": (None, torch.arange(9).expand(2, 9), None),
    }
    for name, (mask, positions, real) in layouts.items():
        kwargs = {"input_ids": tokens, "attention_mask": mask, "position_ids": positions, "use_cache": False}
        want, got = plain(**kwargs).logits, wrapped(**kwargs).logits
        keep = real if real is not None else torch.ones(2, 9, dtype=torch.bool)
        assert torch.allclose(want[keep], got[keep], atol=1e-5, rtol=0), (
            name,
            (want - got)[keep].abs().max(),
        )
        assert sp.state is not None and sp.state.causal_only() == (name == "whole"), name
