"""How the policy trainer spreads one model over its ranks: the parts of a training step that differ.

The PPO update in ``policy_trainer`` is written once against this interface; a strategy wraps the
unchanged HF model (torchtitan style) and owns what depends on the parallelism: backward, gradient
clipping and the optimizer step, full-state-dict gathering and loading, per-rank optimizer state.
Chosen by ``service.train_service.engine`` through ``strategy_factory.create_parallel_strategy``:

- ``single``: one process, plain model and AdamW.
- ``fsdp``: FSDP2 ``fully_shard`` per decoder layer and at the root over a 1-D device mesh of the
  trainer ranks (gloo on CPU, NCCL on GPU), mixed precision from the config.
- ``deepspeed``: DeepSpeed ZeRO stage 0-3 (``deepspeed_strategy``), config generated from
  ``service.train_service.deepspeed``.

Data parallelism: every rank sees the same mini-batch boundaries and computes its own contiguous
slice of each one; the loss normaliser is global (computed from the whole mini-batch), and since
the gradient reduction averages over ranks the per-rank loss is scaled by the world size — so the
summed gradient equals the single-process one.
"""

from __future__ import annotations

import logging
import os
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NoReturn, cast

import torch
import torch.distributed as dist

from nexrl_hpc.weight_sync.wire import plan_buckets


