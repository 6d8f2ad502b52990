"""A trainer rank's checkpoint files: the HF-layout model and this rank's optimizer state.

``local_path/model`` holds the whole weights (written by rank 0 from the gathered state dict; a
LoRA policy's: its adapter in PEFT layout, ``checkpoint.adapter``);
``local_path/optimizer/rank_<r>.safetensors`` holds rank ``r``'s optimizer and LR-schedule state,
laid out as its parallel strategy shards it (an older checkpoint's ``rank_<r>.pt`` still loads).
Weights load at any world size; optimizer state at the layout that wrote it, and single-process,
FSDP2 or ZeRO-3 state at any world size of any of these engines (``reshard``: each rank reads the
elements it holds now). ZeRO-3 state always loads that way, at its own layout too.

A load runs in two phases: ``check`` reads headers only and raises on every rank when any rank
cannot load (nothing changed yet); ``load`` then writes into the live weights and optimizer state,
so an exception there may leave them half replaced (the trainer marks itself unusable).
"""

from __future__ import annotations

import concurrent.futures
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from nexrl_hpc.checkpoint.adapter import (
    adapter_key_map,
    check_adapter_dir,
    read_adapter_dir,
    write_adapter_dir,
)
from nexrl_hpc.checkpoint.digest import write_sidecar
from nexrl_hpc.checkpoint.hf import fsync_path, peek_safetensors_dir, read_safetensors_dir, write_hf_model_dir
from nexrl_hpc.checkpoint.reshard import (
    LiveLayout,
    LiveParameter,
    SavedLayout,
    flat_range,
    layout_of,
    layout_problem,
    resharded_state,
    saved_files,
    saved_layout,
)
from nexrl_hpc.checkpoint.state_file import load_state_file, peek_state_file, save_state_file
from nexrl_hpc.models.value_head import VALUE_HEAD_FILE, is_value_head_name, without_value_head

if TYPE_CHECKING:
    from nexrl_hpc.trainer.parallel import ParallelStrategy


@dataclass(frozen=True)
class CheckpointFiles:
    """Where one rank's parts of a checkpoint are."""

    model_dir: str
    optimizer_file: str


