"""Trainer engines over several ranks compute what the single-process engine computes.

Two real torch.distributed ranks (torchrun, gloo on CPU) against one process, on the same batches
(with an LR warm-up, so the scheduled LR must be the one applied): weights after 3 ``update_actor``
calls within 1e-5, ``compute_log_prob`` within 1e-6; a checkpoint reloads exactly into the same
layout (FSDP2's into one process too), and non-finite gradients skip the optimizer step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nexrl_hpc.checkpoint.hf import read_safetensors_dir
from tests.conftest import REPO
from tests.test_policy_trainer import make_batch

pytestmark = pytest.mark.e2e


def run_engine(model_dir: str, out: Path, engine: str, ranks: int, overrides: tuple[str, ...] = ()) -> None:
    run_engines([(model_dir, out, engine, overrides)], ranks)


Case = tuple[str, Path, str, tuple[str, ...]]  # model dir, output dir, engine, config overrides


def run_engines(cases: list[Case], ranks: int) -> None:
    """The cases one after another in one launch of ``ranks`` processes (one start-up for all)."""
    module = ["-m", "tests.helpers.engine_numerics"]
    for i, (model_dir, out, engine, overrides) in enumerate(cases):
        out.mkdir(parents=True)
        module += [*(["::"] if i else []), model_dir, str(out), engine, "3", *overrides]
    if ranks == 1:
        cmd = [sys.executable, *module]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(ranks),
            *module,
        ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120 + 120 * len(cases)
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def single_runs(
    tiny_model_dir: str, chatml_model_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """What the single-process engine computes for the tiny model and the tied chat model (shared
    by every comparison in this module)."""
    root = tmp_path_factory.mktemp("engines")
    runs = {"tiny": root / "single", "tied": root / "single_tied"}
    run_engines(
        [(tiny_model_dir, runs["tiny"], "single", ()), (chatml_model_dir, runs["tied"], "single", ())], 1
    )
    return runs


@pytest.fixture(scope="module")
def single_run(single_runs: dict[str, Path]) -> Path:
    return single_runs["tiny"]


@pytest.fixture(scope="module")
def tied_single_run(single_runs: dict[str, Path]) -> Path:
    return single_runs["tied"]


PACKED_BY_TOKENS = (
    "service.train_service.actor.packing=true",
    "service.train_service.actor.ppo_max_token_len_per_gpu=20",
)
SHARED_PROMPTS = (
    "service.train_service.actor.share_prompt=true",
    "service.train_service.actor.ppo_max_token_len_per_gpu=20",
)
ZERO3 = ("service.train_service.deepspeed.zero_stage=3",)


@pytest.fixture(scope="module")
def fsdp_runs(
    tiny_model_dir: str, chatml_model_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Every FSDP2 case of this module, on two ranks of one launch."""
    root = tmp_path_factory.mktemp("fsdp")
    cases = {
        "plain": (tiny_model_dir, ()),
        "packed": (tiny_model_dir, PACKED_BY_TOKENS),
        "shared": (tiny_model_dir, SHARED_PROMPTS),  # the 4-D mask through FSDP2
        "tied": (chatml_model_dir, ()),
    }
    run_engines([(model, root / name, "fsdp", over) for name, (model, over) in cases.items()], 2)
    return {name: root / name for name in cases}


