"""The `flywheel` command.

    flywheel up [--config F] [--run-dir D] [key=value ...]     everything on this machine, tiny model by default
    flywheel serve SERVICE [--config F] [key=value ...]         one service (controller|rollout|environment|replay|trainer
                                                                |reward_model|teacher)
    flywheel env submit|list|remove ...                         change the environment mix of a running job
    flywheel status [--json]                                    where a running job is (env and status find
                                                                the local run: newest live runs/*/, or --run-dir)
    flywheel eval [--config F] [--model M] [--data D] [--n N]  accuracy and pass@n of a model on a dataset
    flywheel collect [--config F] [--model M] [--data D] [--n N] [--out R]
                                                                NeMo Gym rollouts.jsonl of a model, no training
    flywheel config check|show [--config] F [key=value ...]     validate, or print the resolved config; runs nothing
    flywheel data from-gym ROLLOUTS --to sft|dpo --out F.jsonl  NeMo Gym rollouts -> an SFT or DPO dataset

Config is parsed and validated before any heavy import, so a bad key fails in well under a
second with one line that names it (exit code 2).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import sys
import time

from services.common.config import ConfigError, FlywheelConfig, dump_config, load, load_config
from services.common.devices import checked_plan
from services.common.errors import RUN_FAILED_EXIT, RunFailed
from services.common.logs import setup_logging

SERVICES = ("controller", "rollout", "environment", "replay", "trainer")
SERVE_MODULES = {**{s: f"services.{s}.main" for s in SERVICES}, "reward_model": "services.rollout.reward_model",
                 "teacher": "services.rollout.teacher"}
"""`flywheel serve NAME` -> the module whose serve(cfg) runs it: the five services, env.reward_model's server
(a model, so it lives with rollout), which a run starts only when an environment of kind reward_model is used,
and a distillation run's teacher (the `teacher:` section)."""


def _config(args) -> FlywheelConfig:
    return load_config(args.config, args.overrides)


def cmd_serve(args) -> int:
    if args.nproc_per_node:
        args.overrides = [*args.overrides, f"trainer.nproc_per_node={args.nproc_per_node}"]
    cfg = _config(args)
    setup_logging(args.service, cfg.run.name, cfg.telemetry.log_level)
    # Before the service's imports: torch, vLLM and NCCL read some of them at import or at start, and the processes
    # it starts (trainer ranks, vLLM's engine) inherit them.
    os.environ.update({"rollout": cfg.rollout.env_vars, "trainer": cfg.trainer.env_vars}.get(args.service, {}))
    module = importlib.import_module(SERVE_MODULES[args.service])  # heavy imports happen here
    try:
        asyncio.run(module.serve(cfg))
    except RunFailed as err:
        logging.getLogger(f"flywheel.{args.service}").error("the run cannot go on: %s", err)
        return RUN_FAILED_EXIT
    return 0


def cmd_export(args) -> int:
    from services.trainer.export import export_adapter, export_checkpoint

    try:
        step_dir = (export_adapter if args.adapter else export_checkpoint)(args.checkpoint, args.out)
    except (FileNotFoundError, ValueError) as err:
        print(f"export: {err}", file=sys.stderr, flush=True)
        return 2
    print(f"exported {step_dir} -> {args.out}{' (PEFT adapter)' if args.adapter else ''}", flush=True)
    return 0


def cmd_up(args) -> int:
    from services.local import run_local

    cfg, notes = load(args.config, args.overrides)
    if notes:
        print(f"{len(notes)} NeMo RL keys accepted without effect (`flywheel config check` lists them)", flush=True)
    return run_local(_planned(cfg), args.config, args.run_dir, resume=args.resume)


def _planned(cfg: FlywheelConfig) -> FlywheelConfig:
    """data.* read and checked (a bad file or row stops here, before anything starts), trackers and the tool parser
    importable, grpo.max_num_steps bounded by grpo.max_num_epochs; each decision printed."""
    from services.common.chat_template import check_chat_template
    from services.common.data import DataError, plan_config
    from services.common.data.offline_tokens import offline_plan_config
    from services.controller.tracking import TrackerError, check_trackers

    cfg.policy.generation.check_parsers()
    check_teacher(cfg)
    try:
        check_chat_template(cfg.policy)
        check_trackers(cfg)
        cfg, lines = plan_config(cfg) if cfg.offline is None else offline_plan_config(cfg)
    except DataError as err:
        raise ConfigError("\n".join(f"data error: {line}" for line in str(err).splitlines())) from None
    except TrackerError as err:
        raise ConfigError(f"config error: {err}") from None
    for line in lines:
        print(line, flush=True)
    return cfg


