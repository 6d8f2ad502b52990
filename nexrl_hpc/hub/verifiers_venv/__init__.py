"""Code that runs in verifiers' own venv (``scripts/install_verifiers.sh``), never in the run's:
``worker.py`` (the process the run starts) and ``nexrl_chat.py`` (its in-process harness). They import
the standard library and verifiers only, nothing of nexrl_hpc."""
