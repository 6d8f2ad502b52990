"""A vLLM plugin: the run's broadcast weight-transfer engine, registered with vLLM's factory.

vLLM (>= 0.32) receives weights through ``vllm.distributed.weight_transfer``: a registry of engines
that its workers drive from the online endpoints (``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``). Its built-in engines
need CUDA; this one speaks the run's wire (``weight_sync/wire.py``: gloo on CPU, NCCL on GPUs), so
CPU CI runs the same path as a GPU cluster. Only the transport is ours: the weights go to vLLM's
own ``model.load_weights`` (HF names; it fuses qkv and gate_up and skips a tied head) inside
vLLM's layerwise reload, as its NCCL engine does.

How it gets into vLLM's processes without touching vLLM's venv: ``VLLMServer`` copies this file,
``wire.py`` (as ``nexrl_weight_wire``) and a ``.dist-info`` whose ``entry_points.txt`` names
``register`` under ``vllm.general_plugins`` into the server's private ``PYTHONPATH`` directory; vLLM
loads general plugins in every process it starts (API server, engine core, workers). The server
starts with ``--weight-transfer-config '{"backend": "nexrl_broadcast"}'``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

try:  # in vLLM's venv: the copy beside this file
    from nexrl_weight_wire import BroadcastGroup, prefetched, receive_buckets  # type: ignore[import-not-found]
except ImportError:  # in the project (tests, mypy)
    from nexrl_hpc.weight_sync.wire import BroadcastGroup, prefetched, receive_buckets

ENGINE_NAME = "nexrl_broadcast"
PLUGIN_MODULE = "nexrl_vllm_weight_plugin"  # this file's name in the server's PYTHONPATH directory
WIRE_MODULE = "nexrl_weight_wire"  # wire.py's


def register() -> None:
    """The ``vllm.general_plugins`` entry point (vLLM may call it more than once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if ENGINE_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(ENGINE_NAME, _engine_class())


def _engine_class() -> type:
    """Built on first use: vLLM is importable only in vLLM's processes."""
    import torch
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

    @dataclass
    class BroadcastInitInfo(WeightTransferInitInfo):
        backend: str
        host: str
        port: int
        prefix: str
        world_size: int
        timeout_s: float
        form_timeout_s: float
        bucket_bytes: int
        rank_offset: int

    @dataclass
    class BroadcastUpdateInfo(WeightTransferUpdateInfo):
        pass

    class BroadcastWeightTransferEngine(WeightTransferEngine[BroadcastInitInfo, BroadcastUpdateInfo]):
        """Joins the sync's group at ``rank_offset`` + this worker's rank; ``update_weights``
        receives every bucket the trainer sends and loads it."""

        init_info_cls = BroadcastInitInfo
        update_info_cls = BroadcastUpdateInfo
        supports_draft_weight_update = False

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._group: Any = None

        def init_transfer_engine(self, init_info: BroadcastInitInfo) -> None:
            self.shutdown()  # a group per sync: the previous one is done (or broken)
            pc = self.parallel_config
            rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
            device = str(self.device) if init_info.backend == "nccl" else "cpu"
            self._group = BroadcastGroup(vars(init_info), rank=rank, device=device)

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

        def receive_weights(self, update_info: BroadcastUpdateInfo) -> None:
            if self._group is None:
                raise RuntimeError("no weight broadcast group: call /init_weight_transfer_engine first")
            try:
                tied = bool(getattr(self.model_config.hf_config, "tie_word_embeddings", False))
                for bucket in prefetched(receive_buckets(self._group)):  # loads while the next arrives
                    self.model.load_weights(_with_tied_head(bucket, tied, self.device))
            finally:
                self.shutdown()

        def update_weights(self, update_info: dict[str, Any]) -> None:
            self.receive_weights(self.parse_update_info(update_info))
            if torch.accelerator.is_available():
                torch.accelerator.synchronize()

        def shutdown(self) -> None:
            if self._group is not None:
                self._group.close()
                self._group = None

    return BroadcastWeightTransferEngine


def _with_tied_head(bucket: list[tuple[str, Any]], tied: bool, device: Any) -> list[tuple[str, Any]]:
    """The bucket on ``device``; a tied model's embedding also as ``lm_head.weight``: the trainer
    sends a tied weight once, and vLLM's layerwise reload refreshes the head only from that name."""
    out = [(name, tensor.to(device)) for name, tensor in bucket]
    if tied:
        out += [("lm_head.weight", t) for name, t in out if name.endswith("embed_tokens.weight")]
    return out


def dist_info_files() -> dict[str, str]:
    """The ``.dist-info`` directory's files that make ``register`` a ``vllm.general_plugins`` entry point."""
    return {
        "METADATA": "Metadata-Version: 2.1\nName: nexrl-vllm-weight-plugin\nVersion: 0\n",
        "entry_points.txt": f"[vllm.general_plugins]\n{ENGINE_NAME} = {PLUGIN_MODULE}:register\n",
    }
