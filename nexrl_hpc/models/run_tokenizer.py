"""The run's tokenizer from its config alone, for parts that need token ids before (or apart from) the model.

The data loader measures prompt lengths with it and the rollout workers apply its chat template, so
both see exactly the ids the policy is trained on: ``model.path``'s own tokenizer (``AutoTokenizer``,
with its chat template), or with ``model.path`` null the tiny model's char tokenizer built from
``model.tiny.tokenizer`` (the same one ``materialize_base_model`` saves).
"""

from __future__ import annotations

from typing import Any

from nexrl_hpc.config.schema import ModelConfig


def load_run_tokenizer(model_cfg: ModelConfig) -> Any:
    """A fast HF tokenizer with a pad token (its EOS when the model defines none)."""
    if model_cfg["path"] is None:
        from nexrl_hpc.models.tokenizer import build_char_tokenizer

        tiny = model_cfg["tiny"]["tokenizer"]
        return build_char_tokenizer(tiny["alphabet"], tiny.get("chat_template"))
    from nexrl_hpc.models.tiny import load_tokenizer

    return load_tokenizer(model_cfg["path"])
