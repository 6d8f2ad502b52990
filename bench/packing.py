"""Padding-free training against padded training, through the real trainer (PolicyTrainer).

One batch of 64 sequences — prompts of 32-128 tokens, responses of 16-512, drawn uniformly (seeded) —
trained with ``update_actor`` and scored with ``compute_log_prob`` twice from the same weights:
padded (micro-batches of 8 rows) and packed (``actor.packing=true`` with micro-batches of at most
8 x the batch's padded width real tokens: the same memory budget). Tokens/s counts real tokens
(prompt + response); the gradient difference is the largest element-wise difference of the
accumulated gradients of one optimizer step over the whole batch (fp32, no clipping).

The model: a Llama built from model.tiny with hidden 256, 4 layers, 8 heads over 4 KV heads, tied
embeddings, 1024 positions.

With ``--group N`` every N consecutive rows share one prompt (a GRPO group of N samples) and two
more engines run: packed by shared prompts (``actor.share_prompt=true``, the same token budget), each
group's prompt computed once, and ``share_prompt=auto`` (the default; packed otherwise), which
shares only when its FLOP estimate says so (the bench prints what it chose). Tokens/s counts the
same real tokens for every engine (every row's prompt), so a ratio is what a user's batch gains.

    python bench/packing.py [--repeats 3] [--rows 64] [--group 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import cast

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nexrl_hpc.algorithm.batching import pack_trajectories  # noqa: E402
from nexrl_hpc.config.schema import RLTrainConfig  # noqa: E402
from nexrl_hpc.models.tiny import materialize_base_model  # noqa: E402
from nexrl_hpc.trainer.policy_trainer import PolicyTrainer  # noqa: E402
from nexrl_hpc.trainer.worker import TrainWorker  # noqa: E402
from nexrl_hpc.types import Batch, Trajectory  # noqa: E402

MODEL = [
    "model.tiny.hidden_size=256",
    "model.tiny.intermediate_size=688",
    "model.tiny.num_hidden_layers=4",
    "model.tiny.num_attention_heads=8",
    "model.tiny.num_key_value_heads=4",
    "model.tiny.tie_word_embeddings=true",
    "model.tiny.max_position_embeddings=1024",
]


def compose(overrides: list[str]) -> RLTrainConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from nexrl_hpc.assembly import validate_config
    from nexrl_hpc.config import register_resolvers
    from nexrl_hpc.config.location import config_dir

    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name="bench"):
        return validate_config(hydra_compose("rl_train", overrides=overrides))


def make_batch(rows: int, vocab: int, seed: int, group: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    trajs: list[dict] = []
    prompt: list[int] = []
    for i in range(rows):
        if i % group == 0:
            p_len = int(torch.randint(32, 129, (1,), generator=g))
            prompt = torch.randint(4, vocab, (p_len,), generator=g).tolist()
        r_len = int(torch.randint(16, 513, (1,), generator=g))
        trajs.append(
            {
                "prompt_ids": prompt,
                "response_ids": torch.randint(4, vocab, (r_len,), generator=g).tolist(),
                "behaviour_log_probs": [-2.0] * r_len,
            }
        )
    t = pack_trajectories(Batch.from_trajectories(cast(list[Trajectory], trajs)), pad_token_id=0)
    t["old_log_probs"] = t["behaviour_log_probs"] + 0.05 * torch.randn(
        t["behaviour_log_probs"].shape, generator=g
    )
    t["advantages"] = torch.randn(rows, 1, generator=g) * t["response_mask"]
    return t


def trainer(model_dir: str, overrides: list[str]) -> PolicyTrainer:
    eng = PolicyTrainer(model_dir)
    eng.initialize_worker(TrainWorker(compose(overrides), eng).train_service_config())
    eng.init_model()
    return eng


def timed(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument(
        "--group", type=int, default=1, help="rows per shared prompt (> 1: also time share_prompt)"
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    common = [
        *MODEL,
        f"data.batch_size={args.rows}",
        "data.rollout_repeat_n=1",
        "algorithm.adv_estimator=reinforce_pp",  # one sample per prompt: no group estimator
        f"service.train_service.actor.ppo_mini_batch_size={args.rows}",
        "service.train_service.actor.grad_clip=1.0e9",
        "service.train_service.actor.optim.lr=1.0e-6",
        "service.train_service.num_threads=2",
        "service.train_service.actor.share_prompt=false",  # padded and packed as named (the default); the third shares
    ]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = materialize_base_model(compose(common)["model"], os.path.join(tmp, "model"))
        padded = trainer(model_dir, [*common, "service.train_service.actor.ppo_micro_batch_size=8"])
        vocab = padded.model.config.vocab_size
        batch = make_batch(args.rows, vocab, seed=1, group=args.group)
        width = batch["input_ids"].shape[1]
        budget = 8 * width
        engines = {"padded": padded}
        layouts = {
            "packed": ["service.train_service.actor.packing=true"],
            "shared prompts": ["service.train_service.actor.share_prompt=true"],
            # the default: shares prompts when its estimate says it is cheaper, else packed here
            "auto": [
                "service.train_service.actor.packing=true",
                "service.train_service.actor.share_prompt=auto",
            ],
        }
        for name in ("packed", "shared prompts", "auto") if args.group > 1 else ("packed",):
            engines[name] = trainer(
                model_dir,
                [*common, *layouts[name], f"service.train_service.actor.ppo_max_token_len_per_gpu={budget}"],
            )
        auto_shares = (
            "auto" in engines and engines["auto"].plan_batch("update_actor", batch)[0]["shared_prompts"]
        )
        real_tokens = int(batch["attention_mask"].sum())
        # gradients of one step from the same weights
        for eng in engines.values():
            eng.update_actor({"batch": dict(batch)})
        grad_diff = {
            name: max(
                float((a.grad - b.grad).abs().max())
                for a, b in zip(padded.model.parameters(), eng.model.parameters())
                if a.grad is not None and b.grad is not None
            )
            for name, eng in engines.items()
            if name != "padded"
        }
        grad_max = max(float(a.grad.abs().max()) for a in padded.model.parameters() if a.grad is not None)
        results = {}
        for name, eng in engines.items():
            update_s = timed(partial(eng.update_actor, {"batch": batch}), args.repeats)
            logp_s = timed(partial(eng.compute_log_prob, {"batch": batch}), args.repeats)
            results[name] = (update_s, logp_s)
    shared = f", every {args.group} rows sharing a prompt" if args.group > 1 else ""
    print(
        f"\n{args.rows} sequences{shared}, {real_tokens} real tokens in a padded {args.rows} x {width} batch "
        f"({real_tokens / (args.rows * width):.0%} real); packed micro-batches of <= {budget} tokens; "
        f"median of {args.repeats}\n"
    )
    print("| engine | update_actor s | update tokens/s | compute_log_prob s | log-prob tokens/s |")
    print("| --- | --- | --- | --- | --- |")
    for name, (update_s, logp_s) in results.items():
        print(
            f"| {name} | {update_s:.2f} | {real_tokens / update_s:,.0f} | {logp_s:.2f} | {real_tokens / logp_s:,.0f} |"
        )
    print()
    for name in results:
        if name == "padded":
            continue
        ratio = results["padded"][0] / results[name][0]
        logp_ratio = results["padded"][1] / results[name][1]
        label = {"packed": "packed", "shared prompts": "shared-prompt"}.get(name, name)
        print(f"{label} / padded tokens/s: {ratio:.2f}x (update_actor), {logp_ratio:.2f}x (compute_log_prob)")
        print(f"{label} max |grad diff|: {grad_diff[name]:.2e} (largest gradient element {grad_max:.2e})")
    if args.group > 1:
        print(f"auto chose: {'shared prompts' if auto_shares else 'packed'}")


if __name__ == "__main__":
    main()
