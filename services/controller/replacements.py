"""The controller's answers to rollout's and replay's events: a group gone stale, filtered by dynamic sampling, or
poisoned gets a replacement lease, one lease unit each (main.py's docstring: intent saved, published, saved; the
event acked after). A Controller mixin: these read and change its leases and counters.

    replay StaleGroups (stale) ──▶ the same prompt again, for the step that waits for it
    replay StaleGroups (filtered) ──▶ a new prompt for its step, within grpo.dynamic_sampling_max_gen_batches
    rollout PoisonedGroup ──▶ counted; a new prompt, or the run stops past rollout.max_poisoned_groups (poison.py)
"""

from __future__ import annotations

import logging

from services.common.logs import RateLimitedLog
from services.common.pb.flywheel.v1 import types_pb2
from services.controller import poison

log = logging.getLogger("flywheel.controller")
_warn = RateLimitedLog(log)


def refill_budget(g) -> int:
    """Extra prompts one step may lease: dynamic_sampling_max_gen_batches counts the first batch too."""
    return (g.dynamic_sampling_max_gen_batches - 1) * g.num_prompts_per_step


class Replacements:
    async def _on_stale(self, msg) -> None:
        ids = self._event_ids(msg, "stale")  # before the lock: a stray event is dropped without waiting for a unit
        if ids:
            async with self.leasing:
                for gid in ids:
                    await self._stale(gid)

    def _event_ids(self, msg, kind: str) -> list[str]:
        """A StaleGroups event's group ids of _group_id's form; any other is a stray id, warned about and skipped."""
        ids = types_pb2.StaleGroups.FromString(msg.data).group_ids
        kept = [gid for gid in ids if self._is_group_id(gid)]
        if len(kept) < len(ids):
            stray = next(gid for gid in ids if not self._is_group_id(gid))
            _warn.warning(kind, "ignored %d id(s) of a %s event that are no group id, e.g. %r", len(ids) - len(kept),
                          kind, stray[:64])
        return kept

    async def _stale(self, gid: str) -> None:
        key = f"again/{gid}"
        if self._group_id(key) in self.leased:  # announced twice: replaced already
            return
        old = self.leased.get(gid)
        self.releases += 1
        if old is not None:
            # For the step that is waiting for data: the same prompt, unless its environment left the mix
            # (removed; rollout could not score it), then a prompt of the mix as it is now.
            again = old.env_name in self.registry.entries
            await self._unit({"target": max(self.trained_step + 1, old.target_step), "key": key, "drop": gid,
                              "again": again})
        else:
            # Leased so long ago that it was forgotten (it reached replay late, e.g. after an outage):
            # its step was filled from later steps' groups, so the run is one group short. A new prompt.
            log.warning("group %s went stale after its lease was forgotten; leasing a new prompt", gid)
            await self._unit({"target": self.trained_step + 1, "key": key, "drop": gid, "again": False})

    async def _on_filtered(self, msg) -> None:
        """Dynamic sampling: a group with equal rewards was dropped; a new prompt refills its step."""
        ids = self._event_ids(msg, "filtered")
        if ids:
            async with self.leasing:
                for gid in ids:
                    if not await self._refill(gid):
                        return

    async def _refill(self, gid: str) -> bool:
        """False when the step is past its refill budget (the run stops)."""
        key = f"refill/{gid}"
        if self._group_id(key) in self.leased:  # announced twice: refilled already
            return True
        old = self.leased.get(gid)  # None: forgotten, its step filled from later ones (see _stale)
        target = self.trained_step + 1 if old is None else max(self.trained_step + 1, old.target_step)
        self.refills[target] = self.refills.get(target, 0) + 1
        if self.refills[target] > refill_budget(self.cfg.grpo):
            self.fatal = (f"dynamic sampling: step {target} needed more than grpo.dynamic_sampling_max_gen_batches="
                          f"{self.cfg.grpo.dynamic_sampling_max_gen_batches} batches of prompts to find "
                          f"{self.cfg.grpo.num_prompts_per_step} groups whose rewards differ")
            self.wake.set()
            return False
        self.releases += 1
        await self._unit({"target": target, "key": key, "drop": gid, "again": False})
        return True

    async def _on_poisoned(self, msg) -> None:
        """A group no delivery could run: counted, and a new prompt leased in its place, not the same one (it
        would fail again); past rollout.max_poisoned_groups the run stops."""
        p = types_pb2.PoisonedGroup.FromString(msg.data)
        if not self._is_group_id(p.group_id):  # before the lock, as _event_ids
            _warn.warning("poisoned", "ignored a poisoned-group event for %r: no group id", p.group_id[:64])
            return
        async with self.leasing:
            old = self.leased.get(p.group_id)
            if old is None or self.fatal:  # announced twice, or no lease of this run: a stray event must not stop it
                _warn.warning("poisoned", "ignored a poisoned-group event for group %r, not leased", p.group_id[:64])
                return
            self.poisoned += 1
            log.error("%s", poison.describe(p))
            self.fatal = poison.run_failure(self.poisoned, self.cfg.rollout, p)
            if self.fatal:
                self.leased.pop(p.group_id)
                self.wake.set()
                return
            self.releases += 1
            await self._unit({"target": max(self.trained_step + 1, old.target_step), "key": f"poisoned/{p.group_id}",
                              "drop": p.group_id, "again": False})
