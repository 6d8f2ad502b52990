"""What a TRL user writes around the client: the ``environment_factory`` class and its reward function.

As in TRL's docs: ``reset(**row)`` gets the dataset's columns, every other public method is a tool, and
the reward function reads the instances (``environments``)."""

import os

from nexrl_openenv_lookup.client import LookupEnv
from nexrl_openenv_lookup.models import LookupAction

ENV_URL = os.environ.get("OPENENV_BASE_URL", "http://127.0.0.1:8000")


class LookupToolEnv:
    def __init__(self):
        self.client = LookupEnv(base_url=ENV_URL).sync()
        self.client.connect()
        self.calls = []
        self.last_value = None

    def reset(self, **kwargs):
        self.client.reset(table=kwargs["table"])
        self.calls = []
        self.last_value = None
        return None

    def k(self, key: str) -> str:
        """
        Look up the digit stored under a key.

        Args:
            key: a key, e.g. c

        Returns:
            The digit.
        """
        result = self.client.step(LookupAction(key=key))
        self.calls.append(key)
        if not result.observation.found:
            raise KeyError(f"no key {key!r}")
        self.last_value = result.observation.value
        return result.observation.value


def reward_func(environments, completions, key, **kwargs):
    """0.5 for looking up the row's key first, 0.5 for answering the value the tool returned."""
    rewards = []
    for env, completion, row_key in zip(environments, completions, key):
        answers = [m["content"] for m in completion if m["role"] == "assistant"]
        reward = 0.5 if env.calls[:1] == [row_key] else 0.0
        if env.last_value is not None and len(answers) > 1 and answers[-1].startswith(env.last_value):
            reward += 0.5
        rewards.append(reward)
    return rewards


def broken_reward(environments, **kwargs):
    """A reward function with a bug (reads a column the rows do not have)."""
    return [kwargs["answer_v2"][0] for _ in environments]


class NoDocEnv(LookupToolEnv):
    def peek(self, key: str) -> str:
        return key


class BriefedLookupEnv(LookupToolEnv):
    def reset(self, **kwargs):
        super().reset(**kwargs)
        return f"Keys: {''.join(sorted(kwargs['table']))}."


def nan_reward(environments, **kwargs):
    """A reward function that returns NaN (0/0 in a user's normalisation)."""
    return [float("nan") for _ in environments]
