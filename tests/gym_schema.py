"""NeMo Gym's own model of a rollouts.jsonl line, as the oracle for what `flywheel collect` writes.

The `nemo-gym` package lives in the repository's `.venv-gym` (`make gym-venv`; it needs Python 3.12 and brings Ray,
so Flywheel never imports it): each line is validated there by `BaseVerifyResponse`, the model of what
`ng_collect_rollouts` writes (nemo_gym/base_resources_server.py), and its index keys are NeMo Gym's constants.
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
for n, line in enumerate(open(sys.argv[1]), 1):
    row = json.loads(line)
    BaseVerifyResponse.model_validate(row)
    assert isinstance(row[TASK_INDEX_KEY_NAME], int) and isinstance(row[ROLLOUT_INDEX_KEY_NAME], int), n
print("ok", n)
"""


def nemo_gym_reads(path: Path) -> int:
    """The number of lines NeMo Gym's model accepted; AssertionError with its complaint otherwise."""
    python = VENV / "bin" / "python"
    require(python.exists(), "no .venv-gym with the nemo-gym package: run `make gym-venv`")
    proc = subprocess.run([str(python), "-c", CHECK, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return int(proc.stdout.split()[-1])
