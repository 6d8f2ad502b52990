"""RewardService: the model reward served as a role of its own (``reward_model.placement=own_ranks``).

In mpi mode it runs on the ranks of the placement group ``reward`` (``reward_model.world_size`` of
them, Slurm resources ``placement.resources.reward``); rollout workers call ``score_batch`` through
the signed RPC (``execute(service.score_batch, ...)``), spread over the services by instance index.
In local mode it is one module of the run's process. A judge without ``base_url`` gets its own
local engine server (the ``nexrl_hpc.inference`` server on ``judge.model_path``), started by
``launch`` on this rank while the rest of the run starts, and SIGKILLed by ``abort``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from nexrl_hpc.config.schema import LocalInferenceConfig, RLTrainConfig
from nexrl_hpc.core.execute import long_poll
from nexrl_hpc.core.module import NexRLModule
from nexrl_hpc.inference.local_server import LocalInferenceServer
from nexrl_hpc.scoring.classifier import ClassifierScorer
from nexrl_hpc.scoring.judge import JudgeScorer

Scorer = ClassifierScorer | JudgeScorer


def judge_api_key(config: RLTrainConfig) -> str | None:
    """The key of a judge given by base_url: the environment variable ``judge.api_key_env`` names."""
    return os.environ.get(config["reward_model"]["judge"]["api_key_env"]) or None


def build_scorer(config: RLTrainConfig, base_url: str | None = None, api_key: str | None = None) -> Scorer:
    """The configured scorer; a judge talks to ``base_url`` (default: ``judge.base_url``)."""
    rm = config["reward_model"]
    if rm["type"] == "classifier":
        return ClassifierScorer(rm["classifier"])
    url = base_url or rm["judge"]["base_url"]
    if url is None:
        raise ValueError("reward_model.judge.base_url is null and no judge server was started")
    return JudgeScorer(rm["judge"], url, api_key if base_url else judge_api_key(config))


def judge_server_config(config: RLTrainConfig) -> LocalInferenceConfig:
    """The judge server's settings: the policy server's (service.inference_service.local), with
    ``reward_model.judge.local``'s threads, batch size and start-up timeout."""
    return {**config["service"]["inference_service"]["local"], **config["reward_model"]["judge"]["local"]}


class RewardService(NexRLModule):
    """Scores (prompt, response) pairs for the rollout workers: ``score_batch``."""

    def __init__(self, config: RLTrainConfig, run_dir: str) -> None:
        super().__init__()
        self._config = config
        self._run_dir = run_dir
        self._server: LocalInferenceServer | None = None
        self._scorer: Scorer | None = None

    def _runs_judge_server(self) -> bool:
        rm = self._config["reward_model"]
        return rm["type"] == "judge" and rm["judge"]["base_url"] is None

    def launch(self) -> None:
        """Start the judge's server (when this service runs one) without waiting for it."""
        if not self._runs_judge_server() or self._server is not None:
            return
        judge = self._config["reward_model"]["judge"]
        train = self._config["service"]["train_service"]
        self._server = LocalInferenceServer(
            str(judge["model_path"]),
            judge_server_config(self._config),
            os.path.join(self._run_dir, "logs"),
            judge["model"],
            device=train["device"],
            dtype=train["dtype"],
            log_name=f"{self._module_name}-judge.log",
            runtime=self._config["runtime"],
        )
        self._server.launch()

    @long_poll
    def wait_ready(self) -> str:
        """Load the scorer (the classifier's weights; the judge's server up); returns what it is."""
        if self._scorer is None:
            if self._server is not None:
                self._scorer = build_scorer(self._config, self._server.wait_ready(), self._server.api_key)
            else:
                self._scorer = build_scorer(self._config)
        return self.describe()

    def score_batch(
        self, prompts: Sequence[Any], responses: Sequence[str], answers: Sequence[Any]
    ) -> list[dict[str, float]]:
        """One score dict per response (a judge's: with its counters); called over the RPC."""
        if self._scorer is None:
            self.wait_ready()
        assert self._scorer is not None
        return self._scorer.score_batch(list(prompts), list(responses), list(answers))

    def describe(self) -> str:
        rm = self._config["reward_model"]
        if rm["type"] == "classifier":
            return f"{self._module_name}: classifier {rm['classifier']['path']}"
        url = self._scorer.base_url if isinstance(self._scorer, JudgeScorer) else rm["judge"]["base_url"]
        return f"{self._module_name}: judge {rm['judge']['model']} at {url}"

    def judge_server_pid(self) -> int | None:
        """The judge server's process id (tests, operators), None when this service runs none."""
        return self._server.process.pid if self._server is not None and self._server.process else None

    def stop(self) -> None:
        if self._scorer is not None:
            self._scorer.close()
        if self._server is not None:
            self._server.stop()

    def abort(self) -> None:
        if self._server is not None:
            self._server.kill()
