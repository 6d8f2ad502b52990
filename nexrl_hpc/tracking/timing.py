"""The step-time breakdown: the trainer's timeline cut at each metrics line, every moment in one part.

Why on the trainer's timeline: the step time a user feels is the time between two trainer lines
(``timing/step_s``); in the async modes generation overlaps training, so a part per module would
not add up. Here every second between two lines is in exactly one ``timing/*`` part of
``TIMING_PARTS``, and they sum to ``timing/step_s`` (``timing/other_s`` is the remainder: the
trainer's own bookkeeping). Where the trainer *waits* (for its next batch, for the engines to
load its weights), the wait is split by what ran meanwhile, from intervals on the wall clock
that the other modules report: the batch's generation first, then its reward scoring, then a
validation (it runs beside the next batch's rollouts, so a trainer waits for it only when the
batch is in and the next version must wait for the validation's end), and what is left is
``timing/wait_s`` (hand-offs, the algorithm, queues).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable, Sequence

Interval = tuple[float, float]

# the parts of timing/step_s, in the order of a step (docs/architecture.md#seeing-a-run)
TIMING_PARTS = (
    "timing/generation_s",
    "timing/reward_s",
    "timing/validation_s",
    "timing/wait_s",
    "timing/old_log_prob_s",
    "timing/teacher_log_prob_s",
    "timing/update_s",
    "timing/export_s",
    "timing/weight_sync_s",
    "timing/checkpoint_s",
    "timing/other_s",
)
# split off a wait for a batch in this order of precedence; the rest of the wait is timing/wait_s
_BATCH_WAIT = ("timing/generation_s", "timing/reward_s", "timing/validation_s")


def merge(intervals: Iterable[Sequence[float]]) -> list[Interval]:
    """Sorted, non-overlapping intervals covering the same time (empty ones dropped)."""
    out: list[Interval] = []
    for start, end in sorted((float(s), float(e)) for s, e in intervals if e > s):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def rollout_intervals(times: Sequence[Sequence[float] | None]) -> dict[str, list[Interval]]:
    """A batch's generation and reward-scoring time, from each trajectory's ``rollout_times``
    ([started, generated, scored], wall clock; None: a trajectory that carries none)."""
    stamped = [t for t in times if t is not None and len(t) == 3]
    return {
        "generation": merge((t[0], t[1]) for t in stamped),
        "reward": merge((t[1], t[2]) for t in stamped),
    }


def _covered(points: Sequence[float], starts: list[list[float]], layers: list[list[Interval]]) -> list[int]:
    """For each elementary piece between consecutive ``points``: the index of the first layer that
    covers it (len(layers) when none does)."""
    found = []
    for a, b in zip(points, points[1:]):
        mid = (a + b) / 2
        for i, layer in enumerate(layers):
            k = bisect.bisect_right(starts[i], mid) - 1
            if k >= 0 and layer[k][1] > mid:
                found.append(i)
                break
        else:
            found.append(len(layers))
    return found


def split_wait(
    seconds: float, wall: Interval, layers: Sequence[Sequence[Interval]]
) -> tuple[list[float], float]:
    """Split a wait of ``seconds`` (monotonic) spanning ``wall`` by merged interval ``layers``
    (earlier layers win where they overlap): the seconds of each layer, and the rest. The parts
    sum to ``seconds`` exactly (the wall clock only says which fraction is which)."""
    start, end = wall
    if end <= start or seconds <= 0:
        return [0.0] * len(layers), max(seconds, 0.0)
    clipped = [[(max(s, start), min(e, end)) for s, e in layer if e > start and s < end] for layer in layers]
    points = sorted({start, end, *(x for layer in clipped for iv in layer for x in iv)})
    starts = [[s for s, _ in layer] for layer in clipped]
    owners = _covered(points, starts, clipped)
    share = [0.0] * (len(layers) + 1)
    for (a, b), owner in zip(zip(points, points[1:]), owners):
        share[owner] += b - a
    scale = seconds / (end - start)
    parts = [s * scale for s in share[:-1]]
    return parts, seconds - sum(parts)


class StepTimeline:
    """The trainer thread's marks between two metrics lines. The trainer calls ``begin_wait`` /
    ``end_wait`` around waiting for a batch, ``waited`` for a call it waited in, ``add`` for its own
    work, and ``line`` when it writes the step's line."""

    def __init__(self) -> None:
        self._line_at = time.monotonic()
        self._parts: dict[str, float] = dict.fromkeys(TIMING_PARTS, 0.0)
        self._waits: list[tuple[float, Interval]] = []  # waits for a batch: (seconds, wall interval)
        self._calls: list[tuple[str, float, Interval]] = []  # calls waited in: (part, seconds, wall)
        self._wait_from: tuple[float, float] | None = None

    def start(self) -> None:
        """The trainer loop starts: the first line's window opens, waiting for the first batch."""
        self._line_at = time.monotonic()
        self.begin_wait()

    def begin_wait(self) -> None:
        self._wait_from = (time.monotonic(), time.time())

    def end_wait(self) -> None:
        if self._wait_from is not None:
            mono, wall = self._wait_from
            self._waits.append((time.monotonic() - mono, (wall, time.time())))
            self._wait_from = None

    def add(self, part: str, seconds: float) -> None:
        self._parts[part] += seconds

    def waited(self, part: str, seconds: float, wall: Interval) -> None:
        """A call the trainer waited in, ``part`` unless a validation ran meanwhile."""
        self._calls.append((part, seconds, wall))

    def wall_since(self) -> float:
        """The earliest wall-clock time a part of the open window may overlap."""
        walls = [w[0] for _, w in self._waits] + [w[0] for _, _, w in self._calls]
        return min(walls) if walls else time.time()

    def line(self, validations: Sequence[Interval], rollouts: dict[str, list[Interval]]) -> dict[str, float]:
        """The window's parts (``TIMING_PARTS`` and ``timing/step_s``); the next window opens now."""
        now = time.monotonic()
        parts = dict(self._parts)
        validation = merge(validations)
        layers = [rollouts.get("generation", []), rollouts.get("reward", []), validation]
        for seconds, wall in self._waits:
            shares, rest = split_wait(seconds, wall, layers)
            for key, share in zip(_BATCH_WAIT, shares):
                parts[key] += share
            parts["timing/wait_s"] += rest
        for part, seconds, wall in self._calls:
            (share,), rest = split_wait(seconds, wall, [validation])
            parts["timing/validation_s"] += share
            parts[part] += rest
        step_s = now - self._line_at
        parts["timing/other_s"] = step_s - sum(v for k, v in parts.items() if k != "timing/other_s")
        parts["timing/step_s"] = step_s
        self._line_at = now
        self._parts = dict.fromkeys(TIMING_PARTS, 0.0)
        self._waits, self._calls = [], []
        return parts
