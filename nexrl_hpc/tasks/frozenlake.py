"""FrozenLake, the standard multi-turn agent example: walk a frozen grid to the goal without falling in.

The map is ``size`` x ``size`` cells: frozen (``F``), holes (``H``), a start (``S``) and a goal
(``G``) both placed at random, each cell frozen with probability ``p``; a map is kept only when a
path of frozen cells joins start and goal, so every map is solvable. Maps are generated from
``(seed, size, p)`` (Python's ``random``, the same map on every machine), so a data row holds only
those numbers and the environment rebuilds the map.

One model turn is one move. The model sees the grid rendered as text, one row per line::

    _P__
    _O__
    ___G
    O___

(``P`` the player, ``_`` frozen, ``O`` a hole, ``G`` the goal; ``X`` / ``√`` mark the player in a
hole / on the goal in the last observation, which ends the episode). It answers ``L``, ``D``, ``R``
or ``U`` (also ``Left``/``Down``/``Right``/``Up`` or ``1``-``4``, optionally in a ```` ``` ```` block,
so an instruction-following LLM can play). Anything else is an invalid action: the player stays,
the turn is used up. Reward 1 on reaching the goal, else 0. The episode ends in a hole, on the goal
or after ``max_steps`` moves. On a slippery lake a move goes the intended way with probability 1/3
and to either side of it otherwise.

The char model's alphabet needs only ``P_OG``, the newline and ``LDRU``. ``format_warmup`` teaches
the fresh model the syntax (one letter, then EOS, every turn) with the letter left at chance, so RL
starts from the random policy and has to learn to read the grid.
"""

from __future__ import annotations

import random
import re
from collections import deque
from typing import Any

from nexrl_hpc.agents.agent import BaseAgent
from nexrl_hpc.agents.environments import BaseEnv
from nexrl_hpc.agents.types import ModelOutput

INVALID = 0
ACTION_NAMES = {1: "Left", 2: "Down", 3: "Right", 4: "Up"}  # 0: invalid (no move)
LETTERS = "LDRU"  # the compact syntax: letter i + 1 is action i + 1
MOVES = {1: (0, -1), 2: (1, 0), 3: (0, 1), 4: (-1, 0)}  # action -> (row, column) step
ALPHABET = "P_OG\n" + LETTERS  # what a char tokenizer needs to play
_SLIPS = {1: (4, 2), 2: (1, 3), 3: (2, 4), 4: (3, 1)}  # action -> the two perpendicular actions
_WORDS = {
    **{name.lower(): a for a, name in ACTION_NAMES.items()},
    **{letter.lower(): i + 1 for i, letter in enumerate(LETTERS)},
    **{str(a): a for a in ACTION_NAMES},
}
_BLOCK = re.compile(r"```(?:\w*\n)?(.*?)```", re.DOTALL)

Map = list[str]  # rows of S F H G


def find(desc: Map, char: str) -> tuple[int, int]:
    """The cell holding ``char`` (S or G)."""
    for r, row in enumerate(desc):
        if char in row:
            return r, row.index(char)
    raise ValueError(f"the map has no {char!r}: {desc}")


def shortest_path(desc: Map) -> str:
    """One shortest move sequence from S to G (letters ``LDRU``); "" when there is none."""
    size, start, goal = len(desc), find(desc, "S"), find(desc, "G")
    came: dict[tuple[int, int], tuple[tuple[int, int], int] | None] = {start: None}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        if cell == goal:
            moves = []
            while came[cell] is not None:
                cell, action = came[cell]  # type: ignore[misc]
                moves.append(LETTERS[action - 1])
            return "".join(reversed(moves))
        for action, (dr, dc) in MOVES.items():
            nxt = (cell[0] + dr, cell[1] + dc)
            if 0 <= nxt[0] < size and 0 <= nxt[1] < size and nxt not in came and desc[nxt[0]][nxt[1]] != "H":
                came[nxt] = (cell, action)
                queue.append(nxt)
    return ""