def check_teacher(cfg: FlywheelConfig) -> None:
    """A distillation run's teacher must share the student's tokenizer and vocabulary (NeMo RL's check): refused here,
    before anything starts, and again by the trainer as it starts (a run launched another way)."""
    if cfg.algorithm != "distillation":
        return
    from services.common.tokenizing import check_same_vocabulary

    try:
        check_same_vocabulary(cfg.policy, cfg.teacher.model_name)
    except (OSError, ValueError) as err:
        raise ConfigError(f"config error: teacher.model_name: {err}") from None


def cmd_eval(args) -> int:
    from services.evaluate import eval_command, exported_if_checkpoint

    model = exported_if_checkpoint(args.model, args.run_dir) if args.model else None
    cfg, _ = load(args.config, [*args.overrides, *_model_data_n(model, args.data, args.n)])
    return eval_command(cfg, args.run_dir)


def cmd_collect(args) -> int:
    from services.collect import collect_command
    from services.evaluate import exported_if_checkpoint

    run_dir = args.run_dir or time.strftime("runs/collect-%Y%m%d-%H%M%S")  # a checkpoint is exported into it
    model = exported_if_checkpoint(args.model, run_dir) if args.model else None
    cfg, _ = load(args.config, [*args.overrides, *_model_data_n(model, args.data, args.n)])
    return collect_command(cfg, args.out, run_dir)


def _model_data_n(model: str | None, data: str | None, n: int | None) -> list[str]:
    """eval's and collect's --model, --data and --n as config overrides."""
    extra = [f"policy.model_name={model}"] if model else []
    extra += [f"grpo.val_num_generations_per_prompt={n}"] if n else []
    return extra + ([f"++data.validation={{data_path: {data}}}"] if data else [])


def cmd_config(args) -> int:
    """check: validate and list the keys accepted without effect; show: the resolved config as YAML."""
    path = args.config or args.file
    cfg, notes = load(path, args.overrides)
    if args.action == "show":
        print(dump_config(cfg), end="")
        return 0
    for key, why in notes:
        print(f"note: {key}: {why}")
    _planned(cfg)
    print(checked_plan(cfg).describe())  # the devices `flywheel up` would give each process here
    print(f"{path or 'the embedded default'}: ok ({len(notes)} keys accepted without effect)")
    return 0


def cmd_env(args) -> int:
    from services.controller.client import env_command

    return env_command(args)


def cmd_status(args) -> int:
    from services.controller.client import status_command

    return status_command(args)


