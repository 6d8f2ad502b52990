"""Turn a batch of trajectories into the padded tensors the trainer consumes.

Layout (as verl/NexRL): prompt left-padded to the batch's longest prompt, response right-padded
to the longest response; ``position_ids`` count real tokens only, so left padding does not shift
rotary positions. Token ids are exactly the engine's; nothing is re-tokenised.
"""

from __future__ import annotations

import numpy as np
import torch

from nexrl_hpc.types import Batch

TRAINING_TENSOR_KEYS = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "responses",
    "response_mask",
    "behaviour_log_probs",
)


def pack_trajectories(batch: Batch, pad_token_id: int) -> dict[str, torch.Tensor]:
    prompts: list[list[int]] = batch.values["prompt_ids"]
    responses: list[list[int]] = batch.values["response_ids"]
    behaviour: list[list[float]] = batch.values["behaviour_log_probs"]
    masks: list[list[int] | None] = batch.values.get("loss_mask") or [None] * len(prompts)
    if not prompts:
        raise ValueError("cannot pack an empty batch")
    n = len(prompts)
    p_lens = np.fromiter((len(p) for p in prompts), dtype=np.int64, count=n)
    r_lens = np.fromiter((len(r) for r in responses), dtype=np.int64, count=n)
    p_len = int(p_lens.max())
    r_len = max(int(r_lens.max()), 1)
    input_ids = np.full((n, p_len + r_len), pad_token_id, dtype=np.int64)
    response_mask = np.zeros((n, r_len), dtype=np.float32)
    logp = np.zeros((n, r_len), dtype=np.float32)
    for i in range(n):
        pl, rl = p_lens[i], r_lens[i]
        if len(behaviour[i]) != rl:
            raise ValueError(
                f"trajectory {i}: {rl} response tokens but {len(behaviour[i])} behaviour logprobs"
            )
        input_ids[i, p_len - pl : p_len] = prompts[i]
        if rl:
            input_ids[i, p_len : p_len + rl] = responses[i]
            logp[i, :rl] = behaviour[i]
            mask = masks[i]
            if mask is None:
                response_mask[i, :rl] = 1.0
            elif len(mask) != rl:
                raise ValueError(f"trajectory {i}: {rl} response tokens but a loss mask of {len(mask)}")
            else:
                response_mask[i, :rl] = mask
    cols = np.arange(p_len + r_len)
    attention = ((cols >= (p_len - p_lens)[:, None]) & (cols < (p_len + r_lens)[:, None])).astype(np.int64)
    attention_mask = torch.from_numpy(attention)
    input_t = torch.from_numpy(input_ids)
    return {
        "input_ids": input_t,
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": input_t[:, p_len:].clone(),
        "response_mask": torch.from_numpy(response_mask),
        "behaviour_log_probs": torch.from_numpy(logp),
    }