def generate_map(seed: int, size: int, p: float) -> Map:
    """A random solvable map: each cell frozen with probability ``p``, start and goal at random cells.

    Draws until one is solvable; that ends for any ``p`` > 0 (start and goal drawn next to each
    other is a solvable map)."""
    if size < 2:
        raise ValueError(f"a FrozenLake map needs size >= 2, got {size}")
    if not 0.0 < p <= 1.0:
        raise ValueError(f"the frozen probability p must be in (0, 1], got {p}")
    rng = random.Random(seed)
    while True:
        cells = [["F" if rng.random() < p else "H" for _ in range(size)] for _ in range(size)]
        start = (rng.randrange(size), rng.randrange(size))
        goal = start
        while goal == start:
            goal = (rng.randrange(size), rng.randrange(size))
        cells[start[0]][start[1]] = "S"
        cells[goal[0]][goal[1]] = "G"
        desc = ["".join(row) for row in cells]
        if shortest_path(desc):
            return desc


def render(desc: Map, player: tuple[int, int]) -> str:
    """The grid as the model sees it: ``P`` player, ``_`` frozen, ``O`` hole, ``G`` goal; one row a line."""
    lines = []
    for r, row in enumerate(desc):
        chars = []
        for c, cell in enumerate(row):
            if (r, c) == player:
                chars.append({"H": "X", "G": "√"}.get(cell, "P"))
            else:
                chars.append({"H": "O", "G": "G"}.get(cell, "_"))
        lines.append("".join(chars))
    return "\n".join(lines) + "\n"


def parse_action(text: str) -> int:
    """1-4 (Left, Down, Right, Up) from a response; 0 (invalid) when it names no single action.

    The last ```` ``` ```` block counts when there is one; its content (or the whole response),
    stripped and case-folded, must be a letter, a name or a number of an action.
    """
    blocks = _BLOCK.findall(text)
    candidate = (blocks[-1] if blocks else text).strip().lower()
    return _WORDS.get(candidate, INVALID)


def _move(desc: Map, cell: tuple[int, int], action: int) -> tuple[int, int]:
    dr, dc = MOVES[action]
    r, c = cell[0] + dr, cell[1] + dc
    return (r, c) if 0 <= r < len(desc) and 0 <= c < len(desc) else cell  # a wall: stay


def random_policy_success(desc: Map, max_steps: int, is_slippery: bool = False) -> float:
    """The exact probability that uniformly random moves reach the goal within ``max_steps``.

    Why: the baseline a learnt policy is measured against on the same held-out maps.
    """
    goal = find(desc, "G")
    cells = [(r, c) for r in range(len(desc)) for c in range(len(desc)) if desc[r][c] in "SF"]
    value = dict.fromkeys(cells, 0.0)  # success probability with k moves left, k = 0
    for _ in range(max_steps):
        nxt_value = {}
        for cell in cells:
            total = 0.0
            for action in MOVES:
                outcomes = [action, *_SLIPS[action]] if is_slippery else [action]
                for actual in outcomes:
                    to = _move(desc, cell, actual)
                    reached = 1.0 if to == goal else (0.0 if desc[to[0]][to[1]] == "H" else value[to])
                    total += reached / len(outcomes)
            nxt_value[cell] = total / len(MOVES)
        value = nxt_value
    return value[find(desc, "S")]


def task_map(task: dict[str, Any]) -> Map:
    """The task's map: ``desc`` (rows of S F H G) when given, else rebuilt from ``seed``/``size``/``p``."""
    if task.get("desc") is not None:
        desc = [str(row) for row in task["desc"]]
        if any(len(row) != len(desc) for row in desc) or any(set(row) - set("SFHG") for row in desc):
            raise ValueError(f"task 'desc' must be square rows of S F H G, got {desc}")
        find(desc, "S"), find(desc, "G")
        return desc
    missing = [k for k in ("seed", "size", "p") if k not in task]
    if missing:
        raise KeyError(f"a FrozenLake task needs 'desc' or seed, size and p; missing {missing}")
    return generate_map(int(task["seed"]), int(task["size"]), float(task["p"]))


