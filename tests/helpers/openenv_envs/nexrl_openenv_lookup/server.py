"""The environment's server: an OpenEnv ``Environment`` and its FastAPI app (``create_app``)."""

from typing import Any

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import State

from nexrl_openenv_lookup.models import LookupAction, LookupObservation


class LookupEnvironment(Environment[LookupAction, LookupObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self.table: dict[str, str] = {}
        self._state = State(episode_id=None, step_count=0)

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> LookupObservation:
        self.table = dict(kwargs.get("table") or {})
        self._state = State(episode_id=episode_id, step_count=0)
        return LookupObservation(done=False, reward=None)

    def step(self, action: LookupAction, timeout_s: float | None = None, **kwargs: Any) -> LookupObservation:
        self._state.step_count += 1
        found = action.key in self.table
        return LookupObservation(value=self.table.get(action.key, ""), found=found, done=False, reward=None)

    @property
    def state(self) -> State:
        return self._state


app = create_app(
    LookupEnvironment, LookupAction, LookupObservation, env_name="nexrl_lookup", max_concurrent_envs=512
)
