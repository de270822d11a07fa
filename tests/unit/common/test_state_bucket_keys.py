"""read_prefixed lists a run-state bucket's keys under a prefix exactly: live ones with their values, never a
deleted or purged one, nor one under another prefix; and the same right after the broker restarts, which is when
a restarted controller reads its leases and submitted environments (real NATS, file storage)."""

from __future__ import annotations

import asyncio

import nats

from services.common.bus import open_state_bucket, read_prefixed
from services.common.infra import start_nats


async def _read(url: str) -> tuple[dict[str, bytes], dict[str, bytes], dict[str, bytes]]:
    nc = await nats.connect(url)
    js = nc.jetstream()
    kv = await open_state_bucket(js, "keys")
    try:
        return (await read_prefixed(js, kv, "lease."), await read_prefixed(js, kv, "validated.", skip={"validated.1"}),
                await read_prefixed(js, kv, "env."))
    finally:
        await nc.close()


def test_keys_under_a_prefix_are_listed_exactly_before_and_after_a_broker_restart(tmp_path):
    server = start_nats(tmp_path / "nats")

    async def fill() -> None:
        nc = await nats.connect(server.url)
        kv = await open_state_bucket(nc.jetstream(), "keys")
        for i in range(300):
            await kv.put(f"lease.g{i}", f"group {i}".encode())
        for i in range(0, 300, 7):
            await kv.purge(f"lease.g{i}")  # trained: the marker keeps the subject
        await kv.delete("lease.g1")
        await kv.put("lease.g2", b"leased again")
        for v in range(3):
            await kv.put(f"validated.{v}", f'{{"v": {v}}}'.encode())
        await kv.put("controller", b"{}")
        await nc.close()

    asyncio.run(fill())
    live = {f"lease.g{i}": f"group {i}".encode() for i in range(300) if i % 7 and i != 1} | {"lease.g2": b"leased again"}
    validated = {"validated.0": b'{"v": 0}', "validated.2": b'{"v": 2}'}
    try:
        assert asyncio.run(_read(server.url)) == (live, validated, {})
        for _ in range(3):
            server.stop()
            server = start_nats(tmp_path / "nats", port=server.port)
            assert asyncio.run(_read(server.url)) == (live, validated, {})
    finally:
        server.stop()
