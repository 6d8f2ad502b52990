"""bf16 compute keeps fp32 master weights: at a small LR the weights move in bf16 as they do in fp32.

With bf16 parameters an AdamW step of ~1e-6 is below half a bf16 ulp of most weights and rounds
away; fp32 masters (parameters and optimizer state in fp32, compute in bf16) keep every update.
Measured element-wise, before and after 3 updates at lr 1e-6 on the tiny model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.helpers.master_weights import measure

BF16 = ["service.train_service.dtype=bfloat16"]
FP32 = ["service.train_service.dtype=float32"]


def _assert_fp32_masters(result: dict, label: str, compute: str) -> None:
    print(f"{label}: {100 * result['changed_frac']:.1f} % of the weights changed in 3 steps at lr 1e-6")
    assert result["changed_frac"] >= 0.99, (label, result)
    assert result["masters_changed_frac"] >= 0.99, (label, result)
    assert result["param_dtypes"] == ["torch.float32"], (label, result)
    assert result["optimizer_dtypes"] == ["torch.float32"], (label, result)
    assert result["compute_dtypes"] == [compute], (label, result)


def test_single_engine_bf16_moves_the_weights_as_fp32_does(tiny_model_dir: str) -> None:
    fp32 = measure(tiny_model_dir, "single", FP32, world_size=1)
    bf16 = measure(tiny_model_dir, "single", BF16, world_size=1)
    _assert_fp32_masters(fp32, "single, fp32", "torch.float32")
    _assert_fp32_masters(bf16, "single, bf16 compute", "torch.bfloat16")


@pytest.mark.e2e
def test_fsdp2_on_two_ranks_bf16_moves_the_weights_as_fp32_does(tiny_model_dir: str, tmp_path: Path) -> None:
    """Two gloo ranks: sharded fp32 parameters, bf16 all-gathers for compute, fp32 optimizer shards."""
    cases = {"bf16": BF16, "fp32": FP32}
    compute = {"bf16": "torch.bfloat16", "fp32": "torch.float32"}
    module = ["-m", "tests.helpers.master_weights"]
    for i, (name, overrides) in enumerate(cases.items()):
        module += [*(["::"] if i else []), tiny_model_dir, str(tmp_path / name), "fsdp", *overrides]
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *module])
    for name in cases:
        ranks = [json.loads((tmp_path / name / f"rank_{r}.json").read_text()) for r in range(2)]
        _assert_fp32_masters(ranks[0], f"fsdp x2, {name}", compute[name])
        assert ranks[1]["param_dtypes"] == ranks[1]["optimizer_dtypes"] == ["torch.float32"], ranks[1]


@pytest.mark.e2e
def test_deepspeed_bf16_keeps_fp32_masters_in_its_optimizer(tiny_model_dir: str, tmp_path: Path) -> None:
    """DeepSpeed holds the module in bf16 (what it computes and exports) and the fp32 masters in its
    optimizer, at every ZeRO stage: the masters and AdamW's state are fp32 and the masters all move."""
    pytest.importorskip("deepspeed", reason="engine=deepspeed needs the deepspeed extra")
    module = ["-m", "tests.helpers.master_weights"]
    for stage in range(4):
        out = str(tmp_path / f"zero{stage}")
        stage_key = f"service.train_service.deepspeed.zero_stage={stage}"
        module += [*(["::"] if stage else []), tiny_model_dir, out, "deepspeed", *BF16, stage_key]
    _run([sys.executable, *module])
    for stage in range(4):
        result = json.loads((tmp_path / f"zero{stage}" / "rank_0.json").read_text())
        print(
            f"deepspeed zero{stage}, bf16: {100 * result['masters_changed_frac']:.1f} % of the fp32 masters changed"
        )
        assert result["masters_changed_frac"] >= 0.99, (stage, result)
        assert result["master_dtypes"] == result["optimizer_dtypes"] == ["torch.float32"], (stage, result)
        assert result["param_dtypes"] == result["compute_dtypes"] == ["torch.bfloat16"], (stage, result)


def _run(cmd: list[str]) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
