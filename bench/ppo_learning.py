"""``algorithm=ppo`` learns the default task under ``mpirun``, with a critic group of 1 and of 2 FSDP2
ranks and with a value head on the policy (``critic.head_on_policy``): held-out accuracy at the last
step by ``scripts/independent_eval.py``, per seed, against GRPO (the default algorithm) run in the
same bench on the same seeds.

Each seed runs ``mpirun -n N python -m launch.train launch_mode=mpi seed=S`` as a user starts it:
the driver, the actor's trainer group (``--actor-ranks``; FSDP2 when more than one), the critic's
group (PPO with a value model of its own) and one rollout rank. Every seed builds its own random tiny model
(``model.tiny.init_seed: ${seed}``). The goal of issue 39: held-out accuracy >= 0.9 by the
independent evaluation (plain transformers, greedy, the last checkpoint), with 1 and 2 critic ranks.
The run's own validation at the last step is printed beside it.

    python bench/ppo_learning.py [--seeds 1 2 3] [--steps 50] [--actor-ranks 1] [overrides ...]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launch_runs import independent_accuracy, timed_train_run  # noqa: E402

GOAL = 0.9
CRITIC = "service.train_service.critic"


def settings() -> dict[str, tuple[list[str], int]]:
    """Label -> (the overrides, the critic's ranks): GRPO, then PPO with 1 and 2 FSDP2 critic ranks
    and with the value head on the policy (no critic ranks)."""
    ppo = ["algorithm=ppo", f"{CRITIC}.engine=fsdp"]
    return {
        "grpo": ([], 0),
        "ppo, critic 1 rank (fsdp)": ([*ppo, f"{CRITIC}.world_size=1"], 1),
        "ppo, critic 2 ranks (fsdp)": ([*ppo, f"{CRITIC}.world_size=2"], 2),
        "ppo, value head on the policy": (["algorithm=ppo", f"{CRITIC}.head_on_policy=true"], 0),
    }


def run(overrides: list[str], name: str, ranks: int, steps: int) -> tuple[float, float, float]:
    """(independent held-out accuracy of the last checkpoint, the run's validation at ``steps``,
    wall seconds) of one run."""
    independent: dict[str, float] = {}

    def evaluate_last_checkpoint(run_dir: str) -> None:
        independent["accuracy"] = independent_accuracy(run_dir, name, steps)

    launcher = ["mpirun", "-n", str(ranks)]
    rows, _, wall = timed_train_run(overrides, name, launcher, inspect_run_dir=evaluate_last_checkpoint)
    val = [r for r in rows if "val/accuracy" in r]
    if not val or val[-1]["step"] != steps:
        raise SystemExit(
            f"{name}: no validation at step {steps} (validate.eval.validate_freq must divide it)"
        )
    return independent["accuracy"], val[-1]["val/accuracy"], wall


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--actor-ranks", type=int, default=1, help="the actor's trainer ranks (FSDP2 if > 1)")
    parser.add_argument("--only", nargs="+", default=None, help="these settings' labels alone")
    args, extra = parser.parse_known_args()
    actor = [f"service.train_service.world_size={args.actor_ranks}"]
    if args.actor_ranks > 1:
        actor.append("service.train_service.engine=fsdp")
    common = ["launch_mode=mpi", f"train_worker.total_train_steps={args.steps}", *actor, *extra]
    chosen = {k: v for k, v in settings().items() if args.only is None or k in args.only}
    results: dict[str, list[tuple[float, float]]] = {}
    for label, (overrides, critic_ranks) in chosen.items():
        results[label] = []
        ranks = 1 + args.actor_ranks + critic_ranks + 1  # driver, actor, critic, one rollout rank
        for seed in args.seeds:
            name = f"{re.sub(r'[^A-Za-z0-9]+', '_', label)}_seed{seed}"
            independent, own, wall = run([f"seed={seed}", *common, *overrides], name, ranks, args.steps)
            results[label].append((independent, own))
            print(
                f"{label}, seed {seed}: independent {independent:.3f}, the run's validation {own:.3f} "
                f"at step {args.steps} (mpirun -n {ranks}, {wall:.0f} s)",
                flush=True,
            )
    where = " ".join([f"--actor-ranks {args.actor_ranks}", *extra])
    print(f"\nmpirun, {where}; seeds {args.seeds}; held-out accuracy at step {args.steps} (goal >= {GOAL})\n")
    print("| setting | independent eval per seed | mean | seeds >= 0.9 | the run's validation per seed |")
    print("| --- | --- | --- | --- | --- |")
    for label, accs in results.items():
        independent = [a for a, _ in accs]
        hits = sum(a >= GOAL for a in independent)
        print(
            f"| {label} | {', '.join(f'{a:.2f}' for a in independent)} | {statistics.mean(independent):.3f} "
            f"| {hits}/{len(accs)} | {', '.join(f'{o:.2f}' for _, o in accs)} |"
        )
    if "grpo" in results:
        grpo = statistics.mean(a for a, _ in results["grpo"])
        for label, accs in results.items():
            if label != "grpo":
                print(
                    f"mean independent accuracy {label} / grpo: {statistics.mean(a for a, _ in accs) / grpo:.3f}x"
                )


if __name__ == "__main__":
    main()
