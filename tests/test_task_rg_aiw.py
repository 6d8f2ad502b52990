"""The shipped realistic task ``task=rg_aiw``: reasoning-gym questions as chat, a Qwen2 model built offline.

Quick tests: the model ``model.tiny`` builds (architecture=qwen2, tokenizer kind=chatml_bpe) is a
tied, grouped-query Qwen2 directory with a byte-level BPE tokenizer and the ChatML template that
``AutoModelForCausalLM``/``AutoTokenizer`` load; the tokenizer every process trains from the config
is the saved one, token for token; the warm-up teaches the answer syntax, not the answers; a
``chatml_bpe`` tokenizer without a corpus is a config error. The e2e test runs a few steps of
the task; bench/rg_task.py measures that it learns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, compose_config, compose_raw, run_train

QUICK = [  # a smaller corpus and warm-up than the task's: the same code paths, seconds
    "task=rg_aiw",
    "model.tiny.tokenizer.corpus_args.size=300",
    "model.tiny.warmup_args.size=64",
    "model.tiny.warmup_args.steps=40",
]


@pytest.fixture(scope="module")
def rg_aiw_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    from nexrl_hpc.models.tiny import materialize_base_model

    cfg = compose_config(QUICK)
    return cfg, materialize_base_model(cfg["model"], str(tmp_path_factory.mktemp("rg_aiw") / "base_model"))


def test_built_model_dir_is_a_tied_gqa_qwen2_with_a_chatml_bpe_tokenizer(
    rg_aiw_model: tuple[dict[str, Any], str],
) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cfg, model_dir = rg_aiw_model
    config = AutoConfig.from_pretrained(model_dir)
    assert config.model_type == "qwen2" and config.tie_word_embeddings is True
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)  # grouped-query attention
    assert config.hidden_size // config.num_attention_heads >= 32  # vLLM's CPU attention
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    assert 0.2e6 < sum(p.numel() for p in model.parameters()) < 1.0e6

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.is_fast and 256 < len(tokenizer) <= cfg["model"]["tiny"]["tokenizer"]["vocab_size"]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert config.eos_token_id == tokenizer.eos_token_id
    question = (
        "Linda has 3 male friends and she also has 2 female friends. How many female friends does John have?"
    )
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    assert text == f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text).input_ids
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert tokens[:3] == ["<|im_start|>", "user", "Ċ"]  # Ċ: the byte-level form of a newline
    assert tokens[-4:] == ["Ċ", "<|im_start|>", "assistant", "Ċ"]
    assert "Ġfemale" in tokens and "Ġfriends" in tokens  # the BPE learnt the task's words (Ġ: a space)
    assert tokens[tokens.index("Ġmale") - 2 :][:2] == ["Ġ", "3"]  # Qwen2's split: digits one by one
    assert len(ids) < len(text) / 2.5  # a trained BPE, not bytes
    assert tokenizer.decode(ids) == text  # byte-level: lossless


def test_every_process_trains_the_same_tokenizer_as_the_saved_one(
    rg_aiw_model: tuple[dict[str, Any], str],
) -> None:
    """The data loader and rollout workers train the BPE from the config again: it must be the saved one."""
    from transformers import AutoTokenizer

    from nexrl_hpc.models.run_tokenizer import load_run_tokenizer
    from nexrl_hpc.models.tiny import load_tokenizer

    cfg, model_dir = rg_aiw_model
    saved = AutoTokenizer.from_pretrained(model_dir)  # the user's view: Qwen2Tokenizer
    here = load_run_tokenizer(cfg["model"])  # what the data loader and rollout workers use
    trainer_view = load_tokenizer(model_dir)  # the controller's and the trainer's view of the directory
    assert here.get_vocab() == saved.get_vocab() == trainer_view.get_vocab()
    assert here.chat_template == saved.chat_template == trainer_view.chat_template
    messages = [
        {"role": "user", "content": "Mary has 15 male friends and she also has 2 female friends. Ünïcode?"}
    ]
    kwargs: dict[str, Any] = {"add_generation_prompt": True, "tokenize": True, "return_dict": False}
    ids = saved.apply_chat_template(messages, **kwargs)
    assert here.apply_chat_template(messages, **kwargs) == ids
    assert trainer_view.apply_chat_template(messages, **kwargs) == ids
    # another process (its own hash seeds) trains the same merges
    code = (
        "import json, sys; from tests.conftest import compose_config; "
        "from nexrl_hpc.models.run_tokenizer import load_run_tokenizer; "
        f"tok = load_run_tokenizer(compose_config({QUICK!r})['model']); "
        "print(json.dumps(json.loads(tok.backend_tokenizer.to_str())['model']['merges']))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    merges = json.loads(out.stdout.strip().splitlines()[-1])
    assert merges == json.loads(saved.backend_tokenizer.to_str())["model"]["merges"]


def test_warmed_up_model_writes_an_answer_then_stops_but_does_not_know_which(
    rg_aiw_model: tuple[dict[str, Any], str],
) -> None:
    """Syntax only: one answer token and <|im_end|>; the answers are not taught (RL's job)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nexrl_hpc.tasks.reasoning_gym import reasoning_gym_rows

    cfg, model_dir = rg_aiw_model
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    rows = reasoning_gym_rows({**cfg["validate"]["data"]["reasoning_gym"], "size": 40})
    answers = {str(r["answer"]) for r in rows}
    torch.manual_seed(0)
    given: Counter[str] = Counter()
    correct = 0
    for row in rows:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True, return_dict=False
        )
        out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=True, top_k=0)
        new = out[0, len(ids) :].tolist()
        assert new[1] == tokenizer.eos_token_id, tokenizer.decode(new)  # one token, then <|im_end|>
        text = tokenizer.decode(new, skip_special_tokens=True)
        assert text in answers, text  # an answer's form
        given[text] += 1
        correct += text == str(row["answer"])
    assert len(given) >= 3, given  # sampling spreads over the answers
    assert correct / len(rows) <= 0.45, correct  # chance is ~1/6


