"""Trainer engines over several ranks compute what the single-process engine computes.

Two real torch.distributed ranks (torchrun, gloo on CPU) against one process, on the same batches:
weights after 3 ``update_actor`` calls within 1e-5, ``compute_log_prob`` within 1e-6.
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

pytestmark = pytest.mark.e2e


def run_engine(model_dir: str, out: Path, engine: str, ranks: int) -> None:
    out.mkdir(parents=True)
    module = ["-m", "tests.helpers.engine_numerics", model_dir, str(out), engine]
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
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_fsdp2_on_two_ranks_matches_the_single_process_engine(tiny_model_dir: str, tmp_path: Path) -> None:
    run_engine(tiny_model_dir, tmp_path / "single", "single", 1)
    run_engine(tiny_model_dir, tmp_path / "fsdp", "fsdp", 2)
    ref = read_safetensors_dir(str(tmp_path / "single" / "weights"))
    got = read_safetensors_dir(str(tmp_path / "fsdp" / "weights"))
    assert set(ref) == set(got)
    base = read_safetensors_dir(str(Path(tiny_model_dir)))
    moved = max(float((ref[k] - base[k]).abs().max()) for k in ref)
    assert moved > 1e-3  # the updates did change the weights
    worst = max(float((ref[k] - got[k]).abs().max()) for k in ref)
    assert worst <= 1e-5, worst
    lp_ref, lp_got = torch.load(tmp_path / "single" / "logp.pt"), torch.load(tmp_path / "fsdp" / "logp.pt")
    assert lp_ref.shape == lp_got.shape == (13, 2)
    assert float((lp_ref - lp_got).abs().max()) <= 1e-6
    m_ref = json.loads((tmp_path / "single" / "metrics.json").read_text())
    m_got = json.loads((tmp_path / "fsdp" / "metrics.json").read_text())
    for a, b in zip(m_ref, m_got):
        assert b["actor/pg_loss"] == pytest.approx(a["actor/pg_loss"], abs=1e-6)
        assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-5)
        assert b["actor/optimizer_steps"] == a["actor/optimizer_steps"] == 2
    for engine in ("single", "fsdp"):
        resumed = json.loads((tmp_path / engine / "resumed.json").read_text())
        assert resumed["same_logp"] and resumed["next_update_diff"] == 0.0, (engine, resumed)


def test_checkpoint_of_two_fsdp_ranks_loads_weights_anywhere_and_refuses_its_optimizer_elsewhere(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    from nexrl_hpc.train.local_engine import LocalTrainEngine
    from nexrl_hpc.train.worker import TrainWorker
    from tests.conftest import compose_config

    run_engine(tiny_model_dir, tmp_path / "fsdp", "fsdp", 2)
    ckpt = tmp_path / "fsdp" / "ckpt"
    assert sorted(p.name for p in (ckpt / "optimizer").iterdir()) == ["rank_0.pt", "rank_1.pt"]
    eng = LocalTrainEngine(tiny_model_dir)
    eng.initialize_worker(TrainWorker(compose_config(), eng).train_service_config())
    eng.init_model()
    with pytest.raises(ValueError) as err:
        eng.load_checkpoint(str(ckpt))
    assert "engine=fsdp on 2 rank(s)" in str(err.value) and "engine=single on 1" in str(err.value)
    eng.load_checkpoint(str(ckpt), load_optimizer=False)  # the weights load at any world size
    saved = read_safetensors_dir(str(ckpt / "model"))
    for k, v in eng.model.state_dict().items():
        assert torch.equal(v, saved[k]), k
