"""The chaos harness (chaos.py) in its bounded CI form: one 60-step run in which every process of the run is
killed with SIGKILL once (the trainer resuming from its checkpoint) and three are paused past the liveness
window, each at a seeded random step; the run must finish with reward rising and the ledger balanced.

Each fault is checked as /proc saw it (faults.py), not as the schedule meant it: the killed pid died and a new
process with its command line ran; the paused one was stopped (state T) through its pause. The ledger reads
JetStream's and Redis's own state (oracles.py)."""

from __future__ import annotations

import pytest

from chaos import KILLED, PAUSED, reward_rose, run_chaos

STEPS = 60
SEED = 7


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_every_process_killed_once_and_three_paused_and_the_ledger_balances(tmp_path):
    observed, ledger = run_chaos(tmp_path, STEPS, SEED)

    kills = {o.fault.target: o for o in observed if o.fault.action == "kill"}
    pauses = {o.fault.target: o for o in observed if o.fault.action == "pause"}
    assert sorted(kills) == sorted(KILLED) and sorted(pauses) == sorted(PAUSED)
    for target, o in kills.items():
        assert o.died, f"{target} (pid {o.pid}) still ran after SIGKILL"
        assert o.successor not in (None, o.pid), f"no new {target} process ran after the kill"
    for target, o in pauses.items():
        assert o.stopped, f"{target} (pid {o.pid}) was not stopped through its pause, or did not run again"
    assert ledger.trained == STEPS * 16 and ledger.published > 0 and ledger.stored >= ledger.published
    first, last = reward_rose(tmp_path)
    assert last >= 0.15 and last >= 2 * first, f"reward did not rise: first 10 {first:.3f}, last 10 {last:.3f}"


VLLM_STEPS = 16


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_vllm_worker_killed_and_paused_mid_sync_with_in_flight_updates_and_the_ledger_balances(tmp_path):
    """The production engine under the same harness, bounded: vLLM on CPU starts in ~30 s, so its worker alone
    is killed (its engine core must die with it) and paused right after a step, while the trainer pushes that
    step's weights into it and groups are sampled across updates."""
    overrides = ["policy.generation.backend=vllm", "grpo.async_grpo.in_flight_weight_updates=true",
                 "checkpointing.enabled=false"]  # no Commit: every trained group's record stays for the audit
    observed, ledger = run_chaos(tmp_path, VLLM_STEPS, SEED, overrides, killed=("rollout-0",), paused=("rollout-0",))

    assert [(o.fault.action, o.fault.target) for o in observed] in (
        [("kill", "rollout-0"), ("pause", "rollout-0")], [("pause", "rollout-0"), ("kill", "rollout-0")])
    kill, pause = sorted(observed, key=lambda o: o.fault.action)
    assert kill.died and kill.successor not in (None, kill.pid), f"no new worker after killing pid {kill.pid}"
    assert not kill.survivors, f"the killed worker's processes {kill.survivors} outlived it"
    assert pause.stopped
    assert ledger.trained == VLLM_STEPS * 16 and ledger.restarts == 1, ledger
