"""``engine=deepspeed``: DeepSpeed ZeRO (stage 0-3) over the trainer ranks.

The engine's PPO loop calls ``backward`` once per micro-batch and ``step`` once per mini-batch, with
a per-rank loss already scaled by the world size (see ``parallel``). DeepSpeed runs with
``managed_gradient_accumulation=false``: ``backward`` only accumulates (no division by the
accumulation steps), ``step`` is the accumulation boundary — it reduces (averaging over ranks),
clips to ``grad_clip`` with the same ``max_norm / (norm + 1e-6)`` factor as torch's
``clip_grad_norm_``, and skips the update when the norm is not finite. So the accumulated gradient
and the update equal the single-process engine's.

The optimizer handed back to the engine is the client AdamW that DeepSpeed wraps: the engine's
LambdaLR sets the learning rate on its param groups, which are the groups the ZeRO optimizer steps.
The generated DeepSpeed config comes from ``service.train_service.deepspeed``; its ``config``
mapping is merged on top (raw DeepSpeed keys for what the section does not name).

Checkpoints: ZeRO-3's optimizer state is saved by parameter name (``zero3_state``), so it resumes
on any world size and into or out of the other engines (``checkpoint.reshard``); stages 0-2 save
DeepSpeed's own ``state_dict``, which loads only into the stage and world size that wrote it.
"""

from __future__ import annotations

import enum
import os
import socket
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from nexrl_hpc.trainer.parallel import ParallelStrategy
from nexrl_hpc.trainer.zero3_state import is_by_name, load_zero3_state, zero3_state
from nexrl_hpc.weight_sync.wire import plan_buckets