class TrainerCheckpointIO:
    """Save and load one trainer rank's model, optimizer and LR schedule (every rank calls each
    method: they hold collectives)."""

    def __init__(
        self,
        par: ParallelStrategy,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        engine: str,
        base_model_dir: str,
        max_shard_bytes: int,
    ):
        self.par = par
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.engine = engine  # service.train_service.engine: part of the optimizer file's layout
        self.base_model_dir = base_model_dir
        self.max_shard_bytes = max_shard_bytes
        hf_model = par.unwrap(model)  # a LoRA policy (a peft model): its files are the adapter's
        self.peft_model = hf_model if hasattr(hf_model, "peft_config") else None

    def write_model(
        self, path: str, fsync: bool, tied_head: bool = False, value_head_file: str | None = None
    ) -> None:
        """Gather the full weights to rank 0, which writes the HF-layout directory: a tied weight
        once, under the name it shares (as ``save_pretrained`` writes it), or also under its own
        name with ``tied_head`` (for an inference engine that reloads it only from there). A value
        head on the policy (``models.value_head``) stays out of the directory: into
        ``value_head_file`` when given (a checkpoint), else nowhere (an engine's weights)."""
        par = self.par
        state = par.full_state_dict(self.model)
        if par.rank == 0 and self.peft_model is not None:
            write_adapter_dir(self.peft_model, state, path, self.base_model_dir, fsync=fsync)
        elif par.rank == 0:
            hf_model = par.unwrap(self.model)
            value_head = {k: v for k, v in state.items() if is_value_head_name(k)}
            state = without_value_head(state)
            state = with_tied_entries(state, hf_model) if tied_head else without_tied_entries(state, hf_model)
            # a durable copy is a checkpoint's: its weight files' digests go into COMPLETE
            write_hf_model_dir(
                state, self.base_model_dir, path, self.max_shard_bytes, fsync=fsync, sidecars=fsync
            )
            if value_head and value_head_file is not None:
                hexdigest, size = save_state_file(value_head, value_head_file)
                write_sidecar(value_head_file, hexdigest, size)
                fsync_path(value_head_file)
        par.barrier()

    def save(self, local_path: str, global_step: int, save_weight_only: bool = False) -> None:
        par = self.par
        value_head_file = os.path.join(local_path, VALUE_HEAD_FILE)
        self.write_model(os.path.join(local_path, "model"), fsync=True, value_head_file=value_head_file)
        if save_weight_only:
            return
        assert self.optimizer is not None and self.scheduler is not None
        opt_dir = os.path.join(local_path, "optimizer")
        os.makedirs(opt_dir, exist_ok=True)
        path = os.path.join(opt_dir, f"rank_{par.rank}.safetensors")
        hexdigest, size = save_state_file(
            {
                "optimizer": par.optimizer_state(self.model, self.optimizer),
                "scheduler": self.scheduler.state_dict(),
                "global_step": global_step,
                "world_size": par.world_size,
                "engine": self.engine,
            },
            path,
        )
        write_sidecar(path, hexdigest, size)  # hashed as written: COMPLETE takes it from here
        fsync_path(path)
        par.barrier()
        if par.rank == 0:
            fsync_path(opt_dir)

    def files(self, local_path: str) -> CheckpointFiles:
        return CheckpointFiles(os.path.join(local_path, "model"), optimizer_file(local_path, self.par.rank))

    def check(self, files: CheckpointFiles, load_optimizer: bool) -> None:
        """Names, shapes and layout, from headers alone, before a tensor byte is read: raises on
        every rank if any rank cannot load (every rank loads, or none does)."""
        par = self.par
        error = self._check_weights(files.model_dir) if par.rank == 0 else None
        if error is None and load_optimizer:
            try:
                saved = self._reshard_from(files)
                if saved is not None:
                    saved_files(os.path.dirname(os.path.dirname(files.optimizer_file)), saved)
            except ValueError as exc:
                error = exc
            else:
                error = self._check_optimizer_file(files.optimizer_file) if saved is None else None
        par.agree(error)

    def live_layout(self) -> LiveLayout:
        stage = getattr(self.par, "stage", None) if self.engine == "deepspeed" else None
        return LiveLayout(self.engine, self.par.world_size, stage)

    def _reshard_from(self, files: CheckpointFiles) -> SavedLayout | None:
        """The saved layout when it differs from this trainer's and can be resharded into it; None
        when the files load as they are (or are refused by the same-layout check, naming them)."""
        saved = saved_layout(os.path.dirname(os.path.dirname(files.optimizer_file)))
        live = self.live_layout()
        if saved is None or layout_problem(saved, live):
            return None
        by_name_zero3 = saved.engine == live.engine == "deepspeed" and saved.by_name
        return (
            saved
            if by_name_zero3 or (saved.engine, saved.world_size) != (live.engine, live.world_size)
            else None
        )

    def load(self, files: CheckpointFiles, load_optimizer: bool) -> None:
        """After ``check``: the bytes go straight into the live weights and optimizer state where
        they match (``tensor_reads``: no fresh memory to fault in), the optimizer file read
        alongside the weights. An exception here may leave the live state half replaced."""
        par = self.par
        assert self.optimizer is not None and self.scheduler is not None
        opt_path = files.optimizer_file
        reshard = self._reshard_from(files) if load_optimizer else None
        if reshard is not None:
            self._load_resharded(files, reshard)
            return
        saved: dict[str, Any] = {}
        error: Exception | None
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="optimizer-read") as pool:
            live = par.optimizer_state_in_place(self.model, self.optimizer) if load_optimizer else None
            into = None if live is None else {"optimizer": live}  # as save lays the file out
            reading = pool.submit(read_optimizer_file, opt_path, into) if load_optimizer else None
            self._load_weights(files.model_dir)
            try:
                saved = reading.result() if reading is not None else {}
                error = self._layout_error(opt_path, saved) if reading is not None else None
            except (OSError, ValueError, RuntimeError) as exc:
                error = exc
        par.agree(error)
        if load_optimizer:
            par.load_optimizer_state(self.model, self.optimizer, saved["optimizer"])
            self.scheduler.load_state_dict(saved["scheduler"])

    def _load_resharded(self, files: CheckpointFiles, saved: SavedLayout) -> None:
        """Weights, then the elements of the optimizer state this rank holds now out of every saved
        rank's file (``reshard``), loaded as if this layout had saved them; ZeRO-3's saved fp32
        masters replace the weights of a single or FSDP2 trainer (its fp32 parameters)."""
        assert self.optimizer is not None and self.scheduler is not None
        state: dict[str, Any] = {}
        error: Exception | None = None
        try:  # read before the weights change: a file that fails here leaves the trainer as it was
            checkpoint_dir = os.path.dirname(os.path.dirname(files.optimizer_file))
            in_files = None  # a LoRA adapter's files name its weights as peft saves them
            if self.peft_model is not None and self.engine == "deepspeed":
                in_files = {live: name for name, live in self._adapter_keys().items()}
            params = self.live_parameters()
            state = resharded_state(checkpoint_dir, saved, self.engine, params, in_files)
        except (OSError, ValueError) as exc:
            error = exc
        self.par.agree(error)
        self._load_weights(files.model_dir)
        if state["masters"]:
            self._load_masters(state["masters"])
        self.par.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def _load_masters(self, masters: dict[str, torch.Tensor]) -> None:
        """The saved fp32 masters into this rank's part of each parameter (an FSDP2 shard's local
        rows, or the whole parameter)."""
        with torch.no_grad():
            for name, p in self.par.unwrap(self.model).named_parameters():
                if name in masters:
                    to_local = getattr(p, "to_local", None)
                    local = to_local() if to_local is not None else p.data
                    local.copy_(masters[name].to(local.device, local.dtype))

    def live_parameters(self) -> list[LiveParameter]:
        """The optimizer's parameters in its order (ZeRO-3: the trainable ones in ``named_parameters``
        order), each with its name, whole shape and the elements this rank holds: an FSDP2
        DTensor's shard of rows, a ZeRO-3 partition (``ds_tensor``), else all."""
        assert self.optimizer is not None
        named = [(n, p) for n, p in self.par.unwrap(self.model).named_parameters()]
        if self.engine == "deepspeed":
            return [self._zero3_parameter(n, p) for n, p in named if p.requires_grad]
        names = {id(p): n for n, p in named}
        out = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                shape = tuple(p.shape)
                lo, hi = 0, p.numel()
                local_shape = shape
                to_local = getattr(p, "to_local", None)
                if to_local is not None:
                    lo, hi = flat_range("fsdp", self.par.rank, self.par.world_size, shape)
                    local_shape = tuple(to_local().shape)
                    if math.prod(local_shape) != hi - lo:
                        raise ValueError(
                            f"{names[id(p)]}: FSDP2 shard of {list(local_shape)}, elements {lo}..{hi} "
                            f"of {list(shape)} expected"
                        )
                out.append(LiveParameter(names[id(p)], shape, lo, hi, local_shape))
        return out

    def _zero3_parameter(self, name: str, p: torch.nn.Parameter) -> LiveParameter:
        """A ZeRO-3 parameter's partition: ``ds_tensor`` holds ``ceil(numel / world)`` elements of the
        flattened parameter, the valid ones ``[rank*part, min((rank+1)*part, numel))``."""
        shape = tuple(getattr(p, "ds_shape", p.shape))
        lo, hi = flat_range("deepspeed", self.par.rank, self.par.world_size, shape)
        part = getattr(p, "ds_tensor", None)
        if part is None or part.numel() != math.ceil(math.prod(shape) / self.par.world_size):
            raise ValueError(
                f"{name}: not a ZeRO-3 partition of ceil({math.prod(shape)} / {self.par.world_size}) elements"
            )
        return LiveParameter(name, shape, lo, hi, (hi - lo,))

    def _check_weights(self, model_dir: str) -> Exception | None:
        """Why the HF directory cannot replace this model's weights (names, shapes), from the
        safetensors headers alone; None when it can."""
        par = self.par
        if self.peft_model is not None:
            return check_adapter_dir(model_dir, self._adapter_keys(), par.full_shapes(self.model))
        try:
            entries = peek_safetensors_dir(model_dir)
        except (OSError, ValueError) as exc:
            return exc
        hf_model = par.unwrap(self.model)
        expected = par.full_shapes(self.model)
        value_head = {k: shape for k, shape in expected.items() if is_value_head_name(k)}
        if value_head:
            error = _value_head_file_problem(_value_head_file(model_dir), value_head)
            if error is not None:
                return error
            expected = {k: shape for k, shape in expected.items() if k not in value_head}
        tied = {"lm_head.weight"} if getattr(hf_model.config, "tie_word_embeddings", False) else set()
        missing, unexpected = set(expected) - set(entries) - tied, set(entries) - set(expected)
        if missing or unexpected:
            return ValueError(
                f"{model_dir}: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
            )
        wrong = [
            f"{k} {list(e.shape)} (model: {list(expected[k])})"
            for k, e in entries.items()
            if e.shape != expected[k]
        ]
        return ValueError(f"{model_dir}: shapes differ from the model's: {wrong[:5]}") if wrong else None

    def _check_optimizer_file(self, path: str) -> Exception | None:
        """Why this rank's optimizer file cannot be loaded (missing, another layout), from its
        header alone (an older ``torch.save`` file is checked once read); None when it can."""
        if not os.path.exists(path):
            return FileNotFoundError(
                f"{path}: optimizer state missing (checkpoint saved with save_weight_only, "
                "or by fewer trainer ranks?)"
            )
        if not path.endswith(".safetensors"):
            return None
        try:
            return self._layout_error(path, peek_state_file(path))
        except (OSError, ValueError) as exc:
            return exc

    def _layout_error(self, path: str, saved: dict[str, Any]) -> ValueError | None:
        engine, par = self.engine, self.par
        if saved.get("world_size", 1) == par.world_size and saved.get("engine", "single") == engine:
            return None
        layout = layout_of(saved)
        refused = layout_problem(layout, self.live_layout())
        why = f" ({refused[0]}: {refused[1]})" if refused else " (an older torch.save file: not resharded)"
        return ValueError(
            f"{path} holds optimizer state of engine={layout.engine} on "
            f"{layout.world_size} rank(s); this run has engine={engine} on {par.world_size}{why}: "
            "resume with the same layout, or load the weights only (load_optimizer=False)"
        )

    def _load_weights(self, model_dir: str) -> None:
        """Rank 0 reads the HF directory (checked by ``_check_weights``) into the weights it holds
        whole, if any; every rank gets its part."""
        par = self.par
        state: dict[str, torch.Tensor] = {}
        error: Exception | None = None
        if par.rank == 0:
            try:
                if self.peft_model is not None:
                    state = read_adapter_dir(model_dir, self._adapter_keys())
                else:
                    state = read_safetensors_dir(model_dir, into=par.full_weights_in_place(self.model))
                    if any(is_value_head_name(k) for k in par.full_shapes(self.model)):
                        state.update(load_state_file(_value_head_file(model_dir)))
            except (OSError, ValueError) as exc:
                error = exc
        par.agree(error)
        par.load_full_state_dict(self.model, state)

    def _adapter_keys(self) -> dict[str, str]:
        return adapter_key_map(self.peft_model, list(self.par.full_shapes(self.model)))


