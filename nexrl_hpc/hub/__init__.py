"""Environments from the hubs people publish to: ``verifiers`` (and, later, OpenEnv), run in their own
venv and driven by a rollout worker of this run (``rollout_worker.type=verifiers``)."""
