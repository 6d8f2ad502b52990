"""File digests of a checkpoint: computed while its files are written, checked before a resume.

Why: ``COMPLETE`` alone proves only that a save got to its end; a file damaged afterwards (a
truncated or bit-flipped ``state.h5`` on a flaky parallel filesystem) made every requeue of the job
crash on it. Now ``COMPLETE`` lists every file of the checkpoint with its size and xxh3-128, and a
resume takes the newest checkpoint whose files still match (``verify_checkpoint``).

Why xxh3-128 and on a thread: the digest guards against corruption, not forgery (the run dir is the
job user's, 0700); xxh3 hashes at several GB/s, and it runs on a thread of its own while the
writer's ``os.write`` (or the checker's ``preadv``) releases the GIL, so the I/O and the hashing
overlap (bench/checkpoint.py measures the cost). The big files (weights, optimizer state) are hashed
by their writers from the bytes they write, which leave the digest in a ``<file>.xxh3`` sidecar; the
checkpoint manager gathers the sidecars into ``COMPLETE`` (and removes them), hashing by reading
only the small files that have none (state.h5, config and tokenizer files).
"""

from __future__ import annotations

import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xxhash

ALGORITHM = "xxh3_128"
SIDECAR = ".xxh3"
CHUNK = 16 << 20


class StreamDigest:
    """xxh3-128 of the bytes given to ``update``, in order, hashed on a thread of its own.

    The caller keeps each buffer unchanged until its future is done (``update`` returns it)."""

    def __init__(self) -> None:
        self._hash = xxhash.xxh3_128()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="digest")
        self._last: Future | None = None
        self.size = 0

    def update(self, data: Any) -> Future:
        self.size += len(data)
        self._last = self._pool.submit(self._hash.update, data)
        return self._last

    def hexdigest(self) -> str:
        try:
            if self._last is not None:
                self._last.result()
        finally:
            self._pool.shutdown()
        return self._hash.hexdigest()


def hash_file(path: str) -> tuple[str, int]:
    """(xxh3-128, size) of a file, read in large sequential chunks while the previous one is hashed."""
    digest = StreamDigest()
    buffers = [bytearray(CHUNK), bytearray(CHUNK)]
    pending: list[Future | None] = [None, None]
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        offset, i = 0, 0
        while True:
            if pending[i] is not None:
                pending[i].result()  # type: ignore[union-attr]  # this buffer's bytes are hashed
            got = os.preadv(fd, [buffers[i]], offset)
            if got == 0:
                break
            pending[i] = digest.update(memoryview(buffers[i])[:got])
            offset += got
            i ^= 1
    finally:
        os.close(fd)
    return digest.hexdigest(), digest.size


def write_sidecar(path: str, hexdigest: str, size: int) -> None:
    """The digest a writer computed for ``path`` (``manifest`` takes it while the size matches)."""
    with open(path + SIDECAR, "w") as f:
        f.write(f"{hexdigest} {size}\n")


def manifest(root: str) -> dict[str, dict[str, Any]]:
    """``{relative path: {"size", "xxh3_128"}}`` of every file under ``root``; writers' sidecars are
    used (and removed) where their size still matches, every other file is read and hashed."""
    files: dict[str, dict[str, Any]] = {}
    for d, _, names in os.walk(root):
        for name in sorted(names):
            if name.endswith(SIDECAR):
                continue
            path = os.path.join(d, name)
            size = os.path.getsize(path)
            recorded = _read_sidecar(path + SIDECAR)
            if recorded is not None and recorded[1] == size:
                hexdigest = recorded[0]
            else:
                hexdigest, size = hash_file(path)
            files[os.path.relpath(path, root)] = {"size": size, ALGORITHM: hexdigest}
    for d, _, names in os.walk(root):
        for name in names:
            if name.endswith(SIDECAR):
                os.unlink(os.path.join(d, name))
    return files


def _read_sidecar(path: str) -> tuple[str, int] | None:
    try:
        with open(path) as f:
            hexdigest, size = f.read().split()
        return hexdigest, int(size)
    except (OSError, ValueError):
        return None


def complete_record(step: int, files: dict[str, dict[str, Any]]) -> str:
    """The text of ``COMPLETE``: the step and every file's digest."""
    return json.dumps({"step": step, "algorithm": ALGORITHM, "files": files}, indent=1) + "\n"


def verify_checkpoint(path: str, marker: str) -> str | None:
    """Why the checkpoint at ``path`` cannot be trusted (a file missing, of another size, with
    other bytes; an unreadable marker), or None. A marker of an older version (the step alone)
    has no digests: such a checkpoint is trusted as before."""
    try:
        with open(os.path.join(path, marker)) as f:
            text = f.read()
    except OSError as exc:
        return f"{marker} unreadable ({exc})"
    if text.strip().isdigit():
        return None
    try:
        record = json.loads(text)
        files = {str(k): (int(v["size"]), str(v[ALGORITHM])) for k, v in record["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"{marker} is not a digest record ({type(exc).__name__}: {exc})"
    for rel, (size, _) in files.items():  # sizes first: cheap, and what a truncation changes
        try:
            actual = os.path.getsize(os.path.join(path, rel))
        except OSError:
            return f"{rel} is missing"
        if actual != size:
            return f"{rel} has {actual} bytes, {size} when saved"
    for rel, (_, expected) in sorted(files.items(), key=lambda kv: kv[1][0]):  # small files first
        actual_digest, _ = hash_file(os.path.join(path, rel))
        if actual_digest != expected:
            return f"{rel} does not match its digest ({ALGORITHM} {actual_digest}, {expected} when saved)"
    return None
