"""Weight sync: end of an optimizer step -> every inference server serving the new version.

One run, two servers (vLLM's CPU build, or ``--backend local``: nexrl_hpc's own server), a
Qwen2.5-0.5B-shaped model (Qwen2, hidden 896, 14 heads / 2 KV heads, intermediate 4864, vocab
151,936, tied; random weights, fp32; ``--layers`` of its 24). The bench's process is the trainer
(one process: ``SingleProcess``). Timed per version, versions alternating in order:

- broadcast: ``WeightPublisher.publish`` with ``weight.transport=broadcast`` (a fresh group per
  sync, the weights in ``--bucket-mb`` buckets, both servers receiving at once; for vLLM its
  weight-transfer API with the run's plugin, between pause and resume);
- disk: the trainer's export (``write_hf_model_dir``, no fsync) + both servers reloading it at
  once (``VLLMReloadTransport`` / ``DiskReloadTransport``);
- raw broadcast (the floor): the same tensors broadcast over gloo from this process to two
  receiving processes (one per server) that only receive: no rendezvous, no HTTP, no loading.

Ratios: broadcast / raw broadcast (goal <= 1.3x), broadcast / disk (goal <= 0.5x). Also the
trainer's peak extra memory (RSS above its level before the sync, sampled every millisecond)
during a broadcast (goal <= one bucket + 10 %).

    python bench/weight_sync.py [--layers 24] [--backend vllm|local] [--reps 3] [--bucket-mb 256]
    python bench/weight_sync.py --backend local --device cuda       # servers and trainer on the GPU
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from nexrl_hpc.checkpoint.hf import write_hf_model_dir  # noqa: E402
from nexrl_hpc.checkpoint.trainer_io import tied_weight_names, with_tied_entries  # noqa: E402
from nexrl_hpc.trainer.parallel import SingleProcess  # noqa: E402
from nexrl_hpc.trainer.weight_broadcast import broadcast_weights  # noqa: E402
from nexrl_hpc.weight_sync.broadcast import BroadcastRendezvous  # noqa: E402
from nexrl_hpc.weight_sync.publisher import WeightPublisher  # noqa: E402
from nexrl_hpc.weight_sync.transport import create_weight_transport  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN = {"hidden_size": 896, "num_attention_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864}
VOCAB = 151_936
GOALS = {"raw": 1.3, "disk": 0.5}


def build_model_dir(out: str, layers: int) -> Any:
    """A random Qwen2.5-0.5B-shaped model (its tokenizer is not needed: prompts are token ids)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB,
        num_hidden_layers=layers,
        tie_word_embeddings=True,
        max_position_embeddings=512,
        torch_dtype="float32",
        **QWEN,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    model.save_pretrained(out, safe_serialization=True)
    return model


class Service:
    """What the publisher calls on an inference service, over one server's transport."""

    def __init__(self, name: str, transport: Any):
        self.name, self.transport = name, transport

    def get_module_name(self) -> str:
        return self.name

    def weight_receivers(self) -> int:
        return self.transport.receivers() if self.transport.broadcast else 0

    def receive_weights(self, spec: dict[str, Any], rank_offset: int, version: int) -> None:
        self.transport.receive(spec, rank_offset, version)

    def reload_weights(self, model_path: str, version: int) -> None:
        self.transport.publish(model_path, version)


class Source:
    """The trainer: this process's model, one bucket at a time; RSS sampled while it sends."""

    def __init__(self, model: Any):
        self.model, self.par = model, SingleProcess()
        self.peak_extra = 0

    def broadcast_weights(self, spec: dict[str, Any]) -> dict[str, Any]:
        base, stop = rss(), threading.Event()

        def sample() -> None:
            while not stop.is_set():
                self.peak_extra = max(self.peak_extra, rss() - base)
                time.sleep(0.001)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            return broadcast_weights(self.par, self.model, spec, set(tied_weight_names(self.model)))
        finally:
            stop.set()
            sampler.join()


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def config(work: str, backend: str) -> Any:
    from hydra import compose, initialize_config_dir

    from nexrl_hpc.assembly import validate_config
    from nexrl_hpc.config import register_resolvers

    register_resolvers()
    overrides = [f"run_dir={work}/run", f"service.inference_service.backend={backend}"]
    with initialize_config_dir(
        config_dir=os.path.join(REPO, "configs"), version_base="1.3", job_name="bench"
    ):
        return validate_config(compose("rl_train", overrides=overrides))


