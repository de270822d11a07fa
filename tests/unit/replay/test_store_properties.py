"""Property test: random put / sample / commit / restart sequences against a slow reference.

The reference below is the buffer written the obvious way, in memory. Every store answer
must equal the reference's, and the invariants the trainer relies on are checked directly:
no duplicate in a batch, each group chosen at most once, the staleness bound, the same
step gives the same batch, and an evicted group never comes back.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from services.common.infra import start_redis
from services.replay.store import Put, ReplayStore, StepCommitted


class Reference:
    """The replay buffer semantics, slowly and plainly."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.unchosen: dict[str, tuple[int, int]] = {}  # id -> (version, ingest seq)
        self.seen: set[str] = set()
        self.choices: dict[int, list[str]] = {}
        self.committed = -1
        self.seq = 0

    def put(self, gid: str, version: int) -> bool:
        if gid in self.seen:
            return False
        self.seen.add(gid)
        self.seq += 1
        self.unchosen[gid] = (version, self.seq)
        return True

    def sample(self, step: int, n: int, k: int) -> tuple[bool, list[str], list[str]]:
        if step in self.choices:
            return True, self.choices[step], []
        if step <= self.committed:
            raise StepCommitted
        stale = sorted((g for g, (v, _) in self.unchosen.items() if step - v > k),
                       key=lambda g: (self.unchosen[g][0], g))
        for g in stale:
            del self.unchosen[g]
        eligible = [g for g, (v, _) in self.unchosen.items() if v <= step]
        if len(eligible) < n:
            return False, [], stale
        if self.policy == "freshest":
            eligible.sort(key=lambda g: (-self.unchosen[g][0], self.unchosen[g][1]))
        else:
            eligible.sort(key=lambda g: self.unchosen[g][1])
        chosen = eligible[:n]
        for g in chosen:
            del self.unchosen[g]
        self.choices[step] = chosen
        return True, chosen, stale

    def commit(self, step: int) -> None:
        self.choices = {s: c for s, c in self.choices.items() if s > step}
        self.committed = max(self.committed, step)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server.url
    server.stop()


ops = st.lists(st.one_of(
    st.tuples(st.just("put"), st.integers(0, 14), st.integers(-1, 2)),  # group id, version - current step
    st.tuples(st.just("sample"), st.integers(0, 2), st.integers(0, 5)),  # 0: an earlier step again, 1: this step, 2: next
    st.tuples(st.just("commit"), st.integers(0, 1), st.just(0)),
    st.tuples(st.just("restart"), st.just(0), st.just(0)),
), max_size=40)


@settings(max_examples=60, deadline=None)
@given(ops=ops, n=st.integers(1, 3), k=st.integers(0, 2), policy=st.sampled_from(["fifo", "freshest"]))
def test_store_matches_reference_and_keeps_invariants(redis_url, ops, n, k, policy):
    asyncio.run(_run(redis_url, ops, n, k, policy))


async def _run(url: str, ops, n: int, k: int, policy: str) -> None:
    clients, run = [Redis.from_url(url)], uuid.uuid4().hex
    store, ref = ReplayStore(clients[0], run), Reference(policy)
    step, asked, chosen_ever, evicted = 0, set(), set(), set()
    try:
        for op, a, b in ops:
            if op == "put":
                gid, version = f"g{a}", max(0, step + b)
                payload = f"{gid}@{version}".encode()
                assert await store.put(Put(group_id=gid, version_start=version, finished_at_s=0.0,
                                           payload=payload)) == ref.put(gid, version)
            elif op == "sample":
                step += a == 2
                ask = sorted(asked)[b % len(asked)] if a == 0 and asked else step
                if ask <= ref.committed and ask not in ref.choices:
                    with pytest.raises(StepCommitted):
                        await store.sample(ask, n, k, policy)
                    continue
                result = await store.sample(ask, n, k, policy)
                ready, ids, stale = ref.sample(ask, n, k)
                assert (result.ready, result.group_ids, sorted(result.stale_ids)) == (ready, ids, sorted(stale))
                evicted.update(stale)
                if ready:
                    versions = [int(p.decode().split("@")[1]) for p in result.payloads]
                    assert len(set(ids)) == len(ids) == n
                    assert all(0 <= ask - v <= k for v in versions)
                    assert not evicted & set(ids)
                    if ask not in asked:
                        assert not chosen_ever & set(ids)
                        chosen_ever.update(ids)
                    asked.add(ask)
            elif op == "commit":
                commit_step = step - a
                if commit_step >= 0:
                    await store.commit(commit_step)
                    ref.commit(commit_step)
            else:
                clients.append(Redis.from_url(url))
                store = ReplayStore(clients[-1], run)
    finally:
        for client in clients:
            await client.aclose()
