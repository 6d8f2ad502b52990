"""Where an unknown key was meant to go: the closest names in the WHOLE key tree, and verl's names.

An unknown key gets, in this order: the key it moved to (``validate.MOVED_KEYS``); its nexrl_hpc
name when it is one of verl's (``VERL_KEYS``, with what differs); a close name among its siblings
and the keys of the same name elsewhere in the tree (``data.lr`` ->
``service.train_service.actor.optim.lr``); a close name anywhere. docs/configuration.md's verl table is ``verl_key_table()``
(tests/test_key_names.py holds them equal).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class VerlKey:
    """One of verl's config keys and what it is here."""

    verl: str
    ours: str | None  # the nexrl_hpc key; None: no key of its own (``note`` says what does it)
    note: str = ""  # what differs (units, values), or how the setting is made here


_TS = "service.train_service.actor"
_CRITIC = "service.train_service.critic"
VERL_KEYS: tuple[VerlKey, ...] = (
    VerlKey("data.train_files", "data.data_files", "and data.type=parquet (jsonl, hf: other readers)"),
    VerlKey("data.val_files", "validate.data.data_files"),
    VerlKey("data.train_batch_size", "data.batch_size", "prompts per step, as in verl"),
    VerlKey("data.val_batch_size", "validate.data.batch_size"),
    VerlKey("data.max_prompt_length", "rollout_worker.max_prompt_length"),
    VerlKey("data.max_response_length", "rollout_worker.max_response_length"),
    VerlKey("actor_rollout_ref.model.path", "model.path"),
    VerlKey("actor_rollout_ref.model.enable_gradient_checkpointing", "model.gradient_checkpointing"),
    VerlKey("actor_rollout_ref.rollout.n", "data.rollout_repeat_n"),
    VerlKey("actor_rollout_ref.rollout.temperature", "rollout_worker.temperature"),
    VerlKey("actor_rollout_ref.rollout.top_p", "rollout_worker.top_p"),
    VerlKey("actor_rollout_ref.rollout.val_kwargs.temperature", "rollout_worker.val_kwargs.temperature"),
    VerlKey("actor_rollout_ref.rollout.name", "service.inference_service.backend", "vllm | sglang | local"),
    VerlKey(
        "actor_rollout_ref.rollout.gpu_memory_utilization",
        "service.inference_service.vllm.gpu_memory_utilization",
    ),
    VerlKey(
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
        "service.inference_service.vllm.tensor_parallel_size",
    ),
    VerlKey("actor_rollout_ref.actor.optim.lr", f"{_TS}.optim.lr"),
    VerlKey("actor_rollout_ref.actor.optim.lr_warmup_steps", f"{_TS}.optim.lr_warmup_steps"),
    VerlKey("actor_rollout_ref.actor.optim.weight_decay", f"{_TS}.optim.weight_decay"),
    VerlKey(
        "actor_rollout_ref.actor.ppo_mini_batch_size",
        f"{_TS}.ppo_mini_batch_size",
        "counts SEQUENCES here (prompts x data.rollout_repeat_n), PROMPTS in verl: "
        "verl's value times rollout.n",
    ),
    VerlKey(
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        f"{_TS}.ppo_micro_batch_size",
        "sequences per forward/backward on each trainer rank",
    ),
    VerlKey("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", f"{_TS}.ppo_max_token_len_per_gpu"),
    VerlKey(
        "actor_rollout_ref.actor.use_dynamic_bsz",
        None,
        f"micro-batches by tokens: set {_TS}.ppo_max_token_len_per_gpu (null: by sequences)",
    ),
    VerlKey("actor_rollout_ref.actor.ppo_epochs", f"{_TS}.ppo_epochs"),
    VerlKey("actor_rollout_ref.actor.clip_ratio_low", f"{_TS}.clip_ratio_low"),
    VerlKey("actor_rollout_ref.actor.clip_ratio_high", f"{_TS}.clip_ratio_high"),
    VerlKey("actor_rollout_ref.actor.entropy_coeff", f"{_TS}.entropy_coeff"),
    VerlKey("actor_rollout_ref.actor.grad_clip", f"{_TS}.grad_clip"),
    VerlKey("actor_rollout_ref.actor.loss_agg_mode", f"{_TS}.loss_agg_mode"),
    VerlKey("actor_rollout_ref.actor.policy_loss.loss_mode", f"{_TS}.policy_loss", "vanilla | gspo"),
    VerlKey(
        "actor_rollout_ref.actor.use_kl_loss",
        None,
        "the KL loss is on when algorithm.kl_loss_coef > 0 (0: off, no reference model)",
    ),
    VerlKey("actor_rollout_ref.actor.kl_loss_coef", "algorithm.kl_loss_coef"),
    VerlKey("actor_rollout_ref.actor.kl_loss_type", "algorithm.kl_loss_type"),
    VerlKey(
        "algorithm.adv_estimator",
        "algorithm.adv_estimator",
        "same key; reinforce_plus_plus(_baseline) is reinforce_pp(_baseline) here",
    ),
    VerlKey("algorithm.norm_adv_by_std_in_grpo", "algorithm.norm_adv_by_std"),
    VerlKey("critic.model.path", f"{_CRITIC}.model_path", "null: the policy's initial model"),
    VerlKey("critic.optim.lr", f"{_CRITIC}.optim.lr"),
    VerlKey("critic.cliprange_value", f"{_CRITIC}.cliprange_value"),
    VerlKey("critic.ppo_epochs", f"{_CRITIC}.ppo_epochs"),
    VerlKey(
        "critic.ppo_mini_batch_size",
        f"{_CRITIC}.ppo_mini_batch_size",
        "counts SEQUENCES here, PROMPTS in verl (as the actor's)",
    ),
    VerlKey("critic.ppo_micro_batch_size_per_gpu", f"{_CRITIC}.ppo_micro_batch_size"),
    VerlKey("critic.grad_clip", f"{_CRITIC}.grad_clip"),
    VerlKey("trainer.critic_warmup", f"{_CRITIC}.warmup_steps"),
    VerlKey("trainer.total_training_steps", "train_worker.total_train_steps"),
    VerlKey("trainer.total_epochs", "data.max_epochs", "null here: cycle until total_train_steps"),
    VerlKey("trainer.save_freq", "train_worker.save_freq"),
    VerlKey("trainer.test_freq", "validate.eval.validate_freq"),
    VerlKey("trainer.val_before_train", "validate.validate_before_train"),
    VerlKey("trainer.project_name", "project_name"),
    VerlKey("trainer.experiment_name", "experiment_name"),
    VerlKey("trainer.logger", "logger.backend", "[console] or [console, wandb]"),
    VerlKey("trainer.default_local_dir", "train_worker.checkpoint_path", "default: <run_dir>/checkpoints"),
    VerlKey("trainer.max_actor_ckpt_to_keep", "train_worker.max_ckpt_to_keep"),
    VerlKey("trainer.resume_mode", "resume.mode", "auto | from_path | disable"),
    VerlKey(
        "custom_reward_function.path",
        "rollout_worker.reward_fn",
        "with the function's name: rollout_worker.reward_fn=path/to/file.py:compute_score",
    ),
    VerlKey("custom_reward_function.name", "rollout_worker.reward_fn", "as custom_reward_function.path"),
    VerlKey(
        "reward_model.enable",
        "reward_model.type",
        "classifier (a reward model) | judge (an LLM judge) | null: off",
    ),
    VerlKey("reward_model.model.path", "reward_model.classifier.path", "with reward_model.type=classifier"),
    VerlKey("reward_model.micro_batch_size_per_gpu", "reward_model.classifier.micro_batch_size", ""),
    VerlKey("reward_model.max_length", "reward_model.classifier.max_length", ""),
)
VERL_KEY_BY_NAME = {k.verl: k for k in VERL_KEYS}


