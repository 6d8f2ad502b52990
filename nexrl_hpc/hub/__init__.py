"""Environments from the hubs people publish to, each run in its own venv by a worker process
(``venv_process``): ``verifiers`` tasksets (``rollout_worker.type=verifiers``) and OpenEnv
environments behind TRL's ``environment_factory`` class (``rollout_worker.type=openenv``)."""
