"""Peak memory of a training micro-step: log-probs and entropy in bounded memory vs materialised.

One micro-batch of ``--rows`` sequences (a ``--prompt-tokens`` prompt, ``--tokens`` response tokens
each) through a Qwen2.5-0.5B-shaped model (hidden 896, 24 layers, 14 heads / 2 KV heads,
intermediate 4864, vocabulary 151,936, tied embeddings; random weights from a local
``Qwen2Config``, fp32 master weights): the trainer's forward (``response_log_probs_and_entropy``),
its loss (``ActorLoss`` with an entropy bonus, so the entropy's gradient flows too) and backward.
Two variants of the same step, each in a fresh subprocess:

- ``bounded``: ``service.train_service.logprob_chunk_tokens=--chunk`` (the LM head scores that many
  positions at a time, backward recomputes each chunk);
- ``materialised``: ``logprob_chunk_tokens=0`` (``log_softmax(logits.float())`` over the whole
  vocabulary, the baseline);
- ``bounded_sp2``: ``bounded`` as one rank of ``sequence_parallel_size=2`` sees it
  (``sequence_parallel.emulate_sequence_parallel``: the other rank's data stood in by copies, so
  every tensor has its real shape; its values are not compared), where the trainer has it.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` (reset before each step); on CPU the
process's peak resident set (``VmHWM`` of /proc/self/status, reset before each step by writing 5 to
/proc/self/clear_refs; glibc is told to mmap every allocation of 64 KiB or more, so what a step
frees leaves the RSS and the peak is the step's own). Both count everything alive in the step:
weights, gradients, activations (gradient checkpointing on, as ``hardware=gpu``), the runtime. Each subprocess
measures ``--tokens`` first, then the fit lengths (x 1/4 and 1/2), with a reset before each; the
longest response fitting ``--budget-gb`` is a least-squares line through those peaks, extrapolated
(said so in the output). Then the log-probs, entropies and every parameter's gradient of the two
variants at ``--tokens`` are compared (max |delta|; the fp32 goals are 1e-6 and 1e-5).

    python bench/memory.py                                   # the full size, fp32 on CPU (~25 GB for the baseline)
    python bench/memory.py --layers 2 --tokens 512           # a cheap CPU dry run
    python bench/memory.py --device cuda --dtype bfloat16    # on a GPU (autocast over fp32 masters)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nexrl_hpc.algorithm.loss import ActorLoss, LossInputs  # noqa: E402
from nexrl_hpc.trainer.logprobs import response_log_probs_and_entropy  # noqa: E402
from nexrl_hpc.trainer.policy_trainer import enable_activation_checkpointing  # noqa: E402

VOCAB = 151_936
VARIANTS = {"bounded": None, "materialised": 0}  # None: --chunk
SP = "bounded_sp2"  # the bounded path on one rank of sequence_parallel_size=2, emulated in one process
LOSS_ACTOR = {  # the shipped actor defaults (configs/rl_train.yaml), with an entropy bonus
    "policy_loss": "vanilla",
    "clip_ratio_low": 0.2,
    "clip_ratio_high": 0.2,
    "clip_ratio_c": 3.0,
    "log_ratio_clamp": 20.0,
    "entropy_coeff": 0.01,
    "loss_agg_mode": "token-mean",
}


def build_model(layers: int, device: str, attn: str) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=131072,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_dropout=0.0,
    )
    config._attn_implementation = attn
    torch.manual_seed(0)  # the same weights in every subprocess
    with torch.device(device):  # initialised where it runs (a GPU initialises 0.5B weights at once)
        model = Qwen2ForCausalLM(config).to(dtype=torch.float32)
    model.train()
    return model


def make_micro(rows: int, prompt: int, tokens: int, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(tokens)
    width = prompt + tokens
    input_ids = torch.randint(0, VOCAB, (rows, width), generator=g)
    micro = {
        "input_ids": input_ids,
        "attention_mask": torch.ones(rows, width, dtype=torch.long),
        "position_ids": torch.arange(width).expand(rows, width).contiguous(),
        "responses": input_ids[:, prompt:].contiguous(),
        "response_mask": torch.ones(rows, tokens),
        "old_log_probs": torch.full((rows, tokens), -12.0),
        "advantages": torch.randn(rows, 1, generator=g).expand(rows, tokens).contiguous(),
    }
    return {k: v.to(device) for k, v in micro.items()}


def _rss_peak_reset() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def micro_step(model: Any, micro: dict[str, torch.Tensor], chunk: int, dtype: str, device: str) -> Any:
    """Forward (log-probs + entropy), the actor loss, backward; returns (log-probs, entropy)."""
    compute = getattr(torch, dtype)
    loss_fn = ActorLoss.from_config(LOSS_ACTOR, {"kl_loss_coef": 0.0, "kl_loss_type": "low_var_kl"})
    with torch.autocast(device_type=device, dtype=compute, enabled=compute != torch.float32):
        logp, entropy = response_log_probs_and_entropy(model, micro, entropy_grad=True, chunk_tokens=chunk)
    loss, _ = loss_fn(LossInputs(logp, entropy, micro, None))
    loss.backward()
    return logp.detach(), entropy.detach()


def measure(args: argparse.Namespace, model: Any, tokens: int, chunk: int) -> dict[str, Any]:
    """One micro-step at ``tokens`` response tokens per row: its peak memory (bytes)."""
    micro = make_micro(args.rows, args.prompt_tokens, tokens, args.device)
    model.zero_grad(set_to_none=True)
    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        if not _rss_peak_reset():
            raise RuntimeError("/proc/self/clear_refs is not writable: the peak RSS cannot be reset")
        before = _status_kb("VmRSS") * 1024
    start = time.perf_counter()
    try:
        logp, entropy = micro_step(model, micro, chunk, args.dtype, args.device)
    except torch.OutOfMemoryError:
        model.zero_grad(set_to_none=True)
        if args.device == "cuda":
            torch.cuda.empty_cache()
        return {"tokens": tokens, "oom": True}
    if args.device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = _status_kb("VmHWM") * 1024
    return {
        "tokens": tokens,
        "peak": peak,
        "before": before,
        "seconds": time.perf_counter() - start,
        "logp": logp,
        "entropy": entropy,
    }


def worker(args: argparse.Namespace) -> None:
    """One variant in this fresh process: the fit lengths, then ``--tokens`` (its results saved)."""
    torch.set_num_threads(args.threads)
    chunk = args.chunk if VARIANTS.get(args.variant) is None else 0
    model = build_model(args.layers, args.device, args.attn)
    if args.variant == SP:
        from nexrl_hpc.trainer.sequence_parallel import emulate_sequence_parallel

        emulate_sequence_parallel(model, 2)
    if not args.no_checkpointing:
        enable_activation_checkpointing(model)
    points = []
    others = [t for t in fit_lengths(args) if t != args.tokens]
    for tokens in [args.tokens, *others]:  # the compared length first, in the fresh process
        r = measure(args, model, tokens, chunk)
        if tokens == args.tokens and not r.get("oom") and args.variant in VARIANTS:
            grads = {
                k: p.grad.detach().float().cpu() for k, p in model.named_parameters() if p.grad is not None
            }
            torch.save(
                {"logp": r["logp"].cpu(), "entropy": r["entropy"].cpu(), "grads": grads},
                os.path.join(args.out, f"{args.variant}.pt"),
            )
            del grads
        r.pop("logp", None), r.pop("entropy", None)
        points.append(r)
        model.zero_grad(set_to_none=True)
    print("RESULT " + json.dumps(sorted(points, key=lambda p: p["tokens"])), flush=True)


def fit_lengths(args: argparse.Namespace) -> list[int]:
    """The response lengths measured for the fit: ``--fit-tokens``, or ``--tokens`` x 1/4, 1/2, 1."""
    if args.fit_tokens:
        return sorted({int(t) for t in args.fit_tokens.split(",")} | {args.tokens})
    return sorted({max(args.tokens // 4, 1), max(args.tokens // 2, 1), args.tokens})


def run_variant(args: argparse.Namespace, variant: str, out: str) -> list[dict[str, Any]]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--variant", variant, "--out", out]
    for key in (
        "device",
        "dtype",
        "layers",
        "tokens",
        "rows",
        "prompt_tokens",
        "chunk",
        "attn",
        "threads",
        "fit_tokens",
    ):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    if args.no_checkpointing:
        cmd.append("--no-checkpointing")
    # CPU: every allocation of 64 KiB or more mmap-ed, so freed memory leaves the RSS at once (glibc
    # would otherwise raise its mmap threshold to 32 MB after the first frees and keep freed
    # activations in its heap, counted in the next step's peak)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stderr[-6000:])
        raise SystemExit(f"bench/memory.py: the {variant} subprocess failed (exit {proc.returncode})")
    return list(json.loads(lines[-1][len("RESULT ") :]))


def max_deltas(out: str) -> dict[str, float] | None:
    paths = {v: os.path.join(out, f"{v}.pt") for v in VARIANTS}
    if not all(os.path.exists(p) for p in paths.values()):
        return None
    a = torch.load(paths["bounded"], mmap=True, weights_only=True)
    b = torch.load(paths["materialised"], mmap=True, weights_only=True)
    grad = max(float((a["grads"][k] - b["grads"][k]).abs().max()) for k in b["grads"])
    return {
        "logp": float((a["logp"] - b["logp"]).abs().max()),
        "entropy": float((a["entropy"] - b["entropy"]).abs().max()),
        "grad": grad,
        "grad_tensors": float(len(b["grads"])),
    }


def longest_fitting(points: list[dict[str, Any]], budget: float) -> str:
    """The response length whose peak meets ``budget`` on the least-squares line through ``points``."""
    ok = [(float(p["tokens"]), float(p["peak"])) for p in points if not p.get("oom")]
    if len(ok) < 2:
        return "n/a (fewer than two lengths measured)"
    n = len(ok)
    mx, my = sum(x for x, _ in ok) / n, sum(y for _, y in ok) / n
    slope = sum((x - mx) * (y - my) for x, y in ok) / sum((x - mx) ** 2 for x, _ in ok)
    if slope <= 0:
        return "n/a (peak does not grow with length)"
    length = max(int((budget - (my - slope * mx)) / slope), 0)
    ooms = [int(p["tokens"]) for p in points if p.get("oom")]
    if ooms and length >= min(ooms):
        return f"< {min(ooms):,} tokens per response (out of memory there)"
    longest = int(max(x for x, _ in ok))
    where = (
        f"{length / longest:.1f}x the longest measured, {longest:,}: extrapolated"
        if length > longest
        else "within the measured lengths"
    )
    flat = " - the peak hardly grows over these lengths (fixed costs dominate it): measure longer ones (--fit-tokens)"
    return (
        f"{length:,} tokens per response (peak +{slope * 1000 / 2**20:,.0f} MiB per 1,000 tokens; {where})"
        + (flat if length > 8 * longest else "")
    )


def sequence_parallel_available() -> bool:
    try:
        from nexrl_hpc.trainer.sequence_parallel import emulate_sequence_parallel  # noqa: F401
    except ImportError:
        return False
    return True


def sequence_parallel_line(results: dict[str, list[dict[str, Any]]], budget: float) -> str:
    """The ``sequence_parallel_size=2`` line: one rank's peak (its decoder activations are half the
    tokens'; the LM head scores whole rows), measured where the trainer offers it."""
    if SP not in results:
        return "not measured: sequence parallelism not available"
    return longest_fitting(results[SP], budget) + " (one rank of 2, emulated in one process)"


