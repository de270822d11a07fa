"""A stopped controller's successor continues the run: run state in a NATS KV bucket (real NATS)."""

import asyncio
import json
import time
from collections import Counter
from types import SimpleNamespace

from nats.js.api import RetentionPolicy, StorageType, StreamConfig

from services.common.bus import WORK_DEDUP_WINDOW_S, Bus
from services.common.config import load_config
from services.common.pb.flywheel.v1 import controller_pb2, types_pb2
from services.common.data import load_data
from services.controller.datasets import EpochCursor
from services.controller.main import Controller
from services.controller.registry import Entry, Registry
from services.controller.state import RunState, StateStore

ROWS, PER_STEP, EPOCHS = 10, 3, 2  # 3 steps per epoch (one row dropped), 6 steps in all


def _cfg(tmp_path, nats_url: str):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"problem": f"p{i}", "expected_answer": str(i)}) + "\n" for i in range(ROWS)))
    return load_config(None, ["environments=[]", f"data.train.data_path={train}", f"grpo.num_prompts_per_step={PER_STEP}",
                              f"grpo.max_num_epochs={EPOCHS}", "grpo.max_num_steps=6", "grpo.async_grpo.enabled=false",
                              f"addresses.nats_url={nats_url}", "run.name=resume"])


async def _controller(cfg, bus: Bus) -> Controller:
    rows = load_data(cfg).train[0].rows
    registry = Registry(cfg)  # entries set here: no environment service in this test
    registry.entries["math"] = Entry(proto=controller_pb2.EnvironmentSpec(name="math", kind="math", weight=1),
                                     cursor=EpochCursor(rows, prompts_per_step=PER_STEP, epochs=EPOCHS, seed=1,
                                                        shuffle=True), num_prompts=len(rows))
    state = await StateStore.open(bus.js, cfg.run.name)
    controller = Controller(cfg, bus, registry, None, state)
    await controller.resume()
    return controller


async def _serve_versions(controller: Controller, versions: range) -> None:
    """What rollout's weight loads do: each new version opens the admission window one step further."""
    for v in versions:
        controller.workers["rollout-a"] = (v, time.monotonic())
        await controller._lease_window()
        await controller.state.save(controller.snapshot())
        await controller.state.save_leases(controller.leased)


def _report(*group_ids: str):
    """A StaleGroups message as the stale and filtered consumers hand it over (replay's announcement)."""
    return SimpleNamespace(data=types_pb2.StaleGroups(group_ids=list(group_ids)).SerializeToString())


async def _leased(bus: Bus) -> list[types_pb2.PromptGroup]:
    sub = await bus.js.pull_subscribe(bus.subjects.work, durable="test")
    msgs = await sub.fetch(100, timeout=2)
    return [types_pb2.PromptGroup.FromString(m.data) for m in msgs]


def test_a_restarted_controller_leases_each_prompt_of_each_epoch_exactly_once(tmp_path, nats_server):
    cfg = _cfg(tmp_path, nats_server.url)

    async def go():
        bus = await Bus.connect(cfg.addresses.nats_url, cfg.run.name)
        await _serve_versions(await _controller(cfg, bus), range(0, 2))  # steps 0 and 1: mid-epoch 0
        await bus.close()  # the whole controller stops
        bus = await Bus.connect(cfg.addresses.nats_url, cfg.run.name)
        restarted = await _controller(cfg, bus)
        assert restarted.next_target == 2
        await _serve_versions(restarted, range(2, 6))
        groups = await _leased(bus)
        await bus.close()
        return groups

    groups = asyncio.run(go())
    assert Counter(g.target_step for g in groups) == {t: PER_STEP for t in range(6)}
    ids = [g.prompt_id for g in groups]
    assert len(ids) == len(set(ids)) == 18
    for epoch in range(EPOCHS):
        rows = {i.split("/")[-1] for i in ids if f"/e{epoch}/" in i}
        assert len(rows) == 9  # every kept row of the epoch once; the dropped one never


def test_a_stale_report_handled_again_after_a_restart_leases_one_replacement(tmp_path, nats_server):
    """The report's consumer acks after the re-lease: a controller killed in between gets it again."""
    cfg = _cfg(tmp_path, nats_server.url)

    async def go():
        bus = await Bus.connect(cfg.addresses.nats_url, cfg.run.name)
        first = await _controller(cfg, bus)
        await _serve_versions(first, range(0, 2))
        gid, old = next((gid, g) for gid, g in first.leased.items() if g.target_step == 1)
        stale = _report(gid)
        first.trained_step = 0
        await first._on_stale(stale)  # the replacement published and saved; killed before the ack
        await bus.close()
        bus = await Bus.connect(cfg.addresses.nats_url, cfg.run.name)
        restarted = await _controller(cfg, bus)
        restarted.trained_step = 0
        await restarted._on_stale(stale)  # redelivered
        groups = await _leased(bus)
        await bus.close()
        return groups, gid, old.prompt_id

    groups, gid, prompt = asyncio.run(go())
    assert len([g for g in groups if g.prompt_id == prompt and g.group_id != gid]) == 1


