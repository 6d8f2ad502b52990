"""Collectives of a trainer group: commands from trainer rank 0 to the others, shards out, rows back.

Rank 0 is the only rank that talks to clients; the others learn what to do from it over
torch.distributed (NCCL on GPU, gloo on CPU). Headers are msgpack bytes in a uint8 tensor, never
pickle (``broadcast_object_list`` would unpickle what another process sent). A shard travels as
one flat byte buffer per rank so that a whole batch is one ``scatter``, whatever its tensor count.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import torch
import torch.distributed as dist

from nexrl_hpc.rpc.bulk.format import DTYPES


class GroupComm:
    """Rank-0-rooted collectives over the default process group."""

    def __init__(self, device: torch.device):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # NCCL moves only device tensors; gloo only host tensors
        self._device = device if dist.get_backend() == "nccl" else torch.device("cpu")

    # --- headers ---------------------------------------------------------------------------------
    def broadcast_header(self, header: dict[str, Any] | None) -> dict[str, Any]:
        """Rank 0 passes the header; every rank returns it."""
        if self.rank == 0:
            raw = msgpack.packb(header, use_bin_type=True)
            size = torch.tensor([len(raw)], dtype=torch.int64, device=self._device)
        else:
            size = torch.zeros(1, dtype=torch.int64, device=self._device)
        dist.broadcast(size, src=0)
        if self.rank == 0:
            buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self._device)
        else:
            buf = torch.empty(int(size.item()), dtype=torch.uint8, device=self._device)
        dist.broadcast(buf, src=0)
        if self.rank == 0:
            assert header is not None
            return header
        return msgpack.unpackb(buf.cpu().numpy().tobytes(), raw=False)

    def gather_status(self, status: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's status dict on rank 0 (rank order); other ranks get []."""
        raw = msgpack.packb(status, use_bin_type=True)
        sizes = self._gather_sizes(len(raw))
        width = max(sizes) if self.rank == 0 else 0
        width = int(self._broadcast_int(width))
        buf = torch.zeros(width, dtype=torch.uint8, device=self._device)
        buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        parts = [torch.empty_like(buf) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(buf, parts, dst=0)
        if self.rank != 0:
            return []
        assert parts is not None
        return [msgpack.unpackb(p[:n].cpu().numpy().tobytes(), raw=False) for p, n in zip(parts, sizes)]

    # --- shards out ------------------------------------------------------------------------------
    def scatter_shards(self, shards: list[dict[str, torch.Tensor]] | None) -> dict[str, torch.Tensor]:
        """Rank 0 passes one dict of tensors per rank; every rank returns its own."""
        if self.rank == 0:
            assert shards is not None and len(shards) == self.world_size
            packed = [pack_tensors(s) for s in shards]
            specs = [spec for _, spec in packed]
            width = max(buf.numel() for buf, _ in packed)
            header = self.broadcast_header({"specs": specs, "width": width})
            bufs = []
            for buf, _ in packed:
                padded = torch.zeros(width, dtype=torch.uint8)
                padded[: buf.numel()] = buf
                bufs.append(padded.to(self._device))
            mine = torch.empty(width, dtype=torch.uint8, device=self._device)
            dist.scatter(mine, bufs, src=0)
            return shards[0]
        header = self.broadcast_header(None)
        mine = torch.empty(header["width"], dtype=torch.uint8, device=self._device)
        dist.scatter(mine, None, src=0)
        return unpack_tensors(mine.cpu(), header["specs"][self.rank])

    # --- rows back -------------------------------------------------------------------------------
    def gather_rows(self, local: torch.Tensor, counts: list[int]) -> torch.Tensor | None:
        """Every rank's rows concatenated on rank 0 (rank order); None elsewhere."""
        width = max(counts)
        padded = torch.zeros((width, *local.shape[1:]), dtype=local.dtype, device=self._device)
        padded[: local.shape[0]] = local.to(self._device)
        parts = [torch.empty_like(padded) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(padded, parts, dst=0)
        if self.rank != 0:
            return None
        assert parts is not None
        return torch.cat([p[:c].cpu() for p, c in zip(parts, counts)], dim=0)

    # --- helpers ---------------------------------------------------------------------------------
    def _gather_sizes(self, size: int) -> list[int]:
        t = torch.tensor([size], dtype=torch.int64, device=self._device)
        parts = [torch.empty_like(t) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(t, parts, dst=0)
        return [int(p.item()) for p in parts] if parts is not None else []

    def _broadcast_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self._device)
        dist.broadcast(t, src=0)
        return int(t.item())


def pack_tensors(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[list[Any]]]:
    """One flat uint8 buffer and a spec per tensor: [name, dtype, shape, offset, nbytes]."""
    parts, specs, offset = [], [], 0
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        specs.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset, raw.numel()])
        parts.append(raw)
        offset += raw.numel()
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return flat, specs


def unpack_tensors(flat: torch.Tensor, specs: list[list[Any]]) -> dict[str, torch.Tensor]:
    out = {}
    data = flat.numpy()
    for name, dtype_name, shape, offset, nbytes in specs:
        dtype = DTYPES[dtype_name]
        chunk = np.ascontiguousarray(data[offset : offset + nbytes])
        out[name] = (
            torch.from_numpy(chunk).view(dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)
        )
    return out
