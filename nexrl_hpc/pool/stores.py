"""Trajectory stores: where a pool instance keeps trajectories until they are released as a batch.

- ``SimpleTrajectoryStore``: no grouping; every trajectory is releasable at once.
- ``GroupedTrajectoryStore``: grouped by one key; a group becomes releasable when it has ``group_size``.
- ``HierarchicalTrajectoryStore``: nested by several keys; a leaf group is released when complete.
Released trajectories keep their group together, so a batch never splits a GRPO group. A grouped
store can hold back complete groups that ``keep_group`` rejects (DAPO's dynamic sampling): the pool
collects them with ``pop_filtered`` and decides (refill, or ``release_group`` after all).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from nexrl_hpc.types import PutStatus, Trajectory


class TrajectoryStore:
    """Interface: ``add`` returns SUCCESS or FAIL; ``take`` pops up to n released trajectories."""

    def add(self, trajectory: Trajectory) -> PutStatus:
        raise NotImplementedError

    def num_ready(self) -> int:
        raise NotImplementedError

    def num_pending(self) -> int:
        """Trajectories held in incomplete groups."""
        raise NotImplementedError

    def take(self, max_items: int) -> list[Trajectory]:
        raise NotImplementedError

    def is_empty(self) -> bool:
        return self.num_ready() == 0 and self.num_pending() == 0

    def pending_groups(self) -> dict[Any, int]:
        return {}

    def pop_filtered(self) -> list[list[Trajectory]]:
        """Complete groups ``keep_group`` rejected since the last call."""
        return []

    def release_group(self, group: list[Trajectory]) -> None:
        """Release a complete group (one ``pop_filtered`` returned) for batching after all."""
        raise NotImplementedError


KeepGroup = Callable[[list[Trajectory]], bool]


class _ReleasedGroups:
    """Complete groups waiting for a batch; ``take`` hands out whole groups only."""

    def __init__(self) -> None:
        self._groups: deque[list[Trajectory]] = deque()
        self._count = 0

    def push(self, group: list[Trajectory]) -> None:
        self._groups.append(group)
        self._count += len(group)

    def __len__(self) -> int:
        return self._count

    def take(self, max_items: int) -> list[Trajectory]:
        out: list[Trajectory] = []
        while self._groups and len(out) + len(self._groups[0]) <= max_items:
            group = self._groups.popleft()
            self._count -= len(group)
            out.extend(group)
        return out


class SimpleTrajectoryStore(TrajectoryStore):
    def __init__(self) -> None:
        self._ready: deque[Trajectory] = deque()

    def add(self, trajectory: Trajectory) -> PutStatus:
        self._ready.append(trajectory)
        return PutStatus.SUCCESS

    def num_ready(self) -> int:
        return len(self._ready)

    def num_pending(self) -> int:
        return 0

    def take(self, max_items: int) -> list[Trajectory]:
        n = min(max_items, len(self._ready))
        return [self._ready.popleft() for _ in range(n)]


class _GroupRelease(TrajectoryStore):
    """What the grouped stores share: complete groups go to the released queue or, rejected by
    ``keep_group``, to the filtered list."""

    def __init__(self, keep_group: KeepGroup | None) -> None:
        self._released = _ReleasedGroups()
        self._keep_group = keep_group
        self._filtered: list[list[Trajectory]] = []

    def _complete(self, group: list[Trajectory]) -> None:
        if self._keep_group is None or self._keep_group(group):
            self._released.push(group)
        else:
            self._filtered.append(group)

    def pop_filtered(self) -> list[list[Trajectory]]:
        filtered, self._filtered = self._filtered, []
        return filtered

    def release_group(self, group: list[Trajectory]) -> None:
        self._released.push(group)

    def num_ready(self) -> int:
        return len(self._released)

    def take(self, max_items: int) -> list[Trajectory]:
        return self._released.take(max_items)


class GroupedTrajectoryStore(_GroupRelease):
    def __init__(self, key: str, group_size: int, keep_group: KeepGroup | None = None) -> None:
        super().__init__(keep_group)
        self._key = key
        self._group_size = group_size
        self._open: dict[Any, list[Trajectory]] = {}
        self._pending = 0

    def add(self, trajectory: Trajectory) -> PutStatus:
        fields: Mapping[str, Any] = trajectory  # the key is a configured name: any field, the task's too
        if self._key not in fields:
            return PutStatus.FAIL
        value = fields[self._key]
        group = self._open.setdefault(value, [])
        group.append(trajectory)
        self._pending += 1
        if len(group) >= self._group_size:
            del self._open[value]
            self._pending -= len(group)
            self._complete(group)
        return PutStatus.SUCCESS

    def num_pending(self) -> int:
        return self._pending

    def pending_groups(self) -> dict[Any, int]:
        return {k: len(v) for k, v in self._open.items()}


class HierarchicalTrajectoryStore(_GroupRelease):
    """Nested dicts keyed by ``key_list[0]``, then ``key_list[1]``, ...; leaves are groups."""

    def __init__(self, key_list: list[str], group_size: int, keep_group: KeepGroup | None = None) -> None:
        super().__init__(keep_group)
        self._keys = list(key_list)
        self._group_size = group_size
        self._root: dict[Any, Any] = {}
        self._pending = 0

    def add(self, trajectory: Trajectory) -> PutStatus:
        fields: Mapping[str, Any] = trajectory  # configured names: any field, the task's too
        if any(k not in fields for k in self._keys):
            return PutStatus.FAIL
        path = [fields[k] for k in self._keys]
        parents = [self._root]
        node = self._root
        for value in path[:-1]:
            node = node.setdefault(value, {})
            parents.append(node)
        leaf = node.setdefault(path[-1], [])
        leaf.append(trajectory)
        self._pending += 1
        if len(leaf) >= self._group_size:
            del node[path[-1]]
            self._pending -= len(leaf)
            self._complete(leaf)
            # prune empty parents so the hierarchy does not grow without bound
            for depth in range(len(path) - 2, -1, -1):
                if parents[depth + 1]:
                    break
                del parents[depth][path[depth]]
        return PutStatus.SUCCESS

    def num_pending(self) -> int:
        return self._pending

    def pending_groups(self) -> dict[Any, int]:
        out: dict[Any, int] = {}

        def walk(node: dict[Any, Any], prefix: tuple[Any, ...]) -> None:
            for key, child in node.items():
                if isinstance(child, list):
                    out[prefix + (key,)] = len(child)
                else:
                    walk(child, prefix + (key,))

        walk(self._root, ())
        return out


def create_store(
    key_list: list[str], group_size: int, keep_group: KeepGroup | None = None
) -> TrajectoryStore:
    """Store type from the config: no keys -> simple, one key -> grouped, several -> hierarchical.
    ``keep_group`` (grouped stores only; the config checks require a key) filters complete groups."""
    if not key_list:
        return SimpleTrajectoryStore()
    if len(key_list) == 1:
        return GroupedTrajectoryStore(key_list[0], group_size, keep_group)
    return HierarchicalTrajectoryStore(key_list, group_size, keep_group)
