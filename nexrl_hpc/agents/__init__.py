"""The agent model (after rLLM's): episode data, tools, rewards and the sandbox they share.

Agents, environments and workflows build on these; nothing here imports torch.
"""

from nexrl_hpc.agents.types import Episode, ModelOutput, Step, TerminationReason, ToolCall, Trajectory

__all__ = ["Episode", "ModelOutput", "Step", "TerminationReason", "ToolCall", "Trajectory"]
