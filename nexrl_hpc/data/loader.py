"""Data loaders: dataset rows (jsonl, parquet, HF ``datasets``), handed out one rollout task at a time.

Each dataset row becomes ``rollout_repeat_n`` consecutive tasks sharing a ``group_id`` (one GRPO
group). Every task carries the row's stable ``uid``, its ``epoch`` and ``sample_index`` so a sample
can be traced, deduplicated and re-issued across restarts. Returned tasks (``add_item_front``) are
handed out again before fresh ones. A dispatch budget, written by the rollout scheduler only
(scheduler/), caps how many fresh tasks go out (sync mode: exactly one training batch per version).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from typing import Any

from nexrl_hpc.config.schema import DataConfig
from nexrl_hpc.core.execute import long_poll, quick
from nexrl_hpc.core.module import NexRLModule
from nexrl_hpc.data.rows import load_rows

logger = logging.getLogger(__name__)


def task_key(task: dict[str, Any]) -> str:
    """Identity of one rollout task: the sample (uid, epoch) and which of its repeats."""
    return f"{task.get('group_id', task.get('uid'))}#{task.get('sample_index', 0)}"


class BaseDataLoader(NexRLModule):
    """The data loader contract: tasks handed out one at a time, returned tasks put back (front or back)."""

    def __init__(self, config: DataConfig, is_validate: bool = False):
        super().__init__()
        self._config = config
        self._is_validate = is_validate

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitem__(self, index: int) -> dict[str, Any]:
        raise NotImplementedError

    def get_next_item(self) -> dict[str, Any] | None:
        raise NotImplementedError

    @quick
    def is_finished(self) -> bool:
        raise NotImplementedError

    @quick
    def can_return_item(self) -> bool:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError

    def add_item_front(self, item: dict[str, Any]) -> None:
        raise NotImplementedError

    def add_item_back(self, item: dict[str, Any]) -> None:
        raise NotImplementedError


class DatasetLoader(BaseDataLoader):
    """Rows of ``data.data_files`` (jsonl, parquet or HF ``datasets``; see data/readers.py), normalised
    to tasks (data/rows.py). Bad rows are skipped and counted; with a ``tokenizer`` and
    ``max_prompt_length``, prompts longer than that (after templating) are filtered and counted."""

    def __init__(
        self,
        config: DataConfig,
        is_validate: bool = False,
        data_files: list[str] | None = None,
        tokenizer: Any = None,
        max_prompt_length: int | None = None,
        model_path: str | None = None,
    ):
        super().__init__(config, is_validate)
        self._repeat = config["rollout_repeat_n"]
        self._shuffle = config["shuffle"]
        self._seed = config["seed"]
        self._max_epochs = config["max_epochs"]
        self._split = "validation" if is_validate else "train"
        files = data_files if data_files is not None else config["data_files"]
        loaded = load_rows(
            config,
            files,
            self._split,
            tokenizer,
            max_prompt_length,
            key_prefix="validate.data" if is_validate else "data",
            model_path=model_path,
        )
        self.skipped_rows = loaded.skipped
        self.filtered_long_prompts = loaded.filtered_long
        self._rows = loaded.tasks
        if not self._rows:
            raise ValueError(
                f"no usable rows in {files} ({self.skipped_rows} skipped, {self.filtered_long_prompts} "
                f"longer than rollout_worker.max_prompt_length={max_prompt_length} tokens"
                f"{': ' + ', '.join(loaded.long_examples) if loaded.long_examples else ''})"
            )
        self._lock = threading.Condition()
        self._returned: deque[dict[str, Any]] = deque()
        self._outstanding: dict[
            str, tuple[str, dict[str, Any]]
        ] = {}  # handed out, not yet done: key -> (consumer, task)
        # done (trajectory in the pool), not yet trained: a checkpoint hands these out again too
        self._delivered: dict[str, dict[str, Any]] = {}
        self._extra: deque[dict[str, Any]] = deque()  # add_item_back of items that are not returns
        self._gone: set[str] = set()  # consumers whose tasks were re-issued: nothing more goes to them
        self._budget: int | None = None
        self._epoch = 0
        self._order: list[int] = []
        self._cursor = 0  # position in _order (rows)
        self._repeat_index = 0  # next sample_index of the current row
        self._issued_fresh = 0
        self._start_epoch(0)

    # --- epochs ---------------------------------------------------------------------------------
    def _start_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        self._order = list(range(len(self._rows)))
        if self._shuffle:
            random.Random(self._seed * 1_000_003 + epoch).shuffle(self._order)
        self._cursor = 0
        self._repeat_index = 0

    def _fresh_exhausted(self) -> bool:
        return self._cursor >= len(self._order) and (
            self._max_epochs is not None and self._epoch + 1 >= self._max_epochs
        )

    def _next_fresh(self) -> dict[str, Any] | None:
        if self._cursor >= len(self._order):
            if self._max_epochs is not None and self._epoch + 1 >= self._max_epochs:
                return None
            self._start_epoch(self._epoch + 1)
        row = self._rows[self._order[self._cursor]]
        item = dict(row)
        item["epoch"] = self._epoch
        item["sample_index"] = self._repeat_index
        item["group_id"] = f"{row['uid']}@{self._epoch}"
        self._repeat_index += 1
        if self._repeat_index >= self._repeat:
            self._repeat_index = 0
            self._cursor += 1
        return item

    # --- loader API -----------------------------------------------------------------------------
    def __len__(self) -> int:
        """Tasks still to hand out in this epoch (returned items included)."""
        with self._lock:
            remaining_rows = len(self._order) - self._cursor
            return remaining_rows * self._repeat - self._repeat_index + len(self._returned) + len(self._extra)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return dict(self._rows[index])

    @property
    def num_rows(self) -> int:
        return len(self._rows)

    @quick
    def total_tasks(self) -> int:
        """Tasks one epoch hands out (rows x rollout_repeat_n)."""
        return len(self._rows) * self._repeat

    def get_next_item(self) -> dict[str, Any] | None:
        with self._lock:
            if self._returned:
                return self._returned.popleft()
            if self._extra:
                return self._extra.popleft()
            if self._budget is not None and self._budget <= 0:
                return None
            item = self._next_fresh()
            if item is not None:
                self._issued_fresh += 1
                if self._budget is not None:
                    self._budget -= 1
            return item

    @long_poll
    def get_next_items(
        self, max_items: int, wait_s: float = 0.0, consumer: str | None = None
    ) -> list[dict[str, Any]]:
        """Up to ``max_items`` tasks in one call (one round trip when the loader is remote).

        With ``wait_s`` > 0 and nothing to hand out, wait up to that long for items to come back
        or for the dispatch budget to reopen (long poll). With a ``consumer`` name the tasks are
        recorded as outstanding until ``complete_items`` (or a return) — ``requeue_consumer`` hands
        them out again if that consumer dies.
        """
        deadline = time.monotonic() + wait_s
        items: list[dict[str, Any]] = []
        while True:
            for _ in range(max_items - len(items)):
                item = self.get_next_item()
                if item is None:
                    break
                items.append(item)
            remaining = deadline - time.monotonic()
            if items or remaining <= 0:
                break
            # nothing to hand out, also when every task is out (a finished pass): wait rather than
            # answer at once, or a worker whose validation tasks are all out spins on empty polls
            with self._lock:
                if not self._lock.wait(remaining):
                    break
                if not self._returned and not self._extra and (self._budget == 0 or self._fresh_exhausted()):
                    break  # woken without work (wake_waiters): let the caller look around
        if consumer is not None and items:
            with self._lock:
                if consumer in self._gone:  # a long poll of a consumer lost meanwhile: not its tasks
                    self._returned.extendleft(reversed(items))
                    self._lock.notify_all()
                    return []
                for item in items:
                    self._outstanding[task_key(item)] = (consumer, item)
        return items

    def wake_waiters(self) -> None:
        """Return every pending long poll now (e.g. the workers switch between training and validation)."""
        with self._lock:
            self._lock.notify_all()

    @quick
    def complete_items(self, consumer: str, keys: list[str], delivered: bool = True) -> None:
        """``consumer`` is done with these tasks: their trajectories are in the pool (``delivered``,
        remembered until ``release_items``) or were dropped."""
        with self._lock:
            for key in keys:
                entry = self._outstanding.pop(key, None)
                if delivered and entry is not None:
                    self._delivered[key] = entry[1]

    @quick
    def release_items(self, keys: list[str]) -> None:
        """The trainer (or the pool's group filter) consumed the trajectories of these tasks: trained
        or dropped, they are never handed out again — also when the consumer's ``complete_items``
        for one of them has not arrived yet."""
        with self._lock:
            for key in keys:
                self._delivered.pop(key, None)
                self._outstanding.pop(key, None)

    @quick
    def num_untrained(self) -> int:
        """Tasks not trained yet that are waiting to go out, are out, or are done (in the pool)."""
        with self._lock:
            return len(self._returned) + len(self._extra) + len(self._outstanding) + len(self._delivered)

    def requeue_consumer(self, consumer: str) -> int:
        """Hand out again, first, every task ``consumer`` held (it died); returns how many. The
        consumer gets nothing more (a long poll of its still waiting here included)."""
        with self._lock:
            self._gone.add(consumer)
            keys = [k for k, (c, _) in self._outstanding.items() if c == consumer]
            for key in keys:
                self._returned.appendleft(self._outstanding.pop(key)[1])
            self._lock.notify_all()
        return len(keys)

    @quick
    def outstanding(self) -> dict[str, int]:
        """Outstanding tasks per consumer."""
        with self._lock:
            counts: dict[str, int] = {}
            for consumer, _ in self._outstanding.values():
                counts[consumer] = counts.get(consumer, 0) + 1
            return counts

    def is_finished(self) -> bool:
        with self._lock:
            return not self._returned and not self._extra and self._fresh_exhausted()

    def can_return_item(self) -> bool:
        with self._lock:
            if self._returned or self._extra:
                return True
            if self._budget is not None and self._budget <= 0:
                return False
            return not self._fresh_exhausted()

    def reset(self) -> None:
        with self._lock:
            self._returned.clear()
            self._extra.clear()
            self._outstanding.clear()
            self._delivered.clear()
            self._issued_fresh = 0
            self._start_epoch(0)

    def add_item_front(self, item: dict[str, Any]) -> None:
        with self._lock:
            self._outstanding.pop(task_key(item), None)
            self._returned.appendleft(item)
            self._lock.notify_all()

    def add_item_back(self, item: dict[str, Any]) -> None:
        with self._lock:
            self._extra.append(item)
            self._lock.notify_all()

    # --- dispatch budget (written by the rollout scheduler only) ---------------------------------
    def set_dispatch_budget(self, budget: int | None) -> None:
        """Allow ``budget`` more fresh tasks (None: unlimited). Returned tasks are never held back."""
        with self._lock:
            self._budget = budget
            self._lock.notify_all()

    def add_dispatch_budget(self, items: int) -> None:
        """Allow ``items`` more fresh tasks on top of what is left (async modes open one batch at a time)."""
        with self._lock:
            self._budget = (self._budget or 0) + items
            self._lock.notify_all()

    @quick
    def get_skipped_rows(self) -> int:
        return self.skipped_rows

    @quick
    def get_filtered_long_prompts(self) -> int:
        """Prompts left out at load time for being longer than rollout_worker.max_prompt_length."""
        return self.filtered_long_prompts

    # --- checkpointing --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "epoch": self._epoch,
                "cursor": self._cursor,
                "repeat_index": self._repeat_index,
                "issued_fresh": self._issued_fresh,
                "num_rows": len(self._rows),
                # tasks out (or done but not trained) at save time are handed out again after a resume
                "returned": [task for _, task in self._outstanding.values()]
                + list(self._delivered.values())
                + list(self._returned),
                "extra": list(self._extra),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_rows"] != len(self._rows):
            raise ValueError(
                f"data loader state was saved for {state['num_rows']} rows but the data now has {len(self._rows)}"
            )
        with self._lock:
            self._start_epoch(int(state["epoch"]))
            self._cursor = int(state["cursor"])
            self._repeat_index = int(state["repeat_index"])
            self._issued_fresh = int(state["issued_fresh"])
            self._returned = deque(state["returned"])
            self._extra = deque(state["extra"])
