"""The GPU recipes in docs/gpu.md and the README's "your model" command are configs that validate.

Each ``python -m launch.train`` command of those pages is composed with its placeholders pointed at
real local inputs (the ChatML model fixture, verl-schema parquet files) and checked as the launcher
checks it, short of the parts that need the machine it is written for (CUDA, a Slurm cluster).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nexrl_hpc.config.task_choice import with_task_choice
from tests.conftest import REPO, compose_config


def commands(page: Path) -> list[list[str]]:
    """The overrides of every ``python -m launch.train`` command in the page's bash blocks."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith("python -m launch.train") and "model.path=" in line:
                out.append(shlex.split(line)[3:])
    return out


@pytest.fixture(scope="module")
def placeholders(chatml_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    data = tmp_path_factory.mktemp("recipe_data")
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{i} + 1 = ? ####"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(8)
    ]
    for name in ("gsm8k/train.parquet", "gsm8k/test.parquet"):
        (data / name).parent.mkdir(exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), data / name)
    (data / "my_reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"
    )
    return {"model": chatml_model_dir, "data": str(data), "scratch": str(tmp_path_factory.mktemp("scratch"))}


def resolved(args: list[str], ph: dict[str, str]) -> list[str]:
    out = []
    for a in args:
        a = a.replace("$MODELS/Qwen2.5-7B-Instruct", ph["model"])
        a = a.replace("$MODELS/Qwen2.5-0.5B-Instruct", ph["model"]).replace(
            "/models/Qwen2.5-0.5B-Instruct", ph["model"]
        )
        a = a.replace("$DATA/", ph["data"] + "/").replace("$SCRATCH", ph["scratch"])
        a = re.sub(r"=\[(gsm8k/)", f"=[{ph['data']}/\\1", a)  # paths relative to the data dir
        a = a.replace("=my_reward.py:", f"={ph['data']}/my_reward.py:")
        if a.startswith("run_dir=") and not a.startswith(f"run_dir={ph['scratch']}"):
            a = f"run_dir={ph['scratch']}/{a.split('=', 1)[1]}"
        out.append(a)
    return out


@pytest.mark.parametrize("page", ["docs/gpu.md", "README.md", "docs/lora.md"])
def test_every_recipe_command_is_a_valid_config(page: str, placeholders: dict[str, str]) -> None:
    found = commands(REPO / page)
    assert found, f"no launch.train command with model.path in {page}"
    for args in found:
        # as launch.train composes it: your model and no task named is task=custom
        cfg = compose_config(
            with_task_choice(resolved(args, placeholders))
        )  # a ConfigError names any bad key
        assert cfg["model"]["path"] == placeholders["model"]
        assert cfg["task"]["name"] == "custom"
        assert cfg["data"]["answer_key"] == "reward_model.ground_truth"
        if "hardware=gpu" in args:
            assert cfg["service"]["train_service"]["device"] == "cuda"
