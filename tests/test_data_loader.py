"""DataLoader contract: repeats and groups, returns, budgets, epochs, bad rows, exact resume."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from nexrl_hpc.data.loader import DatasetLoader
from nexrl_hpc.tasks.max_digit import generate_splits
from nexrl_hpc.tasks.prepare import prepare_datasets
from tests.conftest import compose_config


def write_rows(path: Path, rows: list[Any]) -> str:
    with open(path, "wb") as f:
        for row in rows:
            f.write(row if isinstance(row, bytes) else (json.dumps(row) + "\n").encode())
    return str(path)


def loader(tmp_path: Path, n_rows: int = 3, **cfg_overrides: Any) -> DatasetLoader:
    overrides = [f"data.{k}={v}" for k, v in cfg_overrides.items()]
    if cfg_overrides.get("rollout_repeat_n") == 1:  # one sample per prompt: no group estimator
        overrides.append("algorithm.adv_estimator=reinforce_pp")
    cfg = compose_config(overrides)
    files = [write_rows(tmp_path / "d.jsonl", [{"prompt": f"p{i}", "answer": str(i)} for i in range(n_rows)])]
    return DatasetLoader(cfg["data"], data_files=files)


def test_each_row_is_repeated_as_one_group(tmp_path: Path) -> None:
    dl = loader(tmp_path, rollout_repeat_n=2, shuffle=False)
    items = [dl.get_next_item() for _ in range(6)]
    assert [(t["uid"], t["sample_index"], t["epoch"]) for t in items] == [
        ("train-0", 0, 0),
        ("train-0", 1, 0),
        ("train-1", 0, 0),
        ("train-1", 1, 0),
        ("train-2", 0, 0),
        ("train-2", 1, 0),
    ]
    assert items[0]["group_id"] == items[1]["group_id"] == "train-0@0"
    assert items[0]["prompt"] == "p0" and items[0]["answer"] == "0"
    nxt = dl.get_next_item()  # max_epochs null: a new epoch starts
    assert nxt["epoch"] == 1 and nxt["group_id"] == "train-0@1"


def test_returned_items_come_back_first_and_are_not_counted_against_budget(tmp_path: Path) -> None:
    dl = loader(tmp_path, rollout_repeat_n=1, shuffle=False)
    dl.set_dispatch_budget(2)
    a, b = dl.get_next_item(), dl.get_next_item()
    assert dl.get_next_item() is None and not dl.can_return_item()
    dl.add_item_front(b)
    assert dl.can_return_item()
    assert dl.get_next_item() == b
    dl.add_item_back({"prompt": "extra", "uid": "x"})
    assert dl.get_next_item()["uid"] == "x"
    assert dl.get_next_item() is None
    dl.set_dispatch_budget(None)
    assert dl.get_next_item()["uid"] == "train-2"
    assert a["uid"] == "train-0"


def test_max_epochs_finishes_and_reset_restarts(tmp_path: Path) -> None:
    dl = loader(tmp_path, n_rows=2, rollout_repeat_n=1, max_epochs=1, shuffle=False)
    assert dl.total_tasks() == 2 and len(dl) == 2
    assert [dl.get_next_item()["uid"] for _ in range(2)] == ["train-0", "train-1"]
    assert dl.get_next_item() is None and dl.is_finished()
    dl.reset()
    assert not dl.is_finished() and dl.get_next_item()["uid"] == "train-0"


def test_shuffle_is_seeded_per_epoch(tmp_path: Path) -> None:
    a = loader(tmp_path, n_rows=20, rollout_repeat_n=1, seed=5)
    b = loader(tmp_path, n_rows=20, rollout_repeat_n=1, seed=5)
    ua = [a.get_next_item()["uid"] for _ in range(40)]
    ub = [b.get_next_item()["uid"] for _ in range(40)]
    assert ua == ub
    assert sorted(ua[:20]) == sorted(ua[20:]) and ua[:20] != ua[20:]  # each epoch a new permutation


def test_state_dict_round_trip_continues_exactly(tmp_path: Path) -> None:
    dl = loader(tmp_path, n_rows=7, rollout_repeat_n=3, seed=2)
    for _ in range(11):
        dl.get_next_item()
    returned = dl.get_next_item()
    dl.add_item_front(returned)
    state = json.loads(json.dumps(dl.state_dict()))  # survives JSON (state.h5 stores it so)
    expected = [dl.get_next_item() for _ in range(30)]
    fresh = loader(tmp_path, n_rows=7, rollout_repeat_n=3, seed=2)
    fresh.load_state_dict(state)
    assert [fresh.get_next_item() for _ in range(30)] == expected


def test_bad_rows_are_skipped_and_counted(tmp_path: Path) -> None:
    cfg = compose_config()
    path = write_rows(
        tmp_path / "bad.jsonl",
        [
            {"prompt": "ok1", "answer": "1"},
            b"\xff\xfe not utf-8\n",
            b"{not json\n",
            {"answer": "no prompt"},
            {"prompt": 7},
            [1, 2],
            b"\n",
            {"prompt": "ok2", "answer": "2"},
        ],
    )
    dl = DatasetLoader(cfg["data"], data_files=[path])
    assert dl.num_rows == 2
    assert dl.get_skipped_rows() == 5


def test_id_key_gives_stable_uids(tmp_path: Path) -> None:
    cfg = compose_config(["data.id_key=id", "data.shuffle=false"])
    path = write_rows(tmp_path / "ids.jsonl", [{"id": "q-17", "prompt": "a"}, {"id": 4, "prompt": "b"}])
    dl = DatasetLoader(cfg["data"], data_files=[path])
    assert dl.get_next_item()["uid"] == "q-17"


def test_task_data_is_materialised_with_a_held_out_validation_file(tmp_path: Path) -> None:
    cfg = compose_config([f"run_dir={tmp_path}"])
    train_files, val_files = prepare_datasets(cfg, str(tmp_path))
    val_rows = [json.loads(line) for line in open(tmp_path / "data" / "validation.jsonl")]
    train_rows = [json.loads(line) for line in open(train_files[0])]
    assert val_files == [str(tmp_path / "data" / "validation.jsonl")]
    assert set(val_rows[0]) == {"prompt", "answer"}
    assert not {r["prompt"] for r in val_rows} & {r["prompt"] for r in train_rows}
    assert len(train_rows) == cfg["task"]["params"]["train_size"]


def test_max_digit_task_is_balanced_and_correct() -> None:
    splits = generate_splits({"num_digits": 3, "train_size": 2000, "val_per_answer": 20}, seed=4)
    for row in splits["train"] + splits["validation"]:
        assert row["answer"] == max(row["prompt"][1:-1])
    counts: dict[str, int] = {}
    for row in splits["validation"]:
        counts[row["answer"]] = counts.get(row["answer"], 0) + 1
    # a model that always prints the same digit cannot score above 1/7 on validation
    assert max(counts.values()) / len(splits["validation"]) <= 1 / 7 + 1e-9


def test_released_tasks_are_never_handed_out_again_even_before_their_completion(tmp_path: Path) -> None:
    """The pool's group filter may consume a task before its worker has reported it complete."""
    from nexrl_hpc.data.loader import task_key

    dl = loader(tmp_path, rollout_repeat_n=2, shuffle=False)
    items = dl.get_next_items(4, consumer="worker")
    keys = [task_key(t) for t in items]
    dl.complete_items("worker", keys[:1])  # one reported, three still out
    dl.release_items(keys[:2])  # consumed: the reported one and one still out
    dl.complete_items("worker", keys[1:2])  # its late report adds nothing back
    state = dl.state_dict()
    assert sorted(task_key(t) for t in state["returned"]) == sorted(keys[2:])  # a resume re-issues the rest
    assert dl.num_untrained() == 2 and dl.requeue_consumer("worker") == 2


