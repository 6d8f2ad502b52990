"""On-policy distillation's parts: the per-token advantage, the config checks, the teacher's
placement and the frozen teacher trainer (the whole runs: tests/test_opd.py)."""

from __future__ import annotations

import pytest
import torch

from nexrl_hpc.algorithm.distillation import distillation_advantages
from nexrl_hpc.config.validate import ConfigError
from nexrl_hpc.runtime.placement import PlacementError, plan_placement
from nexrl_hpc.trainer.policy_trainer import PolicyTrainer
from nexrl_hpc.trainer.worker import TrainWorker
from tests.conftest import compose_config
from tests.test_policy_trainer import make_batch


def test_the_advantage_is_the_negative_reverse_kl_per_token_plus_the_mixed_reward() -> None:
    student = torch.tensor([[-1.0, -2.0, -4.0], [-0.5, -7.0, -7.0]])
    teacher = torch.tensor([[-0.5, -3.0, -9.0], [-0.5, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    reward_adv = torch.tensor([[0.5, 0.5, 0.0], [-1.0, 0.0, 0.0]])
    adv, stats = distillation_advantages(student, teacher, mask, reward_adv, kl_coef=1.0, reward_coef=0.0)
    # -(log pi_s - log pi_t): -(-1 + 0.5) = 0.5, -(-2 + 3) = -1, -(−0.5 + 0.5) = 0; masked tokens 0
    assert torch.allclose(adv, torch.tensor([[0.5, -1.0, 0.0], [0.0, 0.0, 0.0]]))
    assert stats["train/opd_reverse_kl"] == pytest.approx((-0.5 + 1.0 + 0.0) / 3)
    assert stats["train/opd_reverse_kl_seq"] == pytest.approx((0.5 + 0.0) / 2)
    assert stats["train/opd_teacher_log_prob"] == pytest.approx((-0.5 - 3.0 - 0.5) / 3)
    mixed, _ = distillation_advantages(student, teacher, mask, reward_adv, kl_coef=2.0, reward_coef=1.0)
    assert torch.allclose(mixed, torch.tensor([[1.5, -1.5, 0.0], [-1.0, 0.0, 0.0]]))


def test_opd_without_a_teacher_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError) as err:
        compose_config(["algorithm=opd"])
    assert "algorithm.teacher_model_path" in str(err.value)
    with pytest.raises(ConfigError) as err:
        compose_config(["algorithm=opd", "algorithm.teacher_model_path=/nonexistent/teacher"])
    assert "algorithm.teacher_model_path: '/nonexistent/teacher': no such directory" in str(err.value)


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(
    chatml_model_dir: str, tiny_model_dir: str
) -> None:
    with pytest.raises(ConfigError) as err:
        compose_config(["algorithm=opd", f"algorithm.teacher_model_path={chatml_model_dir}"])
    text = str(err.value)
    assert f"algorithm.teacher_model_path: '{chatml_model_dir}'" in text
    assert "tokenizer differs from the student's" in text and "the tiny model of model.tiny" in text
    with pytest.raises(ConfigError) as err:  # a user's model as the student, the char model as teacher
        compose_config(
            [
                "algorithm=opd",
                f"algorithm.teacher_model_path={tiny_model_dir}",
                f"model.path={chatml_model_dir}",
            ]
        )
    assert f"model.path '{chatml_model_dir}'" in str(err.value)
    compose_config(
        ["algorithm=opd", f"algorithm.teacher_model_path={tiny_model_dir}"]
    )  # same tokenizer: fine


def test_the_teacher_gets_ranks_of_its_own_in_mpi_mode(tiny_model_dir: str) -> None:
    cfg = compose_config(
        [
            "launch_mode=mpi",
            "algorithm=opd",
            f"algorithm.teacher_model_path={tiny_model_dir}",
            "service.train_service.teacher_service.world_size=2",
            "service.train_service.teacher_service.engine=fsdp",
        ]
    )
    placement = plan_placement(cfg, 5)
    assert [r.group for r in placement.ranks] == ["driver", "trainer", "teacher", "teacher", "rollout"]
    assert all(not r.module_names for r in placement.ranks if r.group == "teacher")
    with pytest.raises(PlacementError) as err:
        plan_placement(cfg, 4)
    assert "2 teacher (service.train_service.teacher_service.world_size)" in str(err.value)


def test_a_standalone_teacher_needs_a_url_and_the_token(
    tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NEXRL_TRAIN_SERVICE_TOKEN", raising=False)
    with pytest.raises(ConfigError) as err:
        compose_config(
            [
                "algorithm=opd",
                f"algorithm.teacher_model_path={tiny_model_dir}",
                "service.train_service.teacher_service.backend=direct-zmq",
            ]
        )
    text = str(err.value)
    assert "service.train_service.teacher_service.url: backend=direct-zmq needs the API server's url" in text
    assert "service.train_service.token_env: the teacher's backend=direct-zmq" in text
    monkeypatch.setenv("NEXRL_TRAIN_SERVICE_TOKEN", "t")  # set, but guessable
    with pytest.raises(ConfigError) as err:
        compose_config(
            [
                "algorithm=opd",
                f"algorithm.teacher_model_path={tiny_model_dir}",
                "service.train_service.teacher_service.backend=direct-zmq",
                "service.train_service.teacher_service.url=http://127.0.0.1:9",
            ]
        )
    assert (
        "service.train_service.token_env: the teacher's backend=direct-zmq: the bearer token in the "
        "environment variable 'NEXRL_TRAIN_SERVICE_TOKEN' has 1 characters, fewer than 16" in str(err.value)
    )
    monkeypatch.setenv("NEXRL_TRAIN_SERVICE_TOKEN", "t" * 16)
    cfg = compose_config(
        [
            "launch_mode=mpi",
            "algorithm=opd",
            f"algorithm.teacher_model_path={tiny_model_dir}",
            "service.train_service.teacher_service.backend=direct-zmq",
            "service.train_service.teacher_service.url=http://127.0.0.1:9",
        ]
    )
    # a standalone teacher takes no ranks of the job
    assert [r.group for r in plan_placement(cfg, 3).ranks] == ["driver", "trainer", "rollout"]


def test_the_teacher_scores_like_the_same_model_and_refuses_to_train(tiny_model_dir: str) -> None:
    cfg = compose_config(["algorithm=opd", f"algorithm.teacher_model_path={tiny_model_dir}"])
    student, teacher = PolicyTrainer(tiny_model_dir), PolicyTrainer(tiny_model_dir)
    worker = TrainWorker(cfg, student, teacher)
    worker.initialize_workers()
    assert worker.teacher_service_config()["algorithm"]["kl_loss_coef"] == 0.0
    batch = make_batch()
    from_teacher = teacher.compute_log_prob({"batch": batch})["batch"]["old_log_probs"]
    from_student = student.compute_log_prob({"batch": batch})["batch"]["old_log_probs"]
    assert torch.equal(from_teacher, from_student)
    with pytest.raises(RuntimeError, match="distillation teacher"):
        teacher.update_actor({"batch": batch, "meta_info": {}})


def test_a_slurm_job_gets_a_component_for_the_teacher_ranks(tiny_model_dir: str) -> None:
    from nexrl_hpc.launcher.slurm import plan_components

    cfg = compose_config(
        [
            "launcher=slurm",
            "algorithm=opd",
            f"algorithm.teacher_model_path={tiny_model_dir}",
            "placement.resources.teacher.cpus_per_rank=2",
            "launcher.rollout_ranks=2",
        ]
    )
    world, components = plan_components(cfg)
    assert world == 5
    assert [(c.groups, c.ntasks, c.cpus_per_task) for c in components] == [
        (["driver", "trainer"], 2, 1),
        (["teacher"], 1, 2),
        (["rollout"], 2, 1),
    ]
