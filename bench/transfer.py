"""A training batch from the driver to trainer rank 0: nexrl_hpc's signed bulk path vs pickle vs a bare frame.

Two processes on this machine over TCP loopback: the driver (this process) sends a ``--mb`` MB batch
(a dict of tensors of several dtypes, as a trainer gets it) to a "rank 0" process, which receives
it, turns it into tensors and answers with an ACK; the time is taken until the driver has the ACK.
Paths, interleaved rep by rep so machine noise hits them alike:

- nexrl_hpc: the train protocol's ``SignedChannel`` (client -> trainer rank 0: a ``data`` message, header +
  raw buffers in ``rpc.bulk``'s format, Poly1305 tag per chunk
  with one-time keys from the job key, verified before use), ACK signed the same way and checked;
- pickle ``send_pyobj``: the same dict pickled (NexRL's way), ``recv_pyobj`` on rank 0, plain ACK;
- bare frame: the same number of bytes as one unsigned zero-copy ZMQ frame, plain ACK (the
  transport's ceiling: no header, no MAC, no tensors; ZMQ receives it into fresh memory each time);
- bare chunks (extra row): the same bytes as unsigned zero-copy frames of the bulk chunk size,
  copied into a buffer rank 0 reuses: the bulk path without header, MAC and tensors, i.e. what
  authentication costs;
- memcpy: the same bytes copied in-process into a fresh buffer and into a reused one (reference).

Goal: bulk >= 5x pickle and >= 80% of the bare frame. Before timing, one round checks
that rank 0 received every tensor exactly (digest in the signed ACK).

    python bench/transfer.py [--mb 256] [--reps 7] [--chunk-mb 4]
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import multiprocessing as mp
import os
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nexrl_hpc.config.location import default_section  # noqa: E402
from nexrl_hpc.rpc.preauth import WireLimits  # noqa: E402
from nexrl_hpc.rpc.watch import ConnectionWatch  # noqa: E402
from nexrl_hpc.trainer.protocol import SignedChannel  # noqa: E402


def wire_limits() -> WireLimits:
    """A run's pre-authentication limits (the shipped ``runtime.rpc``)."""
    return WireLimits.from_config(default_section("runtime.rpc"))


PATHS = ("bulk", "pickle", "bare", "bare_chunks")
_TIMEOUT_S = 120.0


