"""A real controller process (and the environment service it registers with) on a real NATS, driven the way
rollout and replay drive it, killed from outside, and read back from the broker.

The driver plays rollout's heartbeats (which open the admission window one step at a time) and replay's
"filtered" announcements (each makes the controller draw a refill prompt). No trainer runs: nothing consumes
the work stream, so every group the controller ever published is still in it, in order, which makes the
stream itself the oracle (JetStream's duplicate window stores a republished group id once).

Faults, each observed in the broker rather than in the controller's logs:
- `kill`: SIGKILL at a seeded random moment after a stimulus;
- `work_full`: the work stream refuses new messages (max_msgs reached, discard new), so the controller
  saves a lease and then fails to publish it, and exits;
- `bucket_full`: the state bucket refuses new keys, so the controller publishes a lease and then fails to
  record it (a `lease.<id>` key), and exits. Its run state key is a replacement, which the bucket still takes.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from nats.js.api import DiscardPolicy
from nats.js.errors import NotFoundError

from services.common.bus import Bus, state_bucket
from services.common.config import load_config
from services.common.pb.flywheel.v1 import types_pb2
from services.controller.state import KEY, RunState
from services.local import LocalStack

ROWS, PER_STEP, STEPS = 40, 3, 8


def config(tmp_path: Path):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"problem": f"p{i}", "expected_answer": str(i)}) + "\n" for i in range(ROWS)))
    return load_config(None, ["environments=[]", f"data.train.data_path={train}", f"grpo.num_prompts_per_step={PER_STEP}",
                              "grpo.max_num_epochs=1", f"grpo.max_num_steps={STEPS}", "grpo.async_grpo.enabled=false",
                              "run.name=leases"])


@dataclass
class Driver:
    stack: LocalStack
    bus: Bus
    version: int = 0
    points: list[str] = field(default_factory=list)
    """Where each kill landed, as the broker showed it (before the save, saved not published, ...)."""
    filtered: set[str] = field(default_factory=set)

    @property
    def proc(self):
        return self.stack.children.procs["controller"]

    async def start_controller(self) -> None:
        """Returns once it serves: a controller still starting would undo an injected stream limit (it sets the
        streams' config when it connects)."""
        self.stack.children.start("controller", "controller", self.stack.config_path)
        await asyncio.to_thread(self.stack.wait_serving, "controller", 120)

    async def heartbeats(self) -> None:
        """What rollout does: its loaded version every 0.5 s (the controller forgets a silent worker in 10 s)."""
        while True:
            await self.bus.emit(self.bus.subjects.heartbeat,
                                types_pb2.RolloutHeartbeat(worker_id="driver", loaded_version=self.version))
            await asyncio.sleep(0.5)

    async def published(self) -> list[types_pb2.PromptGroup]:
        """Every group in the work stream, in publish order (nothing consumes it in these tests)."""
        name = self.bus.subjects.stream("work")
        last = (await self.bus.js.stream_info(name)).state.last_seq
        out = []
        for seq in range(1, last + 1):
            try:
                out.append(types_pb2.PromptGroup.FromString((await self.bus.js.get_msg(name, seq)).data))
            except NotFoundError:
                continue
        return out

    async def saved(self) -> RunState | None:
        kv = await self.bus.js.key_value(state_bucket(self.bus.subjects.run))
        try:
            return RunState.decode((await kv.get(KEY)).value)
        except Exception:  # noqa: BLE001 (no bucket or key yet: a controller that never saved)
            return None

    async def announce_filtered(self, group_id: str) -> None:
        """What replay does with a group whose rewards are all equal (dynamic sampling)."""
        self.filtered.add(group_id)
        await self.bus.js.publish(self.bus.subjects.filtered,
                                  types_pb2.StaleGroups(group_ids=[group_id]).SerializeToString())

    async def refuse_new(self, stream: str, on: bool) -> None:
        """Make `stream` refuse any message that does not replace one (max_msgs reached, discard new), or undo it."""
        info = await self.bus.js.stream_info(stream)
        cfg = replace(info.config, max_msgs=info.state.messages if on else -1,
                      discard=DiscardPolicy.NEW if on or stream.startswith("KV_") else DiscardPolicy.OLD)
        await self.bus.js.update_stream(cfg)

    async def where(self) -> str:
        """Which point of the lease sequence the broker shows: the saved pending groups against the stream."""
        saved = await self.saved()
        pending = set(saved.pending) if saved else set()
        if not pending:
            return "nothing pending"
        stored = {g.group_id for g in await self.published()}
        return "published, not recorded" if pending <= stored else "saved, not published"

    async def wait_exit(self, timeout_s: float = 120) -> int:
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None:
            assert time.monotonic() < deadline, "the controller did not exit on the injected fault"
            await asyncio.sleep(0.1)
        return self.proc.returncode

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    async def settled(self, timeout_s: float = 180) -> list[types_pb2.PromptGroup]:
        """The stream once every step and every refill is leased and nothing is pending."""
        want = STEPS * PER_STEP + len(self.filtered)
        deadline = time.monotonic() + timeout_s
        while True:
            groups, saved = await self.published(), await self.saved()
            if len(groups) >= want and saved is not None and not saved.pending:
                return groups
            assert self.proc.poll() is None, f"the controller exited ({self.proc.returncode})"
            assert time.monotonic() < deadline, f"{len(groups)} groups leased of {want}"
            await asyncio.sleep(0.5)