# DeepSpeed 0.19 calls a collective torch 2.13 deprecates, once per step per rank: noise in every log
warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge: ``over`` wins, nested mappings are merged key by key."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def deepspeed_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed config dict for a train-service payload (``deepspeed``, ``dtype``, ``actor``)."""
    ds = cfg["deepspeed"]
    bf16 = cfg["dtype"] == "bfloat16"
    generated: dict[str, Any] = {
        # bookkeeping only: the engine decides the micro-batches and calls step itself
        "train_micro_batch_size_per_gpu": cfg["actor"]["ppo_micro_batch_size"],
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": cfg["actor"]["grad_clip"],
        "zero_optimization": {"stage": ds["zero_stage"]},
        "bf16": {"enabled": bf16},
        "zero_allow_untested_optimizer": True,  # the client AdamW
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    return _merge(generated, dict(ds["config"]))


def _ensure_extensions_dir() -> None:
    """DeepSpeed JIT-compiles a CPU comm op into TORCH_EXTENSIONS_DIR (torch's default is under
    ~/.cache); when that is not writable (read-only home on compute nodes) use a per-user temp dir."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return
    default = os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions")
    probe = default
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.access(probe, os.W_OK):
        os.environ["TORCH_EXTENSIONS_DIR"] = os.path.join(
            tempfile.gettempdir(), f"torch_extensions_{os.getuid()}"
        )


def _ensure_local_rank() -> None:
    """DeepSpeed insists on LOCAL_RANK (torchrun sets it; the MPI runtime and a 1-rank group may
    not): derive it from which ranks share this host."""
    if "LOCAL_RANK" in os.environ or "OMPI_COMM_WORLD_LOCAL_RANK" in os.environ:
        return
    hosts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    rank = dist.get_rank()
    os.environ["LOCAL_RANK"] = str(sum(1 for h in hosts[:rank] if h == hosts[rank]))


_DROP = object()


def _plain(value: Any) -> Any:
    """A copy of an optimizer state with only what ``torch.load(weights_only=True)`` reads back:
    tensors and plain types; enums become ints, other objects (loss scaler, slice mappings) are dropped."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, enum.Enum):
        return value.value
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            pv = _plain(v)
            if pv is not _DROP:
                out[k] = pv
        return out
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        if any(v is _DROP for v in items):
            return _DROP
        return items if isinstance(value, list) else tuple(items)
    return _DROP


class DeepSpeedZeRO(ParallelStrategy):
    """DeepSpeed ZeRO over every rank of the default process group."""

    def __init__(self, cfg: dict[str, Any]):
        if not dist.is_initialized():
            raise RuntimeError(
                "service.train_service.engine=deepspeed needs torch.distributed initialised on every trainer rank"
            )
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.ds_config = deepspeed_config(cfg)
        self.stage = int(self.ds_config["zero_optimization"]["stage"])
        self.engine: Any = None

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        raise NotImplementedError("DeepSpeed wraps the model and the optimizer together: use setup")

    def setup(
        self,
        model: torch.nn.Module,
        make_optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer],
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        _ensure_extensions_dir()
        _ensure_local_rank()
        import deepspeed

        client = make_optimizer([p for p in model.parameters() if p.requires_grad])
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=client, config=self.ds_config, dist_init_required=False
        )
        self.engine = engine
        return engine, client

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return getattr(model, "module", model)

    # --- training step ---------------------------------------------------------------------------
    def zero_grad(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        zero = getattr(self.engine.optimizer, "zero_grad", None)
        if self.stage > 0 and zero is not None:
            zero(set_to_none=True)
        self.engine.zero_grad()

    def backward(self, model: torch.nn.Module, loss: torch.Tensor, last_in_step: bool) -> None:
        """Accumulate only: the loss already carries the mini-batch normaliser (no division by
        accumulation steps), and ``step`` is the boundary whatever ``last_in_step`` says."""
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_norm: float
    ) -> tuple[float, bool]:
        eng = self.engine
        if self.stage == 0 and isinstance(eng.optimizer, torch.optim.Optimizer):
            # stage 0 in fp32: DeepSpeed steps the client optimizer as is (no non-finite check,
            # no norm), so average over ranks, clip and skip here (allreduce_gradients would skip
            # the reduction: outside DeepSpeed's step it is not at an accumulation boundary)
            if self.world_size > 1:
                eng.buffered_allreduce_fallback(grads=None)
            norm = torch.nn.utils.clip_grad_norm_(eng.module.parameters(), max_norm)
            stepped = bool(torch.isfinite(norm))
            if stepped:
                eng.optimizer.step()
            eng.zero_grad()
            return float(norm), stepped
        if hasattr(eng.optimizer, "clip_grad"):
            eng.optimizer.clip_grad = max_norm
        eng.step()
        global_norm = eng.get_global_grad_norm()
        return (
            float(global_norm) if global_norm is not None else float("nan"),
            bool(eng.was_step_applied()),
        )

    # --- weights ---------------------------------------------------------------------------------
    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        if self.stage == 3:
            state = self.engine._zero3_consolidated_16bit_state_dict()
        else:
            state = self.engine.module.state_dict() if self.rank == 0 else None
        if self.rank != 0 or state is None:
            return {}
        return {
            k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype)
            for k, v in state.items()
        }

    def weight_buckets(
        self, model: torch.nn.Module, bucket_bytes: int, skip: set[str]
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """ZeRO-3: each bucket's parameters gathered together (``GatheredParameters``) while it is
        sent, then partitioned again; stages 0-2 hold whole parameters on every rank."""
        if self.stage != 3:
            yield from super().weight_buckets(model, bucket_bytes, skip)
            return
        import deepspeed

        params = {n: p for n, p in self.engine.module.named_parameters() if n not in skip}
        sizes = [(n, int(p.ds_numel) * p.element_size()) for n, p in params.items()]
        for names in plan_buckets(sizes, bucket_bytes):
            with deepspeed.zero.GatheredParameters([params[n] for n in names]):
                yield [(n, params[n].data) for n in names]

    def full_shapes(self, model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
        """ZeRO-3 parameters are empty outside a gather: their whole shape is ``ds_shape``."""
        live = self.engine.module.state_dict(keep_vars=True)
        return {k: tuple(getattr(t, "ds_shape", t.shape)) for k, t in live.items()}

    def load_full_state_dict(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Rank 0's full weights into every rank (ZeRO-3: each parameter gathered, modified on
        rank 0, re-partitioned), then the optimizer's fp32 master copies refreshed from them."""
        import deepspeed

        module = self.engine.module
        present = [sorted(state)] if self.rank == 0 else [None]
        if self.world_size > 1:
            dist.broadcast_object_list(present, src=0)
        names = set(present[0] or [])
        with torch.no_grad():
            for name, t in module.state_dict(keep_vars=True).items():
                if name not in names:
                    continue
                if hasattr(t, "ds_id"):  # a ZeRO-3 partitioned parameter
                    with deepspeed.zero.GatheredParameters([t], modifier_rank=0):
                        if self.rank == 0:
                            t.data.copy_(state[name].to(t.device, t.dtype))
                    continue
                buf = state[name].to(t.device, t.dtype) if self.rank == 0 else torch.empty_like(t)
                if self.world_size > 1:
                    dist.broadcast(buf, src=0)
                t.data.copy_(buf)
        refresh = getattr(self.engine.optimizer, "refresh_fp32_params", None)
        if refresh is not None:
            refresh()

    # --- optimizer state (this rank's partition) -------------------------------------------------
    def optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """ZeRO-3: this rank's partition of each parameter keyed by name (``zero3_state``: resharded
        into any layout); stages 0-2: DeepSpeed's own state_dict (loads at the same layout only)."""
        if self.stage == 3:
            return zero3_state(self.engine)
        return _plain(self.engine.optimizer.state_dict())

    def optimizer_state_in_place(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
        """None: DeepSpeed's ``load_state_dict`` copies into its own partitions whatever it gets."""
        return None

    def load_optimizer_state(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        saved_stage = int(state.get("zero_stage", 0))  # ZeRO optimizers record it; stage 0 is torch's state
        if saved_stage != self.stage:
            raise ValueError(
                f"optimizer state of ZeRO stage {saved_stage}; this run has "
                f"service.train_service.deepspeed.zero_stage={self.stage}: resume with the same stage, "
                "or load the weights only (load_optimizer=False)"
            )
        if self.stage == 3 and is_by_name(state):
            load_zero3_state(self.engine, state)
            return
        opt = self.engine.optimizer
        if isinstance(opt, torch.optim.Optimizer):  # stage 0: the client optimizer itself
            opt.load_state_dict(state)
            return
        state = dict(state, loss_scaler=opt.loss_scaler)
        # the list is indexed by data-parallel rank; only this rank's entry is read
        opt.load_state_dict(
            [state] * self.world_size, load_optimizer_states=True, load_from_fp32_weights=True
        )
