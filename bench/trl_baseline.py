"""TRL's GRPOTrainer on the same model, data and hyperparameters as nexrl_hpc's default run.

Prints one JSON line: steps and wall seconds until greedy validation accuracy >= target (evaluated
after every step, as the nexrl_hpc side does). Used by bench/learning.py; needs ``pip install .[bench]``.

    python bench/trl_baseline.py --model DIR --train train.jsonl --val validation.jsonl --seed 1
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--train", required=True)
    parser.add_argument("--val", required=True)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out-dir", default="/tmp/nexrl_trl_bench")
    args = parser.parse_args()
    t_process = time.time()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    with open(args.train) as f:
        train_rows = [json.loads(line) for line in f]
    with open(args.val) as f:
        val_rows = [json.loads(line) for line in f]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in train_rows])

    def reward(completions: list[str], answer: list[str], **_: object) -> list[float]:
        return [float(c.strip().startswith(a)) for c, a in zip(completions, answer)]

    enc = tokenizer([r["prompt"] for r in val_rows], return_tensors="pt", padding=True)

    def accuracy(m: torch.nn.Module) -> float:
        was_training = m.training
        m.eval()
        with torch.no_grad():
            out = m.generate(**enc, max_new_tokens=2, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        m.train(was_training)
        texts = tokenizer.batch_decode(out[:, enc.input_ids.shape[1] :], skip_special_tokens=True)
        return sum(t.strip().startswith(r["answer"]) for t, r in zip(texts, val_rows)) / len(val_rows)

    result: dict[str, object] = {
        "framework": "trl",
        "seed": args.seed,
        "hit_step": None,
        "accuracy_curve": [],
    }

    class Eval(TrainerCallback):
        def on_train_begin(self, a, state, control, **kw):  # type: ignore[no-untyped-def]
            result["initial_accuracy"] = accuracy(kw["model"])
            self.t0 = time.time()

        def on_step_end(self, a, state, control, **kw):  # type: ignore[no-untyped-def]
            acc = accuracy(kw["model"])
            result["accuracy_curve"].append(round(acc, 4))  # type: ignore[union-attr]
            if acc >= args.target and result["hit_step"] is None:
                result["hit_step"] = state.global_step
                result["seconds_to_target"] = time.time() - self.t0
                result["seconds_to_target_with_startup"] = time.time() - t_process
                control.should_training_stop = True

    config = GRPOConfig(
        output_dir=args.out_dir,
        use_cpu=True,
        bf16=False,
        seed=args.seed,
        per_device_train_batch_size=args.prompts * args.samples,
        num_generations=args.samples,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=2,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        loss_type="dapo",  # token-level normalisation over the batch = nexrl_hpc's token-mean
        scale_rewards="group",
        mask_truncated_completions=False,
        disable_dropout=True,
        max_steps=args.max_steps,
        logging_steps=10_000,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        log_completions=False,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Eval()],
    )
    trainer.train()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
