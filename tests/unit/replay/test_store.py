"""ReplayStore against a real Redis: idempotent puts, reproducible batches, staleness, GC."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from groups import make_group
from services.replay.store import Put, ReplayStore, StepCommitted


@pytest.fixture
async def redis(redis_server):
    client = Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


def put(group_id: str, version: int = 0) -> Put:
    return Put(group_id=group_id, version_start=version, finished_at_s=1000.0 + version,
               payload=make_group(group_id, version).SerializeToString())


async def fill(store: ReplayStore, *versions: int, prefix: str = "g") -> list[str]:
    ids = [f"{prefix}{i}" for i in range(len(versions))]
    assert await store.put_many(put(i, v) for i, v in zip(ids, versions)) == [True] * len(ids)
    return ids


async def test_put_stores_a_group_once_and_counts_the_duplicate(redis):
    store = ReplayStore(redis, "run")
    assert await store.put(put("a"))
    assert not await store.put(put("a"))
    stats = await store.stats()
    assert (stats.size, stats.duplicates) == (1, 1)


async def test_put_leaves_no_payload_on_its_way_in(redis):
    store = ReplayStore(redis, "run")
    assert await store.put_many([put("a"), put("a"), put("b")]) == [True, False, True]
    assert await redis.keys(store.prefix + "in:*") == []
    assert await redis.ttl(store.prefix + "g:a") == -1  # the staging expiry does not follow the stored group
    assert (await store.sample(0, 2, 0)).payloads == [put("a").payload, put("b").payload]


async def test_a_payload_left_by_a_crash_before_its_put_is_taken_by_the_redelivery(redis):
    store = ReplayStore(redis, "run")
    await redis.set(store.prefix + "in:a", b"half-way", ex=60)  # replay died between the SET and the PUT
    assert await store.put(put("a"))
    assert (await store.sample(0, 1, 0)).payloads == [put("a").payload]
    await redis.set(store.prefix + "in:a", b"again", ex=60)  # and once more, after the group was stored
    assert not await store.put(put("a"))
    assert await redis.keys(store.prefix + "in:*") == []


async def test_sample_returns_same_batch_when_step_is_asked_twice(redis):
    store = ReplayStore(redis, "run")
    await fill(store, 0, 0, 0, 0)
    first = await store.sample(0, 2, 0)
    await fill(store, 0, 0, prefix="late")
    again = await store.sample(0, 2, 0)
    restarted = await ReplayStore(redis, "run").sample(0, 2, 0)
    assert first.ready and first.group_ids == ["g0", "g1"]
    assert again.group_ids == restarted.group_ids == first.group_ids
    assert again.payloads == first.payloads and again.replayed


async def test_sample_records_nothing_when_the_batch_is_incomplete(redis):
    store = ReplayStore(redis, "run")
    await fill(store, 0, 0)
    result = await store.sample(0, 3, 0)
    assert (result.ready, result.missing, result.group_ids) == (False, 1, [])
    await fill(store, 0, prefix="h")
    assert (await store.sample(0, 3, 0)).group_ids == ["g0", "g1", "h0"]


async def test_sample_evicts_stale_groups_and_never_returns_them(redis):
    store = ReplayStore(redis, "run")
    await fill(store, 0, 1, 2, 3)
    result = await store.sample(3, 2, 1)
    assert result.stale_ids == ["g0", "g1"]
    assert result.group_ids == ["g2", "g3"]
    assert (await store.stats()).stale_dropped == 2
    assert not await store.put(put("g0"))  # a late redelivery of an evicted group stays out


async def test_groups_newer_than_the_step_are_not_eligible(redis):
    store = ReplayStore(redis, "run")
    await fill(store, 2, 0)
    assert (await store.sample(0, 2, 5)).missing == 1
    assert (await store.sample(0, 1, 5)).group_ids == ["g1"]
    assert (await store.sample(2, 1, 5)).group_ids == ["g0"]


async def test_freshest_policy_prefers_highest_version_then_ingest_order(redis):
    store = ReplayStore(redis, "run")
    await fill(store, 1, 3, 2, 3)
    result = await store.sample(3, 3, 3, "freshest")
    assert result.group_ids == ["g1", "g3", "g2"]


async def test_staleness_bound_holds_after_a_restart(redis):
    await fill(ReplayStore(redis, "run"), 0, 1, 4, 5)
    store = ReplayStore(redis, "run")
    result = await store.sample(5, 2, 1)
    assert result.group_ids == ["g2", "g3"] and sorted(result.stale_ids) == ["g0", "g1"]


async def test_commit_deletes_chosen_groups_and_keeps_later_steps(redis):
    store = ReplayStore(redis, "run")
    await fill(store, 0, 0, 0, 0)
    step0 = await store.sample(0, 2, 1)
    step1 = await store.sample(1, 2, 1)
    assert await store.commit(0) == 2
    assert await redis.exists(*(f"{store.prefix}g:{i}" for i in step0.group_ids)) == 0
    assert (await store.sample(1, 2, 1)).group_ids == step1.group_ids
    assert not await store.put(put(step0.group_ids[0]))  # tombstone: no second life after GC


async def test_sample_of_a_committed_step_is_refused(redis):
    store = ReplayStore(redis, "run")
    await fill(store, 0, 0)
    await store.sample(0, 1, 0)
    await store.commit(0)
    with pytest.raises(StepCommitted):
        await store.sample(0, 1, 0)


async def test_a_batch_deleted_after_its_choice_was_read_answers_step_committed(redis):
    """What a Commit that runs between the SAMPLE script and the MGET of its batch leaves behind."""
    store = ReplayStore(redis, "run")
    await fill(store, 0, 0)
    await store.sample(0, 2, 0)
    await redis.delete(store.prefix + "c:0:1")
    with pytest.raises(StepCommitted):
        await store.sample(0, 2, 0)


async def test_a_chosen_group_is_refused_until_and_after_its_step_is_committed(redis):
    store = ReplayStore(redis, "run")
    await fill(store, 0, 0)
    chosen = (await store.sample(0, 1, 0)).group_ids[0]
    assert not await store.put(put(chosen))  # chosen, its step not committed
    await store.commit(0)
    assert not await store.put(put(chosen))  # committed: the tombstone
    assert await redis.scard(store.prefix + "held") == 0


async def test_put_and_sample_after_redis_lost_its_scripts_load_them_again(redis):
    store = ReplayStore(redis, "run")
    await fill(store, 0)
    await redis.script_flush()
    await fill(store, 0, prefix="h")
    await redis.script_flush()
    assert (await store.sample(0, 2, 0)).payloads == [put("g0").payload, put("h0").payload]


async def test_a_recorded_batch_is_returned_whole_to_a_caller_that_asks_for_fewer(redis):
    store = ReplayStore(redis, "run")
    await fill(store, 0, 0, 0)
    first = await store.sample(0, 3, 0)
    again = await store.sample(0, 1, 0)
    assert again.replayed and again.group_ids == first.group_ids and again.payloads == first.payloads


async def test_stats_report_sizes_by_version_and_counters(redis):
    store = ReplayStore(redis, "run")
    await fill(store, 0, 1, 1, 2)
    assert await store.count_dead_letter("s:1") and not await store.count_dead_letter("s:1")
    stats = await store.stats()
    assert stats.size == 4 and stats.size_by_version == {0: 1, 1: 2, 2: 1}
    assert stats.oldest_finished_at_s == 1000.0 and stats.dead_lettered == 1


async def test_runs_do_not_share_keys(redis):
    a, b = ReplayStore(redis, "a"), ReplayStore(redis, "b")
    await fill(a, 0)
    assert await b.put(put("g0"))
    assert (await b.stats()).size == 1 and (await a.sample(0, 1, 0)).group_ids == ["g0"]
