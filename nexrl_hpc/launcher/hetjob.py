"""submitit with heterogeneous jobs: one Slurm job of several components, one MPI world over them.

submitit has no hetjob support; ``HetSlurmExecutor`` adds it (a subclass, two pitfalls handled:
srun expands ``%j`` per component, so its log paths use ``${SLURM_JOB_ID}``; sacct names
components ``N+0``, ``N+1``). ``launcher.slurm`` decides the components from the placement.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import submitit
from submitit.slurm import slurm as submitit_slurm


@dataclass
class Component:
    """One Slurm (het)job component: ``ntasks`` ranks with the same resources."""

    groups: list[str]
    ntasks: int
    cpus_per_task: int
    gpus_per_task: int


class HetSlurmInfoWatcher(submitit_slurm.SlurmInfoWatcher):
    """sacct shows a heterogeneous job as ``N+0``, ``N+1``...: component 0 is the job."""

    def read_info(self, string: bytes | str) -> dict[str, dict[str, str]]:
        text = string.decode() if isinstance(string, bytes) else string
        lines = [ln for ln in text.splitlines() if not re.match(r"^\d+\+[1-9]\d*\|", ln)]
        return super().read_info("\n".join(re.sub(r"^(\d+)\+0\|", r"\1|", ln) for ln in lines))


class HetSlurmJob(submitit_slurm.SlurmJob):
    watcher = HetSlurmInfoWatcher(delay_s=60)


class HetSlurmExecutor(submitit.SlurmExecutor):
    """A SlurmExecutor whose job may have several components (one MPI world over all of them)."""

    job_class = HetSlurmJob
    _SIZING = (
        "#SBATCH --nodes=",
        "#SBATCH --ntasks-per-node=",
        "#SBATCH --cpus-per-task=",
        "#SBATCH --gpus-per-task=",
        "#SBATCH --gpus-per-node=",
    )

    def __init__(
        self,
        folder: str | Path,
        components: list[Component],
        job_sizing: dict[str, int] | None = None,
        **parameters: Any,
    ):
        super().__init__(folder=folder, max_num_timeout=1000)
        self._components = components
        self._job_sizing = job_sizing or {}  # one-component jobs: nodes, gpus_per_node, cpus_per_gpu
        self.update_parameters(**parameters)

    def _num_tasks(self) -> int:
        """submitit's hook (the job's task ids): one task per rank of every component."""
        return sum(c.ntasks for c in self._components)

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        lines = [
            ln
            for ln in super()._make_submission_file_text(command, uid).splitlines()
            if not ln.startswith(self._SIZING)
        ]
        # each component sizes itself; everything before the first "hetjob" line is component 0
        repeated = [
            ln
            for ln in lines
            if ln.startswith(
                ("#SBATCH --partition=", "#SBATCH --account=", "#SBATCH --qos=", "#SBATCH --time=")
            )
        ]
        sizing: list[str] = []
        for k, comp in enumerate(self._components):
            if k:
                sizing += ["#SBATCH hetjob", *repeated]
            sizing += _component_sizing(comp, self._job_sizing if len(self._components) == 1 else {})
        last_flag = max(i for i, ln in enumerate(lines) if ln.startswith("#SBATCH"))
        lines[last_flag + 1 : last_flag + 1] = sizing
        # srun would expand %j per component (component k's log path would not exist): use the job id
        srun = next(i for i, ln in enumerate(lines) if ln.startswith("srun "))
        line = lines[srun].replace("%j", "${SLURM_JOB_ID}").replace("'", '"')
        if len(self._components) > 1:
            line = line.replace("srun ", f"srun --het-group=0-{len(self._components) - 1} ", 1)
        lines[srun] = line
        return "\n".join(lines) + "\n"


def _component_sizing(comp: Component, job: dict[str, int]) -> list[str]:
    """The #SBATCH lines sizing one component; ``job`` (launcher.nodes / gpus_per_node /
    cpus_per_gpu) only for a job of one component. --cpus-per-gpu replaces --cpus-per-task
    (Slurm refuses both)."""
    lines = [f"#SBATCH --ntasks={comp.ntasks}"]
    if job.get("nodes"):
        lines.append(f"#SBATCH --nodes={job['nodes']}")
    if job.get("cpus_per_gpu"):
        lines.append(f"#SBATCH --cpus-per-gpu={job['cpus_per_gpu']}")
    else:
        lines.append(f"#SBATCH --cpus-per-task={comp.cpus_per_task}")
    if comp.gpus_per_task:
        lines.append(f"#SBATCH --gpus-per-task={comp.gpus_per_task}")
    if job.get("gpus_per_node"):
        lines.append(f"#SBATCH --gpus-per-node={job['gpus_per_node']}")
    return lines


def job_sizing(launcher: dict[str, Any]) -> dict[str, int]:
    """The set ones of launcher.nodes, gpus_per_node, cpus_per_gpu."""
    return {k: int(launcher[k]) for k in ("nodes", "gpus_per_node", "cpus_per_gpu") if launcher.get(k)}
