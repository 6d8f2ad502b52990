"""Resume on another shape: a checkpoint of 2 FSDP2 trainer ranks resumed by 1, 3 and 4 ranks, by
the single-process engine and by 2 DeepSpeed ZeRO-3 ranks, and one of 2 ZeRO-3 ranks resumed by 1
and 4 FSDP2 ranks, the single-process engine and 1 and 3 ZeRO-3 ranks, continue the run.

What "continues exactly" means here. The state a resume starts from is the checkpoint's, so:

- the state the resumed trainer holds is the saved one, bit for bit: its weights, and its
  optimizer state (AdamW's moments and step count, its param groups, the LR schedule) gathered
  whole again equal the saved files' gathered whole (each trainer re-saves what it loaded, in its
  own layout; the files are concatenated here without the code under test); ZeRO-3's fp32 masters
  are the saved masters, or the other engine's fp32 weights, and a trainer resumed from ZeRO-3
  takes its weights from the saved masters (not from the model files);
- the steps after it are those of the uninterrupted run of the checkpoint's shape, and of the
  uninterrupted run of the resumed shape, to fp32 tolerance: an engine of another world size sums
  the same gradients in another order (1e-6 on the loss, 1e-5 on the grad norm and the weights,
  the bounds tests/test_parallel_engines.py holds every engine to); the scheduled LR is equal.

Torchrun ranks on gloo (tests/helpers/reshard_numerics.py). What cannot be resharded (DeepSpeed
ZeRO stages 0-2, and ZeRO-3 files of DeepSpeed's own state_dict, into another engine, world size or
stage) is refused before the run starts: exit 2 naming the key.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from nexrl_hpc.checkpoint.checks import resume_layout_problems
from nexrl_hpc.checkpoint.hf import read_safetensors_dir
from nexrl_hpc.checkpoint.state_file import load_state_file, save_state_file
from nexrl_hpc.config.validate import ConfigError
from tests.conftest import REPO, compose_config, compose_raw

pytestmark = pytest.mark.e2e


def launch(ranks: int, cases: list[tuple[str, ...]]) -> None:
    """The cases one after another in one torchrun launch of ``ranks`` processes."""
    module = ["-m", "tests.helpers.reshard_numerics"]
    for i, case in enumerate(cases):
        Path(case[1]).mkdir(parents=True)
        module += [*(["::"] if i else []), *case]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [*cmd, *module], cwd=REPO, env=env, capture_output=True, text=True, timeout=120 + 120 * len(cases)
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def runs(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """2 FSDP2 ranks and 2 ZeRO-3 ranks through a checkpoint (``fsdp2``, ``zero3x2``); the FSDP2
    one resumed by 2 ZeRO-3 ranks, 1 FSDP2 rank, the single-process engine, 3 and 4 FSDP2 ranks; the
    ZeRO-3 one resumed by 1 and 4 FSDP2 ranks, the single-process engine, 1 and 3 ZeRO-3 ranks, and
    (its model files changed: the weights must come from its fp32 masters) by 1 FSDP2 rank and 1
    ZeRO-3 rank; the single engine's re-saved checkpoint resumed by 3 FSDP2 ranks; the
    uninterrupted runs of 1 and 4 FSDP2 ranks and 1 ZeRO-3 rank. One torchrun launch per world size."""
    pytest.importorskip("deepspeed", reason="engine=deepspeed needs the deepspeed extra")
    root = tmp_path_factory.mktemp("reshard")
    m = tiny_model_dir
    through = {"fsdp2", "fsdp1", "fsdp4", "zero3x2", "zero3x1", "zero3x2_state_dict"}
    more = {"state_dict_resumed", *BF16}
    r = {name: root / name for name in RESUMED | through | more}
    ckpt, z3 = str(r["fsdp2"] / "ckpt"), str(r["zero3x2"] / "ckpt")
    launch(
        2,
        [
            (m, str(r["fsdp2"]), "fsdp", "through"),
            (m, str(r["zero3x2"]), "deepspeed", "through"),
            (m, str(r["fsdp2_to_zero3x2"]), "deepspeed", "resume", ckpt),
            (m, str(r["zero3x2_state_dict"]), "deepspeed+state_dict", "through"),
            (m, str(r["state_dict_resumed"]), "deepspeed", "resume", str(r["zero3x2_state_dict"] / "ckpt")),
            (m, str(r["bf16_zero3x2"]), "deepspeed+bf16", "through"),
            (m, str(r["bf16_fsdp2"]), "fsdp+bf16", "through"),
            (m, str(r["bf16_zero3x2_resumed"]), "deepspeed+bf16", "resume", str(r["bf16_zero3x2"] / "ckpt")),
        ],
    )
    masters_only = str(with_other_model_files(Path(z3), root / "zero3_other_model_files"))
    launch(
        1,
        [
            (m, str(r["to1"]), "fsdp", "resume", ckpt),
            (m, str(r["to_single"]), "single", "resume", ckpt),
            (m, str(r["fsdp1"]), "fsdp", "through"),
            (m, str(r["zero3_to1"]), "fsdp", "resume", z3),
            (m, str(r["zero3_to_single"]), "single", "resume", z3),
            (m, str(r["zero3_to_zero3x1"]), "deepspeed", "resume", z3),
            (m, str(r["zero3x1"]), "deepspeed", "through"),
            (m, str(r["masters_to1"]), "fsdp", "resume", masters_only),
            (m, str(r["masters_to_zero3x1"]), "deepspeed", "resume", masters_only),
            (m, str(r["bf16_zero3_to_fsdp1"]), "fsdp+bf16", "resume", str(r["bf16_zero3x2"] / "ckpt")),
            (m, str(r["bf16_fsdp2_to_zero3x1"]), "deepspeed+bf16", "resume", str(r["bf16_fsdp2"] / "ckpt")),
        ],
    )
    single_ckpt = str(r["to_single"] / "resaved")
    launch(
        3,
        [
            (m, str(r["to3"]), "fsdp", "resume", ckpt),
            (m, str(r["single_to3"]), "fsdp", "resume", single_ckpt),
            (m, str(r["zero3_to_zero3x3"]), "deepspeed", "resume", z3),
        ],
    )
    launch(
        4,
        [
            (m, str(r["to4"]), "fsdp", "resume", ckpt),
            (m, str(r["fsdp4"]), "fsdp", "through"),
            (m, str(r["zero3_to4"]), "fsdp", "resume", z3),
        ],
    )
    return r


# resumed run: (the run whose checkpoint it loads, its trainer ranks, the uninterrupted run of its shape)
CASES: dict[str, tuple[str, int, str | None]] = {
    "to1": ("fsdp2", 1, "fsdp1"),
    "to_single": ("fsdp2", 1, "fsdp1"),
    "to3": ("fsdp2", 3, None),
    "to4": ("fsdp2", 4, "fsdp4"),
    "single_to3": ("fsdp2", 3, None),  # the single engine's re-saved checkpoint of fsdp2's
    "fsdp2_to_zero3x2": ("fsdp2", 2, "zero3x2"),
    "zero3_to1": ("zero3x2", 1, "fsdp1"),
    "zero3_to_single": ("zero3x2", 1, "fsdp1"),
    "zero3_to4": ("zero3x2", 4, "fsdp4"),
    "zero3_to_zero3x1": ("zero3x2", 1, "zero3x1"),
    "zero3_to_zero3x3": ("zero3x2", 3, None),  # partitions of 3 ranks: the last one padded
    "masters_to1": ("zero3x2", 1, "fsdp1"),  # zero3x2's checkpoint with other model files
    "masters_to_zero3x1": ("zero3x2", 1, "zero3x1"),
}
RESUMED = set(CASES)
BF16 = ("bf16_zero3x2", "bf16_fsdp2", "bf16_zero3x2_resumed", "bf16_zero3_to_fsdp1", "bf16_fsdp2_to_zero3x1")


def with_other_model_files(ckpt: Path, copy: Path) -> Path:
    """A copy of a ZeRO-3 checkpoint whose model files hold other weights (each one 1e-2 off): a
    resume that continues the run took its weights from the optimizer files' fp32 masters."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(ckpt, copy)
    for path in (copy / "model").glob("*.safetensors"):
        weights = load_file(str(path))
        save_file({k: v + 1e-2 for k, v in weights.items()}, str(path), metadata={"format": "pt"})
    return copy


