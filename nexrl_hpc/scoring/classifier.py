"""A reward model: an ``AutoModelForSequenceClassification`` directory scoring (prompt, response) pairs.

verl's and OpenRLHF's reward models and TRL's ``reward_funcs=<model id>`` are this: the prompt and
the response go through the model's chat template (as a user and an assistant message) when its
tokenizer has one, else as the prompt's text followed by the response; the score is the logit
``label_index`` at the last real token. Pairs are scored ``micro_batch_size`` at a time, padded (the
model finds its last real token by the pad id) and cut from the left to ``max_length`` tokens.
Nothing is downloaded: the directory is loaded with ``local_files_only``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

from nexrl_hpc.config.reward_model_schema import ClassifierConfig
from nexrl_hpc.config.validate import ConfigError, ConfigProblem

PATH_KEY = "reward_model.classifier.path"


def classifier_path_problem(path: str | None) -> str | None:
    """Why ``path`` is not a sequence-classifier directory, or None."""
    if not path:
        return (
            "reward_model.type=classifier needs the model directory (an AutoModelForSequenceClassification)"
        )
    if not os.path.isfile(os.path.join(path, "config.json")):
        return f"{path!r} is not a model directory (no config.json); nothing is downloaded"
    return None


def pair_text(tokenizer: Any, prompt: Any, response: str, chat: bool) -> str:
    """One (prompt, response) pair as the text the classifier reads."""
    if chat and getattr(tokenizer, "chat_template", None):
        messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        messages.append({"role": "assistant", "content": response})
        return str(tokenizer.apply_chat_template(messages, tokenize=False))
    if isinstance(prompt, list):  # chat messages without a template: their contents in order
        prompt = "\n".join(str(m.get("content", "")) for m in prompt)
    return f"{prompt}{response}"


class ClassifierScorer:
    """``score_batch(prompts, responses, answers) -> [{"reward": logit}, ...]`` (answers unused)."""

    def __init__(self, cfg: ClassifierConfig) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        problem = classifier_path_problem(cfg["path"])
        if problem is not None:
            raise ConfigError([ConfigProblem(PATH_KEY, problem)])
        path = str(cfg["path"])
        self._cfg = cfg
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.tokenizer.truncation_side = "left"  # the response's end decides the score: keep it
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, local_files_only=True, dtype=getattr(torch, cfg["dtype"])
        )
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        labels = int(self.model.config.num_labels)
        if cfg["label_index"] >= labels:
            raise ConfigError(
                [
                    ConfigProblem(
                        "reward_model.classifier.label_index",
                        f"{cfg['label_index']} is past the model's {labels} label(s) ({path})",
                    )
                ]
            )
        self.model.to(cfg["device"]).eval()
        self._lock = threading.Lock()  # one forward at a time: threads would only share the cores

    def score_batch(
        self, prompts: Sequence[Any], responses: Sequence[str], answers: Sequence[Any]
    ) -> list[dict[str, float]]:
        texts = [
            pair_text(self.tokenizer, p, r, self._cfg["apply_chat_template"])
            for p, r in zip(prompts, responses)
        ]
        size = self._cfg["micro_batch_size"]
        scores: list[float] = []
        with self._lock, torch.inference_mode():
            for start in range(0, len(texts), size):
                enc = self.tokenizer(
                    texts[start : start + size],
                    padding=True,
                    truncation=True,
                    max_length=self._cfg["max_length"],
                    return_tensors="pt",
                    add_special_tokens=False,
                ).to(self._cfg["device"])
                logits = self.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
                scores += logits[:, self._cfg["label_index"]].float().tolist()
        return [{"reward": s} for s in scores]

    def close(self) -> None:
        return None
