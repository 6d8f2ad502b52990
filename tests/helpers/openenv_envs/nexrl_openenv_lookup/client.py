"""The environment's client (OpenEnv's WebSocket ``EnvClient``)."""

from typing import Any

from openenv.core import EnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server.types import State

from nexrl_openenv_lookup.models import LookupAction, LookupObservation


class LookupEnv(EnvClient[LookupAction, LookupObservation, State]):
    def _step_payload(self, action: LookupAction) -> dict[str, Any]:
        return {"key": action.key}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[LookupObservation]:
        obs = payload.get("observation", {})
        observation = LookupObservation(
            value=obs.get("value", ""),
            found=obs.get("found", False),
            done=payload.get("done", False),
            reward=payload.get("reward"),
        )
        return StepResult(
            observation=observation, reward=payload.get("reward"), done=payload.get("done", False)
        )

    def _parse_state(self, payload: dict[str, Any]) -> State:
        return State(**payload)