def start_servers(args: argparse.Namespace, model_dir: str, work: str) -> list[Any]:
    cfg = config(work, args.backend)
    svc = cfg["service"]["inference_service"]
    servers: list[Any] = []
    for i in range(2):
        logs = os.path.join(work, "logs")
        if args.backend == "vllm":
            from nexrl_hpc.inference.vllm_server import VLLMServer

            vllm = dict(svc["vllm"], max_model_len=512)
            servers.append(
                VLLMServer(model_dir, vllm, logs, svc["model"], f"s{i}.log", weight_broadcast=True)
            )  # type: ignore[arg-type]
        else:
            from nexrl_hpc.inference.local_server import LocalInferenceServer

            local = dict(svc["local"], num_threads=1)
            servers.append(
                LocalInferenceServer(
                    model_dir, local, logs, svc["model"], device=args.device, log_name=f"s{i}.log"
                )  # type: ignore[arg-type]
            )
    for server in servers:
        server.launch()
    for server in servers:
        server.wait_ready()
    return servers


def services(args: argparse.Namespace, servers: list[Any], broadcast: bool) -> list[Service]:
    out = []
    for i, server in enumerate(servers):
        transport = create_weight_transport(args.backend, 900.0, "wait", broadcast=broadcast)
        transport.set_endpoint(server.base_url, server.api_key)
        out.append(Service(f"inference_service_{i}", transport))
    return out


def raw_receiver(spec: dict[str, Any], rank: int, shapes: list[list[int]], reps: int) -> None:
    """A receiving process of the floor: the same tensors, preallocated, ``reps`` times."""
    from nexrl_hpc.weight_sync.wire import BroadcastGroup

    group = BroadcastGroup(spec, rank=rank)
    buffers = [torch.empty(shape) for shape in shapes]
    for _ in range(reps):
        for buffer in buffers:
            group.broadcast(buffer)
    group.close()


def raw_broadcast(model: Any, reps: int) -> list[float]:
    """The floor: seconds per pass of the model's tensors over gloo to two receiving processes."""
    from nexrl_hpc.weight_sync.wire import BroadcastGroup

    skip = set(tied_weight_names(model))
    tensors = [t.detach() for k, t in model.state_dict().items() if k not in skip]
    rendezvous = BroadcastRendezvous("127.0.0.1", "gloo", 300.0, 256)  # kept: it hosts the store
    spec = rendezvous.spec(3, 0)
    shapes = json.dumps([list(t.shape) for t in tensors])
    code = "import json,sys; from bench.weight_sync import raw_receiver; a=sys.argv; "
    code += "raw_receiver(json.loads(a[1]), int(a[2]), json.loads(a[3]), int(a[4]))"
    env = dict(os.environ, PYTHONPATH=REPO)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, json.dumps(spec), str(r), shapes, str(reps)], cwd=REPO, env=env
        )
        for r in (1, 2)
    ]
    group = BroadcastGroup(spec, rank=0)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for tensor in tensors:
            group.broadcast(tensor)
        times.append(time.perf_counter() - t0)
    group.close()
    for proc in procs:
        proc.wait(timeout=300)
    return times


def disk_sync(
    model: Any, model_dir: str, work: str, version: int, disk: list[Service], tied_head: bool
) -> float:
    """The trainer's export, then both servers reload it at once; seconds."""
    t0 = time.perf_counter()
    state = model.state_dict()
    state = (
        with_tied_entries(state, model)
        if tied_head
        else {k: v for k, v in state.items() if k != "lm_head.weight"}
    )
    path = os.path.join(work, "weights", f"version_{version}")
    write_hf_model_dir(state, model_dir, path, 2 << 30, fsync=False)
    with ThreadPoolExecutor(len(disk)) as pool:
        list(pool.map(lambda s: s.reload_weights(path, version), disk))
    elapsed = time.perf_counter() - t0
    shutil.rmtree(path, ignore_errors=True)
    return elapsed


