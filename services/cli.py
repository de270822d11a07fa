"""The `flywheel` command.

    flywheel up [--config F] [--run-dir D] [key=value ...]     everything on this machine, tiny model by default
    flywheel serve SERVICE [--config F] [key=value ...]         one service (controller|rollout|environment|replay|trainer)
    flywheel env submit|list|remove ...                         change the environment mix of a running job
    flywheel status                                             where a running job is

Config is parsed and validated before any heavy import, so a bad key fails in well under a
second with one line that names it (exit code 2).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import sys

from services.common.config import ConfigError, FlywheelConfig, load_config
from services.common.logs import setup_logging

SERVICES = ("controller", "rollout", "environment", "replay", "trainer")


def _config(args) -> FlywheelConfig:
    return load_config(args.config, args.overrides)


def cmd_serve(args) -> int:
    cfg = _config(args)
    setup_logging(args.service, cfg.run.name, cfg.telemetry.log_level)
    module = importlib.import_module(f"services.{args.service}.main")  # heavy imports happen here
    asyncio.run(module.serve(cfg))
    return 0


def cmd_up(args) -> int:
    from services.local import run_local

    return run_local(_config(args), args.config, args.run_dir)


def cmd_env(args) -> int:
    from services.controller.client import env_command

    return env_command(args)


def cmd_status(args) -> int:
    from services.controller.client import status_command

    return status_command(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flywheel", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--config", help="YAML config file (default: the embedded default)")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. grpo.max_staleness=2")
        return p

    up = with_config(sub.add_parser("up", help="run NATS, Redis and all services locally"))
    up.add_argument("--run-dir", help="where config.yaml, metrics.jsonl and logs go (default: a fresh runs/<time>)")
    up.set_defaults(func=cmd_up)

    serve = sub.add_parser("serve", help="run one service")
    serve.add_argument("service", choices=SERVICES)
    with_config(serve).set_defaults(func=cmd_serve)

    env = sub.add_parser("env", help="submit, list or remove environments of a running job")
    env.add_argument("--controller", default="127.0.0.1:50051", help="controller address host:port")
    env.add_argument("--token", default="", help="bearer token, where auth is configured")
    env_sub = env.add_subparsers(dest="action", required=True)
    submit = env_sub.add_parser("submit")
    submit.add_argument("name")
    submit.add_argument("--kind", default="")
    submit.add_argument("--address", default="")
    submit.add_argument("--jsonl", default="", help="dataset path readable by the controller")
    submit.add_argument("--weight", type=float, default=1.0)
    submit.add_argument("--max-turns", type=int, default=1)
    env_sub.add_parser("list")
    remove = env_sub.add_parser("remove")
    remove.add_argument("name")
    env.set_defaults(func=cmd_env)

    status = sub.add_parser("status", help="print a running job's status")
    status.add_argument("--controller", default="127.0.0.1:50051")
    status.add_argument("--token", default="")
    status.set_defaults(func=cmd_status)
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