class FrozenLakeEnv(BaseEnv):
    """The Gym interface over one map per task; ``max_steps`` moves at most (invalid ones count).

    ``info`` of each step: ``action_is_valid``, ``action_is_effective`` (the player moved),
    ``is_correct`` (on the goal), ``fell_in_hole``, ``steps``. A slippery task's slips come from a
    generator seeded by the task's identity (map seed, group, sample index), so an episode replays
    exactly and the samples of one group slip differently.
    """

    def __init__(self, max_steps: int, task: dict[str, Any] | None = None) -> None:
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        self.max_steps = max_steps
        self.task = task
        self.desc: Map = []
        self.player = (0, 0)
        self.steps = 0
        self.done = False
        self.is_slippery = False
        self._slip_rng = random.Random(0)

    def reset(self, task: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        if task is not None:
            self.task = task
        if self.task is None:
            raise ValueError("FrozenLakeEnv.reset needs a task (none given, none at construction)")
        self.desc = task_map(self.task)
        self.player = find(self.desc, "S")
        self.steps = 0
        self.done = False
        self.is_slippery = bool(self.task.get("is_slippery", False))
        identity = [self.task.get(k) for k in ("seed", "group_id", "sample_index", "uid")]
        self._slip_rng = random.Random(repr(identity))
        return render(self.desc, self.player), {"size": len(self.desc), "is_slippery": self.is_slippery}

    def step(self, action: Any) -> tuple[Any, float, bool, dict[str, Any]]:
        if self.done:
            raise RuntimeError("FrozenLakeEnv.step called after the episode ended; call reset")
        if not self.desc:
            raise RuntimeError("FrozenLakeEnv.step called before reset")
        if isinstance(action, str):
            action = parse_action(action)
        valid = isinstance(action, int) and action in MOVES
        self.steps += 1
        before = self.player
        if valid:
            actual = self._slip_rng.choice([action, *_SLIPS[action]]) if self.is_slippery else action
            self.player = _move(self.desc, self.player, actual)
        cell = self.desc[self.player[0]][self.player[1]]
        on_goal, in_hole = cell == "G", cell == "H"
        self.done = on_goal or in_hole or self.steps >= self.max_steps
        info = {
            "action_is_valid": valid,
            "action_is_effective": self.player != before,
            "is_correct": on_goal,
            "fell_in_hole": in_hole,
            "steps": self.steps,
        }
        return render(self.desc, self.player), float(on_goal), self.done, info

    @staticmethod
    def is_multithread_safe() -> bool:
        return True  # state is per instance


class FrozenLakeAgent(BaseAgent):
    """Shows each grid as a user message and keeps the whole chat history; the action is 0-4.

    ``instruction`` is put before the first grid (the rules and answer format, for a model that
    reads them); the tiny char model plays without one.
    """

    def __init__(self, system_prompt: str | None = None, instruction: str = "") -> None:
        self.instruction = instruction
        super().__init__(system_prompt)

    def format_observation(self, observation: Any, first: bool) -> list[dict[str, Any]]:
        if not isinstance(observation, str):
            raise TypeError(f"FrozenLakeAgent shows rendered grids (str), got {type(observation).__name__}")
        return [{"role": "user", "content": (self.instruction if first else "") + observation}]

    def parse_action(self, text: str, output: ModelOutput | None) -> tuple[Any, str]:
        if output is not None and output.reasoning:
            return parse_action(output.content), output.reasoning
        return parse_action(text), ""


def generate_splits(params: dict[str, Any], seed: int) -> dict[str, list[dict[str, Any]]]:
    """``{"train": rows, "validation": rows}``: maps by seed, validation maps none of the training maps.

    A row: ``prompt`` (the first grid), ``seed``/``size``/``p``/``is_slippery`` (the map),
    ``answer`` (one shortest path), ``random_success`` (what uniformly random moves score on it
    within ``params.max_steps``: the baseline on the held-out maps).
    """
    size, p, max_steps = int(params["size"]), float(params["p"]), int(params["max_steps"])
    slippery = bool(params["is_slippery"])
    rng = random.Random(seed)
    seen: set[tuple[str, ...]] = set()

    def rows(n: int) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while len(out) < n:
            map_seed = rng.randrange(2**31)
            desc = generate_map(map_seed, size, p)
            if tuple(desc) in seen:
                continue
            seen.add(tuple(desc))
            out.append(
                {
                    "prompt": render(desc, find(desc, "S")),
                    "seed": map_seed,
                    "size": size,
                    "p": p,
                    "is_slippery": slippery,
                    "answer": shortest_path(desc),
                    "random_success": random_policy_success(desc, max_steps, slippery),
                }
            )
        return out

    validation = rows(int(params["val_size"]))
    return {"train": rows(int(params["train_size"])), "validation": validation}


def plan_reward(task: dict[str, Any], response: str) -> float:
    """The task as one turn: 1.0 when the response's moves (letters ``LDRU``) walk start to goal.

    Replayed without slipping; a character that is no move, or a hole on the way, scores 0.
    (The multi-turn environment scores itself; this is the task's ``reward_fn`` for
    ``rollout_worker.type=single_turn`` on the same rows.)
    """
    desc = task_map(task)
    cell, goal = find(desc, "S"), find(desc, "G")
    for char in response.strip():
        if char not in LETTERS:
            return 0.0
        cell = _move(desc, cell, LETTERS.index(char) + 1)
        if cell == goal:
            return 1.0
        if desc[cell[0]][cell[1]] == "H":
            return 0.0
    return 0.0


def format_warmup(
    model: Any,
    tokenizer: Any,
    seed: int,
    size: int,
    p: float,
    max_steps: int,
    steps: int,
    batch_size: int,
    lr: float,
    spread: float,
) -> None:
    """Teach the fresh model the episode SYNTAX only: after each grid one move letter, then EOS.

    The demonstrations are random walks on random maps, laid out as the rollout's chat template
    lays them out (grid, letter, EOS, next grid, ...). The letter position is trained to be *some*
    move (loss ``-log P(any of LDRU)``) plus ``spread`` times the letters' mean log-probability
    relative to the set, which keeps the choice near uniform; EOS is trained as it is; grids are
    context only. So the warmed-up model plays like the random policy (a GRPO group of identical
    choices would have no signal) and RL has to learn which move the grid calls for.
    """
    import torch

    vocab = tokenizer.get_vocab()
    missing = sorted(set(ALPHABET) - set(vocab))
    if missing:
        raise ValueError(f"the tokenizer has no token for {missing} (task.alphabet must hold {ALPHABET!r})")
    eos = int(tokenizer.eos_token_id)
    letters = torch.tensor([vocab[c] for c in LETTERS])
    rng = random.Random(seed)
    torch.manual_seed(seed)

    # a tiny model trains as fast on one thread, and one thread does not stall when the machine's
    # cores are shared (two threads stall each other under load)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        model.train()
        for _ in range(steps):
            batch = [_warmup_episode(rng, vocab, eos, size, p, max_steps) for _ in range(batch_size)]
            loss = _warmup_loss(model, batch, int(tokenizer.pad_token_id), letters, eos, spread)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    model.eval()


def _warmup_episode(
    rng: random.Random, vocab: dict[str, int], eos: int, size: int, p: float, max_steps: int
) -> tuple[list[int], list[int], list[int]]:
    """A random walk on a random map as token ids: (ids, positions predicting a letter, positions
    predicting EOS)."""
    env = FrozenLakeEnv(max_steps)
    observation, _ = env.reset({"seed": rng.randrange(2**31), "size": size, "p": p})
    ids: list[int] = []
    letter_at: list[int] = []
    eos_at: list[int] = []
    done = False
    while not done:
        ids += [vocab[c] for c in observation]
        action = rng.randrange(1, 5)
        letter_at.append(len(ids) - 1)
        ids.append(vocab[LETTERS[action - 1]])
        eos_at.append(len(ids) - 1)
        ids.append(eos)
        observation, _, done, _ = env.step(action)
    return ids, letter_at, eos_at


def _warmup_loss(
    model: Any,
    batch: list[tuple[list[int], list[int], list[int]]],
    pad_token_id: int,
    letters: Any,
    eos: int,
    spread: float,
) -> Any:
    """``format_warmup``'s loss on a batch of episodes: some move letter at letter positions (plus
    ``spread`` times the letters' mean log-probability relative to the set), EOS after it."""
    import torch

    batch_size = len(batch)
    width = max(len(row[0]) for row in batch)
    ids = torch.full((batch_size, width), pad_token_id)
    mask = torch.zeros((batch_size, width), dtype=torch.long)
    for b, (row, *_) in enumerate(batch):  # right-padded: positions start at 0
        ids[b, : len(row)] = torch.tensor(row)
        mask[b, : len(row)] = 1
    logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits, dim=-1)
    # (sequence, position) of every letter / EOS prediction
    rows_l = torch.tensor([b for b, (_, at, _) in enumerate(batch) for _ in at])
    pos_l = torch.tensor([t for _, at, _ in batch for t in at])
    rows_e = torch.tensor([b for b, (_, _, at) in enumerate(batch) for _ in at])
    pos_e = torch.tensor([t for _, _, at in batch for t in at])
    member = logp[rows_l, pos_l][:, letters]  # (letter positions, 4)
    in_set = torch.logsumexp(member, dim=-1)
    letter_terms = in_set + spread * (member - in_set[:, None]).mean(dim=-1)
    eos_terms = logp[rows_e, pos_e, eos]
    return -torch.cat([letter_terms, eos_terms]).mean()
