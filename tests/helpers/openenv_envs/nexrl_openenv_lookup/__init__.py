"""An OpenEnv environment written as a user writes one for the hub (models, server, client), and the
class a TRL user passes as ``environment_factory`` around its client (``trl_env``).

The task is the tool-lookup task's (nexrl_hpc/tasks/tool_lookup.py): the row's table is hidden in the
environment's server; the model calls the tool ``k`` with the prompt's key and answers the value."""
