"""The environment's action and observation (OpenEnv's pydantic types)."""

from openenv.core.env_server.types import Action, Observation


class LookupAction(Action):
    key: str


class LookupObservation(Observation):
    value: str = ""
    found: bool = False
