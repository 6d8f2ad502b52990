"""Trajectories/s through rollout worker -> trajectory pool -> GRPO processor -> train batch pool -> trainer.

The LLM is a zero-latency fake and the trainer a no-op, so this measures the framework's own data
path in local mode (the real controller, modules, threads, metrics files). Goal: >= 20k trajectories/s.

    python bench/pipeline.py [--steps 40] [--prompts 128] [--samples 8]
"""

from __future__ import annotations

import argparse

from local_run import run_local


def run(
    steps: int, prompts: int, samples: int, workers: int, extra: tuple[str, ...] = ()
) -> dict[str, float]:
    _, rows = run_local(
        "nexrl_bench_pipeline_",
        [
            "service.inference_service.backend=fake",
            "service.train_service.backend=noop",
            f"train_worker.total_train_steps={steps}",
            f"data.batch_size={prompts}",
            f"data.rollout_repeat_n={samples}",
            f"rollout_worker.num_workers={workers}",
            f"rollout_worker.max_concurrency={prompts * samples}",
            *extra,
        ],
    )
    # wall time from the end of step 1 to the end of the last step: warm-up excluded
    elapsed = rows[-1]["time"] - rows[0]["time"]
    n = (len(rows) - 1) * prompts * samples
    step_s = sorted(r["timing/step_s"] for r in rows[1:])
    return {
        "trajectories": n,
        "seconds": elapsed,
        "per_s": n / elapsed,
        "median_step_ms": 1000 * step_s[len(step_s) // 2],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    import logging

    logging.basicConfig(level=logging.WARNING)
    result = run(args.steps, args.prompts, args.samples, args.workers)
    goal = 20_000
    print()
    print(
        "| path | batch (trajectories) | steps timed | trajectories/s | median step | goal | ratio vs goal |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| rollout -> pool -> GRPO -> batch pool -> no-op trainer (local, fake LLM) | {args.prompts * args.samples} | "
        f"{args.steps - 1} | {result['per_s']:,.0f} | {result['median_step_ms']:.1f} ms | {goal:,} | {result['per_s'] / goal:.2f}x |"
    )


if __name__ == "__main__":
    main()