def parameter_shapes(model_dir: str) -> dict[str, tuple[int, ...]]:
    """The model's parameters in ``named_parameters`` order (what a single-process file's indices
    name) with their shapes."""
    from transformers import AutoModelForCausalLM

    return {n: tuple(p.shape) for n, p in AutoModelForCausalLM.from_pretrained(model_dir).named_parameters()}


def whole_optimizer_state(ckpt: Path, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """Every rank file of ``ckpt`` read and concatenated in rank order (an FSDP2 shard is a run of
    dim-0 rows, a ZeRO-3 partition a run of the flattened parameter's elements), keyed by parameter
    name; the param groups and LR schedule of rank 0; ZeRO-3's fp32 masters apart (``masters``)."""
    names = list(shapes)
    files = sorted((ckpt / "optimizer").glob("rank_*.safetensors"), key=lambda p: int(p.stem[5:]))
    saved = [load_state_file(str(f)) for f in files]
    assert [s["world_size"] for s in saved] == [len(saved)] * len(saved)
    parts: dict[str, dict[str, list[torch.Tensor]]] = {}
    for s in saved:
        for key, entry in s["optimizer"]["state"].items():
            for k, v in entry.items():
                parts.setdefault(names[key] if isinstance(key, int) else key, {}).setdefault(k, []).append(v)
    state: dict[str, dict[str, torch.Tensor]] = {}
    for name, entry in parts.items():
        state[name] = {}
        for k, pieces in entry.items():
            if pieces[0].dim() == 0:  # the step count: every rank's is the same
                assert all(torch.equal(p, pieces[0]) for p in pieces), (name, k)
                state[name][k] = pieces[0]
            else:
                state[name][k] = torch.cat([p.reshape(-1) for p in pieces]).reshape(shapes[name])
    masters = {name: entry.pop("master") for name, entry in state.items() if "master" in entry}
    groups = [
        {k: v for k, v in g.items() if k != "params"}
        | {"params": [names[p] if isinstance(p, int) else p for p in g["params"]]}
        for g in saved[0]["optimizer"]["param_groups"]
    ]
    return {"state": state, "param_groups": groups, "scheduler": saved[0]["scheduler"], "masters": masters}


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["param_groups"] == b["param_groups"] and a["scheduler"] == b["scheduler"]
    assert set(a["state"]) == set(b["state"]) and len(a["state"]) > 10
    for name, entry in a["state"].items():
        assert set(entry) == set(b["state"][name]) == {"step", "exp_avg", "exp_avg_sq"}, name
        for k, v in entry.items():
            assert v.dtype == b["state"][name][k].dtype and torch.equal(v, b["state"][name][k]), (name, k)


def metrics(run: Path) -> list[dict[str, Any]]:
    return json.loads((run / "metrics.json").read_text())


def assert_steps_match(got: list[dict[str, Any]], reference: list[dict[str, Any]]) -> None:
    """The steps after the checkpoint: the loss to 1e-6, the grad norm to 1e-5, the LR equal."""
    assert len(got) == len(reference) == 2
    for a, b in zip(got, reference):
        assert a["actor/pg_loss"] == pytest.approx(b["actor/pg_loss"], abs=1e-6)
        assert a["actor/grad_norm"] == pytest.approx(b["actor/grad_norm"], rel=1e-5)
        assert (
            a["actor/lr"] == b["actor/lr"] and a["actor/optimizer_steps"] == b["actor/optimizer_steps"] == 2
        )


def assert_weights_close(a: Path, b: Path) -> None:
    wa, wb = read_safetensors_dir(str(a)), read_safetensors_dir(str(b))
    assert set(wa) == set(wb)
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= 1e-5


@pytest.mark.parametrize("resumed", sorted(CASES))
def test_a_checkpoint_resumed_on_another_shape_or_engine_continues_the_run(
    tiny_model_dir: str, runs: dict[str, Path], resumed: str
) -> None:
    shapes = parameter_shapes(tiny_model_dir)
    saved_by, ranks, same_shape = CASES[resumed]
    saved = runs[saved_by] / "ckpt"
    got = runs[resumed]
    # the state after the load is the saved one, bit for bit (the weights and the optimizer's)
    before, after_load = whole_optimizer_state(saved, shapes), whole_optimizer_state(got / "resaved", shapes)
    assert_same_state(after_load, before)
    assert len(list((got / "resaved" / "optimizer").glob("rank_*.safetensors"))) == ranks
    # the weights: ZeRO-3's fp32 masters where it saved them, else the model files (fp32 masters)
    w_saved = before["masters"] or read_safetensors_dir(str(saved / "model"))
    w_got = read_safetensors_dir(str(got / "resaved" / "model"))
    assert set(w_saved) == set(w_got) and all(torch.equal(w_saved[k], w_got[k]) for k in w_saved)
    if after_load["masters"]:  # a ZeRO-3 trainer's masters: the saved ones, or the other engine's weights
        assert all(torch.equal(w_saved[k], after_load["masters"][k]) for k in w_saved)
    # the next steps: the uninterrupted run of the checkpoint's shape, and of the resumed shape
    after = metrics(got)
    assert [m["actor/lr"] for m in after] == [1e-3, 1e-3]  # the warm-up ended across the checkpoint
    assert_steps_match(after, metrics(runs[saved_by])[2:])
    assert_weights_close(got / "weights", runs[saved_by] / "weights")
    if same_shape is not None:
        assert_steps_match(after, metrics(runs[same_shape])[2:])
        assert_weights_close(got / "weights", runs[same_shape] / "weights")


def test_a_lora_adapters_optimizer_state_reshards_like_the_whole_models(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    """2 FSDP2 ranks training a LoRA adapter, resumed by 1 FSDP2 rank, by the single-process engine
    and by 1 ZeRO-3 rank; 2 ZeRO-3 ranks training it, resumed by 1 FSDP2 rank: the next steps are
    the uninterrupted run's and so is the exported adapter."""
    pytest.importorskip("deepspeed", reason="engine=deepspeed needs the deepspeed extra")
    from safetensors.torch import load_file

    from nexrl_hpc.checkpoint.adapter import ADAPTER_WEIGHTS

    m = tiny_model_dir
    through, to1, to_single = tmp_path / "lora2", tmp_path / "lora_to1", tmp_path / "lora_single"
    to_zero3, zero3, zero3_to1 = tmp_path / "lora_to_zero3", tmp_path / "lora_zero3x2", tmp_path / "zero3_to1"
    launch(2, [(m, str(through), "fsdp+lora", "through"), (m, str(zero3), "deepspeed+lora", "through")])
    ckpt = str(through / "ckpt")
    launch(
        1,
        [
            (m, str(to1), "fsdp+lora", "resume", ckpt),
            (m, str(to_single), "single+lora", "resume", ckpt),
            (m, str(to_zero3), "deepspeed+lora", "resume", ckpt),
            (m, str(zero3_to1), "fsdp+lora", "resume", str(zero3 / "ckpt")),
        ],
    )
    saved = load_file(str(through / "ckpt" / "model" / ADAPTER_WEIGHTS))
    # the adapter and the tiny model's modules saved in full (its norms and head), nothing else
    assert any("lora_A" in k for k in saved)
    assert all("lora_" in k or k.endswith(("norm.weight", "lm_head.weight")) for k in saved)
    for resumed, run in ((to1, through), (to_single, through), (to_zero3, through), (zero3_to1, zero3)):
        assert_steps_match(metrics(resumed), metrics(run)[2:])
        got, reference = (load_file(str(r / "weights" / ADAPTER_WEIGHTS)) for r in (resumed, run))
        assert set(got) == set(reference)
        assert max(float((got[k] - reference[k]).abs().max()) for k in got) <= 1e-5


def fake_checkpoint(
    root: Path, engine: str, world_size: int, zero_stage: int | None = None, layout: str = "by_name"
) -> Path:
    """A complete checkpoint dir whose optimizer files record ``engine`` on ``world_size`` ranks
    (the headers are all pre-flight reads); ``layout="state_dict"``: a ZeRO-3 file of DeepSpeed's
    own ``state_dict`` (as written before ZeRO-3 files were keyed by name)."""
    ckpt = root / "checkpoints" / "global_step_2"
    (ckpt / "optimizer").mkdir(parents=True)
    optimizer: dict[str, Any] = {"state": {}, "param_groups": []}
    if zero_stage is not None:
        optimizer["zero_stage"] = zero_stage
    if zero_stage == 3 and layout == "by_name":
        optimizer["layout"] = "flat_by_name"
    elif zero_stage is not None:  # DeepSpeed's state_dict: flat groups, no names
        optimizer = {"zero_stage": zero_stage, "optimizer_state_dict": {}, "fp32_flat_groups": []}
    for rank in range(world_size):
        save_state_file(
            {
                "optimizer": optimizer,
                "scheduler": {},
                "global_step": 2,
                "world_size": world_size,
                "engine": engine,
            },
            str(ckpt / "optimizer" / f"rank_{rank}.safetensors"),
        )
    (ckpt / "COMPLETE").write_text("{}")
    return ckpt


DS = "service.train_service.engine=deepspeed"
STAGE2 = "service.train_service.deepspeed.zero_stage=2"


@pytest.mark.parametrize(
    "saved,run,key",
    [
        (("fsdp", 2, None), [DS, STAGE2], "service.train_service.engine"),
        (("deepspeed", 2, 2), [], "service.train_service.engine"),  # into engine=single
        (("deepspeed", 2, 2), [DS, STAGE2], "service.train_service.world_size"),
        (("deepspeed", 1, 3), [DS, STAGE2], "service.train_service.deepspeed.zero_stage"),
        (("deepspeed", 1, 2), [DS], "service.train_service.deepspeed.zero_stage"),
        (("deepspeed", 2, 3, "state_dict"), [DS], "service.train_service.world_size"),
        (("deepspeed", 2, 3, "state_dict"), [], "service.train_service.engine"),
        (("fsdp", 2, None), [], None),  # resharded into the single-process engine
        (("single", 1, None), ["service.train_service.engine=fsdp"], None),
        (("fsdp", 2, None), [DS], None),  # into ZeRO-3 (the default stage)
        (("deepspeed", 2, 3), [], None),  # ZeRO-3 into the single-process engine
        (("deepspeed", 2, 3), [DS], None),  # ZeRO-3 on another world size
        (("deepspeed", 1, 3, "state_dict"), [DS], None),  # the same layout
        (("deepspeed", 1, 2), [DS, STAGE2], None),  # the same layout
    ],
)
def test_pre_flight_refuses_a_layout_change_it_cannot_reshard_naming_the_key(
    tmp_path: Path, saved: tuple[Any, ...], run: list[str], key: str | None
) -> None:
    ckpt = fake_checkpoint(tmp_path, *saved)
    assert layout_problems([f"run_dir={tmp_path}", *run]) == ([] if key is None else [key])
    if key is None:
        return
    with pytest.raises(ConfigError) as err:
        compose_config([f"run_dir={tmp_path}", *run])
    message = str(err.value)
    assert (
        f"{key}: {ckpt / 'optimizer' / 'rank_0.safetensors'}: optimizer state of engine={saved[0]} on {saved[1]} rank(s)"
        in message
    )
    assert "ZeRO stages 0-2 load only into the engine, stage and world size that wrote them" in message
    assert ("from before ZeRO-3 files were keyed by name" in message) == (len(saved) > 3)
    # resume.mode=from_path reads the checkpoint it names; disable reads none
    other = [f"run_dir={tmp_path / 'other'}", "resume.mode=from_path", f"resume.resume_path={ckpt}"]
    assert layout_problems([*other, *run]) == [key]
    assert layout_problems([f"run_dir={tmp_path}", "resume.mode=disable", *run]) == []


def compose_resolved(overrides: list[str]) -> dict[str, Any]:
    from nexrl_hpc.config import resolve_config

    return resolve_config(compose_raw(overrides))[0]


def layout_problems(overrides: list[str]) -> list[str]:
    """The keys ``resume_layout_problems`` names for the composed config (resolved, unchecked)."""
    return [p.path for p in resume_layout_problems(compose_resolved(overrides))]


def test_a_refused_resume_exits_2_naming_the_key_before_anything_starts(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    fake_checkpoint(run_dir, "deepspeed", 2, 2)
    proc = subprocess.run(
        [sys.executable, "-m", "launch.train", f"run_dir={run_dir}", DS, STAGE2],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "service.train_service.world_size: " in proc.stderr
    assert "engine=deepspeed on 2 rank(s) (ZeRO stage 2) does not load on 1 rank(s)" in proc.stderr
    assert "ZeRO stages 0-2 load only into the engine, stage and world size that wrote them" in proc.stderr
    assert not (run_dir / "config.yaml").exists()  # refused before the run wrote anything


def test_mpi_run_of_two_fsdp2_trainer_ranks_resumes_on_one_with_two_rollout_ranks(tmp_path: Path) -> None:
    """mpirun -n 4 (driver, 2 FSDP2 trainer ranks, 1 rollout rank) stops at its checkpoint of step
    4; the same run dir resumed by mpirun -n 4 (driver, 1 FSDP2 trainer rank, 2 rollout ranks) trains
    steps 5-8: every step once, every sample trained as planned, and its checkpoint is the new
    shape's."""
    from tests.test_mpi import FAST, assert_trained_as_planned, mpirun

    run_dir = tmp_path / "run"
    common = [
        f"run_dir={run_dir}",
        "seed=6",
        "service.train_service.engine=fsdp",
        "service.inference_service.backend=fake",
        "logger.dump_rollouts=true",
        "data.batch_size=8",
        "train_worker.save_freq=4",
        "train_worker.max_ckpt_to_keep=null",
        *FAST,
    ]

    def run(ranks: int, world_size: int, steps: int) -> list[dict[str, Any]]:
        args = [
            *common,
            f"service.train_service.world_size={world_size}",
            f"train_worker.total_train_steps={steps}",
        ]
        proc = subprocess.run(mpirun(ranks, args), cwd=REPO, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        return json.loads((run_dir / "logs" / "ranks.json").read_text())

    first = run(4, 2, 4)
    assert [r["group"] for r in first] == ["driver", "trainer", "trainer", "rollout"]
    second = run(4, 1, 8)
    assert [r["group"] for r in second] == ["driver", "trainer", "rollout", "rollout"]
    assert "resumed at step 4 from" in (run_dir / "train.log").read_text()
    assert_trained_as_planned(run_dir, 8)
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in rows if "train/reward_mean" in r] == list(range(1, 9))
    saved = run_dir / "checkpoints"
    assert len(list((saved / "global_step_4" / "optimizer").glob("rank_*.safetensors"))) == 2
    assert len(list((saved / "global_step_8" / "optimizer").glob("rank_*.safetensors"))) == 1


def test_a_zero3_checkpoint_of_deepspeeds_own_state_dict_still_resumes_on_its_layout(
    tiny_model_dir: str, runs: dict[str, Path]
) -> None:
    """ZeRO-3 optimizer files written as DeepSpeed's ``state_dict`` (checkpoints from before they
    were keyed by name) load into the layout that wrote them: the run continues as uninterrupted,
    and the state re-saved by name is the one a by-name checkpoint of that run holds."""
    from nexrl_hpc.checkpoint.reshard import SavedLayout, saved_layout

    saved = runs["zero3x2_state_dict"] / "ckpt"
    assert saved_layout(str(saved)) == SavedLayout("deepspeed", 2, 3, by_name=False)
    assert "fp32_flat_groups" in load_state_file(str(saved / "optimizer" / "rank_0.safetensors"))["optimizer"]
    got = runs["state_dict_resumed"]
    shapes = parameter_shapes(tiny_model_dir)
    by_name = whole_optimizer_state(runs["zero3x2"] / "ckpt", shapes)
    resaved = whole_optimizer_state(got / "resaved", shapes)
    assert_same_state(resaved, by_name)
    assert set(resaved["masters"]) == set(by_name["masters"]) == set(shapes)
    assert all(torch.equal(by_name["masters"][k], v) for k, v in resaved["masters"].items())
    assert_steps_match(metrics(got), metrics(runs["zero3x2"])[2:])
    assert_weights_close(got / "weights", runs["zero3x2"] / "weights")


def test_under_bf16_zero3s_fp32_masters_cross_engines_and_its_own_resume_is_exact(
    tiny_model_dir: str, runs: dict[str, Path]
) -> None:
    """dtype=bfloat16: ZeRO-3's module weights (what its model files hold) are its fp32 masters
    rounded, so a resume that continues exactly needs the masters. A ZeRO-3 checkpoint resumed by
    its own layout continues exactly as the uninterrupted run; resumed by FSDP2, its fp32 parameters
    are the saved masters; an FSDP2 checkpoint resumed by ZeRO-3 gives ZeRO-3 FSDP2's fp32 weights
    as masters (bit for bit, not rounded)."""
    shapes = parameter_shapes(tiny_model_dir)
    zero3 = whole_optimizer_state(runs["bf16_zero3x2"] / "ckpt", shapes)
    masters = zero3["masters"]
    rounded = read_safetensors_dir(str(runs["bf16_zero3x2"] / "ckpt" / "model"))
    assert set(masters) == set(shapes) and not all(torch.equal(masters[k], rounded[k]) for k in shapes)
    assert all(torch.equal(masters[k].bfloat16().float(), rounded[k]) for k in shapes)
    # its own layout: the steps after the checkpoint are the uninterrupted run's, exactly
    after, through = metrics(runs["bf16_zero3x2_resumed"]), metrics(runs["bf16_zero3x2"])[2:]
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/lr"):
        assert [m[key] for m in after] == [m[key] for m in through], key
    # into FSDP2: its fp32 parameters are the masters
    fsdp_weights = read_safetensors_dir(str(runs["bf16_zero3_to_fsdp1"] / "resaved" / "model"))
    assert all(torch.equal(fsdp_weights[k], masters[k]) for k in shapes)
    assert_same_state(whole_optimizer_state(runs["bf16_zero3_to_fsdp1"] / "resaved", shapes), zero3)
    # from FSDP2: ZeRO-3's masters are FSDP2's fp32 weights
    fsdp_saved = read_safetensors_dir(str(runs["bf16_fsdp2"] / "ckpt" / "model"))
    resaved = whole_optimizer_state(runs["bf16_fsdp2_to_zero3x1"] / "resaved", shapes)
    assert set(resaved["masters"]) == set(shapes)
    assert all(torch.equal(resaved["masters"][k], fsdp_saved[k]) for k in shapes)
    assert any(not torch.equal(fsdp_saved[k].bfloat16().float(), fsdp_saved[k]) for k in shapes)
    assert_same_state(resaved, whole_optimizer_state(runs["bf16_fsdp2"] / "ckpt", shapes))
