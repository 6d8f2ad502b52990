"""Build the policy model: a tiny Llama or Qwen2 from the config (random init, local) or an HF directory."""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.utils import logging as hf_logging

from nexrl_hpc.checkpoint.hf import write_safetensors
from nexrl_hpc.checkpoint.trainer_io import without_tied_entries
from nexrl_hpc.config.schema import ModelConfig, TinyModelConfig
from nexrl_hpc.models.run_tokenizer import build_tiny_tokenizer, load_tokenizer

__all__ = ["build_tiny_model", "load_model", "load_tokenizer", "materialize_base_model", "stop_token_ids"]

ARCHITECTURES: dict[str, tuple[type[Any], type[PreTrainedModel]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
}


def build_tiny_model(cfg: TinyModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Random-init model of ``cfg.architecture`` sized to its tokenizer (``cfg.tokenizer``)."""
    tokenizer = build_tiny_tokenizer(cfg["tokenizer"])
    config_cls, model_cls = ARCHITECTURES[cfg["architecture"]]
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        max_position_embeddings=cfg["max_position_embeddings"],
        tie_word_embeddings=cfg["tie_word_embeddings"],
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        attention_dropout=0.0,
        torch_dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg["init_seed"])
        model = model_cls(config)
    return model, tokenizer


def materialize_base_model(cfg: ModelConfig, out_dir: str) -> str:
    """Return an HF-layout directory holding the initial policy: ``cfg.path`` or the tiny model saved to ``out_dir``."""
    if cfg["path"] is not None:
        return cfg["path"]
    if os.path.exists(os.path.join(out_dir, "config.json")) and os.path.exists(
        os.path.join(out_dir, "tokenizer.json")
    ):
        return out_dir
    model, tokenizer = build_tiny_model(cfg["tiny"])
    warmup = cfg["tiny"].get("warmup")
    if warmup:  # e.g. a task's syntax warm-up: RL post-training starts from a model that can write the format
        from nexrl_hpc.config.imports import load_object

        with torch.random.fork_rng(devices=[]):
            load_object(warmup)(
                model, tokenizer, cfg["tiny"]["init_seed"], **dict(cfg["tiny"].get("warmup_args") or {})
            )
        model.eval()
    tmp = f"{out_dir}.tmp-{os.getpid()}"
    save_model_dir(model, tmp)
    tokenizer.save_pretrained(tmp)
    if os.path.exists(out_dir):  # an earlier, interrupted attempt
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def save_model_dir(model: PreTrainedModel, out_dir: str) -> None:
    """config.json, generation_config.json and one model.safetensors: what ``save_pretrained``
    writes, without its detour through accelerate's ``unwrap_model``, which imports DeepSpeed
    (a part of every run's start-up) whenever it is installed."""
    os.makedirs(out_dir, exist_ok=True)
    model.config.architectures = [type(model).__name__]  # what vLLM picks the model class by
    model.config.save_pretrained(out_dir)
    if model.can_generate() and model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)
    state = without_tied_entries(model.state_dict(), model)  # a tied head once, as save_pretrained writes it
    write_safetensors(state, out_dir, max_shard_bytes=sys.maxsize)  # one file: never sharded


def stop_token_ids(model_dir: str, tokenizer: Any) -> tuple[int, ...]:
    """Where a response ends by default: the tokenizer's EOS and every ``eos_token_id`` of the
    model's ``generation_config.json`` (an instruct model's end-of-turn token and its base EOS,
    as vLLM stops by default)."""
    ids = [tokenizer.eos_token_id]
    try:
        generation = GenerationConfig.from_pretrained(model_dir)
    except OSError:  # no generation_config.json
        generation = None
    extra = getattr(generation, "eos_token_id", None)
    ids += extra if isinstance(extra, list) else [extra]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def load_model(
    model_dir: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str | None = None,
) -> Any:
    hf_logging.disable_progress_bar()
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kwargs)
    return model.to(device)  # type: ignore[arg-type]  # transformers types .to() as a decorator wrapper


def model_config(model_dir: str) -> Any:
    return AutoConfig.from_pretrained(model_dir)
