"""The run's rule for poisoned groups: it goes on while they are at most rollout.max_poisoned_groups, and past
that it stops with a reason that names the last group's error."""

from types import SimpleNamespace

from services.common.config import load_config
from services.common.pb.flywheel.v1 import types_pb2
from services.controller.main import Controller
from services.controller.poison import describe, run_failure
from services.controller.state import RunState

LAST = types_pb2.PoisonedGroup(group_id="abc", prompt_id="data/e0/3", env_name="math", deliveries=3,
                               error="TemplateError: System role not supported")


def test_the_run_goes_on_up_to_the_bound_and_stops_one_past_it():
    cfg = load_config(None, ["rollout.max_poisoned_groups=2", "rollout.max_group_failures=4"]).rollout
    assert run_failure(1, cfg, LAST) == "" and run_failure(2, cfg, LAST) == ""
    reason = run_failure(3, cfg, LAST)
    assert reason.startswith("3 prompt groups were poisoned"), reason
    assert "rollout.max_poisoned_groups=2" in reason and "rollout.max_group_failures=4" in reason
    assert reason.endswith("the last, prompt 'data/e0/3', failed with: TemplateError: System role not supported")


def test_a_bound_of_zero_stops_at_the_first_poisoned_group():
    assert run_failure(1, load_config(None, ["rollout.max_poisoned_groups=0"]).rollout, LAST) != ""


def test_the_line_names_the_prompt_its_deliveries_and_the_error():
    assert describe(LAST) == ("poisoned group abc (prompt data/e0/3, env math) after 3 deliveries: "
                              "TemplateError: System role not supported")


def test_the_count_survives_a_controller_restart_and_an_older_state_reads_as_none():
    assert RunState.decode(RunState(poisoned=4).encode()).poisoned == 4
    assert RunState.decode(b'{"next_target": 2}').poisoned == 0


def event(group_id: str) -> SimpleNamespace:
    return SimpleNamespace(data=types_pb2.PoisonedGroup(group_id=group_id, prompt_id="data/e0/3", deliveries=3,
                                                        error="TemplateError: x").SerializeToString())


async def test_the_controller_counts_a_leased_group_once_and_ignores_a_stray_event():
    controller = Controller(load_config(None, ["rollout.max_poisoned_groups=0"]), bus=None, registry=None)
    gid = controller._group_id("step/0/0")
    controller.leased[gid] = types_pb2.PromptGroup(group_id=gid, target_step=0)
    for stray in ("not-leased", controller._group_id("step/0/1")):  # no group id; one not leased
        await controller._on_poisoned(event(stray))
    assert controller.poisoned == 0 and controller.fatal == ""
    await controller._on_poisoned(event(gid))  # the bound is 0: the first one stops the run
    assert controller.poisoned == 1 and "failed with: TemplateError: x" in controller.fatal
    await controller._on_poisoned(event(gid))  # announced again by a worker killed before it dropped the group
    assert controller.poisoned == 1
