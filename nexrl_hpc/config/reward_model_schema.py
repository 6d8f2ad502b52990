"""TypedDict schema of ``reward_model``: rewards computed by a model (a sequence classifier or an LLM
judge), colocated with the rollout workers or served on ranks of their own. Part of the config tree
typed in ``nexrl_hpc.config.schema``."""

from __future__ import annotations

from typing import Annotated, Literal, TypedDict

from nexrl_hpc.config.constraints import Ge, Gt


class ClassifierConfig(TypedDict):
    path: str | None  # an AutoModelForSequenceClassification directory
    micro_batch_size: Annotated[int, Ge(1)]  # pairs per forward pass
    max_length: Annotated[int, Ge(2)]  # (prompt + response) tokens; longer are cut from the left
    label_index: Annotated[int, Ge(0)]  # the logit taken as the score
    device: str
    dtype: Literal["float32", "bfloat16", "float16"]
    apply_chat_template: bool  # a tokenizer with a chat template gets the pair as a conversation


class JudgeServerConfig(TypedDict):
    num_threads: Annotated[int, Ge(1)]
    max_batch_size: Annotated[int, Ge(1)]
    startup_timeout_s: Annotated[float, Gt(0.0)]


class JudgeConfig(TypedDict):
    base_url: str | None  # a running OpenAI-compatible server; null: the run starts one on model_path
    model_path: str | None
    api_key_env: str  # base_url given: the environment variable holding its key
    model: str  # the served model name
    prompt_template: str  # str.format fields {prompt}, {response}, {answer}
    system_prompt: str | None
    score_max: Annotated[float, Gt(0.0)]  # a score without its own denominator is divided by this
    max_tokens: Annotated[int, Ge(1)]
    temperature: Annotated[float, Ge(0.0)]
    concurrency: Annotated[int, Ge(1)]
    request_timeout_s: Annotated[float, Gt(0.0)]
    max_retries: Annotated[int, Ge(0)]
    local: JudgeServerConfig


class RewardModelConfig(TypedDict):
    type: Literal["classifier", "judge"] | None  # null: no model reward
    placement: Literal["colocated", "own_ranks"]
    world_size: Annotated[int, Ge(1)]  # own_ranks: ranks of the placement group "reward"
    combine: Literal[
        "replace", "add"
    ]  # replace: the model's score is the reward | add: reward_fn's + weight * it
    weight: float
    classifier: ClassifierConfig
    judge: JudgeConfig
