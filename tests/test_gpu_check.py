"""bench/gpu_check.py, the one command a GPU machine runs, through its CPU dry path (hardware=cpu).

The dry run is the same code as on a GPU: the same model builder (2 layers, the full 151,936-row
vocabulary over a tokenizer of a few hundred ids, so nearly every sampled id is one the tokenizer
cannot decode), the same ``launch.train`` commands (local mode; mpirun with an FSDP2 and a DeepSpeed
trainer group of 1; LoRA; PPO with a critic), the same metrics parsing and table.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "gpu_check.py"


def load_gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.e2e
def test_dry_run_trains_every_stage_and_reports_its_numbers(tmp_path: Path) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    stages = ["local", "mpi_fsdp", "mpi_deepspeed", "local_lora", "local_ppo"]
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--dry-run",
        "--out",
        str(out),
        "--work",
        str(work),
        "--only",
        *stages,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    for stage in stages:
        assert f"| {stage} | ok |" in done.stdout
    results = {r["name"]: r for r in json.loads((out / "results.json").read_text())}
    assert list(results) == stages
    for stage, result in results.items():
        n = result["numbers"]
        assert result["ok"] and n["gen_tok_s"] > 0 and n["train_tok_s"] > 0, stage
        assert n["max_rss_gb"] > 0.1, stage  # the trainer's own peak, from its metrics
        # 8 prompts x 4 samples x 8 tokens from a random model whose 151,936 rows cover ~300 tokens
        assert n["undecodable_tokens"] > 100, stage
        assert result["steps"] and result["steps"][0]["perf/trained_tokens"] > 0
        # weight delivery: the engine scored the canary with the trainer's weights (fp32: 1e-4)
        assert n["sync_s"] > 0 and 0 <= n["verify_max_abs_diff"] <= 1e-4, stage
        assert 0 <= n["logprob_mismatch_max"] <= 1e-4, stage
    ppo_rows = [json.loads(line) for line in (work / "local_ppo" / "metrics.jsonl").read_text().splitlines()]
    assert any("critic/vf_loss" in row for row in ppo_rows)  # the stage trained a critic
    assert "| sync s | verify max abs delta | mismatch max |" in done.stdout
    log = (out / "gpu_check.log").read_text()
    assert "'layers': 2" in log and "no wheels installed" in log
    assert json.loads((work / "model" / "config.json").read_text())["vocab_size"] == 151_936


def test_mfu_counts_six_n_plus_attention_per_trained_token() -> None:
    gc = load_gpu_check()
    steps = [  # the first step warms up and is left out
        {"perf/generated_tokens": 1.0, "timing/generation_s": 1.0, "perf/trained_tokens": 1.0,
         "timing/update_s": 1.0, "perf/trajectories": 1.0},
        {"perf/generated_tokens": 500.0, "timing/generation_s": 2.0, "perf/trained_tokens": 1000.0,
         "timing/update_s": 0.5, "perf/trajectories": 10.0, "perf/max_memory_allocated_gb": 3.5},
    ]  # fmt: skip
    model = {"parameters": 1_000_000, "layers": 2, "hidden": 64}
    n = gc.run_numbers(steps, model, peak_tflops=1.0)
    assert n["gen_tok_s"] == 250.0 and n["train_tok_s"] == 2000.0
    flops_per_token = 6 * 1_000_000 + 6 * 2 * 64 * 100  # mean trained length 100
    assert n["mfu"] == pytest.approx(flops_per_token * 2000.0 / 1e12)
    assert n["max_memory_allocated_gb"] == 3.5
    assert "mfu" not in gc.run_numbers(steps, model, peak_tflops=None)


def test_card_peaks_take_the_most_specific_name_first() -> None:
    gc = load_gpu_check()

    def peak(name: str) -> float | None:
        return next((p for key, p in gc.PEAK_BF16_TFLOPS if key in name), None)

    assert peak("NVIDIA H100 80GB HBM3") == 989.0
    assert peak("NVIDIA H100 PCIe") == 756.0
    assert peak("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak("Tesla T4") is None


def test_wheels_install_offline_with_their_scripts_and_libraries(tmp_path: Path) -> None:
    """A wheel's ``.data/{bin,lib}`` (MPICH's mpirun and libmpi) land where the stages look."""
    gc = load_gpu_check()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    dist = "probe_pkg-1.0"
    with zipfile.ZipFile(wheels / f"{dist}-py3-none-any.whl", "w") as z:
        z.writestr("probe_pkg/__init__.py", "VALUE = 7\n")
        z.writestr(f"{dist}.data/data/lib/libmpi.so.12", b"\x7fELF")
        z.writestr(f"{dist}.data/data/bin/mpirun", "#!/bin/sh\necho probe\n")
        z.writestr(f"{dist}.dist-info/METADATA", "Metadata-Version: 2.1\nName: probe-pkg\nVersion: 1.0\n")
        z.writestr(
            f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        z.writestr(f"{dist}.dist-info/RECORD", "")
    site = tmp_path / "site"
    names, env = gc.install_wheels(str(wheels), str(site))
    assert names == ["probe_pkg 1.0"]
    assert env["MPI4PY_LIBMPI"] == str(site / "lib" / "libmpi.so.12")
    assert env["PATH"] == str(site / "bin") and os.access(site / "bin" / "mpirun", os.X_OK)
    merged = gc.stage_env({"PATH": "/usr/bin"}, env)
    assert merged["PATH"] == f"{site / 'bin'}{os.pathsep}/usr/bin"
    probe = subprocess.run(
        [sys.executable, "-c", "import probe_pkg; print(probe_pkg.VALUE)"],
        env=merged,
        capture_output=True,
        text=True,
    )
    assert probe.stdout.strip() == "7"
