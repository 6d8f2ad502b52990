"""An engine that serves stale weights under the new version's label (weight verification's tests).

``install()`` (run by a ``sitecustomize`` the tests put on ``PYTHONPATH``, so it reaches every
process of a run, mpirun's ranks included) patches the disk transport: when it publishes version
``V`` of ``NEXRL_STALE_ENGINE="V"`` or ``"V:RANK"`` (on MPI rank RANK only, ``PMI_RANK``), the
server reloads version ``V - 1``'s export but is told it serves ``V`` — the failure a version
label cannot see. Nothing else changes.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "NEXRL_STALE_ENGINE"


def install() -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    version_text, _, rank = spec.partition(":")
    if rank and os.environ.get("PMI_RANK") != rank:
        return
    stale_version = int(version_text)
    from nexrl_hpc.weight_sync.transport import DiskReloadTransport

    publish = DiskReloadTransport.publish

    def publish_stale(self: DiskReloadTransport, model_path: str, version: int) -> None:
        if version == stale_version:
            model_path = str(Path(model_path).with_name(f"version_{version - 1}"))
        publish(self, model_path, version)

    DiskReloadTransport.publish = publish_stale  # type: ignore[method-assign]


def sitecustomize_dir(tmp_path: Path) -> Path:
    """A directory holding a ``sitecustomize.py`` that calls ``install()`` (put it first on PYTHONPATH)."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text("import tests.helpers.stale_engine as s\n\ns.install()\n")
    return site
