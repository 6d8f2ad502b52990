"""Turn a batch of trajectories into the padded tensors the trainer consumes.

Layout (as verl/NexRL): prompt left-padded to the batch's longest prompt, response right-padded
to the longest response; ``position_ids`` count real tokens only, so left padding does not shift
rotary positions. Token ids are exactly the engine's; nothing is re-tokenised.
"""

from __future__ import annotations

import torch

from nexrl_hpc.types import Batch

TRAINING_TENSOR_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask", "behaviour_log_probs")


def pack_trajectories(batch: Batch, pad_token_id: int) -> dict[str, torch.Tensor]:
    prompts: list[list[int]] = batch.values["prompt_ids"]
    responses: list[list[int]] = batch.values["response_ids"]
    behaviour: list[list[float]] = batch.values["behaviour_log_probs"]
    masks: list[list[int]] | None = batch.values.get("loss_mask")
    if not prompts:
        raise ValueError("cannot pack an empty batch")
    p_len = max(len(p) for p in prompts)
    r_len = max(max(len(r) for r in responses), 1)
    ids_rows, attn_rows, resp_rows, mask_rows, logp_rows = [], [], [], [], []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if len(behaviour[i]) != len(r):
            raise ValueError(f"trajectory {i}: {len(r)} response tokens but {len(behaviour[i])} behaviour logprobs")
        lm = masks[i] if masks is not None and masks[i] is not None else [1] * len(r)
        if len(lm) != len(r):
            raise ValueError(f"trajectory {i}: {len(r)} response tokens but a loss mask of {len(lm)}")
        left = p_len - len(p)
        right = r_len - len(r)
        ids_rows.append([pad_token_id] * left + list(p) + list(r) + [pad_token_id] * right)
        attn_rows.append([0] * left + [1] * (len(p) + len(r)) + [0] * right)
        resp_rows.append(list(r) + [pad_token_id] * right)
        mask_rows.append(list(lm) + [0] * right)
        logp_rows.append(list(behaviour[i]) + [0.0] * right)
    attention_mask = torch.tensor(attn_rows, dtype=torch.long)
    return {
        "input_ids": torch.tensor(ids_rows, dtype=torch.long),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": torch.tensor(resp_rows, dtype=torch.long),
        "response_mask": torch.tensor(mask_rows, dtype=torch.float32),
        "behaviour_log_probs": torch.tensor(logp_rows, dtype=torch.float32),
    }
