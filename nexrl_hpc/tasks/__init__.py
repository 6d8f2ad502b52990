"""Tasks: a data generator (train + held-out validation rows) and a reward function, chosen by ``task=<name>``."""