def test_a_long_poll_on_a_finished_pass_waits_until_woken_or_a_task_comes_back(tmp_path: Path) -> None:
    """Every validation task out: a worker's long poll waits (it used to answer at once, and the
    worker spun on empty polls, stalling validation by up to a second on 2 cores)."""
    import threading
    import time

    dl = loader(tmp_path, n_rows=2, rollout_repeat_n=1, max_epochs=1, shuffle=False)
    out = dl.get_next_items(2, consumer="w")
    assert [t["uid"] for t in out] == ["train-0", "train-1"] and dl.is_finished()
    t0 = time.monotonic()
    assert dl.get_next_items(2, wait_s=0.3, consumer="w") == []
    assert time.monotonic() - t0 >= 0.25  # waited for the whole poll
    threading.Timer(0.1, dl.wake_waiters).start()  # end_validate wakes the workers
    t0 = time.monotonic()
    assert dl.get_next_items(2, wait_s=5.0, consumer="w") == []
    assert time.monotonic() - t0 < 2.0
    threading.Timer(0.1, dl.requeue_consumer, args=("w",)).start()  # a dead worker's tasks come back
    t0 = time.monotonic()
    back = dl.get_next_items(2, wait_s=5.0, consumer="v")
    assert sorted(t["uid"] for t in back) == ["train-0", "train-1"] and time.monotonic() - t0 < 2.0