def _value_head_file(model_dir: str) -> str:
    """The value head's file of the checkpoint whose model directory is ``model_dir``."""
    return os.path.join(os.path.dirname(os.path.abspath(model_dir)), VALUE_HEAD_FILE)


def _value_head_file_problem(path: str, shapes: dict[str, tuple[int, ...]]) -> Exception | None:
    """Why the checkpoint's value head file cannot replace the live value head; None when it can."""
    if not os.path.exists(path):
        return FileNotFoundError(
            f"{path}: no value head in this checkpoint (saved by a run without "
            "service.train_service.critic.head_on_policy?)"
        )
    try:
        saved = peek_state_file(path)
    except (OSError, ValueError) as exc:
        return exc
    got = {k: tuple(v.shape) for k, v in saved.items()} if isinstance(saved, dict) else {}
    if got != shapes:
        return ValueError(f"{path}: holds {got}, the value head is {shapes}")
    return None


def tied_weight_names(model: torch.nn.Module) -> dict[str, str]:
    """``{tied name: the name it shares}`` (``lm_head.weight -> model.embed_tokens.weight``) when
    the model's config ties them; empty otherwise."""
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return {}
    tied = getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None)
    if isinstance(tied, dict):
        return {str(k): str(v) for k, v in tied.items()}
    # older transformers list the tied names only: each shares the input embedding
    embedding = model.get_input_embeddings().weight  # type: ignore[operator]
    source = next((n for n, p in model.named_parameters() if p is embedding), None)
    return {str(name): source for name in tied or ()} if source else {}