def test_chatml_bpe_without_a_corpus_is_a_config_error_naming_the_key() -> None:
    from nexrl_hpc.assembly import validate_config
    from nexrl_hpc.config.validate import ConfigError

    with pytest.raises(ConfigError) as err:
        validate_config(compose_raw(["task=rg_aiw", "model.tiny.tokenizer.corpus=null"]))
    assert [p.path for p in err.value.problems] == ["model.tiny.tokenizer.corpus"]
    with pytest.raises(ConfigError) as err:
        validate_config(compose_raw(["task=rg_aiw", "+model.tiny.tokenizer.corpus_args.nope=1"]))
    assert [p.path for p in err.value.problems] == ["model.tiny.tokenizer.corpus"]


@pytest.mark.e2e
def test_rg_aiw_task_runs_end_to_end_on_its_chat_model(tmp_path: Path) -> None:
    """A few steps of the task on a smaller warm-up: the run trains the Qwen2 chat model on
    chat-message prompts and reports the greedy validation reward. That the reward rises (+0.45 to
    +0.85 at step 200 over three seeds) is measured by bench/rg_task.py, not re-proved here."""
    run_dir = tmp_path / "rg_aiw"
    steps = 3
    proc = run_train(
        [
            *QUICK,
            f"run_dir={run_dir}",
            "seed=1",
            f"train_worker.total_train_steps={steps}",
            f"validate.eval.validate_freq={steps}",
            "logger.backend=[]",
        ],
        timeout=380,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(run_dir / "metrics.jsonl") as f:
        rows: list[dict[str, Any]] = [json.loads(line) for line in f]
    assert [r["step"] for r in rows if "train/reward_mean" in r] == [1, 2, 3]
    val = [(r["step"], r["val/reward"]) for r in rows if "val/reward" in r]
    assert [v[0] for v in val] == [0, steps], val
    assert val[0][1] <= 0.45, val  # the warmed-up model: the format, answers near chance (~1/6)
    assert all(r["actor/nan_skipped"] == 0 for r in rows if "actor/nan_skipped" in r)
    assert os.path.isfile(run_dir / "base_model" / "chat_template.jinja")
