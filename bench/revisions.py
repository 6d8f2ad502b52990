"""The same benchmarks on two revisions of the code, interleaved in one run: did a change move a number?

    python bench/revisions.py --base f9b1a52 --runs 3 -- pipeline.py --steps 20 :: rpc.py --calls 20000

Each revision is checked out into a temporary git worktree and every bench runs from that tree (its
own ``nexrl_hpc``, configs and bench script, put first on PYTHONPATH), alternating base / head
``--runs`` times so that drift of the machine hits both alike. Every markdown table a bench prints is
read back; each numeric cell becomes one row of the result: the median of each revision's runs and
the ratio head / base. A behaviour-free restructuring should leave every ratio within the spread
of the runs (printed beside it).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a number with an optional unit, optionally followed by a bracketed second figure ("2.41 (2.49)")
_NUMBER = re.compile(r"^[~≈]?\s*(-?[\d,]*\.?\d+)\s*(µs|us|ms|s|x|%|/s|GB/s|MB/s)?(\s*\(.*\))?$")


def table_numbers(output: str) -> dict[tuple[str, str], float]:
    """(row label, column header) -> value for every numeric cell of the markdown tables printed."""
    found: dict[tuple[str, str], float] = {}
    header: list[str] | None = None
    for line in output.splitlines():
        line = line.strip()
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if header is None:
            header = cells
            continue
        if all(set(c) <= set("-: ") for c in cells):
            continue  # the separator row
        for column, cell in zip(header[1:], cells[1:]):
            match = _NUMBER.match(cell.replace("**", ""))
            if match:
                found[(cells[0], column)] = float(match.group(1).replace(",", ""))
    return found


def worktree(rev: str, where: str) -> str:
    path = os.path.join(where, rev.replace("/", "_"))
    subprocess.run(["git", "worktree", "add", "--detach", "-q", path, rev], cwd=REPO, check=True)
    return path


def run_bench(tree: str, command: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": tree}
    script = os.path.join(tree, "bench", command[0])
    done = subprocess.run(
        [sys.executable, script, *command[1:]], cwd=tree, env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"{command[0]} failed in {tree} (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", required=True, help="the revision to compare against (e.g. main~3, a sha)")
    parser.add_argument("--head", default="HEAD", help="the revision under test (default: HEAD)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each bench per revision (interleaved)")
    parser.add_argument("benches", nargs=argparse.REMAINDER, help="-- BENCH.py ARGS [:: BENCH.py ARGS ...]")
    args = parser.parse_args()
    words = [w for w in args.benches if w != "--"]
    commands = [c for c in (" ".join(words)).split("::") if c.strip()]
    if not commands:
        parser.error("name at least one bench: -- pipeline.py --steps 20 :: rpc.py")
    with tempfile.TemporaryDirectory(prefix="nexrl_revisions_") as where:
        trees = {"base": worktree(args.base, where), "head": worktree(args.head, where)}
        try:
            for command in commands:
                argv = command.split()
                values: dict[str, dict[tuple[str, str], list[float]]] = {
                    side: defaultdict(list) for side in trees
                }
                for _ in range(args.runs):
                    for side, tree in trees.items():
                        for key, value in table_numbers(run_bench(tree, argv)).items():
                            values[side][key].append(value)
                print(
                    f"\n### {command.strip()} — {args.runs} runs each, base {args.base}, head {args.head}\n"
                )
                print("| row | column | base median (min-max) | head median (min-max) | head / base |")
                print("|---|---|---|---|---|")
                for key in values["base"]:
                    base, head = values["base"][key], values["head"].get(key)
                    if not head:
                        continue
                    b, h = statistics.median(base), statistics.median(head)
                    ratio = f"{h / b:.2f}x" if b else "n/a"
                    print(
                        f"| {key[0]} | {key[1]} | {b:,.4g} ({min(base):,.4g}-{max(base):,.4g}) "
                        f"| {h:,.4g} ({min(head):,.4g}-{max(head):,.4g}) | {ratio} |"
                    )
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=REPO, check=False)


if __name__ == "__main__":
    main()
