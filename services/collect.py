"""`flywheel collect`: NeMo Gym's rollouts.jsonl from an environment mix and a model, without training.

    the prompts `flywheel eval` takes (data.validation, --data, or what the config's environments generate)
        ──▶ environment + rollout services, policy.model_name = --model (evaluate.py: the same services and code)
        ──▶ rollout's Generate: n episodes a prompt, as training runs them, scored by the environment
        ──▶ to_gym.gym_rollout: one NeMo Gym rollout a line ──▶ --out (prompts × n lines)

Sampling is each prompt's (its environment's, else policy.generation's), as validation samples. An environment
of kind agent (NeMo Gym, verifiers, programs) runs each episode's agent against rollout's OpenAI endpoint, as
in training (services/rollout/agent_groups.py): the line's output is the conversation the endpoint recorded,
its reward the agent environment's, and its named rewards and metrics (NeMo Gym's extra verify fields) extra
top-level keys. An agent episode samples as its requests say, and as its environment's `sampling` where they
leave a field out.

A prompt whose agent failed every attempt (rollout runs a failed episode again, rollout.max_group_failures
attempts in all) writes no lines and costs nothing else: it goes to <run_dir>/collect_failed.jsonl with its
task index, environment, messages and error, so that exactly those can be collected again.
"""

from __future__ import annotations

from pathlib import Path

from services.common.config import FlywheelConfig
from services.common.messages import message_to_dict, tools_to_dicts
from services.common.data.to_gym import gym_rollout
from services.common.jsonl import write_jsonl
from services.evaluate import scored_on_a_stack


def rollout_lines(prompts, results, model: str) -> list[dict]:
    """Each prompt's completions, in prompt then sampling order, as NeMo Gym rollouts."""
    lines = []
    for task, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        if result.error:
            continue
        messages = [message_to_dict(m) for m in prompt.messages]
        tools = tools_to_dicts(prompt.tools) or None
        for i, c in enumerate(result.completions):
            lines.append(gym_rollout(prompt=messages, tools=tools, episode=[message_to_dict(m) for m in c.messages],
                                     reward=c.reward, metrics={**c.named_rewards, **c.metrics},
                                     env_name=prompt.env_name, model=model, task_index=task, rollout_index=i))
    return lines


def failed_lines(prompts, results) -> list[dict]:
    """The prompts whose episodes failed every attempt, as collect_failed.jsonl lines."""
    return [{"task_index": task, "env_name": prompt.env_name,
             "messages": [message_to_dict(m) for m in prompt.messages], "error": result.error}
            for task, (prompt, result) in enumerate(zip(prompts, results, strict=True)) if result.error]


def run_collect(cfg: FlywheelConfig, out: Path, run_dir: Path) -> tuple[int, int]:
    """Writes `out` (and run_dir/collect_failed.jsonl); (rollouts written, prompts failed)."""
    prompts, _, results = scored_on_a_stack(cfg, run_dir)
    lines = rollout_lines(prompts, results, cfg.policy.model_name)
    write_jsonl(out, lines)
    failed = failed_lines(prompts, results)
    write_jsonl(run_dir / "collect_failed.jsonl", failed)
    return len(lines), len(failed)


def collect_command(cfg: FlywheelConfig, out: str, run_dir: str) -> int:
    logs = Path(run_dir).resolve()
    n = cfg.grpo.val_num_generations_per_prompt
    print(f"collect: {cfg.policy.model_name}, {n} rollouts per prompt, services' logs in {logs}", flush=True)
    count, failed = run_collect(cfg, Path(out), logs)
    print(f"collect: {count} rollouts written to {out}", flush=True)
    if failed:
        print(f"collect: {failed} prompts failed every attempt and wrote nothing: {logs / 'collect_failed.jsonl'}",
              flush=True)
    return 0