def key_paths(tree: Mapping) -> list[str]:
    """Every dotted key path of a nested mapping (its inner mappings' keys too; not into lists)."""
    paths: list[str] = []
    for key, value in tree.items():
        paths.append(str(key))
        if isinstance(value, Mapping):
            paths += [f"{key}.{sub}" for sub in key_paths(value)]
    return paths


def verl_hint(path: str) -> str:
    """`` (verl's name: ...)`` for a verl key, else ''."""
    known = VERL_KEY_BY_NAME.get(path)
    if known is None:
        return ""
    if known.ours is None:
        return f" (verl's name; here: {known.note})"
    note = f"; {known.note}" if known.note else ""
    return f" (verl's name; here it is {known.ours!r}{note})"


def _node(tree: Mapping, parent: str) -> Mapping | None:
    node: object = tree
    for part in parent.split(".") if parent else []:
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node if isinstance(node, Mapping) else None


def _quoted(paths: list[str]) -> str:
    return " or ".join(repr(p) for p in paths)


def did_you_mean(path: str, tree: Mapping) -> str:
    """The hint that follows "unknown key" for ``path`` in the config ``tree`` (a nested mapping of
    the valid keys): `` (did you mean 'a.b'?)``, verl's counterpart, or the keys under its parent."""
    hint = verl_hint(path)
    if hint:
        return hint
    parent, _, leaf = path.rpartition(".")
    everywhere = [p for p in key_paths(tree) if p != path]
    siblings = _node(tree, parent)
    close_sibling = (
        difflib.get_close_matches(leaf, [str(k) for k in siblings], n=1, cutoff=0.6)
        if siblings is not None
        else []
    )
    candidates = [(parent + "." if parent else "") + c for c in close_sibling]
    candidates += [p for p in everywhere if p.rpartition(".")[2] == leaf and p not in candidates]
    if candidates:
        return f" (did you mean {_quoted(candidates[:3])}?)"
    by_leaf: dict[str, list[str]] = {}
    for p in everywhere:
        by_leaf.setdefault(p.rpartition(".")[2], []).append(p)
    close = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.75)
    if close:
        return f" (did you mean {_quoted(by_leaf[close[0]][:3])}?)"
    close = difflib.get_close_matches(path, everywhere, n=1, cutoff=0.75)
    if close:
        return f" (did you mean {close[0]!r}?)"
    if siblings is not None:
        return f" (valid keys under {parent or '<root>'}: {', '.join(sorted(str(k) for k in siblings))})"
    return ""


def verl_key_table() -> str:
    """The markdown table of ``VERL_KEYS`` that docs/configuration.md shows."""
    lines = ["| verl | nexrl_hpc | note |", "| --- | --- | --- |"]
    for k in VERL_KEYS:
        ours = f"`{k.ours}`" if k.ours else "—"
        lines.append(f"| `{k.verl}` | {ours} | {k.note.replace('|', '&#124;')} |")
    return "\n".join(lines)
