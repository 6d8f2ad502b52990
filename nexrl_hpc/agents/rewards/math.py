"""math_reward_fn, kept importable under its old path (it lives in nexrl_hpc.rewards.math)."""

from nexrl_hpc.rewards.math import MAX_ANSWER_CHARS, gsm8k_final_answer, math_reward_fn

__all__ = ["MAX_ANSWER_CHARS", "gsm8k_final_answer", "math_reward_fn"]