class ParallelStrategy(ABC):
    rank: int = 0
    world_size: int = 1
    sequence_parallel_size: int = (
        1  # ranks of a group splitting the same rows' sequences (``sequence_parallel``)
    )

    @abstractmethod
    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model to train (sharded or not); its parameters are what the optimizer gets."""

    def setup(
        self,
        model: torch.nn.Module,
        make_optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer],
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """Wrap the model and build its optimizer (an engine like DeepSpeed does both at once)."""
        model = self.wrap(model)  # only what requires grad: a LoRA model's adapter
        return model, make_optimizer([p for p in model.parameters() if p.requires_grad])

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The HF model inside what ``setup`` returned (its state-dict keys and ``config``)."""
        return model

    def zero_grad(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def backward(self, model: torch.nn.Module, loss: torch.Tensor, last_in_step: bool) -> None:
        """Accumulate ``loss``'s gradient; ``last_in_step`` marks the last micro-batch before the
        optimizer step (engines that reduce gradients at that boundary need to know)."""
        loss.backward()

    def step(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_norm: float
    ) -> tuple[float, bool]:
        """Clip to ``max_norm`` and step; (global grad norm, stepped). A non-finite norm skips the step."""
        norm = self.clip_grad_norm(model, max_norm)
        if not torch.isfinite(norm):
            optimizer.zero_grad(set_to_none=True)
            return float(norm), False
        optimizer.step()
        return float(norm), True

    def loss_scale(self) -> float:
        """Multiplier of a rank's loss so that the reduced gradient is the whole batch's sum: the
        data-parallel ranks' count (the ranks of a sequence-parallel group sum one loss's gradient)."""
        return float(self.world_size // self.sequence_parallel_size)

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        full = getattr(norm, "full_tensor", None)  # a DTensor under FSDP2
        return full() if full is not None else norm

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sum per-rank metric contributions (identity on one rank)."""
        if self.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def all_reduce_max(self, value: float) -> float:
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def agree(self, error: Exception | None) -> None:
        """Raise on every rank if any rank has an error (a check made on one rank must not leave the
        others waiting in the next collective)."""
        failed = self.all_reduce_max(1.0 if error is not None else 0.0)
        if error is not None:
            raise error
        if failed:
            raise ValueError("failed on another trainer rank (see its error)")

    def all_gather_rows(self, local: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Concatenate every rank's rows (rank order); ``counts`` are the rows each rank holds. The
        ranks of a sequence-parallel group hold the same rows: the first one's count once."""
        if self.world_size == 1:
            return local
        width = max(counts)
        padded = torch.zeros((width, *local.shape[1:]), dtype=local.dtype)
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded)
        every = self.sequence_parallel_size
        return torch.cat([p[:c] for r, (p, c) in enumerate(zip(parts, counts)) if r % every == 0], dim=0)

    @abstractmethod
    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's weights on rank 0 (CPU, fp32); other ranks get an empty dict."""

    @abstractmethod
    def load_full_state_dict(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load full weights (given on rank 0; other ranks may pass an empty dict)."""

    def optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def full_shapes(self, model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
        """Every weight's name and whole (unsharded) shape: what a full state dict must hold."""
        return {k: tuple(v.shape) for k, v in self.unwrap(model).state_dict().items()}

    def full_weights_in_place(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Live tensors a full state dict read on this rank may be written into directly (a load
        then needs no new memory): none unless this rank holds the whole model."""
        return {}

    def optimizer_state_in_place(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
        """The live optimizer state, shaped like ``optimizer_state``'s result and sharing its
        tensors' memory (FSDP2's ``to_local`` shards share it), for a load to write into; None when
        there is none yet — a new optimizer creates it at the first step, and asking FSDP2's
        ``get_optimizer_state_dict`` for it would create it — or it cannot be shared."""
        return self.optimizer_state(model, optimizer) if optimizer.state else None

    def load_optimizer_state(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        optimizer.load_state_dict(state)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def weight_buckets(
        self, model: torch.nn.Module, bucket_bytes: int, skip: set[str]
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The full weights (HF names, ``skip`` left out), one bucket of at most ``bucket_bytes`` at a
        time; a collective on every rank, in the same order. A sharded tensor (FSDP2's DTensor) is
        gathered when its bucket comes, so no rank holds more than one bucket beyond its shards."""
        state = self.unwrap(model).state_dict()
        sizes = [(k, v.numel() * v.element_size()) for k, v in state.items() if k not in skip]
        for names in plan_buckets(sizes, bucket_bytes):
            yield [(k, _full_tensor(state[k])) for k in names]


class SingleProcess(ParallelStrategy):
    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {
            k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype)
            for k, v in model.state_dict().items()
        }

    def load_full_state_dict(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        device = next(model.parameters()).device
        live = model.state_dict()
        # tensors read in place (full_weights_in_place) are loaded already
        rest = {k: v for k, v in state.items() if k not in live or v.data_ptr() != live[k].data_ptr()}
        model.load_state_dict({k: v.to(device) for k, v in rest.items()}, strict=False)

    def full_weights_in_place(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return model.state_dict()


class FSDP2(ParallelStrategy):
    """FSDP2 over every rank of the default process group (one data-parallel dimension)."""

    def __init__(self, device: torch.device, param_dtype: str, reduce_dtype: str):
        if not dist.is_initialized():
            raise RuntimeError(
                "service.train_service.engine=fsdp needs torch.distributed initialised on every trainer rank"
            )
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._device = device
        self._param_dtype, self._reduce_dtype = param_dtype, reduce_dtype

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(self._device.type, (self.world_size,))
        mp = mixed_precision_policy(self._param_dtype, self._reduce_dtype)
        for layer in _decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        return model

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = cast(
            "dict[str, torch.Tensor]",
            get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)),
        )
        if self.rank != 0:
            return {}
        return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}

    def load_full_state_dict(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(
            model,
            cast("dict[str, Any]", state),
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False),
        )

    def optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's shards as plain tensors (the file stores a shard; its layout is the model's)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return _local_shards(get_optimizer_state_dict(model, optimizer))

    def load_optimizer_state(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """Shards saved by ``optimizer_state`` become DTensors laid out like their parameters again."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
        from torch.distributed.tensor import DTensor

        params = dict(model.named_parameters())
        for fqn, entry in state["state"].items():
            param = params.get(fqn)
            if not isinstance(param, DTensor):
                continue
            local_shape = param.to_local().shape
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == local_shape:
                    entry[key] = DTensor.from_local(
                        value.to(param.device),
                        param.device_mesh,
                        param.placements,
                        run_check=False,
                        shape=param.shape,
                        stride=param.stride(),
                    )
        set_optimizer_state_dict(model, optimizer, state)


def _full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (an all-gather), any other tensor as it is."""
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor.detach()


def _local_shards(value: Any) -> Any:
    """``value`` with every DTensor replaced by its local shard."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local().detach()
    if isinstance(value, dict):
        return {k: _local_shards(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_local_shards(v) for v in value)
    return value


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks FSDP shards one by one (HF causal LMs keep them at ``model.layers``)."""
    get_base = getattr(model, "get_base_model", None)  # a peft model: the HF model inside
    inner = getattr(get_base() if callable(get_base) else model, "model", None)
    layers = getattr(inner, "layers", None)
    return list(layers) if layers is not None else []


def dp_slices(n: int, world_size: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) row ranges of ``n`` rows for each rank (sizes differ by at most 1)."""
    base, extra = divmod(n, world_size)
    out, start = [], 0
    for r in range(world_size):
        size = base + (1 if r < extra else 0)
        out.append((start, start + size))
        start += size
    return out


def mixed_precision_policy(param_dtype: str, reduce_dtype: str) -> Any:
    """FSDP2's policy from ``service.train_service.fsdp``: parameters all-gathered (and computed) in
    ``param_dtype``, gradients reduce-scattered in ``reduce_dtype`` (bf16 / fp32 on GPUs)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(
        param_dtype=getattr(torch, param_dtype), reduce_dtype=getattr(torch, reduce_dtype)
    )


def init_trainer_process_group(backend: str) -> None:
    """torch.distributed from the launcher's environment (torchrun / the MPI runtime) with
    ``service.train_service.dist_backend`` (gloo on CPU, NCCL on GPU)."""
    if dist.is_initialized():
        return
    dist.init_process_group(
        backend=backend, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"])
    )


def close_trainer_process_group() -> None:
    """Destroy the process group once every rank is done with it: left to the interpreter's exit,
    gloo's worker threads can outlive it and abort the process ("terminate called without an
    active exception", SIGABRT) after the work succeeded."""
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_trainer_process(code: int) -> NoReturn:
    """End a trainer rank's process with ``code`` once its logs and output are flushed, without the
    interpreter's teardown: even after ``destroy_process_group`` a thread left by gloo or DeepSpeed
    can abort the process there (SIGABRT, "terminate called without an active exception": seen at
    the exit of ZeRO-3 ranks whose work had succeeded), and the launcher counts the rank failed."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
