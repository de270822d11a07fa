"""NeMo Gym's own model of a rollouts.jsonl line, as the oracle for what `flywheel collect` writes.

The `nemo-gym` package lives in the repository's `.venv-gym` (`make gym-venv`; it needs Python 3.12 and brings Ray,
so Flywheel never imports it): each line is validated there by `BaseVerifyResponse`, the model of what
`ng_collect_rollouts` writes (nemo_gym/base_resources_server.py), its index keys are NeMo Gym's constants, and the
whole file goes through NeMo Gym's own aggregation of verify responses (reward_profile.compute_aggregate_metrics).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from needs import require

VENV = Path(__file__).parents[1] / ".venv-gym"
CHECK = """
import json, sys
from nemo_gym.base_resources_server import BaseVerifyResponse
from nemo_gym.global_config import ROLLOUT_INDEX_KEY_NAME, TASK_INDEX_KEY_NAME
from nemo_gym.reward_profile import compute_aggregate_metrics
rows = [json.loads(line) for line in open(sys.argv[1])]
for n, row in enumerate(rows, 1):
    BaseVerifyResponse.model_validate(row)
    assert isinstance(row[TASK_INDEX_KEY_NAME], int) and isinstance(row[ROLLOUT_INDEX_KEY_NAME], int), n
print(len(rows), compute_aggregate_metrics(rows).agent_metrics["mean/reward"])
"""


def nemo_gym_reads(path: Path) -> tuple[int, float]:
    """(the lines NeMo Gym's model accepted, the mean reward its aggregation reports); AssertionError with its
    complaint otherwise."""
    python = VENV / "bin" / "python"
    require(python.exists(), "no .venv-gym with the nemo-gym package: run `make gym-venv`")
    proc = subprocess.run([str(python), "-c", CHECK, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines, mean = proc.stdout.split()[-2:]
    return int(lines), float(mean)
