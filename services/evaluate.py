"""`flywheel eval`: accuracy, average length and pass@k of a model on a dataset, by the validation code.

    config (data.validation, or --data; without either, the prompts the config's environments generate, as
    validation takes them) ──▶ environment + rollout services, policy.model_name = --model
        ──▶ Validator (services/controller/evaluation.py): Generate n episodes per prompt, scored by the environment
        ──▶ printed metrics, <run_dir>/eval.json and eval_samples.jsonl (each prompt's rewards, or its error)

A prompt whose agent failed every attempt is left out of the metrics and counted (validation/failed_prompts;
evaluation.py), its error in eval_samples.jsonl: one broken episode does not cost the whole evaluation.

--model is a Hugging Face model id or directory, or a trainer checkpoint, which is exported first.
Rollout's HF engine loads it; the vLLM engine starts from random weights and takes real ones only
from the trainer, so eval refuses it rather than score random weights.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from services.common.config import ConfigError, FlywheelConfig
from services.common.jsonl import write_jsonl
from services.common.pb.flywheel.v1 import rollout_pb2_grpc
from services.common.server import channel
from services.common.data import DataError, load_data
from services.controller.evaluation import Validator, generated_prompts, validation_prompts
from services.controller.main import spec_from_config
from services.controller.registry import Registry
from services.local import LocalStack


def eval_prompts(cfg: FlywheelConfig):
    if cfg.policy.generation.backend != "hf":
        raise ConfigError("config error: policy.generation.backend: flywheel eval and collect need hf (rollout's vLLM engine "
                          "starts from random weights and takes real ones from the trainer)")
    try:
        prompts = validation_prompts(cfg, load_data(cfg).validation)
    except DataError as err:
        raise ConfigError("\n".join(f"data error: {line}" for line in str(err).splitlines())) from None
    if not prompts and not cfg.generating_environments:
        raise ConfigError("config error: data.validation: nothing to evaluate (set data.validation.data_path, "
                          "pass --data, a train split_validation_size, or an `environments` entry that generates "
                          "its prompts)")
    return prompts


def scored_on_a_stack(cfg: FlywheelConfig, run_dir: Path):
    """eval_prompts(cfg) scored by an environment and a rollout service started for it (their logs in
    `run_dir`): (prompts, metrics, results) as `scored` gives them. Eval and collect both run this."""
    prompts = eval_prompts(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    with LocalStack(cfg, run_dir) as stack:
        stack.start_reward_model()
        for service, name in (("environment", "environment"), ("rollout", "rollout-0")):
            stack.children.start(name, service, stack.config_path)
        return asyncio.run(scored(stack.cfg, prompts))


def run_eval(cfg: FlywheelConfig, run_dir: Path) -> dict[str, float]:
    _, metrics, results = scored_on_a_stack(cfg, run_dir)
    (run_dir / "eval.json").write_text(json.dumps(metrics, indent=1) + "\n")
    write_jsonl(run_dir / "eval_samples.jsonl", [{"prompt": p.prompt, "rewards": p.rewards, "lengths": p.lengths}
                                                  | ({"error": p.error} if p.error else {}) for p in results])
    return metrics


async def scored(cfg: FlywheelConfig, prompts):
    """(the prompts scored, generated ones included; metrics; each prompt's PromptResult, in prompt order)."""
    rollout = channel(cfg.addresses.rollout, security=cfg.security)
    registry = Registry(cfg)
    try:
        if not prompts:  # the environment service generates them, once the environments are registered there
            for spec in cfg.environments:
                await registry.submit(spec_from_config(spec))
            prompts = await generated_prompts(cfg, registry)
        named = {p.env_name for p in prompts}
        for spec in cfg.environments:  # an environment named only in the config (an agent's) is known by name then
            if spec.name in named and spec.name not in registry.entries:
                await registry.register(spec_from_config(spec))
        validator = Validator(prompts, rollout_pb2_grpc.RolloutServiceStub(rollout),
                              n=cfg.grpo.val_num_generations_per_prompt)
        return (prompts, *await validator.run())
    finally:
        await rollout.close()
        await registry.close()


def _out(run_dir: str | None) -> Path:
    return Path(run_dir or f"runs/eval-{time.strftime('%Y%m%d-%H%M%S')}").resolve()


def exported_if_checkpoint(model: str, run_dir: str | None) -> str:
    """A trainer checkpoint (step_N, or a checkpoint_dir) becomes a Hugging Face directory in the eval's run dir."""
    path = Path(model)
    if not (path / "training_info.json").exists() and not any(path.glob("step_*/training_info.json")):
        return model
    from services.trainer.export import export_checkpoint  # torch: only here, and only for a checkpoint

    out = _out(run_dir) / "hf"
    step_dir = export_checkpoint(path, out)
    print(f"eval: exported {step_dir} -> {out}", flush=True)
    return str(out)


def eval_command(cfg: FlywheelConfig, run_dir: str | None) -> int:
    out = _out(run_dir)
    n = cfg.grpo.val_num_generations_per_prompt
    print(f"eval: {cfg.policy.model_name}, {n} samples per prompt, results in {out}", flush=True)
    metrics = run_eval(cfg, out)
    for key, value in metrics.items():
        print(f"{key:<28} {value:.4f}", flush=True)
    return 0
