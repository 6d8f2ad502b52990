"""What a run's start-up does with the garbage collector, the base model and the imports (each in a
fresh interpreter: the GC's state and ``sys.modules`` are per process), and in which order."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from nexrl_hpc.inference.service import InferenceService
from tests.conftest import REPO, compose_config

GC_PROBE = """
import gc, json, sys
from tests.conftest import compose_config
from nexrl_hpc.runtime.gc_tuning import freeze_imports, hold_collections, settle_after_setup
runtime = compose_config(sys.argv[1:])["runtime"]
python_default = gc.get_threshold()
hold_collections(runtime)
held = gc.get_threshold()
import nexrl_hpc.controller  # torch, transformers: the heavy imports
freeze_imports(runtime)
after_imports = gc.get_freeze_count()
garbage = [[] for _ in range(3)]
for a, b in zip(garbage, garbage[1:] + garbage[:1]):
    a.append(b)  # a cycle, unreachable below: the settling collection must take it
ref = id(garbage[0])
del garbage, a, b
settle_after_setup(runtime)
print(json.dumps({"default": python_default, "held": held, "after_imports": after_imports,
                  "frozen": gc.get_freeze_count(), "threshold": gc.get_threshold(),
                  "cycle_kept": any(id(o) == ref for o in gc.get_objects())}))
"""


def gc_probe(*overrides: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", GC_PROBE, *overrides], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_configured_thresholds_hold_from_before_the_imports_and_start_up_objects_are_frozen() -> None:
    out = gc_probe()
    assert out["held"] == [20000, 50, 100] == out["threshold"], out  # configs/rl_train.yaml
    # the imports' objects (~480k) are frozen without a collection; settling adds the set-up's
    assert out["after_imports"] > 100_000 and out["frozen"] >= out["after_imports"], out
    assert not out["cycle_kept"], out  # the collection before the final freeze took the garbage


def test_without_freezing_nothing_is_frozen_and_other_thresholds_are_taken() -> None:
    out = gc_probe("runtime.gc_freeze_after_setup=false", "runtime.gc_thresholds=[900,20,30]")
    assert out["held"] == [900, 20, 30] == out["threshold"] != out["default"], out
    assert out["after_imports"] == 0 and out["frozen"] == 0, out


MODEL_PROBE = """
import json, sys
from tests.conftest import compose_config
from nexrl_hpc.models.tiny import materialize_base_model
cfg = compose_config(sys.argv[2:])["model"]
path = materialize_base_model(cfg, sys.argv[1])
print(json.dumps({"path": path, "deepspeed_imported": "deepspeed" in sys.modules}))
"""


def test_the_tiny_base_model_is_written_without_importing_deepspeed_and_loads_as_saved(
    tmp_path: Path,
) -> None:
    """``save_pretrained`` imports DeepSpeed (~0.5 s) through accelerate whenever it is installed;
    the run's own writer leaves the same config and weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from nexrl_hpc.models.tiny import build_tiny_model
    from tests.conftest import compose_config

    for name, overrides in (
        ("llama", []),
        ("qwen2_tied", ["model.tiny.architecture=qwen2", "model.tiny.tie_word_embeddings=true"]),
    ):
        out_dir = tmp_path / name
        proc = subprocess.run(
            [sys.executable, "-c", MODEL_PROBE, str(out_dir), *overrides],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result == {"path": str(out_dir), "deepspeed_imported": False}, result
        assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= {
            p.name for p in out_dir.iterdir()
        }
        reference, _ = build_tiny_model(compose_config(overrides)["model"]["tiny"])  # same init seed
        reference_dir = tmp_path / f"{name}_save_pretrained"
        reference.save_pretrained(reference_dir)
        assert json.loads((out_dir / "config.json").read_text()) == json.loads(
            (reference_dir / "config.json").read_text()
        )
        loaded = AutoModelForCausalLM.from_pretrained(out_dir)
        assert type(loaded).__name__ == json.loads((out_dir / "config.json").read_text())["architectures"][0]
        ids = torch.randint(0, reference.config.vocab_size, (2, 9))
        with torch.no_grad():
            assert torch.equal(loaded(ids).logits, reference(ids).logits)


QUIET = ["validate.validate_before_train=false", "validate.validate_at_end=false", "logger.backend=[]"]


def _run_recording_wait_ready(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch, *overrides: str
) -> list[dict[str, Any]]:
    """Run in this process; for every server waited for, what the trainer's side had done by then."""
    from nexrl_hpc.controller import NexRLController

    seen: list[dict[str, Any]] = []
    controller: NexRLController | None = None
    original = InferenceService.wait_ready

    def recording_wait_ready(self: InferenceService) -> str | None:
        assert controller is not None
        seen.append(
            {
                "exported": sorted(p.name for p in (run_dir / "weights").glob("version_*")),
                "train_step": controller.train_worker.get_train_step(),
            }
        )
        return original(self)

    monkeypatch.setattr(InferenceService, "wait_ready", recording_wait_ready)
    cfg = compose_config([f"run_dir={run_dir}", "service.inference_service.backend=fake", *QUIET, *overrides])
    controller = NexRLController(cfg)
    controller.run()
    return seen


def test_the_trainer_loads_and_exports_before_waiting_for_the_servers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh run exports version 0, a resumed one loads its checkpoint and exports that step,
    before the first wait for a server (a vLLM start-up then overlaps the checkpoint's load)."""
    run_dir = tmp_path / "run"
    steps = ["train_worker.save_freq=2", "resume.mode=auto"]
    fresh = _run_recording_wait_ready(run_dir, monkeypatch, "train_worker.total_train_steps=2", *steps)
    assert fresh and fresh[0] == {"exported": ["version_0"], "train_step": 0}
    resumed = _run_recording_wait_ready(run_dir, monkeypatch, "train_worker.total_train_steps=3", *steps)
    assert resumed and resumed[0]["train_step"] == 2 and "version_2" in resumed[0]["exported"]
    with open(run_dir / "metrics.jsonl") as f:
        trained = [r["step"] for r in map(json.loads, f) if "train/loss" in r]
    assert trained == [1, 2, 3]  # and the resumed run went on from its checkpoint


IMPORT_AHEAD = """
import sys
from nexrl_hpc.inference.factory import CLIENT_MODULE, import_llm_client_ahead
from tests.conftest import compose_config

backend = sys.argv[1]
cfg = compose_config(["run_dir=/nonexistent", f"service.inference_service.backend={backend}"])
assert CLIENT_MODULE not in sys.modules and "openai" not in sys.modules
thread = import_llm_client_ahead(cfg)
if thread is not None:
    assert thread.name == "import-llm-client"
    thread.join(60)
print(CLIENT_MODULE in sys.modules, "openai" in sys.modules)
"""


@pytest.mark.parametrize(("backend", "imported"), [("local", "True True"), ("fake", "False False")])
def test_the_llm_client_is_imported_ahead_on_a_thread_of_its_own(backend: str, imported: str) -> None:
    """What a rollout worker starts when it is wired to its service: for a real backend the
    client's import (openai's ~0.3 s) on a thread beside the servers' start-up; for the fake
    backend nothing (it never imports the client)."""
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_AHEAD, backend], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == imported
