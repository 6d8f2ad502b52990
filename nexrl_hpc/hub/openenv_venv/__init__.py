"""Code that runs in OpenEnv's own venv (``scripts/install_openenv.sh``), never in the run's:
``worker.py``, the process the run starts. It imports the standard library, OpenEnv's dependencies
and the user's environment package only, nothing of nexrl_hpc."""
