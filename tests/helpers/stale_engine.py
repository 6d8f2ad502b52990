"""An engine that serves stale weights under the new version's label (weight verification's tests).

``install()`` (run by a ``sitecustomize`` the tests put on ``PYTHONPATH``, so it reaches every
process of a run, mpirun's ranks and their local servers included) patches both transports: when
version ``V`` of ``NEXRL_STALE_ENGINE="V"`` or ``"V:RANK"`` (on MPI rank RANK only, ``PMI_RANK``)
is published, a disk reload loads version ``V - 1``'s export, and a broadcast is received by the
local server but not loaded; either way the server then says it serves ``V`` — the failure a
version label cannot see. ``NEXRL_STALE_ENGINE="adapter"``: the local engine takes every LoRA
adapter's version and never applies one (it serves the base model). Nothing else changes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

ENV = "NEXRL_STALE_ENGINE"
ADAPTER = "adapter"  # NEXRL_STALE_ENGINE=adapter: the local engine never applies a LoRA adapter


def install() -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    version_text, _, rank = spec.partition(":")
    if rank and os.environ.get("PMI_RANK") != rank:
        return
    if version_text == ADAPTER:
        _label_adapters_without_loading()
        return
    stale_version = int(version_text)
    from nexrl_hpc.weight_sync.transport import DiskReloadTransport

    publish = DiskReloadTransport.publish

    def publish_stale(self: DiskReloadTransport, model_path: str, version: int) -> None:
        if version == stale_version:
            model_path = str(Path(model_path).with_name(f"version_{version - 1}"))
        publish(self, model_path, version)

    DiskReloadTransport.publish = publish_stale  # type: ignore[method-assign]
    _receive_broadcasts_without_loading(stale_version)


def _receive_broadcasts_without_loading(stale_version: int) -> None:
    """The local server's broadcast receive, for ``stale_version``: every bucket taken off the wire
    (the trainer's send succeeds), none loaded, the version label set."""
    from nexrl_hpc.inference import broadcast_receive

    receive = broadcast_receive.receive_into_engine

    def receive_stale(engine: Any, spec: dict[str, Any], rank: int, version: int) -> str:
        if version != stale_version:
            return receive(engine, spec, rank, version)
        from nexrl_hpc.weight_sync.wire import BroadcastGroup, receive_buckets

        group = BroadcastGroup(spec, rank=rank)
        try:
            for _ in receive_buckets(group):
                pass
        finally:
            group.close()
        engine.weight_version = version
        return f"received version {version}, loaded nothing"

    broadcast_receive.receive_into_engine = receive_stale


def _label_adapters_without_loading() -> None:
    """The local engine takes every LoRA adapter's version label and keeps serving the base model:
    the adapter never reaches it, and its version says otherwise."""
    from nexrl_hpc.inference import lora_adapter

    def label_only(engine: Any, model_path: str, weight_version: int | None) -> str:
        engine.weight_version = weight_version if weight_version is not None else engine.weight_version + 1
        return f"took version {engine.weight_version}, loaded nothing"

    lora_adapter.load_adapter = label_only


def sitecustomize_dir(tmp_path: Path) -> Path:
    """A directory holding a ``sitecustomize.py`` that calls ``install()`` (put it first on PYTHONPATH)."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text("import tests.helpers.stale_engine as s\n\ns.install()\n")
    return site
