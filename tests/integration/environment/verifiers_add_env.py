"""A `verifiers` environment with a tool, written with the real package (0.4, `verifiers.v1`): the model is asked
for a sum, may call the `add` MCP tool, and the rubric rewards the right number in its last reply. It runs only in
the verifiers venv (`make verifiers`), never in Flywheel's: the test drives it through VerifiersAgent's runner.

Importable as a verifiers taskset plugin by its module name (`__all__` exports the one Taskset); run as
`python -m verifiers_add_env` it serves the tool (verifiers starts tool servers that way)."""

import asyncio
import json
import re

import verifiers.v1 as vf
from verifiers.v1.types import content_text


class AddToolsetConfig(vf.ToolsetConfig):
    pass


class AddToolset(vf.Toolset[AddToolsetConfig]):
    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


class AddData(vf.TaskData):
    a: int
    b: int
    # Faults a test switches on in a row: the rubric raises, returns NaN, or hangs.
    crash: bool = False
    nan: bool = False
    hang_s: float = 0.0


class AddTaskConfig(vf.TaskConfig):
    tools: AddToolsetConfig = AddToolsetConfig()
    shared_tool: bool = False
    """Serve the tool once for the taskset (verifiers' shared toolset, started with the env's serving) instead of
    once per episode: with VerifiersAgent's shared runner, an episode then starts no tool server."""
    record: str = ""
    """A file the rubric appends one JSON line to per scored episode (the task, the reply verifiers got back
    from the model, the reward): a test's record of the episode from verifiers' side."""


def last_number(text: str) -> int | None:
    numbers = re.findall(r"-?\d+", text)
    return int(numbers[-1]) if numbers else None


class AddTask(vf.Task[AddData, vf.State, AddTaskConfig]):
    @classmethod
    def toolsets(cls, config: AddTaskConfig) -> list[vf.Toolset]:
        return [] if config.shared_tool else [AddToolset(config.tools)]

    @vf.reward
    async def correct(self, task: AddData, trace: vf.Trace) -> float:
        if task.crash:
            raise RuntimeError("the rubric crashed")
        if task.hang_s:  # as a rubric that runs a program (a test suite, a checker) and it hangs
            proc = await asyncio.create_subprocess_exec("sleep", str(task.hang_s))
            await proc.wait()
        reward = float("nan") if task.nan else float(last_number(last_reply(trace)) == task.a + task.b)
        if self.config.record:
            line = json.dumps({"id": task.id, "a": task.a, "b": task.b, "reply": last_reply(trace), "reward": reward})
            with open(self.config.record, "a") as f:  # one write of one short line: episodes do not interleave
                f.write(line + "\n")
        return reward

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(last_reply(trace)))


def last_reply(trace: vf.Trace) -> str:
    replies = trace.assistant_messages
    return (content_text(replies[-1].content) or "") if replies else ""


class AddTasksetConfig(vf.TasksetConfig):
    task: AddTaskConfig = AddTaskConfig()
    n: int = 4


class AddTaskset(vf.Taskset[AddTask, AddTasksetConfig]):
    @classmethod
    def toolsets(cls, config: AddTasksetConfig) -> list[vf.Toolset]:
        return [AddToolset(config.task.tools)] if config.task.shared_tool else []

    def load(self):
        for i in range(self.config.n):
            data = AddData(prompt=f"what is {i} + {i + 2}? use the add tool.", a=i, b=i + 2, id=f"add-{i}")
            yield AddTask(data, self.config.task)


__all__ = ["AddTaskset"]

if __name__ == "__main__":
    AddToolset.run()