def gib(x: float) -> str:
    return f"{x / 2**30:.2f}"


def report(args: argparse.Namespace, results: dict[str, list[dict[str, Any]]], deltas: Any) -> None:
    where = f"{args.device} {args.dtype}"
    print(
        f"\nQwen2.5-0.5B-shaped, {args.layers} layers, vocab {VOCAB:,}, tied; {args.rows} x "
        f"({args.prompt_tokens} prompt + response) tokens; {where}; chunk {args.chunk}; "
        f"gradient checkpointing {'off' if args.no_checkpointing else 'on'}"
    )
    print(
        "peak: "
        + ("torch.cuda.max_memory_allocated" if args.device == "cuda" else "process VmHWM (peak RSS)")
    )
    print("\n| variant | response tokens | peak GiB | before step GiB | step increase GiB | step s |")
    print("|---|---|---|---|---|---|")
    for variant, points in results.items():
        for p in points:
            if p.get("oom"):
                print(f"| {variant} | {p['tokens']:,} | OOM | | | |")
                continue
            print(
                f"| {variant} | {p['tokens']:,} | {gib(p['peak'])} | {gib(p['before'])} | "
                f"{gib(p['peak'] - p['before'])} | {p['seconds']:.1f} |"
            )
    budget = args.budget_gb * 1e9
    print(f"\nlongest response fitting {args.budget_gb:g} GB ({args.rows} rows per micro-batch; a line")
    print(f"through the peaks at {', '.join(f'{t:,}' for t in fit_lengths(args))} tokens, not past an OOM):")
    for variant in VARIANTS:
        print(f"  {variant}: {longest_fitting(results[variant], budget)}")
    print(f"  sequence_parallel_size=2: {sequence_parallel_line(results, budget)}")
    if deltas is not None:
        print(
            f"\nmax |delta| bounded vs materialised at {args.tokens:,} tokens: log-prob {deltas['logp']:.2e} "
            f"(fp32 goal 1e-6), entropy {deltas['entropy']:.2e}, gradient {deltas['grad']:.2e} "
            f"over {int(deltas['grad_tensors'])} tensors (fp32 goal 1e-5)"
        )
    main = {v: next((p for p in pts if p["tokens"] == args.tokens), None) for v, pts in results.items()}
    b, m = main["bounded"], main["materialised"]
    if b is None or m is None or b.get("oom") or m.get("oom"):
        print("peak memory bounded / materialised: n/a (a variant ran out of memory)")
        return
    print(
        f"step increase bounded / materialised: {(b['peak'] - b['before']) / (m['peak'] - m['before']):.2f}x"
    )
    print(f"peak memory bounded / materialised: {b['peak'] / m['peak']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=4096, help="response tokens per row")
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=1024, help="logprob_chunk_tokens of the bounded variant")
    parser.add_argument("--budget-gb", type=float, default=16.0)
    parser.add_argument(
        "--fit-tokens",
        default="",
        help="comma-separated response lengths for the fit (default: --tokens x 1/4, 1/2)",
    )
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=sorted([*VARIANTS, SP]), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/memory.py: --device cuda but no CUDA device is visible")
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory(prefix="nexrl_memory_") as out:
        variants = [*VARIANTS, *([SP] if sequence_parallel_available() else [])]
        results = {v: run_variant(args, v, out) for v in variants}
        deltas = max_deltas(out)
    report(args, results, deltas)


if __name__ == "__main__":
    main()
