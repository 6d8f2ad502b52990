"""tensor_reads: safetensors bytes straight into live tensors where they fit (same memory after the
read), new tensors elsewhere; tied or mismatched targets are never written; broken files are named."""

from __future__ import annotations

import errno
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from nexrl_hpc.checkpoint import tensor_reads
from nexrl_hpc.checkpoint.hf import peek_safetensors_dir, read_safetensors_dir, write_safetensors
from nexrl_hpc.checkpoint.tensor_reads import (
    CHUNK,
    PartialLoadError,
    TensorFileError,
    exclusive,
    read_header,
    read_tensors,
)


def read_file(path: Path, into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    fd = os.open(path, os.O_RDONLY)
    try:
        entries, _ = read_header(fd, str(path))
        return read_tensors(fd, str(path), entries, into)
    finally:
        os.close(fd)


def test_matching_live_tensors_receive_the_bytes_and_the_rest_are_new(tmp_path: Path) -> None:
    saved = {
        "big": torch.randn(CHUNK // 4 + 1000),  # spans two reads
        "half": torch.randn(3, 5).to(torch.bfloat16),
        "ints": torch.arange(7, dtype=torch.int64),
        "flag": torch.tensor([True, False]),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "m.safetensors"
    save_file(saved, str(path))
    live = {
        "big": torch.zeros(CHUNK // 4 + 1000),
        "half": torch.zeros(3, 5),  # another dtype: not written
        "ints": torch.zeros(7, 1, dtype=torch.int64),  # another shape: not written
        "flag": torch.zeros(4, dtype=torch.bool)[::2],  # not contiguous: not written
    }
    before = {k: v.clone() for k, v in live.items()}
    back = read_file(path, live)
    assert set(back) == set(saved)
    for k, v in saved.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    assert back["big"].data_ptr() == live["big"].data_ptr()
    for k in ("half", "ints", "flag"):
        assert back[k].data_ptr() != live[k].data_ptr() and torch.equal(live[k], before[k]), k


def test_tied_or_overlapping_targets_are_left_alone(tmp_path: Path) -> None:
    shared = torch.zeros(8)
    assert set(exclusive({"a": shared, "b": shared, "c": torch.zeros(8)})) == {"c"}
    buf = torch.zeros(16)
    assert set(exclusive({"lo": buf[:9], "hi": buf[8:], "empty": buf[:0]})) == {"empty"}
    assert set(exclusive({"lo": buf[:8], "hi": buf[8:]})) == {"lo", "hi"}
    path = tmp_path / "tied.safetensors"
    save_file({"embed": torch.ones(8), "lm_head": torch.full((8,), 2.0)}, str(path))
    back = read_file(path, {"embed": shared, "lm_head": shared})
    assert torch.equal(shared, torch.zeros(8))
    assert torch.equal(back["embed"], torch.ones(8)) and torch.equal(back["lm_head"], torch.full((8,), 2.0))


def test_a_sharded_directory_reads_into_the_live_model_across_files(tmp_path: Path) -> None:
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(4)))
    other = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(4)))
    paths = write_safetensors(model.state_dict(), str(tmp_path), max_shard_bytes=2048)
    assert len(paths) > 2
    live = other.state_dict()
    where = {k: v.data_ptr() for k, v in live.items()}
    back = read_safetensors_dir(str(tmp_path), into=live)
    assert {k: v.data_ptr() for k, v in back.items()} == where
    for k, v in model.state_dict().items():
        assert torch.equal(other.state_dict()[k], v), k
    entries = peek_safetensors_dir(str(tmp_path))
    assert {k: e.shape for k, e in entries.items()} == {k: tuple(v.shape) for k, v in live.items()}


def test_a_broken_file_is_refused_naming_the_file_and_the_tensor(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.randn(100)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-4])
    with pytest.raises(
        TensorFileError, match=r"w\.safetensors: tensor 'w' .* in a file of \d+ bytes \(truncated\?\)"
    ):
        read_file(path)
    (n,) = struct.unpack("<Q", data[:8])
    path.write_bytes(data[:8] + data[8 : 8 + n].replace(b'"F32"', b'"Q99"') + data[8 + n :])
    with pytest.raises(
        TensorFileError, match=r"w\.safetensors: not a safetensors header \(KeyError: 'Q99'\)"
    ):
        read_file(path)
    path.write_bytes(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(TensorFileError, match="runs past the end of the file"):
        read_file(path)


def test_a_failed_read_says_whether_live_tensors_were_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EIO before any live tensor was touched: a plain error (the live state is intact); after: the
    error says the tensors loaded in place are incomplete."""
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.randn(CHUNK // 4), "b": torch.randn(CHUNK // 4)}, str(path))
    real, calls = os.preadv, []

    def fail_at(n: int) -> Any:
        def preadv(fd: int, buffers: Any, offset: int) -> int:
            calls.append(offset)
            if len(calls) == n:
                raise OSError(errno.EIO, "Input/output error")
            return real(fd, buffers, offset)

        return preadv

    monkeypatch.setattr(tensor_reads.os, "preadv", fail_at(1))
    live = {"a": torch.zeros(CHUNK // 4), "b": torch.zeros(CHUNK // 4)}
    with pytest.raises(TensorFileError, match="read failed at byte .*: .*Input/output error") as err:
        read_file(path, live)
    assert not isinstance(err.value, PartialLoadError) and not live["a"].any()
    calls.clear()
    monkeypatch.setattr(tensor_reads.os, "preadv", fail_at(2))
    with pytest.raises(PartialLoadError, match="the tensors loaded in place are incomplete"):
        read_file(path, live)
    assert torch.equal(live["a"], load_file(str(path))["a"]) and not live["b"].any()


def test_a_broken_later_shard_says_the_live_model_was_partly_replaced(tmp_path: Path) -> None:
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(4)))
    paths = write_safetensors(model.state_dict(), str(tmp_path), max_shard_bytes=2048)
    last = Path(sorted(p for p in paths if p.endswith(".safetensors"))[-1])
    last.write_bytes(last.read_bytes()[:-8])
    with pytest.raises(TensorFileError, match=r"\(truncated\?\)$"):
        read_safetensors_dir(str(tmp_path))
    with pytest.raises(
        PartialLoadError, match=r"\(truncated\?\); the tensors loaded in place are incomplete"
    ):
        read_safetensors_dir(str(tmp_path), into=model.state_dict())