def cmd_data(args) -> int:
    from services.common.data.from_gym import from_gym_command

    return from_gym_command(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flywheel", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--config", help="YAML config file (default: the embedded default)")
        p.add_argument("overrides", nargs="*", help="overrides as NeMo RL writes them: key=value, ++key=value, "
                       "+key=value, ~key (e.g. grpo.async_grpo.max_trajectory_age_steps=2)")
        return p

    up = with_config(sub.add_parser("up", help="run NATS, Redis and all services locally"))
    up.add_argument("--run-dir", help="where config.yaml, metrics.jsonl and logs go (default: a fresh runs/<time>)")
    up.add_argument("--resume", action="store_true", help="start a stopped run again in its --run-dir: the trainer "
                    "from its latest checkpoint, the controller from its saved leases")
    up.set_defaults(func=cmd_up)

    serve = sub.add_parser("serve", help="run one service")
    serve.add_argument("service", choices=SERVE_MODULES)
    serve.add_argument("--nproc-per-node", type=int, help="trainer only: ranks to start here (trainer.nproc_per_node)")
    with_config(serve).set_defaults(func=cmd_serve)

    export = sub.add_parser("export", help="write a trainer checkpoint as a Hugging Face model directory")
    export.add_argument("checkpoint", help="a step_N checkpoint, or a checkpoint_dir (its newest step_N)")
    export.add_argument("out", help="output directory (safetensors, config, tokenizer, generation config)")
    export.add_argument("--adapter", action="store_true",
                        help="a LoRA run's adapters alone, in PEFT's format (for vLLM LoRA requests, PEFT), "
                             "instead of the merged model")
    export.set_defaults(func=cmd_export)

    def run_finder(p: argparse.ArgumentParser) -> None:
        p.add_argument("--controller", default="", help="controller host:port (default: find the local run)")
        p.add_argument("--run-dir", default=None, help="the run directory `flywheel up` made (default: the newest "
                       "live one under ./runs, or $FLYWHEEL_RUN_DIR)")
        p.add_argument("--token", default="", help="bearer token (default: the run's controller.auth_token)")
        p.add_argument("--tls-ca", default="", help="with --controller: PEM CA bundle of a controller serving TLS")
        p.add_argument("--tls-cert", default="", help="with --controller: client certificate, for mutual TLS")
        p.add_argument("--tls-key", default="", help="with --controller: the client certificate's key")

    env = sub.add_parser("env", help="submit, list or remove environments of a running job")
    run_finder(env)
    env_sub = env.add_subparsers(dest="action", required=True)
    submit = env_sub.add_parser("submit")
    submit.add_argument("name")
    submit.add_argument("--kind", default="")
    submit.add_argument("--address", default="")
    submit.add_argument("--jsonl", default="", help="dataset path readable by the controller")
    submit.add_argument("--weight", type=float, default=1.0)
    submit.add_argument("--max-turns", type=int, default=1)
    submit.add_argument("--agent", default="", help='agent spec as JSON, e.g. \'{"type": "program", "command": '
                        '["python", "agent.py"]}\' (kind agent; docs/agents.md)')
    submit.add_argument("--timeout", type=float, default=0.0, help="seconds per call (remote) or episode (agent)")
    env_sub.add_parser("list")
    remove = env_sub.add_parser("remove")
    remove.add_argument("name")
    env.set_defaults(func=cmd_env)

    ev = with_config(sub.add_parser("eval", help="accuracy and pass@k of a model (or an exported checkpoint) on "
                                    "data.validation, by the validation code"))
    ev.add_argument("--model", help="Hugging Face id or directory, or a trainer checkpoint (step_N or its "
                    "checkpoint_dir: exported first) (default: policy.model_name)")
    ev.add_argument("--data", help="dataset to evaluate on (default: data.validation)")
    ev.add_argument("--n", type=int, help="samples per prompt; pass@n is reported (default: "
                    "grpo.val_num_generations_per_prompt)")
    ev.add_argument("--run-dir", help="where eval.json and eval_samples.jsonl go (default: runs/eval-<time>)")
    ev.set_defaults(func=cmd_eval)

    co = with_config(sub.add_parser("collect", help="NeMo Gym's rollouts.jsonl (responses_create_params, response "
                                    "with its output items, reward, named rewards) from the eval prompts and a model, "
                                    "without training; `flywheel data from-gym` reads it (docs/data.md)"))
    co.add_argument("--model", help="Hugging Face id or directory, or a trainer checkpoint (exported first) "
                    "(default: policy.model_name)")
    co.add_argument("--data", help="prompts (default: data.validation, else what the environments generate)")
    co.add_argument("--n", type=int, help="rollouts per prompt (default: grpo.val_num_generations_per_prompt)")
    co.add_argument("--out", default="rollouts.jsonl", help="the rollouts file to write (default: rollouts.jsonl)")
    co.add_argument("--run-dir", help="where the services' logs go (default: runs/collect-<time>)")
    co.set_defaults(func=cmd_collect)

    config = sub.add_parser("config", help="validate a config (check) or print it resolved (show)")
    config.add_argument("action", choices=("check", "show"))
    config.add_argument("file", nargs="?", help="the config file (or --config)")
    with_config(config).set_defaults(func=cmd_config)

    status = sub.add_parser("status", help="print a running job's status")
    run_finder(status)
    status.add_argument("--json", action="store_true", help="the raw StatusResponse")
    status.set_defaults(func=cmd_status)

    data = sub.add_parser("data", help="make training data")
    gym = data.add_subparsers(dest="action", required=True).add_parser(
        "from-gym", help="NeMo Gym rollouts.jsonl -> SFT rows (high-reward rollouts) or DPO pairs (one prompt's best "
        "vs worst), tool calls in OpenAI chat form; every rollout left out is printed with its reason")
    gym.add_argument("rollouts", help="a rollouts.jsonl as NeMo Gym writes it")
    gym.add_argument("--to", required=True, choices=("sft", "dpo"))
    gym.add_argument("--out", required=True, help="the dataset to write (.jsonl), for data.train.data_path")
    gym.add_argument("--min-reward", type=float, default=1.0, help="sft: keep rollouts with reward >= this")
    gym.add_argument("--min-gap", type=float, default=0.5, help="dpo: pair a prompt's best and worst rollouts when "
                     "their rewards differ by at least this")
    data.set_defaults(func=cmd_data)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may follow options (`serve replay --config F a=b`); argparse leaves those over.
    args, extra = parser.parse_known_args(argv)
    unknown = [e for e in extra if e.startswith("-") or "=" not in e]
    if unknown or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        return args.func(args)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
