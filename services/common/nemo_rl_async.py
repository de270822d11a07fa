"""NeMo RL's single-controller `async_rl` block -> Flywheel's async GRPO (docs/nemo_rl_mapping.md, "async_rl").

NeMo RL's single-controller loop (nemo_rl/algorithms/single_controller.py at 7ea279a) reads `async_rl` instead
of `grpo.async_grpo` (its entrypoint refuses both at once). Its sampler is the staleness policy:

    in_order  max_lookahead_versions L ──▶ grpo.async_grpo: L = 0 disabled (synchronous), else enabled with
                                            max_trajectory_age_steps L and in_flight_weight_updates true
    windowed  max_staleness_versions k ──▶ the same with k; sample_freshest_first true ──▶ replay.selection freshest
    ready_first, weight_fifo, custom   ──▶ refused, each with its reason (SAMPLER_REFUSED)
    recompute_kv_cache_after_weight_updates ──▶ grpo.async_grpo.recompute_kv_cache_after_weight_updates
    max_buffered_rollouts              ──▶ replay.capacity_groups

Why L is k: in_order admits dispatch batch t only while the trainer is at version >= t - L, which is Flywheel's
admission rule (the controller leases for step t only while rollout's weights are >= t - k), so no group trains
more than L versions after the weights it started on. The single controller keeps generating through a weight
sync (vLLM's async engine takes the new weights under running requests), which is in_flight_weight_updates.
The other async_rl keys are RULES below: accepted where they ask for what Flywheel does, refused otherwise.
"""

from __future__ import annotations

from typing import Any

from services.common.config_loader import Problem
from services.common.nemo_rl_rules import Rule, any_, get, is_, off

SAMPLER_REFUSED = {
    "ready_first": "ready_first trains every ready group however old (stragglers past its admission window are "
                   "never evicted); Flywheel bounds every group's age by grpo.async_grpo.max_trajectory_age_steps "
                   "and drops older ones",
    "weight_fifo": "weight_fifo drains one weight version at a time, oldest first, waiting for its batch to fill; "
                   "Flywheel's replay.selection is fifo (ingest order) or freshest, over every eligible version",
    "custom": "a sampler class loaded from user code is not built",
}
STALENESS = {"in_order": "max_lookahead_versions", "windowed": "max_staleness_versions"}
"""The samplers Flywheel's async GRPO is, and the key each names its staleness bound by (NeMo RL's default 1)."""
ORDER = {"in_order": "; a step takes the first eligible groups in ingest order (replay.selection), not only the "
                    "batch dispatched for it, under the same bound"}
"""Where a sampler's batch composition differs from replay's while the staleness bound is the same."""


def prepare(tree: dict, problems: list[Problem], notes: list[Problem]) -> None:
    """async_rl's sampler, KV recompute and buffer cap -> grpo.async_grpo and replay; the rest is left to RULES."""
    block = _block(tree, problems, notes)
    if block is None:
        return
    sampler = block.pop("sampler", None) or {"name": "in_order"}  # NeMo RL's default sampler
    recompute = block.pop("recompute_kv_cache_after_weight_updates", False)
    cap = block.pop("max_buffered_rollouts", None)
    grpo = tree.setdefault("grpo", {})
    if grpo.get("async_grpo") is not None:
        problems.append(("grpo.async_grpo", "set beside async_rl: NeMo RL's single-controller entrypoint refuses "
                         "both; set grpo.async_grpo=null (async_rl's sampler maps onto it)"))
        return
    grpo.pop("async_grpo", None)  # NeMo RL's single-controller configs null it; the sampler decides it
    name = sampler.get("name")
    if name not in STALENESS:
        why = SAMPLER_REFUSED.get(name, "not one of NeMo RL's samplers")
        problems.append(("async_rl.sampler.name", f"Flywheel cannot honour {name!r}: {why}"))
        return
    k = _sampler_bound(sampler, name, tree, problems)
    if k is not None:
        grpo["async_grpo"] = _async_grpo(name, k, recompute, notes)
        _buffer(cap, tree, problems)


def _block(tree: dict, problems: list[Problem], notes: list[Problem]) -> dict | None:
    """The async_rl mapping to translate, or None (absent; null, accepted; anything else, refused)."""
    block = tree.get("async_rl", {})
    if isinstance(block, dict):
        return block if "async_rl" in tree else None
    if block is None:
        del tree["async_rl"]
        notes.append(("async_rl", "accepted, no effect: null asks for no single-controller mode"))
    else:
        problems.append(("async_rl", f"must be a mapping (NeMo RL's single-controller settings), not {block!r}"))
    return None


def _async_grpo(name: str, k: int, recompute: bool, notes: list[Problem]) -> dict:
    """grpo.async_grpo for a sampler of staleness bound k (0: synchronous)."""
    if k == 0:
        notes.append(("async_rl.sampler", f"{name} with {STALENESS[name]} 0 is synchronous GRPO: "
                      "grpo.async_grpo.enabled false"))
        if recompute:  # nothing generates through a sync then, and rollout drops its prefix cache after each load
            notes.append(("async_rl.recompute_kv_cache_after_weight_updates", "accepted, no effect: synchronous, "
                          "no request runs through a weight sync, and rollout drops its KV cache after every load"))
        return {"enabled": False}
    notes.append(("async_rl.sampler", f"{name} with {STALENESS[name]} {k} is grpo.async_grpo with "
                  f"max_trajectory_age_steps {k}, in_flight_weight_updates true (the single controller generates "
                  "through a weight sync)" + ORDER.get(name, "")))
    return {"enabled": True, "max_trajectory_age_steps": k, "in_flight_weight_updates": True,
            "recompute_kv_cache_after_weight_updates": bool(recompute)}


