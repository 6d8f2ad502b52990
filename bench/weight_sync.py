"""Weight sync to a real vLLM server: end of an optimizer step -> vLLM serving the new version.

What is timed, per version (the trainer's weights already updated in memory):

- write: ``write_hf_model_dir(..., fsync=False)``, what the trainer's ``export_weights`` does into
  the sync path (once per version; both paths below start from these files);
- vLLM: ``VLLMReloadTransport.publish`` (pause -> collective_rpc reload_weights ->
  update_weight_version + /weight_info check -> reset_prefix_cache -> resume). When it returns the
  server serves the version; the first request after it is timed apart (not in the ratio);
- read: ``read_safetensors_dir`` of the same files, every tensor copied into memory (safetensors
  maps the file lazily; vLLM copies each tensor into its parameters).

ratio = (write + vLLM) / (write + read); publish and read alternate in order rep by rep, the page
cache is as warm for both. Disk writeback makes the write time noisy on a VM; it is the same
write in both sums. The model is the tiny Llama, scaled up for the larger sizes
(built locally, random init). Goal: vLLM path <= 1.5x the baseline. Needs vLLM's venv
(bash scripts/install_vllm.sh).

    python bench/weight_sync.py [--gb 0 0.5] [--reps 5]      # 0: the default tiny model
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import httpx  # noqa: E402
import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from nexrl_hpc.assembly import validate_config  # noqa: E402
from nexrl_hpc.checkpoint.hf import read_safetensors_dir, write_hf_model_dir  # noqa: E402
from nexrl_hpc.config import register_resolvers  # noqa: E402
from nexrl_hpc.inference.vllm_server import VLLMServer  # noqa: E402
from nexrl_hpc.models.tiny import build_tiny_model, materialize_base_model  # noqa: E402
from nexrl_hpc.weight_sync.transport import VLLMReloadTransport  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIDDEN, INTERMEDIATE = 1024, 2816
GOAL = 1.5


def config(work: str, gb: float) -> Any:
    overrides = [f"run_dir={work}/run", "service.inference_service.backend=vllm"]
    if gb > 0:
        per_layer = (4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTERMEDIATE + 2 * HIDDEN) * 4
        overrides += [
            f"model.tiny.hidden_size={HIDDEN}",
            f"model.tiny.intermediate_size={INTERMEDIATE}",
            f"model.tiny.num_hidden_layers={max(1, round(gb * 1e9 / per_layer))}",
            "model.tiny.num_attention_heads=8",
            "model.tiny.num_key_value_heads=8",
        ]
    register_resolvers()
    with initialize_config_dir(
        config_dir=os.path.join(REPO, "configs"), version_base="1.3", job_name="bench"
    ):
        return validate_config(compose("rl_train", overrides=overrides))


def publish_and_probe(
    transport: VLLMReloadTransport, sync_dir: str, version: int, probe: httpx.Client, served_model: str
) -> tuple[float, float]:
    """(publish, first request after it) in seconds."""
    t0 = time.perf_counter()
    transport.publish(sync_dir, version)
    t1 = time.perf_counter()
    body = {"model": served_model, "prompt": "m123=", "max_tokens": 1, "temperature": 0.0}
    probe.post("/v1/completions", json=body).raise_for_status()
    return t1 - t0, time.perf_counter() - t1


def read_back(sync_dir: str, state: dict[str, torch.Tensor]) -> float:
    """Seconds to read the safetensors into memory (safetensors maps lazily: every tensor is copied,
    as vLLM copies each into its parameters)."""
    t0 = time.perf_counter()
    loaded = {k: t.clone() for k, t in read_safetensors_dir(sync_dir).items()}
    elapsed = time.perf_counter() - t0
    assert torch.equal(loaded["lm_head.weight"], state["lm_head.weight"])
    return elapsed


def bench_size(gb: float, reps: int, work: str) -> dict[str, Any]:
    cfg = config(work, gb)
    base = materialize_base_model(cfg["model"], os.path.join(work, "base_model"))
    model, _ = build_tiny_model(cfg["model"]["tiny"])
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    del model
    size_mb = sum(t.numel() * t.element_size() for t in state.values()) / 1e6
    max_shard = cfg["service"]["train_service"]["export_max_shard_mb"] << 20
    svc = cfg["service"]["inference_service"]
    server = VLLMServer(base, svc["vllm"], os.path.join(work, "logs"), svc["model"])
    t = time.monotonic()
    url = server.start()
    print(f"  {size_mb:.1f} MB model: vLLM ready in {time.monotonic() - t:.0f}s", flush=True)
    transport = VLLMReloadTransport(600.0, svc["vllm"]["pause_mode"])
    transport.set_endpoint(url, server.api_key)
    probe = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {server.api_key}"}, timeout=60)
    rows: dict[str, list[float]] = {k: [] for k in ("write", "publish", "first", "read", "vllm", "base")}
    try:
        for rep in range(reps + 1):  # rep 0 warms up
            with torch.no_grad():
                state["lm_head.weight"].add_(0.01)  # a new version (the optimizer step, not timed)
            sync_dir = os.path.join(work, "weights", f"version_{rep}")
            t0 = time.perf_counter()
            write_hf_model_dir(state, base, sync_dir, max_shard, fsync=False)  # the trainer's export
            write = time.perf_counter() - t0
            if rep % 2 == 0:
                publish, first = publish_and_probe(transport, sync_dir, rep + 1, probe, svc["model"])
                read = read_back(sync_dir, state)
            else:
                read = read_back(sync_dir, state)
                publish, first = publish_and_probe(transport, sync_dir, rep + 1, probe, svc["model"])
            if rep:
                for k, v in (("write", write), ("publish", publish), ("first", first), ("read", read)):
                    rows[k].append(v)
                rows["vllm"].append(write + publish)
                rows["base"].append(write + read)
            old = os.path.join(work, "weights", f"version_{rep - 1}")
            if os.path.exists(old):  # the sync path keeps few versions (not timed)
                shutil.rmtree(old)
    finally:
        server.stop()
    if os.environ.get("NEXRL_BENCH_VERBOSE"):
        print({k: [round(x * 1000, 1) for x in v] for k, v in rows.items()})
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {"gb": gb, "size_mb": size_mb, "reps": reps, **med, "timings": transport.last_timings}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--gb", type=float, nargs="+", default=[0.0, 0.5], help="model sizes; 0: the default tiny model"
    )
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    results = []
    for gb in args.gb:
        with tempfile.TemporaryDirectory(prefix="nexrl_wsync_") as work:
            results.append(bench_size(gb, args.reps, work))
    ms = lambda s: f"{s * 1000:.1f}"  # noqa: E731
    print()
    print(
        "| model (fp32) | reps | write (export) ms | vLLM reload ms | step end -> vLLM serving ms "
        "| first request after ms | read ms | write + read ms | ratio | goal |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ratio = r["vllm"] / r["base"]
        print(
            f"| {r['size_mb']:.1f} MB | {r['reps']} | {ms(r['write'])} | {ms(r['publish'])} | {ms(r['vllm'])} "
            f"| {ms(r['first'])} | {ms(r['read'])} | {ms(r['base'])} | {ratio:.2f}x "
            f"| ≤ {GOAL:.2f}x {'met' if ratio <= GOAL else 'NOT met'} |"
        )
    for r in results:
        print(
            f"last reload steps ({r['size_mb']:.1f} MB): "
            + ", ".join(f"{k} {ms(v)} ms" for k, v in r["timings"].items())
        )


if __name__ == "__main__":
    main()
