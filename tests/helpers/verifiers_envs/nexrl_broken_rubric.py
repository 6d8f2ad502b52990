"""A verifiers taskset whose rubric raises on every episode (the default task's prompts)."""

import verifiers.v1 as vf


class BrokenData(vf.TaskData):
    answer: str


class BrokenTask(vf.Task[BrokenData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, task: BrokenData, trace: vf.Trace) -> float:
        raise KeyError("the rubric's lookup table has no 'answer_v2' column")


class BrokenTaskset(vf.Taskset[BrokenTask, vf.TasksetConfig]):
    def load(self):
        for i in range(64):
            yield BrokenTask(
                BrokenData(prompt=f"m{i % 10}{(i * 7) % 10}{(i * 3) % 10}=", answer="9"), self.config.task
            )


__all__ = ["BrokenTaskset"]