def _sampler_bound(sampler: dict, name: str, tree: dict, problems: list[Problem]) -> int | None:
    """The sampler's staleness bound; windowed's freshest-first order moves to replay.selection."""
    rest = {key: v for key, v in sampler.items() if key not in ("name", STALENESS[name])}
    if name == "windowed" and rest.pop("sample_freshest_first", False):
        tree.setdefault("replay", {})["selection"] = "freshest"  # smallest lag first, ingest order on ties
    for key in rest:
        problems.append((f"async_rl.sampler.{key}", f"not a key of NeMo RL's {name} sampler"))
    k = sampler.get(STALENESS[name], 1)
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        problems.append((f"async_rl.sampler.{STALENESS[name]}", f"must be a count of versions, not {k!r}"))
        return None
    return None if rest else k


def _buffer(cap: Any, tree: dict, problems: list[Problem]) -> None:
    """max_buffered_rollouts is replay.capacity_groups: the unconsumed groups held before generation backs off."""
    if cap is None:
        return
    n = get(tree, "grpo.num_prompts_per_step", 16)
    if not isinstance(cap, int) or cap < n:
        problems.append(("async_rl.max_buffered_rollouts", f"Flywheel cannot honour {cap!r}: below "
                         f"grpo.num_prompts_per_step ({n}), no step's batch could ever be stored"))
        return
    tree.setdefault("replay", {})["capacity_groups"] = cap


A = "async_rl"
F = f"{A}.rollout_failure"
REDELIVERED = ("Flywheel drops no prompt: the work queue redelivers a failed generation (after ack_wait) until it "
               "lands; dropping a prompt and training its step short or on a substitute is not built")
RETRY = ("retries before NeMo RL gives up on a prompt (it then fails the run, its budgets being 0): Flywheel's "
         "work queue redelivers a failed generation without such a budget; which groups train is the same")
RULES: tuple[Rule, ...] = (
    Rule(f"{A}.min_groups_for_streaming_train",
         lambda v, t: isinstance(v, int) and 1 <= v <= get(t, "grpo.num_prompts_per_step", 16),
         "the smallest chunk of ready groups NeMo RL's train pump feeds into a step; the step's one update covers "
         "all grpo.num_prompts_per_step groups either way (replay hands the trainer the whole batch); NeMo RL "
         "itself refuses more than num_prompts_per_step"),
    Rule(f"{A}.max_inflight_prompts", lambda v, t: v == get(t, "grpo.num_prompts_per_step", 16),
         "NeMo RL's cap on prompts generated at once over the whole fleet; at grpo.num_prompts_per_step it is "
         "Flywheel's default (a step's prompts shared over the rollout workers). Flywheel's cap is per worker and "
         "counts generation only: set rollout.max_groups_in_flight instead"),
    Rule(f"{A}.diagnostics", any_, "prints of prompts and completions: a log, not the update"),
    Rule(f"{F}.max_skipped_prompts", is_(0), REDELIVERED),
    Rule(f"{F}.max_consecutive_dropped_prompts", is_(0), REDELIVERED),
    Rule(f"{F}.on_dropped_prompt", is_("shrink"), "replace keeps a pool of spare prompts diverted from the data "
         "ahead of their turn; " + REDELIVERED),
    *(Rule(f"{F}.{key}", any_, "read only once a prompt may be dropped (a drop budget above 0 or "
                                "on_dropped_prompt replace), which is refused on its own")
      for key in ("min_step_batch_fraction", "max_replacement_attempts", "replacement_reserve_prompts")),
    *(Rule(f"{F}.{key}", any_, RETRY) for key in (
        "max_infra_attempts_per_prompt", "max_data_attempts_per_prompt", "backoff_base_s", "max_backoff_s",
        "nemo_gym.max_row_attempts")),
    *(Rule(f"{F}.{key}", is_(None), "null (NeMo RL's default) sets no deadline; per-request generation deadlines "
           "are not built (an environment Step's deadline is rollout.step_timeout_s)")
      for key in ("native.generation_timeout_s", "native.env_timeout_s", "nemo_gym.rollout_timeout_s")),
    Rule(f"{A}.stall_watchdog.stall_action", is_("warn"), "a stall watchdog that only warns is a log; ending the "
         "run on a stall is not built"),
    *(Rule(f"{A}.stall_watchdog.{key}", any_, "the stall watchdog only warns here: a log, not the update")
      for key in ("interval_s", "stall_timeout_s", "gym_subprocess_check")),
    Rule(f"{A}.generation_fleet_health", off, "per-shard health probes and quarantine are not built: rollout "
         "workers pull from the work queue, and a dead worker's unacked work is redelivered to another"),
    Rule(f"{A}.generation_router", off, "NeMo RL's HTTP router in front of the generation fleet for NeMo Gym is "
         "not built"),
)
