"""Write HF-layout model directories (config + safetensors + tokenizer) atomically.

What transformers, vLLM and SGLang load: ``config.json``, ``model.safetensors`` (or shards with
``model.safetensors.index.json`` above ``max_shard_bytes``), tokenizer files. Tensors that share
memory under two names are written as two copies (safetensors stores no aliases); the trainer
leaves a tied head out unless an engine needs it (``trainer_io.without_tied_entries``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading

import torch
from safetensors.torch import save_file

from nexrl_hpc.checkpoint.digest import write_sidecar
from nexrl_hpc.checkpoint.tensor_reads import (
    PartialLoadError,
    TensorEntry,
    TensorFileError,
    exclusive,
    read_header,
    read_tensors,
)
from nexrl_hpc.checkpoint.tensor_writes import writable, write_tensor_file

HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class WritebackKicker:
    """While a save writes under ``root``, start the kernel's writeback of its files every
    ``interval_s`` (``posix_fadvise(DONTNEED)`` on each file: async writeback of the dirty pages,
    then the clean ones leave the page cache).

    Why: left alone, the kernel writes little until the final fsync, so serialising (torch.save,
    safetensors) and the disk take turns; the writers are also throttled to the estimated disk
    bandwidth. Kicked, the disk works while the next tensors are serialised: a 3 GB checkpoint saves
    2-4x faster here (bench/checkpoint.py), and it leaves no GBs of checkpoint in the page cache.
    Works on the files of every process on this host (trainer ranks write model/ and optimizer/)."""

    def __init__(self, root: str, interval_s: float = 0.1):
        self._root = root
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="checkpoint-writeback", daemon=True)

    def __enter__(self) -> WritebackKicker:
        if hasattr(os, "posix_fadvise"):
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            for d, _, files in os.walk(self._root):
                for name in files:
                    try:
                        fd = os.open(os.path.join(d, name), os.O_RDONLY)
                    except OSError:  # renamed or removed meanwhile
                        continue
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    except OSError:
                        pass
                    finally:
                        os.close(fd)


def _untie(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    seen: dict[tuple[int, int], str] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        t = tensor.detach().to("cpu")
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()))
        if key in seen:
            t = t.clone()
        else:
            seen[key] = name
        out[name] = t.contiguous()
    return out


def write_safetensors(
    state_dict: dict[str, torch.Tensor], out_dir: str, max_shard_bytes: int, sidecars: bool = False
) -> list[str]:
    """Write one file or shards + index; returns the written file paths. ``sidecars``: leave each
    weight file's digest (hashed as it was written) beside it for the checkpoint's ``COMPLETE``."""
    tensors = _untie(state_dict)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if total <= max_shard_bytes:
        shards = [tensors]
    paths, weight_map = [], {}
    for i, shard in enumerate(shards, start=1):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        path = os.path.join(out_dir, fname)
        items = list(shard.items())
        if writable(items):
            hexdigest, nbytes = write_tensor_file(path, items, {"format": "pt"}, hashed=sidecars)
            if sidecars:
                write_sidecar(path, hexdigest, nbytes)
        else:  # a dtype without a code here (float8...): safetensors' writer; COMPLETE hashes it by reading
            save_file(shard, path, metadata={"format": "pt"})
        paths.append(path)
        weight_map.update(dict.fromkeys(shard, fname))
    if len(shards) == 1:
        return paths
    index = os.path.join(out_dir, "model.safetensors.index.json")
    with open(index, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    paths.append(index)
    return paths


def write_hf_model_dir(
    state_dict: dict[str, torch.Tensor],
    source_model_dir: str,
    out_dir: str,
    max_shard_bytes: int,
    fsync: bool = True,
    sidecars: bool = False,
) -> None:
    """Write weights + the source model's config/tokenizer files to ``out_dir`` (temp dir, then
    rename); ``sidecars``: the weight files' digests beside them (a checkpoint's model/)."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".tmp-{os.path.basename(out_dir)}-{os.getpid()}")
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    # a durable copy is written for the disk (kicked writeback); a fast one (weight sync) for the
    # page cache, where the inference service reads it right away
    with WritebackKicker(tmp) if fsync else contextlib.nullcontext():
        written = write_safetensors(state_dict, tmp, max_shard_bytes, sidecars)
        for name in HF_SIDE_FILES:
            src = os.path.join(source_model_dir, name)
            if os.path.exists(src):
                shutil.copyfile(src, os.path.join(tmp, name))
                written.append(os.path.join(tmp, name))
    if fsync:
        for path in written:
            fsync_path(path)
        fsync_path(tmp)
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    if fsync:
        fsync_path(parent)


def safetensors_files(model_path: str) -> list[str]:
    """The weight files of an HF-layout directory (single file, or the shards its index names)."""
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_path}")
    return [os.path.join(model_path, f) for f in files]


def peek_safetensors_dir(model_path: str) -> dict[str, TensorEntry]:
    """Every tensor's name, dtype and shape from the headers alone (no tensor bytes read)."""
    found: dict[str, TensorEntry] = {}
    for path in safetensors_files(model_path):
        fd = os.open(path, os.O_RDONLY)
        try:
            found.update((e.name, e) for e in read_header(fd, path)[0])
        finally:
            os.close(fd)
    return found


def read_safetensors_dir(
    model_path: str, into: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """All tensors of an HF-layout directory, read eagerly.

    ``into``: tensors by name (say, the live model's state dict) that receive the bytes in place when
    they match in dtype and shape (``tensor_reads.read_tensors``); the rest are new tensors."""
    state: dict[str, torch.Tensor] = {}
    into = exclusive(into or {})  # tied weights may sit in different files
    for path in safetensors_files(model_path):
        fd = os.open(path, os.O_RDONLY)
        try:
            entries, _ = read_header(fd, path)
            state.update(read_tensors(fd, path, entries, into))
        except TensorFileError as exc:
            if any(n in into and t.data_ptr() == into[n].data_ptr() for n, t in state.items()):
                raise PartialLoadError(f"{exc}; the tensors loaded in place are incomplete") from exc
            raise
        finally:
            os.close(fd)
    return state
