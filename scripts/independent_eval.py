"""Independent check of a run: greedy accuracy of its newest complete checkpoint with plain transformers.

Uses nothing from nexrl_hpc: finds ``<run_dir>/checkpoints/global_step_*`` with a COMPLETE marker,
loads ``model/`` with AutoModelForCausalLM + PreTrainedTokenizerFast, greedily completes every
prompt of ``<run_dir>/data/validation.jsonl`` and counts a completion right when, stripped, it
starts with the row's ``answer``. Prints JSON: {"checkpoint", "accuracy", "n"}.

    python scripts/independent_eval.py <run_dir> [--max-new-tokens 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast


def newest_complete_checkpoint(run_dir: str) -> str:
    folder = os.path.join(run_dir, "checkpoints")
    steps = []
    for name in os.listdir(folder):
        m = re.fullmatch(r"global_step_(\d+)", name)
        if m and os.path.exists(os.path.join(folder, name, "COMPLETE")):
            steps.append((int(m.group(1)), name))
    if not steps:
        raise SystemExit(f"no complete checkpoint in {folder}")
    return os.path.join(folder, max(steps)[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--max-new-tokens", type=int, default=2)
    args = parser.parse_args()
    ckpt = newest_complete_checkpoint(args.run_dir)
    model_dir = os.path.join(ckpt, "model")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with open(os.path.join(args.run_dir, "data", "validation.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    correct = 0
    for row in rows:
        ids = tokenizer(row["prompt"], return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        correct += text.strip().startswith(str(row["answer"]))
    print(json.dumps({"checkpoint": ckpt, "accuracy": correct / len(rows), "n": len(rows)}))


if __name__ == "__main__":
    main()
