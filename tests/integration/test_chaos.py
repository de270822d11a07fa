"""The chaos harness (chaos.py) in its bounded CI form: one 60-step run in which every process of the run is
killed with SIGKILL once (the trainer resuming from its checkpoint) and three are paused past the liveness
window, each at a seeded random step; the run must finish with reward rising and the ledger balanced."""

from __future__ import annotations

import pytest

from chaos import KILLED, PAUSED, reward_rose, run_chaos
from services.local import read_restarts

STEPS = 60
SEED = 7


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_every_process_killed_once_and_three_paused_and_the_ledger_balances(tmp_path):
    faults, ledger = run_chaos(tmp_path, STEPS, SEED)

    assert sorted(f.target for f in faults if f.action == "kill") == sorted(KILLED)
    assert sorted(f.target for f in faults if f.action == "pause") == sorted(PAUSED)
    assert {r["service"] for r in read_restarts(tmp_path)} >= set(KILLED), "the supervisor restarted each"
    assert ledger.trained == STEPS * 16 and ledger.published > 0
    first, last = reward_rose(tmp_path)
    assert last >= 0.15 and last >= 2 * first, f"reward did not rise: first 10 {first:.3f}, last 10 {last:.3f}"