def without_tied_entries(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``state`` with every tied weight only under the name it shares (no ``lm_head.weight`` beside
    the embedding): what ``save_pretrained`` writes, and what transformers, vLLM, SGLang, the local
    engine and a resumed trainer re-tie on load (``config.json`` says tied)."""
    tied = tied_weight_names(model)
    return {k: v for k, v in state.items() if k not in tied or tied[k] not in state}


def with_tied_entries(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tied weight under its own name too (``lm_head.weight`` beside the embedding).

    Why: vLLM's in-place reload (``reload_weights``) refreshes a tied head only from an
    ``lm_head.weight`` entry: without one its CPU platform keeps the head's packed GEMM weights
    and serves a head that is neither the old nor the new policy (measured on vLLM 0.32). So the
    weight exports a vLLM server reloads carry it; checkpoints do not. ``config.json`` still says
    tied, so transformers loads the directory as the user's tied model."""
    out = dict(state)
    for name, source in tied_weight_names(model).items():
        if name not in out and source in out:
            out[name] = out[source]
    return out


def optimizer_file(local_path: str, rank: int) -> str:
    """This rank's optimizer file: the state file, or the ``torch.save`` file of an older
    checkpoint when only that exists."""
    path = os.path.join(local_path, "optimizer", f"rank_{rank}.safetensors")
    legacy = path.removesuffix(".safetensors") + ".pt"
    return legacy if not os.path.exists(path) and os.path.exists(legacy) else path


def read_optimizer_file(path: str, into: Any = None) -> dict[str, Any]:
    """A rank's optimizer file: the state file (its tensors read into ``into``'s where they match),
    or a ``torch.save`` file of an older checkpoint (``weights_only``: tensors and plain values only;
    its tensors copied out of the mapping)."""
    if path.endswith(".safetensors"):
        return load_state_file(path, into=into)
    saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return _materialize(saved)


def _materialize(obj: Any) -> Any:
    """A copy of ``obj`` whose tensors live in memory (not in a memory-mapped file)."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _materialize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_materialize(v) for v in obj)
    return obj