def run(args: argparse.Namespace, work: str) -> dict[str, Any]:
    model_dir = os.path.join(work, "model")
    model = build_model_dir(model_dir, args.layers).to(args.device)
    size = sum(t.numel() * t.element_size() for k, t in model.state_dict().items() if k != "lm_head.weight")
    t = time.monotonic()
    servers = start_servers(args, model_dir, work)
    print(
        f"{size / 1e9:.2f} GB model, {args.layers} layers: 2 {args.backend} servers ready in {time.monotonic() - t:.0f}s",
        flush=True,
    )
    publisher = WeightPublisher(
        {
            "sync_weight_path": os.path.join(work, "weights"),
            "keep_versions": 2,
            "broadcast_host": "127.0.0.1",
            "broadcast_backend": "gloo",
            "broadcast_timeout_s": 600.0,
            "broadcast_form_timeout_s": 30.0,
            "bucket_mb": args.bucket_mb,
        }  # type: ignore[typeddict-item]
    )
    source = Source(model)
    receiving = services(args, servers, broadcast=True)
    publisher.set_inference_services(receiving)  # type: ignore[arg-type]
    publisher.set_weight_source(source)
    disk = services(args, servers, broadcast=False)
    rows: dict[str, list[float]] = {"broadcast": [], "disk": []}
    try:
        for rep in range(args.reps + 1):  # rep 0 warms up
            order = ("broadcast", "disk") if rep % 2 == 0 else ("disk", "broadcast")
            for kind in order:
                with torch.no_grad():
                    model.model.embed_tokens.weight.add_(0.001)  # a new version (not timed)
                version = 2 * rep + (kind == "disk") + 1
                if kind == "broadcast":
                    t0 = time.perf_counter()
                    publisher.publish(version)
                    elapsed = time.perf_counter() - t0
                else:
                    elapsed = disk_sync(model, model_dir, work, version, disk, args.backend == "vllm")
                if rep:
                    rows[kind].append(elapsed)
    finally:
        for server in servers:
            server.stop()
    rows["raw"] = raw_broadcast(model.cpu(), args.reps)
    med = {k: statistics.median(v) for k, v in rows.items()}
    steps = [getattr(s.transport, "last_timings", {}) for s in receiving]
    return {"size": size, "med": med, "rows": rows, "peak_extra": source.peak_extra, "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--backend", choices=["vllm", "local"], default="vllm")
    ap.add_argument("--device", default="cpu", help="the trainer's and (backend=local) the servers' device")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=256)
    args = ap.parse_args()
    if args.device != "cpu" and args.backend == "vllm":
        ap.error("--device: vLLM's device is its venv's build; use --backend local for another device")
    with tempfile.TemporaryDirectory(prefix="nexrl_wsync_") as work:
        r = run(args, work)
    med, size = r["med"], r["size"]
    s = lambda x: f"{x:.2f}"  # noqa: E731
    print()
    print("| model (fp32) | servers | reps | broadcast s | disk s | raw broadcast s | GB/s (broadcast) |")
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {size / 1e9:.2f} GB, {args.layers} layers | 2 {args.backend} ({args.device}) | {args.reps} "
        f"| {s(med['broadcast'])} | {s(med['disk'])} | {s(med['raw'])} | {size / 1e9 / med['broadcast']:.2f} |"
    )
    print()
    for base, goal in GOALS.items():
        ratio = med["broadcast"] / med[base]
        name = "raw broadcast" if base == "raw" else base
        print(f"broadcast / {name}: {ratio:.2f}x (goal <= {goal}x: {'met' if ratio <= goal else 'NOT met'})")
    bucket = args.bucket_mb << 20
    peak = r["peak_extra"]
    verdict = "met" if peak <= 1.1 * bucket else "NOT met"
    print(
        f"trainer peak extra memory during a broadcast: {peak / 2**20:.0f} MiB (goal <= {1.1 * bucket / 2**20:.0f} MiB: {verdict})"
    )
    print("all (s):", {k: [round(x, 3) for x in v] for k, v in r["rows"].items()})
    for i, steps in enumerate(r["steps"]):
        if steps:
            print(f"server {i}, last broadcast (s):", {k: round(v, 3) for k, v in steps.items()})


if __name__ == "__main__":
    main()
