"""The agent model of seed 004 (rLLM): episode data, tools, rewards and the sandbox they share.

Agents, environments and workflows build on these (issue 7); nothing here imports torch.
"""

from nexrl_hpc.agents.types import Episode, ModelOutput, Step, TerminationReason, ToolCall, Trajectory

__all__ = ["Episode", "ModelOutput", "Step", "TerminationReason", "ToolCall", "Trajectory"]
