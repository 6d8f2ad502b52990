"""On-policy distillation end to end: ``python -m launch.train algorithm=opd`` with the model of a
finished default run as the teacher takes a fresh student most of the way to the teacher's held-out
accuracy in 15 steps (GRPO alone is at ~0.45-0.6 there) — with the teacher in the process, on its own
ranks of an MPI job, and as a worker group of a standalone API server beside the student's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, independent_eval, run_train
from tests.test_mpi import mpirun
from tests.test_train_service import api_server, env, start_workers, stop_group, workers_log_tail

pytestmark = pytest.mark.e2e
__all__ = ["api_server"]  # the fixture, imported for the standalone test
STEPS = 15


@pytest.fixture(scope="module")
def teacher_model(default_run: tuple[Path, subprocess.CompletedProcess]) -> str:
    """The model of a finished default run (50 steps of GRPO, seed 7)."""
    run_dir, proc = default_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(run_dir / "checkpoints" / "global_step_50" / "model")


def opd_args(teacher: str, run_dir: Path) -> list[str]:
    return [
        "algorithm=opd",
        f"algorithm.teacher_model_path={teacher}",
        f"train_worker.total_train_steps={STEPS}",
        f"run_dir={run_dir}",
        "seed=7",
        "logger.backend=[]",
    ]


def held_out_accuracy(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["val/accuracy"] for r in rows if "val/accuracy" in r]


def check_distilled(run_dir: Path, teacher: str) -> None:
    """In 15 steps the fresh student closes at least 80% of the gap from its own start to the teacher's
    held-out accuracy, in the run's validation and by an independent greedy evaluation of its last
    checkpoint; the reverse KL to the teacher fell. The teacher is a 50-step GRPO run, which ends
    anywhere from ~0.83 to 1.0 by scheduling; a student ends ~0.12 under a 0.83 teacher and ~0.03 under
    a 1.0 one, so the bar is a share of the teacher's gain rather than a fixed gap (GRPO alone is at
    ~0.45-0.6 after 15 steps: under 80% of either)."""
    teacher_accuracy = held_out_accuracy(Path(teacher).parents[2])[-1]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    bar = val[0] + 0.8 * (teacher_accuracy - val[0])
    assert val[0] <= 0.3 and val[-1] >= bar, (val, bar)
    kl = [r["train/opd_reverse_kl"] for r in rows if "train/opd_reverse_kl" in r]
    assert len(kl) == STEPS and kl[-1] < 0.5 * kl[0], kl
    result = independent_eval(run_dir)
    assert result["checkpoint"].endswith(f"global_step_{STEPS}") and result["accuracy"] >= bar, (result, bar)


def test_opd_with_the_teacher_in_the_process(teacher_model: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "opd"
    proc = run_train(opd_args(teacher_model, run_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_distilled(run_dir, teacher_model)


def test_opd_with_the_teacher_on_its_own_ranks_under_mpirun(teacher_model: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "opd_mpi"
    proc = subprocess.run(
        mpirun(4, opd_args(teacher_model, run_dir)), cwd=REPO, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = json.loads((run_dir / "logs" / "ranks.json").read_text())
    assert [(r["group"], r["modules"]) for r in ranks[1:]] == [
        ("trainer", ["trainer_rank_0"]),
        ("teacher", ["teacher_rank_0"]),
        ("rollout", ["rollout_worker", "inference_service"]),
    ]
    check_distilled(run_dir, teacher_model)


def test_opd_with_student_and_teacher_groups_on_one_api_server(
    api_server: str, teacher_model: str, tmp_path: Path
) -> None:
    student = start_workers(
        api_server, "student", tmp_path
    )  # 2 FSDP ranks (their own torch.distributed group)
    teacher = start_workers(api_server, "teacher", tmp_path, backend="single", nproc=1)
    run_dir = tmp_path / "opd_service"
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "launch.train",
                *opd_args(teacher_model, run_dir),
                "service.train_service.backend=direct-zmq",
                f"service.train_service.url={api_server}",
                "service.train_service.identifier=student",
                "service.train_service.engine=fsdp",
                "service.train_service.world_size=2",
                "service.train_service.teacher_service.backend=direct-zmq",
            ],
            cwd=REPO,
            env=env(),
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        check_distilled(run_dir, teacher_model)
    finally:
        stop_group(student, api_server, "student")
        stop_group(teacher, api_server, "teacher")
    assert student.returncode == 0, workers_log_tail(tmp_path, "student")
    assert teacher.returncode == 0, workers_log_tail(tmp_path, "teacher")