class _OpenWeights:
    """The rollout scheduler as a rollout worker asks it: never reloading."""

    def check_rollout_service_status(self, model_tag: str) -> str:
        return "continue"


def test_during_a_validation_a_worker_takes_its_tasks_first_then_the_next_training_batch(
    tmp_path: Path,
) -> None:
    """Sync mode releases the next training batch beside the validation (same weights): a worker
    fetches validation tasks while any are left, then training tasks at once, and long-polls the
    training loader only when neither has work."""
    from nexrl_hpc.rollout.simple import SimpleRolloutWorker

    cfg = compose_config([f"run_dir={tmp_path}"])
    (tmp_path / "v").mkdir()
    train = loader(tmp_path, n_rows=4, rollout_repeat_n=1, shuffle=False)
    val_files = [
        write_rows(tmp_path / "v" / "val.jsonl", [{"prompt": f"v{i}", "answer": "0"} for i in range(3)])
    ]
    val = DatasetLoader(cfg["validate"]["data"], data_files=val_files, is_validate=True)
    worker = SimpleRolloutWorker(cfg)
    worker.set_module_references(None, train, _OpenWeights(), val, None)  # type: ignore[arg-type]
    train.set_dispatch_budget(2)
    worker.begin_validate()
    tasks, is_validate = worker._fetch_tasks(2, 0.5)
    assert is_validate and [t["prompt"] for t in tasks] == ["v0", "v1"]
    tasks, is_validate = worker._fetch_tasks(2, 0.5)
    assert is_validate and [t["prompt"] for t in tasks] == ["v2"]
    started = time.monotonic()
    tasks, is_validate = worker._fetch_tasks(4, 0.5)  # validation all out: training, without a wait
    assert not is_validate and [t["prompt"] for t in tasks] == ["p0", "p1"]
    assert time.monotonic() - started < 0.2
    tasks, is_validate = worker._fetch_tasks(4, 0.3)  # nothing anywhere: the training loader's long poll
    assert tasks == [] and time.monotonic() - started >= 0.3
    val.add_item_front(
        {"prompt": "v1", "uid": "validate-1", "answer": "0"}
    )  # a failed step's task comes back
    tasks, is_validate = worker._fetch_tasks(4, 0.5)
    assert is_validate and [t["prompt"] for t in tasks] == ["v1"]
    worker.end_validate()
    train.set_dispatch_budget(1)
    tasks, is_validate = worker._fetch_tasks(4, 0.5)
    assert not is_validate and [t["prompt"] for t in tasks] == ["p2"]
