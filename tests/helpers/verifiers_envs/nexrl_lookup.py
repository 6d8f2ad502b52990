"""A multi-turn verifiers (v1) environment with a tool: the model gets a key, calls the ``lookup``
tool (a ``vf.Toolset`` MCP server that verifiers starts in its subprocess runtime as
``python -m nexrl_lookup``) and answers with the value the tool returned. Its rubric: 1.0 when the
last reply starts with it. The server is the taskset's (``Taskset.toolsets``: one per worker,
shared by its episodes), not each task's (``Task.toolsets``: a server process per episode).
"""

import verifiers.v1 as vf

TABLE = {"a": "3", "b": "7", "c": "1", "d": "5", "e": "0", "f": "6", "g": "2", "h": "4"}


class LookupToolset(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = None  # the tool's own name: lookup

    @vf.tool
    def lookup(self, key: str) -> str:
        """The value stored under a key."""
        return TABLE.get(key, "?")


class LookupData(vf.TaskData):
    answer: str


class LookupTask(vf.Task[LookupData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def answered_the_value(self, task: LookupData, trace: vf.Trace) -> float:
        return float(trace.last_reply.startswith(task.answer))

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class LookupConfig(vf.TasksetConfig):
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()


class LookupTaskset(vf.Taskset[LookupTask, LookupConfig]):
    @classmethod
    def toolsets(cls, config: LookupConfig) -> list[vf.Toolset]:
        return [LookupToolset(config.tools)]

    def load(self):
        for _ in range(4):
            for key, value in TABLE.items():
                yield LookupTask(LookupData(prompt=key, answer=value), self.config.task)


__all__ = ["LookupTaskset"]

if __name__ == "__main__":
    LookupToolset.run()