def test_a_stale_report_announced_twice_leases_one_replacement(tmp_path, nats_server):
    """Replay killed after publishing its outbox and before trimming it announces the same ids again."""
    cfg = _cfg(tmp_path, nats_server.url)

    async def go():
        bus = await Bus.connect(cfg.addresses.nats_url, cfg.run.name)
        controller = await _controller(cfg, bus)
        await _serve_versions(controller, range(0, 2))
        before = dict(controller.leased)
        gid = next(gid for gid, g in before.items() if g.target_step == 1)
        controller.trained_step = 0
        stale = _report(gid)
        await controller._on_stale(stale)
        await controller._on_stale(stale)
        groups = await _leased(bus)
        await bus.close()
        return groups, before, controller.registry.entries["math"].cursor.offset, controller.releases

    groups, before, offset, releases = asyncio.run(go())
    assert len(groups) == len(before) + 1 and releases == 1
    assert offset == 2 * PER_STEP, "the second report took no prompt from the dataset"


def test_a_stale_group_of_an_environment_that_left_the_mix_is_replaced_by_a_prompt_of_the_mix(tmp_path, nats_server):
    """Rollout announces a group stale when its environment is gone (removed; NOT_FOUND): leasing the same prompt
    again would fail again, so the replacement is drawn from the environments still in the mix."""
    cfg = _cfg(tmp_path, nats_server.url)

    async def go():
        bus = await Bus.connect(cfg.addresses.nats_url, cfg.run.name)
        controller = await _controller(cfg, bus)
        await _serve_versions(controller, range(0, 2))
        gone = next(g for g in controller.leased.values() if g.target_step == 1)
        gone.env_name = "removed"  # as if leased from an environment that was removed since
        controller.trained_step = 0
        offset = controller.registry.entries["math"].cursor.offset
        await controller._on_stale(_report(gone.group_id))
        groups = await _leased(bus)
        await bus.close()
        return groups, gone, controller.registry.entries["math"].cursor.offset - offset

    groups, gone, drawn = asyncio.run(go())
    replacement = groups[-1]
    assert drawn == 1, "one new prompt drawn from the mix"
    assert (replacement.env_name, replacement.target_step) == ("math", 1)
    assert replacement.prompt_id != gone.prompt_id and replacement.group_id != gone.group_id


def test_a_filtered_report_announced_twice_refills_once_and_counts_once(tmp_path, nats_server):
    """A refill counted twice would also bring the dynamic-sampling budget's fatal stop early."""
    cfg = _cfg(tmp_path, nats_server.url)

    async def go():
        bus = await Bus.connect(cfg.addresses.nats_url, cfg.run.name)
        controller = await _controller(cfg, bus)
        await _serve_versions(controller, range(0, 1))
        gid = next(iter(controller.leased))
        await controller._on_filtered(_report(gid))
        await controller._on_filtered(_report(gid))
        groups = await _leased(bus)
        await bus.close()
        return groups, controller.refills, controller.releases

    groups, refills, releases = asyncio.run(go())
    assert len(groups) == PER_STEP + 1 and refills == {0: 1} and releases == 1


def test_run_state_round_trips_through_the_bucket(nats_server):
    async def go():
        bus = await Bus.connect(nats_server.url, "rt")
        store = await StateStore.open(bus.js, "rt")
        assert await store.load() is None
        await store.save(RunState(next_target=7, offsets={"math": 21}, leased={"math": 21}, releases=2))
        again = await StateStore.open(bus.js, "rt")
        loaded = await again.load()
        await bus.close()
        return loaded

    assert asyncio.run(go()) == RunState(next_target=7, offsets={"math": 21}, leased={"math": 21}, releases=2)


def test_used_up_epochs_stop_the_run_with_the_reason_instead_of_starving_the_trainer(tmp_path, nats_server):
    cfg = _cfg(tmp_path, nats_server.url)

    async def go():
        bus = await Bus.connect(cfg.addresses.nats_url, cfg.run.name)
        controller = await _controller(cfg, bus)
        controller.registry.entries["math"].cursor.seek(6 * PER_STEP - 1)  # as if refills used up the data
        await _serve_versions(controller, range(0, 6))
        await bus.close()
        return controller.fatal

    assert "has no prompts left: grpo.max_num_epochs=2 are used up" in asyncio.run(go())


