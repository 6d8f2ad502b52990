"""``python -m launch.merge_lora <checkpoint or adapter dir> <out_dir> [--base <model dir>]``
(``nexrl-merge-lora``): a LoRA run's adapter merged into its base model (peft's
``merge_and_unload``), written as a plain HF model directory any HF-layout loader takes.

The input is a checkpoint (``checkpoints/global_step_<N>``, whose ``model/`` holds the adapter) or
an adapter directory itself; the base is the one the adapter records (``base_model_name_or_path``,
the run's model) unless ``--base`` names another. Exit 0; 2 when the input holds no adapter or the
base model directory is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

from nexrl_hpc.checkpoint.adapter import ADAPTER_CONFIG, is_adapter_dir
from nexrl_hpc.checkpoint.hf import HF_SIDE_FILES


def adapter_dir_of(path: str) -> str | None:
    """The adapter directory of a checkpoint or of an adapter directory; None if neither."""
    for candidate in (path, os.path.join(path, "model")):
        if is_adapter_dir(candidate):
            return candidate
    return None


def merge(adapter_dir: str, base_dir: str, out_dir: str) -> None:
    """Base + adapter, merged in fp32 and saved with the base's tokenizer files."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(out_dir)
    for name in HF_SIDE_FILES:  # the tokenizer and chat template the engines load from the directory
        src, dst = os.path.join(base_dir, name), os.path.join(out_dir, name)
        if os.path.exists(src) and not os.path.exists(dst):
            shutil.copyfile(src, dst)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nexrl-merge-lora", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a LoRA checkpoint (global_step_<N>) or adapter directory")
    parser.add_argument("out_dir", help="where the merged HF model directory is written")
    parser.add_argument("--base", default=None, help="the base model directory (default: the adapter's)")
    args = parser.parse_args(argv)
    adapter_dir = adapter_dir_of(args.checkpoint)
    if adapter_dir is None:
        print(f"{args.checkpoint}: no LoRA adapter ({ADAPTER_CONFIG}) here or in its model/", file=sys.stderr)
        return 2
    with open(os.path.join(adapter_dir, ADAPTER_CONFIG)) as f:
        base_dir = args.base or json.load(f).get("base_model_name_or_path")
    if not base_dir or not os.path.isdir(base_dir):
        print(f"{adapter_dir}: base model directory {base_dir!r} not found (pass --base)", file=sys.stderr)
        return 2
    merge(adapter_dir, base_dir, args.out_dir)
    print(f"merged {adapter_dir} into {base_dir}: {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