def make_batch(total_bytes: int, seq_len: int = 4096) -> dict[str, torch.Tensor]:
    """A train batch of about ``total_bytes``: token ids, masks, log-probs, advantages (29 B/token)."""
    rows = max(1, total_bytes // (29 * seq_len))
    g = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.randint(0, 150_000, (rows, seq_len), generator=g),
        "position_ids": torch.arange(seq_len).repeat(rows, 1),
        "attention_mask": torch.ones(rows, seq_len, dtype=torch.bool),
        "loss_mask": torch.rand(rows, seq_len, generator=g).round(),
        "old_log_probs": -torch.rand(rows, seq_len, generator=g),
        "ref_log_probs": -torch.rand(rows, seq_len, generator=g).to(torch.bfloat16),
        "advantages": torch.randn(rows, 1, generator=g).expand(rows, seq_len).to(torch.bfloat16).contiguous(),
        "rewards": torch.randn(rows, generator=g),
        "response_lengths": torch.randint(1, seq_len, (rows,), dtype=torch.int32, generator=g),
    }


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.blake2b()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def rank0(conn: Any) -> None:
    """The receiving trainer rank: one ROUTER per path, answers every batch with an ACK."""
    key, nbytes = conn.recv()
    ctx = zmq.Context()
    socks = {}
    for path in PATHS:
        s = ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        socks[path] = s
    channel = SignedChannel(key, 2 * nbytes, wire_limits(), name="rank0")  # what trainer rank 0 runs
    channel.prepare_server(socks["bulk"])
    watch = ConnectionWatch(socks["bulk"], key, wire_limits(), lambda reason, peer: None, "rank0")  # noqa: F841
    addresses = {p: f"tcp://127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}" for p, s in socks.items()}
    channel.me = addresses["bulk"]
    conn.send(addresses)
    into, got = np.empty(nbytes, dtype=np.uint8), 0  # the bare_chunks path's reused buffer
    poller = zmq.Poller()
    for s in socks.values():
        poller.register(s, zmq.POLLIN)
    while True:
        for sock, _ in poller.poll():
            if sock is socks["bulk"]:
                msg = channel.feed(sock.recv_multipart(copy=False))
                if msg is not None:
                    rid, sender, header, tensors = msg
                    ack = {"kind": "ack", "op_id": header["op_id"], "rejected": channel.rejected}
                    if header.get("check"):
                        ack["digest"] = digest(tensors)
                    del msg, tensors  # the batch is "handed to the trainer" and dropped
                    channel.send(sock, ack, sender, routing_id=rid)
            elif sock is socks["pickle"]:
                rid = sock.recv()
                batch = sock.recv_pyobj()  # NexRL: pickle.loads of the whole frame
                assert isinstance(batch["input_ids"], torch.Tensor)
                del batch
                sock.send_multipart([rid, b"ack"])
            elif sock is socks["bare_chunks"]:
                rid, frame = sock.recv_multipart(copy=False)
                n = len(frame)
                into[got : got + n] = np.frombuffer(frame.buffer, dtype=np.uint8)
                got += n
                if got == nbytes:
                    got = 0
                    sock.send_multipart([rid, b"ack"])
            else:
                rid, frame = sock.recv_multipart(copy=False)
                if frame.bytes == b"stop":
                    sock.send_multipart([rid, b"bye"])
                    return
                del frame
                sock.send_multipart([rid, b"ack"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=256, help="batch size in MiB")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--chunk-mb", type=float, default=4.0, help="bulk chunk size in MiB")
    ap.add_argument("--verbose", action="store_true", help="print every rep's time (ms)")
    args = ap.parse_args()

    batch = make_batch(args.mb << 20)
    nbytes = sum(t.numel() * t.element_size() for t in batch.values())
    key = secrets.token_bytes(32)
    chunk_bytes = int(args.chunk_mb * (1 << 20))
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=rank0, args=(child,), daemon=True)
    proc.start()
    parent.send((key, nbytes))
    addresses = parent.recv()
    ctx = zmq.Context()
    socks = {}
    for path, address in addresses.items():
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, int(_TIMEOUT_S * 1000))
        if path != "bulk":  # the bulk socket connects with the channel's credentials (below)
            s.connect(address)
        socks[path] = s
    client = SignedChannel(
        key, 1 << 20, wire_limits(), name="driver", chunk_bytes=chunk_bytes
    )  # the client's
    client.prepare_client(socks["bulk"])
    socks["bulk"].connect(addresses["bulk"])
    ops = itertools.count()
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in batch.values()])  # the bare frame's bytes

    def bulk(check: bool = False) -> dict[str, Any]:
        op_id = f"update_actor-{next(ops)}"
        client.send(
            socks["bulk"],
            {"kind": "data", "op_id": op_id, "operation": "update_actor", "check": check},
            addresses["bulk"],
            batch,
        )
        while True:  # the client's wait for the ACK (a result message arrives whole: one feed)
            msg = client.feed(socks["bulk"].recv_multipart(copy=False))
            if msg is not None:
                break
        if msg[2].get("op_id") != op_id:
            raise RuntimeError(f"no valid ACK for {op_id}")
        return msg[2]

    def pickled() -> None:
        socks["pickle"].send_pyobj(batch)
        if socks["pickle"].recv() != b"ack":
            raise RuntimeError("bad ACK")

    def bare() -> None:
        socks["bare"].send(flat.numpy(), copy=False)
        if socks["bare"].recv() != b"ack":
            raise RuntimeError("bad ACK")

    def bare_chunks() -> None:
        data = flat.numpy()
        for start in range(0, nbytes, chunk_bytes):
            socks["bare_chunks"].send(data[start : start + chunk_bytes], copy=False)
        if socks["bare_chunks"].recv() != b"ack":
            raise RuntimeError("bad ACK")

    runs: dict[str, Callable[[], Any]] = {
        "bulk": bulk,
        "pickle": pickled,
        "bare": bare,
        "bare_chunks": bare_chunks,
    }
    ack = bulk(check=True)  # correctness first: rank 0 got every tensor bit for bit
    if ack["digest"] != digest(batch) or ack["rejected"]:
        raise SystemExit(f"bulk transfer corrupted the batch or dropped messages: {ack}")
    for run in runs.values():  # warm-up: connections, allocator, huge-page pool
        run()
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    for _ in range(args.reps):
        for path, run in runs.items():
            t0 = time.perf_counter()
            run()
            times[path].append(time.perf_counter() - t0)
    src = flat.numpy()
    warm = np.empty_like(src)
    times["memcpy_fresh"], times["memcpy_warm"] = [], []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        dest = np.empty_like(src)
        dest[:] = src
        times["memcpy_fresh"].append(time.perf_counter() - t0)
        del dest
        t0 = time.perf_counter()
        warm[:] = src
        times["memcpy_warm"].append(time.perf_counter() - t0)
    socks["bare"].send(b"stop")
    socks["bare"].recv()
    proc.join(10)

    if args.verbose:
        print({p: [round(x * 1000) for x in t] for p, t in times.items()})
    gbps = {p: nbytes / statistics.median(t) / 1e9 for p, t in times.items()}
    best = {p: nbytes / min(t) / 1e9 for p, t in times.items()}
    labels = {
        "bulk": "nexrl_hpc train protocol (SignedChannel data message): header + raw buffers, Poly1305 per chunk, verified, signed ACK",
        "pickle": "pickle send_pyobj / recv_pyobj (NexRL's way) + ACK",
        "bare": "one bare unsigned zero-copy ZMQ frame + ACK (ceiling)",
        "bare_chunks": "the same bytes as unsigned chunk frames, copied into a reused buffer + ACK (bulk minus MAC)",
        "memcpy_fresh": "memcpy in-process, into a fresh buffer (reference)",
        "memcpy_warm": "memcpy in-process, into a reused buffer (reference)",
    }
    print(
        f"\nbatch: {len(batch)} tensors, {nbytes / 2**20:.0f} MiB; {args.reps} reps per path (interleaved); "
        f"bulk chunks of {args.chunk_mb:g} MiB; GB/s = 1e9 B/s of the median rep (best in brackets)\n"
    )
    print("| path | GB/s | ratio vs pickle | ratio vs bare frame | goal |")
    print("|---|---|---|---|---|")
    for path, label in labels.items():
        goal = ""
        if path == "bulk":
            vs_pickle, vs_bare = gbps["bulk"] / gbps["pickle"], gbps["bulk"] / gbps["bare"]
            ok = vs_pickle >= 5 and vs_bare >= 0.8
            goal = f"≥ 5x pickle, ≥ 0.80x bare: {'met' if ok else 'NOT met'}"
        print(
            f"| {label} | {gbps[path]:.2f} ({best[path]:.2f}) | {gbps[path] / gbps['pickle']:.2f}x "
            f"| {gbps[path] / gbps['bare']:.2f}x | {goal} |"
        )


if __name__ == "__main__":
    main()