@pytest.fixture(scope="module")
def deepspeed_runs(
    tiny_model_dir: str, chatml_model_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Every two-rank DeepSpeed case of this module (ZeRO stages 0-3, packed, shared prompts, the
    tied model), on two ranks of one launch."""
    _need_deepspeed()
    root = tmp_path_factory.mktemp("deepspeed")
    stages = {
        f"zero{k}": (tiny_model_dir, (f"service.train_service.deepspeed.zero_stage={k}",)) for k in range(4)
    }
    cases = {
        **stages,
        "packed": (tiny_model_dir, (*PACKED_BY_TOKENS, *ZERO3)),
        "shared": (tiny_model_dir, (*SHARED_PROMPTS, *ZERO3)),  # the 4-D mask through ZeRO-3
        "tied": (chatml_model_dir, ZERO3),
    }
    run_engines([(model, root / name, "deepspeed", over) for name, (model, over) in cases.items()], 2)
    return {name: root / name for name in cases}


def assert_matches_single(ref: Path, got: Path, base_model_dir: str, reload_in_place: bool = True) -> None:
    w_ref, w_got = read_safetensors_dir(str(ref / "weights")), read_safetensors_dir(str(got / "weights"))
    assert set(w_ref) == set(w_got)
    base = read_safetensors_dir(base_model_dir)
    moved = max(float((w_ref[k] - base[k]).abs().max()) for k in w_ref if k in base)
    assert moved > 1e-3  # the updates did change the weights
    worst = max(float((w_ref[k] - w_got[k]).abs().max()) for k in w_ref)
    assert worst <= 1e-5, worst
    lp_ref, lp_got = torch.load(ref / "logp.pt"), torch.load(got / "logp.pt")
    assert lp_ref.shape == lp_got.shape == (13, 2)
    # response positions only: past a response the padded engine's value is noise, a packed one's 0
    mask = make_batch(13, seed=0)["response_mask"]
    assert float(((lp_ref - lp_got) * mask).abs().max()) <= 1e-6
    m_ref = json.loads((ref / "metrics.json").read_text())
    m_got = json.loads((got / "metrics.json").read_text())
    for a, b in zip(m_ref, m_got):
        assert b["actor/pg_loss"] == pytest.approx(a["actor/pg_loss"], abs=1e-6)
        assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-5)
        assert b["actor/optimizer_steps"] == a["actor/optimizer_steps"] == 2
        assert b["actor/lr"] == a["actor/lr"]
    assert [m["actor/lr"] for m in m_got] == [5e-4, 1e-3, 1e-3]
    for run, in_place in ((ref, True), (got, reload_in_place)):
        resumed = json.loads((run / "resumed.json").read_text())
        assert resumed == {
            "same_logp": True,
            "next_update_diff": 0.0,
            "nan_skipped": 2,
            "nan_weights_equal": True,
            "reload_in_place": in_place,
        }, (run, resumed)


def assert_other_layout_loads_weights_and_refuses_optimizer(
    model_dir: str, ckpt: Path, saved_by: str
) -> None:
    """A single-process engine loads a 2-rank DeepSpeed checkpoint's weights, and refuses its
    optimizer state naming both layouts and the key."""
    from nexrl_hpc.trainer.policy_trainer import PolicyTrainer
    from nexrl_hpc.trainer.worker import TrainWorker
    from tests.conftest import compose_config

    assert sorted(p.name for p in (ckpt / "optimizer").iterdir()) == [
        "rank_0.safetensors",
        "rank_0.safetensors.xxh3",
        "rank_1.safetensors",
        "rank_1.safetensors.xxh3",
    ]
    eng = PolicyTrainer(model_dir)
    eng.initialize_worker(TrainWorker(compose_config(), eng).train_service_config())
    eng.init_model()
    with pytest.raises(ValueError) as err:
        eng.load_checkpoint(str(ckpt))
    assert f"engine={saved_by} on 2 rank(s)" in str(err.value) and "engine=single on 1" in str(err.value)
    assert "service.train_service.engine" in str(err.value)
    eng.load_checkpoint(str(ckpt), load_optimizer=False)  # the weights load at any world size
    saved = read_safetensors_dir(str(ckpt / "model"))
    for k, v in eng.model.state_dict().items():
        assert torch.equal(v, saved[k]), k


def test_fsdp2_on_two_ranks_matches_the_single_process_engine(
    tiny_model_dir: str, single_run: Path, fsdp_runs: dict[str, Path]
) -> None:
    assert_matches_single(single_run, fsdp_runs["plain"], tiny_model_dir)


def test_checkpoint_of_two_fsdp_ranks_loads_weights_and_optimizer_into_one_process(
    tiny_model_dir: str, fsdp_runs: dict[str, Path]
) -> None:
    """FSDP2's optimizer state is resharded (the numerics: tests/test_reshard.py): the single-process
    engine holds each parameter's moments as the two rank files' rows end to end."""
    from nexrl_hpc.checkpoint.state_file import load_state_file
    from nexrl_hpc.trainer.policy_trainer import PolicyTrainer
    from nexrl_hpc.trainer.worker import TrainWorker
    from tests.conftest import compose_config

    ckpt = fsdp_runs["plain"] / "ckpt"
    eng = PolicyTrainer(tiny_model_dir)
    eng.initialize_worker(TrainWorker(compose_config(), eng).train_service_config())
    eng.init_model()
    eng.load_checkpoint(str(ckpt))
    saved = read_safetensors_dir(str(ckpt / "model"))
    for k, v in eng.model.state_dict().items():
        assert torch.equal(v, saved[k]), k
    files = [load_state_file(str(ckpt / "optimizer" / f"rank_{r}.safetensors")) for r in (0, 1)]
    state = eng.optimizer.state_dict()["state"]
    names = [n for n, _ in eng.model.named_parameters()]
    assert sorted(state) == list(range(len(names)))
    for i, name in enumerate(names):
        for key in ("exp_avg", "exp_avg_sq"):
            rows = torch.cat([f["optimizer"]["state"][name][key] for f in files])
            assert torch.equal(state[i][key], rows), (name, key)
        assert torch.equal(state[i]["step"], files[0]["optimizer"]["state"][name]["step"])


def _need_deepspeed() -> None:
    pytest.importorskip("deepspeed", reason="engine=deepspeed needs the deepspeed extra")


def test_zero3_on_two_ranks_matches_the_single_process_engine(
    tiny_model_dir: str, single_run: Path, deepspeed_runs: dict[str, Path]
) -> None:
    """(ZeRO-3's optimizer state reshards into the other engines: tests/test_reshard.py.)"""
    assert_matches_single(single_run, deepspeed_runs["zero3"], tiny_model_dir, reload_in_place=False)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_zero_stages_0_to_2_on_two_ranks_match_the_single_process_engine(
    tiny_model_dir: str, single_run: Path, deepspeed_runs: dict[str, Path], stage: int
) -> None:
    out = deepspeed_runs[f"zero{stage}"]
    assert_matches_single(single_run, out, tiny_model_dir, reload_in_place=False)
    if stage == 2:
        assert_other_layout_loads_weights_and_refuses_optimizer(tiny_model_dir, out / "ckpt", "deepspeed")


def test_deepspeed_in_one_process_matches_the_single_process_engine(
    tiny_model_dir: str, single_run: Path, tmp_path: Path
) -> None:
    """engine=deepspeed with one trainer rank and no launcher: a 1-rank group of its own."""
    _need_deepspeed()
    run_engine(tiny_model_dir, tmp_path / "zero3", "deepspeed", 1)
    assert_matches_single(single_run, tmp_path / "zero3", tiny_model_dir, reload_in_place=False)


@pytest.mark.parametrize("engine", ["fsdp", "deepspeed"])
def test_tied_model_on_two_ranks_matches_one_process_and_stays_tied(
    chatml_model_dir: str, tied_single_run: Path, request: pytest.FixtureRequest, engine: str
) -> None:
    """A tied GQA Qwen2 trains alike on one process, FSDP2 and ZeRO-3; every export and checkpoint
    holds the embedding once (no ``lm_head.weight``: these exports are for the local engine), and
    loads as the user's tied model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = request.getfixturevalue(f"{engine}_runs")["tied"]
    assert_matches_single(tied_single_run, out, chatml_model_dir, reload_in_place=engine == "fsdp")
    for run in (tied_single_run, out):
        for weights in (run / "weights", run / "ckpt" / "model"):
            w = read_safetensors_dir(str(weights))
            assert "model.embed_tokens.weight" in w and "lm_head.weight" not in w, weights
        model = AutoModelForCausalLM.from_pretrained(str(run / "ckpt" / "model"))
        assert model.config.tie_word_embeddings and model.config.num_key_value_heads == 2
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        tok = AutoTokenizer.from_pretrained(str(run / "ckpt" / "model"))
        assert tok.chat_template == AutoTokenizer.from_pretrained(chatml_model_dir).chat_template


@pytest.mark.parametrize(
    "engine,case", [("fsdp", "packed"), ("deepspeed", "packed"), ("fsdp", "shared"), ("deepspeed", "shared")]
)
def test_packed_token_budget_engines_on_two_ranks_match_the_padded_single_process(
    tiny_model_dir: str, single_run: Path, request: pytest.FixtureRequest, engine: str, case: str
) -> None:
    """Packing and token-budget micro-batches (the ranks then run different numbers of real passes)
    and shared prompts change no number: FSDP2 and ZeRO-3 against the padded single-process engine."""
    out = request.getfixturevalue(f"{engine}_runs")[case]
    assert_matches_single(single_run, out, tiny_model_dir, reload_in_place=engine == "fsdp")
