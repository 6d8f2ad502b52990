"""A verifiers (v1) taskset written as a user writes one for the hub: the default task, "m372=" -> "7".

Single-turn, scored by its rubric: 1.0 when the model's reply starts with the largest digit. Runs in
verifiers' venv (``rollout_worker.verifiers.python_path`` puts this directory on the worker's path).
"""

import itertools
import random

import verifiers.v1 as vf


class MaxDigitData(vf.TaskData):
    answer: str


class MaxDigitTask(vf.Task[MaxDigitData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def starts_with_the_answer(self, task: MaxDigitData, trace: vf.Trace) -> float:
        return float(trace.last_reply.startswith(task.answer))

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class MaxDigitTaskset(vf.Taskset[MaxDigitTask, vf.TasksetConfig]):
    def load(self):
        digits = list(itertools.product(range(10), repeat=3))
        random.Random(0).shuffle(digits)
        for t in digits:
            prompt = "m" + "".join(map(str, t)) + "="
            yield MaxDigitTask(MaxDigitData(prompt=prompt, answer=str(max(t))), self.config.task)


__all__ = ["MaxDigitTaskset"]