def test_a_group_leased_before_the_stop_that_goes_stale_after_it_is_leased_again(tmp_path, nats_server):
    cfg = _cfg(tmp_path, nats_server.url)

    async def go():
        bus = await Bus.connect(cfg.addresses.nats_url, cfg.run.name)
        first = await _controller(cfg, bus)
        await _serve_versions(first, range(0, 2))
        in_flight = {gid: g.prompt_id for gid, g in first.leased.items() if g.target_step == 1}
        await bus.close()
        bus = await Bus.connect(cfg.addresses.nats_url, cfg.run.name)
        restarted = await _controller(cfg, bus)
        gid = next(iter(in_flight))
        restarted.trained_step = 0
        await restarted._on_stale(_report(gid))
        again = [g for g in restarted.leased.values() if g.prompt_id == in_flight[gid] and g.group_id != gid]
        await bus.close()
        return again, gid in restarted.leased

    again, old_still_leased = asyncio.run(go())
    assert len(again) == 1 and again[0].target_step == 1 and not old_still_leased


def test_a_group_that_goes_stale_after_its_lease_was_forgotten_is_replaced_by_a_new_prompt(tmp_path, nats_server):
    """A group that reached replay long after its step was trained (an outage held it back): the step borrowed
    a later step's group, so the run is one group short; the controller leases a new prompt for the next step."""
    cfg = _cfg(tmp_path, nats_server.url)

    async def go():
        bus = await Bus.connect(cfg.addresses.nats_url, cfg.run.name)
        controller = await _controller(cfg, bus)
        await _serve_versions(controller, range(0, 2))
        before = dict(controller.leased)
        controller.trained_step = 3
        await controller._on_stale(_report("0f" * 16))  # an id of a lease's form, forgotten
        new = [g for gid, g in controller.leased.items() if gid not in before]
        await bus.close()
        return new, controller.releases, {g.prompt_id for g in before.values()}

    new, releases, earlier_prompts = asyncio.run(go())
    assert len(new) == 1 and new[0].target_step == 4 and releases == 1
    assert new[0].prompt_id not in earlier_prompts, "a new prompt, not one already leased"


def test_an_event_naming_no_group_id_leases_nothing_and_leaves_the_controller_running(tmp_path, nats_server):
    """Only a sha256 prefix can be a lease's id. A megabyte id reached the saved intent of a lease unit, whose save
    then failed: the controller stopped, and the event came back to every successor (the fuzzer's stale subject)."""
    cfg = _cfg(tmp_path, nats_server.url)

    async def go():
        bus = await Bus.connect(cfg.addresses.nats_url, cfg.run.name)
        controller = await _controller(cfg, bus)
        await _serve_versions(controller, range(0, 2))
        before = dict(controller.leased)
        for stray in ("g1", "0F" * 16, "0f" * 17, "x" * ((1 << 20) - 100)):
            await controller._on_stale(_report(stray))
            await controller._on_filtered(_report(stray))
        await bus.close()
        return before, dict(controller.leased), controller.releases, controller.broken

    before, after, releases, broken = asyncio.run(go())
    assert (after, releases, broken) == (before, 0, None)


def test_saving_leases_while_stale_groups_leave_them_keeps_the_bucket_equal_to_what_was_saved(nats_server):
    # CI once crashed the controller here (KeyError): a stale or filtered group left `leased` while
    # save_leases awaited the bucket.
    async def go():
        bus = await Bus.connect(nats_server.url, "race")
        store = await StateStore.open(bus.js, "race")
        leased = {f"g{i}": types_pb2.PromptGroup(group_id=f"g{i}", target_step=i) for i in range(20)}

        async def go_stale() -> None:
            for i in range(0, 20, 2):
                await asyncio.sleep(0)
                leased.pop(f"g{i}")

        await asyncio.gather(store.save_leases(leased), go_stale())
        await store.save_leases(leased)
        kept = await (await StateStore.open(bus.js, "race")).load_leases()
        await bus.close()
        return kept

    assert sorted(asyncio.run(go())) == sorted(f"g{i}" for i in range(1, 20, 2))


def test_a_work_stream_from_before_the_longer_duplicate_window_gets_it_when_a_service_connects(tmp_path, nats_server):
    """A run started by an older version resumes with NATS's 2-minute window; the controller's dedup needs the hour."""
    cfg = _cfg(tmp_path, nats_server.url)

    async def go():
        bus = await Bus.connect(cfg.addresses.nats_url, cfg.run.name)
        name = bus.subjects.stream("work")
        await bus.js.delete_stream(name)
        await bus.js.add_stream(StreamConfig(name=name, subjects=[bus.subjects.work],
                                             retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE))
        before = (await bus.js.stream_info(name)).config.duplicate_window
        await bus.close()
        bus = await Bus.connect(cfg.addresses.nats_url, cfg.run.name)
        after = (await bus.js.stream_info(name)).config.duplicate_window
        await bus.close()
        return before, after

    assert asyncio.run(go()) == (120, WORK_DEDUP_WINDOW_S)
