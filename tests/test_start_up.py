"""What a run's start-up does with the garbage collector and the base model, each in a fresh
interpreter (the GC's state and ``sys.modules`` are per process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

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

    for name, overrides in (("llama", []), ("qwen2_tied", ["model.tiny.architecture=qwen2", "model.tiny.tie_word_embeddings=true"])):  # fmt: skip
        out_dir = tmp_path / name
        proc = subprocess.run(
            [sys.executable, "-c", MODEL_PROBE, str(out_dir), *overrides],
            cwd=REPO, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
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
