"""The optimizer state file: nested structure + one tensor stream, a valid safetensors file."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nexrl_hpc.checkpoint.state_file import StateFileError, load_state_file, save_state_file


def _adamw_state() -> dict:
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3, bias=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(4, 7)).sum().backward()
    opt.step()
    return opt.state_dict()


def test_an_optimizer_state_round_trips_exactly_with_its_types(tmp_path: Path) -> None:
    state = {
        "optimizer": _adamw_state(),
        "global_step": 12,
        "engine": "fsdp",
        "extras": {
            3: [None, True, 0.5, float("inf"), (1, "a")],
            "half": torch.randn(3, dtype=torch.bfloat16),
        },
        "flags": torch.tensor([True, False]),
        "ids": torch.arange(5, dtype=torch.int64),
        "odd": torch.randn(3, dtype=torch.float16),  # 6 bytes: what follows must still be aligned
        "empty": torch.empty(0, 4),
    }
    path = str(tmp_path / "rank_0.safetensors")
    save_state_file(state, path)
    back = load_state_file(path)

    assert back["global_step"] == 12 and back["engine"] == "fsdp"
    assert back["extras"][3][:3] == [None, True, 0.5] and math.isinf(back["extras"][3][3])
    assert back["extras"][3][4] == (1, "a")  # tuples stay tuples, int keys stay ints
    groups = back["optimizer"]["param_groups"]
    assert groups == state["optimizer"]["param_groups"] and groups[0]["betas"] == (0.9, 0.95)
    assert set(back["optimizer"]["state"]) == {0, 1, 2}
    for pid, entry in state["optimizer"]["state"].items():
        for key, value in entry.items():
            got = back["optimizer"]["state"][pid][key]
            assert got.dtype == value.dtype and got.shape == value.shape and torch.equal(got, value), (
                pid,
                key,
            )
    for key in ("flags", "ids", "odd", "empty"):
        assert back[key].dtype == state[key].dtype and torch.equal(back[key], state[key]), key
    assert torch.equal(back["extras"]["half"], state["extras"]["half"])

    # a model's optimizer takes it back and steps like the original
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3, bias=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.load_state_dict(back["optimizer"])
    assert opt.param_groups[0]["betas"] == (0.9, 0.95)


def test_it_is_a_safetensors_file_other_tools_read(tmp_path: Path) -> None:
    path = str(tmp_path / "s.safetensors")
    weights = torch.randn(4, 4)
    save_state_file({"w": weights, "n": 3}, path)
    tensors = load_file(path)
    assert len(tensors) == 1 and torch.equal(next(iter(tensors.values())), weights)


def test_what_cannot_be_stored_is_named_at_save(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"state\['optimizer'\]\[0\]: object cannot be stored"):
        save_state_file({"optimizer": [object()]}, str(tmp_path / "x.safetensors"))
    with pytest.raises(TypeError, match="complex64 has no safetensors code"):
        save_state_file({"z": torch.zeros(2, dtype=torch.complex64)}, str(tmp_path / "x.safetensors"))


def test_a_truncated_or_foreign_file_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "rank_0.safetensors"
    save_state_file({"w": torch.randn(1000)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(StateFileError, match=r"rank_0\.safetensors: .* \(truncated\?\)"):
        load_state_file(str(path))
    path.write_bytes(b"\x05")
    with pytest.raises(StateFileError, match="too short"):
        load_state_file(str(path))
    other = tmp_path / "model.safetensors"
    from safetensors.torch import save_file

    save_file({"w": torch.randn(3)}, str(other))
    with pytest.raises(StateFileError, match="not a nexrl state file"):
        load_state_file(str(other))
