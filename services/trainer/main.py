"""The trainer loop: for each step s, Sample(s) from replay, one GRPO (or distillation) step, publish weights s + 1.

    replay ──Sample(s)──▶ advantages ─▶ all ranks: clipped PG loss, optimizer step(s) ─▶ WeightSender.sync(s + 1)
                                                                                         ├▶ checkpoint (every save_period)
                                                                                         └▶ StepReport (NATS) + metrics.jsonl
                                                                                            then replay Commit(s)

Version 0 (the initial weights, or the checkpoint's) is pushed before the first step, so
rollout never samples from weights the trainer does not have. Sync membership is the set
of rollout workers whose heartbeat is recent; a worker that misses a sync is dropped and
joins the next. A worker that joins (or restarts) while the trainer waits for a batch gets
the current version at once, since that batch may need its groups. With k >= 1, Sample(s + 1)
is sent as soon as step s has its batch, so it overlaps step s's training. Only rank 0 talks to
the network; the other ranks follow it (distributed.py).

Delivery and restarts: replay records the batch of each step, so a trainer that restarts
from its latest checkpoint (step_N) runs step N again on the very same batch. The report
of a checkpointed step names it (checkpoint_step) before Commit frees those batches.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
import zlib
from pathlib import Path

import grpc
import nats.errors
import torch
import torch.distributed as dist
from prometheus_client import Gauge

from services.common.bus import Bus, open_state_bucket, read_validated
from services.common.config import FlywheelConfig, GRPOConfig
from services.common.jsonl import read_rows
from services.common.pb.flywheel.v1 import replay_pb2, replay_pb2_grpc, trainer_pb2, trainer_pb2_grpc, types_pb2
from services.common.server import (RETRIED, RPC_ERRORS, channel, freeze_startup_heap, in_daemon_thread, retrying,
                                   run_service)
from services.common.telemetry import setup_telemetry, start_step_span
from services.common.tokenizing import check_same_vocabulary
from services.common.weights import WeightSender
from services.trainer.backends import make_backend
from services.trainer.batch import TrainBatch, batch_advantages, build_batch
from services.trainer.checkpoint import Checkpointer
from services.trainer.distributed import (Lockstep, RankInfo, init_distributed, launch_ranks, rank_from_env,
                                          trainer_device)
from services.trainer.offline import OfflineRun
from services.trainer.step_metrics import step_metrics

log = logging.getLogger("flywheel.trainer")
STEP_METRIC = Gauge("flywheel_trainer_step_metric", "Last value of each per-step metric (reward, KL, clip "
                    "fraction, IS ratio, timings)", ["name"])
LIVE_S = 5.0
POLL_S = 0.01
COMMIT_TRIES = 5


class RankWork:
    """What every rank does in lockstep: the backend's collectives and checkpoint IO."""

    def __init__(self, cfg: FlywheelConfig, info: RankInfo) -> None:
        self.backend = make_backend(cfg, info)
        self.checkpointer = Checkpointer(cfg, info.rank, info.world)

    def train(self, batch: TrainBatch, advantages: torch.Tensor) -> dict[str, float]:
        return self.backend.train_step(batch, advantages)

    def train_offline(self, batch: TrainBatch) -> dict[str, float]:
        return self.backend.offline_step(batch)

    def train_distill(self, batch: TrainBatch, advantages: torch.Tensor | None) -> dict[str, float]:
        return self.backend.distill_step(batch, advantages)

    def validate(self, batch: TrainBatch) -> dict[str, float]:
        return self.backend.validate(batch)

    def weights(self) -> dict[str, torch.Tensor]:
        return self.backend.full_state_dict()

    def save(self, version: int, metrics: dict[str, float], validated: dict[int, dict[str, float]]) -> None:
        self.checkpointer.save(self.backend, version, metrics, validated)

    def restore(self, path: str) -> int:
        return self.checkpointer.restore(self.backend, Path(path))


class Validations:
    """The validations the controller reports (policy version -> metrics), read from the run's NATS KV bucket: checkpoints
    rank by them (checkpointing.metric_name val:...) and grpo.stop_at_validation_metric ends the run on them."""

    def __init__(self, bus: Bus, run: str) -> None:
        self.bus = bus
        self.run = run
        self._bucket = None
        self._known: dict[int, dict[str, float]] = {}
        """What was read so far: a version's validation is written once, so only new keys are read."""

    async def read(self, why: str) -> dict[int, dict[str, float]]:
        """Every validation reported so far; none, with a warning naming `why` they were wanted, when the bucket
        cannot be read."""
        try:
            if self._bucket is None:
                self._bucket = await open_state_bucket(self.bus.js, self.run)
            self._known.update(await read_validated(self.bus.js, self._bucket, known=self._known))
        except (nats.errors.Error, OSError, TimeoutError) as err:
            log.warning("%s: the run's state bucket cannot be read (%s)", why, err)
            return {}
        return dict(self._known)


class Trainer:
    def __init__(self, cfg: FlywheelConfig, ranks: Lockstep, bus: Bus, sender: WeightSender) -> None:
        self.cfg = cfg
        self.ranks = ranks
        self.work: RankWork = ranks.target
        self.bus = bus
        self.sender = sender
        self.replay = replay_pb2_grpc.ReplayServiceStub(channel(cfg.addresses.replay, security=cfg.security))
        self.workers: dict[str, tuple[float, int]] = {}
        """Rollout worker -> (monotonic time of its last heartbeat, the version it reported loaded)."""
        self.delivered: dict[str, int] = {}
        """Rollout worker -> the version a sync last confirmed to it (its heartbeat may lag behind)."""
        self.synced_at = 0.0
        """Monotonic time the last sync ended."""
        self.version = 0
        self.last_sync = None
        self.synced_at_ns = 0
        """Wall clock (unix ns) when the last sync ended: where a k = 0 step's lease delay starts."""
        self.sync_phases: dict[str, float] = {}
        self.sample_returned_ns = 0
        self.validations = Validations(bus, cfg.run.name)
        self.early: tuple[int, asyncio.Task] | None = None
        """(step, its Sample call) asked for while the step before it trains (k >= 1)."""
        self.metrics_path = Path(cfg.run.run_dir or ".") / "metrics.jsonl"
        self.batches_path = Path(cfg.run.run_dir or ".") / "batches.jsonl"
        """One row per step: the groups it trained on (id, target step, version_start); the run's audit trail."""
        self.offline = OfflineRun(cfg, self.work.backend.tokenizer) if cfg.offline is not None else None
        """SFT or DPO: no rollout to sync weights to, the offline step, validation by the loss (offline.py)."""

    def members(self) -> list[str]:
        now = time.monotonic()
        return sorted(w for w, (seen, _) in self.workers.items() if now - seen < LIVE_S)

    def behind(self) -> list[str]:
        """Live workers without the current version: joined or restarted since the last sync. Only a heartbeat
        received after that sync ended counts (an earlier one may predate a load the sync just made)."""
        return [w for w in self.members() if self.workers[w][0] > self.synced_at
                and max(self.workers[w][1], self.delivered.get(w, -1)) < self.version]

    async def _on_heartbeat(self, msg) -> None:
        beat = types_pb2.RolloutHeartbeat.FromString(msg.data)
        self.workers[beat.worker_id] = (time.monotonic(), beat.loaded_version)

    async def _call(self, name: str, *args):
        """A lockstep collective off the event loop."""
        return await in_daemon_thread(self.ranks.call, name, *args)

    async def run(self, stop: asyncio.Event) -> None:
        sub = await self.bus.nc.subscribe(self.bus.subjects.heartbeat, cb=self._on_heartbeat)
        # checkpoint_must_save_by counts from here: restoring and waiting for rollout count against a job's limit too
        started, limit_s = time.monotonic(), self.cfg.checkpointing.must_save_by_s
        try:
            start = await self._resume()
            if self.offline is None:
                while not self.members() and not stop.is_set():
                    await asyncio.sleep(0.1)  # nothing to push the first weights to yet
                await self._sync(start)
            elif start == 0 and self.offline.due(0, final=False):
                self.offline.record(0, await self._call("validate", self.offline.validation))
            t_prev = looping = time.perf_counter()
            for step in range(start, self.cfg.grpo.max_num_steps):
                if stop.is_set():
                    return
                done = await self._step(step, stop)
                if done is None:
                    return
                report, groups = done
                report["timing/train/total_step_time"] = time.perf_counter() - t_prev
                t_prev = time.perf_counter()
                late = out_of_time(limit_s, time.monotonic() - started, (t_prev - looping) / (step + 1 - start))
                validated = await self._early_stop_validations()
                reached = reached_threshold(validated, self.cfg.grpo) if validated is not None else None
                await self._finish_step(step, report, groups, validated, save=late, final=reached is not None)
                if reached is not None:
                    version, value = reached
                    log.warning("grpo.stop_at_validation_metric: the validation of version %d has %s %.4f >= %g: "
                                "the run ends after %d steps (%s)", version, self.cfg.grpo.stop_at_validation_metric,
                                value, self.cfg.grpo.stop_at_validation_threshold, step + 1,
                                "checkpoint saved" if self.cfg.checkpointing.enabled else "checkpointing is disabled")
                    return
                if late:
                    log.warning("checkpointing.checkpoint_must_save_by (%s) is near: stopping after step %d (%s); "
                                "start the run again with --resume to go on",
                                self.cfg.checkpointing.checkpoint_must_save_by, step,
                                "checkpoint saved" if self.cfg.checkpointing.enabled else "checkpointing is disabled")
                    return
        finally:
            if self.early is not None:
                self.early[1].cancel()
            await sub.unsubscribe()

    async def _resume(self) -> int:
        """The step to run first: 0, or N after restoring the latest complete checkpoint step_N."""
        latest = self.work.checkpointer.latest() if self.cfg.checkpointing.enabled else None
        if latest is None:
            return 0
        start = await self._call("restore", str(latest))
        log.info("resumed from %s: next step %d", latest, start)
        for path in (self.metrics_path, self.batches_path):  # rows of steps the crash lost are run again
            _drop_rows_from(path, start)
        return start

    def _sample_request(self, step: int) -> replay_pb2.SampleRequest:
        g = self.cfg.grpo
        return replay_pb2.SampleRequest(step=step, prompts_per_step=g.num_prompts_per_step,
                                        max_staleness=g.max_staleness)

    def _ask_early(self, step: int) -> None:
        """With k >= 1, step `step`'s batch may be complete while the step before it trains: ask for it now, once,
        so that the call (replay's Redis read and its reply) overlaps training. In a synchronous run that batch
        needs the weights the current step makes, so the step asks when it comes."""
        if self.cfg.grpo.max_staleness >= 1 and step < self.cfg.grpo.max_num_steps:
            self.early = (step, asyncio.create_task(self._sample_once(self._sample_request(step))))

    async def _sample_once(self, request: replay_pb2.SampleRequest) -> replay_pb2.SampleResponse | None:
        try:
            response = await self.replay.Sample(request, timeout=30)
        except grpc.aio.AioRpcError as err:  # the step's own loop asks again, with retries
            RPC_ERRORS.labels("replay.Sample", err.code().name).inc()
            return None
        if response.ready:
            self.sample_returned_ns = time.time_ns()
        return response

    async def _sample(self, step: int, stop: asyncio.Event) -> tuple[replay_pb2.SampleResponse, float, float]:
        """The step's batch, the seconds polled before the call that got it, and that call's seconds (for a
        batch asked for early: the seconds this step still waited for it)."""
        request = self._sample_request(step)
        t0 = time.perf_counter()
        early, self.early = self.early, None
        if early is not None and early[0] == step:
            response = await early[1]
            if response is not None and response.ready:
                return response, 0.0, time.perf_counter() - t0
        while not stop.is_set():
            t_call = time.perf_counter()
            response = await retrying(self.replay.Sample, request, rpc="replay.Sample", stop=stop, timeout=30)
            if response is None:
                break
            if response.ready:
                self.sample_returned_ns = time.time_ns()
                return response, t_call - t0, time.perf_counter() - t_call
            late = self.behind()
            if late:  # without them this batch may never fill (e.g. the only worker restarted)
                log.info("sync v%d to %s, which joined since the last sync", self.version, late)
                await self._sync(self.version, late)
            await asyncio.sleep(POLL_S)
        return None, 0.0, 0.0

    async def _step(self, step: int, stop: asyncio.Event
                    ) -> tuple[dict[str, float], list[types_pb2.TrajectoryGroup]] | None:
        response, waited, rpc_s = await self._sample(step, stop)
        if response is None:
            return None
        span = start_step_span(step, response.groups)  # linked to the trace of every group it trains on
        timeline = group_timeline(response.groups, self.synced_at_ns, self.sample_returned_ns)
        self._ask_early(step + 1)
        t0 = time.perf_counter()
        distilling = self.cfg.algorithm == "distillation"
        batch = build_batch(response.groups, self.work.backend.tokenizer.pad_token_id,
                            overlong_filtering=self.cfg.grpo.overlong_filtering,
                            teacher_k=self.cfg.teacher.topk_logits_k if distilling else None)
        if distilling:  # the KL to the teacher's top-k; GRPO's advantages only with distillation.env_reward_weight
            rewarded = self.cfg.distillation.env_reward_weight > 0
            advantages, adv_metrics = batch_advantages(batch, self.cfg.grpo) if rewarded else (None, {})
            build_s = time.perf_counter() - t0
            metrics = await self._call("train_distill", batch, advantages)
        elif self.offline is None:
            advantages, adv_metrics = batch_advantages(batch, self.cfg.grpo)
            build_s = time.perf_counter() - t0
            metrics = await self._call("train", batch, advantages)
        else:
            adv_metrics, build_s = {}, time.perf_counter() - t0
            metrics = await self._call("train_offline", batch)
        metrics = {k if k.startswith("timing/") else f"train/{k}": v for k, v in (metrics | adv_metrics).items()}
        train_s = time.perf_counter() - t0
        sync_s = await self._sync(step + 1) if self.offline is None else 0.0
        if self.offline is not None and self.offline.due(step + 1, final=step + 1 == self.cfg.grpo.max_num_steps):
            metrics |= self.offline.record(step + 1, await self._call("validate", self.offline.validation))
        metrics.update(timeline)
        metrics["timing/train/batch_build"] = build_s
        metrics.update(self.sync_phases)
        metrics |= step_metrics(step, batch, response.groups)
        # The same step must always train on the same batch (a restart included); this makes it checkable.
        metrics["train/batch_crc32"] = float(zlib.crc32(",".join(g.group_id for g in response.groups).encode()))
        metrics.update({"timing/train/replay_wait": waited, "timing/train/replay": rpc_s,
                        "timing/train/policy_training": train_s, "timing/train/weight_sync": sync_s})
        span.set_attributes({"flywheel.train_seconds": train_s, "flywheel.weight_sync_seconds": sync_s})
        span.end()
        return metrics, list(response.groups)

    async def _sync(self, version: int, members: list[str] | None = None) -> float:
        """Push `version` to `members` (every live worker by default)."""
        members = self.members() if members is None else members
        t0 = time.perf_counter()
        state = await self._call("weights")
        gather_s = time.perf_counter() - t0
        result = await in_daemon_thread(self.sender.sync, version, members, state,
                                         timeout_s=self.cfg.weight_sync.timeout_s)
        self.synced_at_ns = time.time_ns()
        self.sync_phases = {"timing/train/weight_gather": gather_s,
                            **{f"timing/train/weight_sync/{k}": v for k, v in result.phases.items()}}
        self.version, self.last_sync = version, result
        self.delivered.update(dict.fromkeys(result.members_ok, version))
        self.synced_at = time.monotonic()
        if result.members_dropped:
            log.warning("sync v%d dropped %s", version, result.members_dropped)
            for w in result.members_dropped:
                self.workers.pop(w, None)  # back in at its next heartbeat
        return result.seconds

    async def _validated(self) -> dict[int, dict[str, float]]:
        """The reported validations, when checkpoints rank by one. None read ranks none: every checkpoint still due
        a validation is then kept, not pruned."""
        name = self.cfg.checkpointing.metric_name
        if not self.cfg.checkpointing.ranks_by_validation:
            return {}
        if self.offline is not None:  # the trainer validates an offline run itself
            return dict(self.offline.validated)
        return await self.validations.read(f"checkpoint ranking by {name} (the checkpoints still due a validation "
                                           f"are kept)")

    async def _early_stop_validations(self) -> dict[int, dict[str, float]] | None:
        """The reported validations, read once a step when grpo.stop_at_validation_metric may end the run after
        it; None when it is not set."""
        if self.cfg.grpo.stop_at_validation_metric is None:
            return None
        return await self.validations.read("grpo.stop_at_validation_metric")

    async def _finish_step(self, step: int, metrics: dict[str, float], groups: list[types_pb2.TrajectoryGroup],
                           validated: dict[int, dict[str, float]] | None, *, save: bool = False,
                           final: bool = False) -> None:
        """Checkpoint if due (or if `save`: the trainer stops after this step), then record and report, then let
        replay free what the checkpoint covers. The last step (max_num_steps, or `final`: an early stop) saves and
        reports itself final, which ends the run. `validated`: the validations this step read already (the early
        stop's), which rank the checkpoint too; None: read them only if a checkpoint is saved and ranks by one."""
        final = final or step + 1 == self.cfg.grpo.max_num_steps
        checkpointed = self.work.checkpointer.due(step + 1, final or save)
        if checkpointed:
            t0 = time.perf_counter()
            await self._call("save", step + 1, metrics, validated if validated is not None else await self._validated())
            metrics["timing/train/checkpoint"] = time.perf_counter() - t0
        for name, value in metrics.items():
            STEP_METRIC.labels(name).set(value)
        with self.batches_path.open("a") as f:
            f.write(json.dumps({"step": step, "groups": [
                {"id": g.group_id, "target_step": g.target_step, "version_start": g.version_start} for g in groups]})
                    + "\n")
        with self.metrics_path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        report = types_pb2.StepReport(step=step, metrics=metrics, final=final)
        if checkpointed:
            report.checkpoint_step = step
        await self.bus.emit(self.bus.subjects.train_step, report)
        if checkpointed:
            await self._commit(step)

    async def _commit(self, step: int) -> None:
        """Replay may see the Commit before the report that allows it: retry briefly, on purpose.
        A Commit that never lands only keeps old batches in Redis; training goes on."""
        try:
            await self.bus.nc.flush()  # the report first, so that replay is likely to have it
        except nats.errors.Error as err:  # a slow broker: Commit itself waits a while for the report
            log.warning("flush before Commit(%d) failed: %r", step, err)
        for attempt in range(COMMIT_TRIES):
            try:
                await self.replay.Commit(replay_pb2.CommitRequest(step=step), timeout=10)
                return
            except grpc.aio.AioRpcError as err:
                if err.code() not in RETRIED:
                    raise
                RPC_ERRORS.labels("replay.Commit", err.code().name).inc()
                await asyncio.sleep(0.1 * 2 ** attempt)
        log.warning("replay did not accept Commit(%d); its batches stay stored", step)


def out_of_time(limit_s: float | None, elapsed_s: float, mean_step_s: float) -> bool:
    """checkpointing.checkpoint_must_save_by as NeMo RL's TimeoutChecker(fit_last_save_time=True) reads it: stop
    after this step if one more step of the mean length would end past the limit (None: no limit)."""
    return limit_s is not None and elapsed_s + mean_step_s >= limit_s


def reached_threshold(validated: dict[int, dict[str, float]], grpo: GRPOConfig) -> tuple[int, float] | None:
    """(version, value) of the earliest validation whose grpo.stop_at_validation_metric is >= the threshold."""
    key = grpo.validation_key(grpo.stop_at_validation_metric)
    for version in sorted(validated):
        value = validated[version].get(key)
        if value is not None and value >= grpo.stop_at_validation_threshold:
            return version, value
    return None


def group_timeline(groups, synced_at_ns: int, sample_returned_ns: int) -> dict[str, float]:
    """Where a step's wait for data went, from the groups' own wall-clock stamps (one host's clock; across
    hosts, skew adds to these). lease_delay: from the end of the previous weight sync to the first lease
    (the worker loading the weights, WeightLoaded, the controller's wake-up; negative when k >= 1 leased
    ahead). rollout_span: first lease to last group finished (work queue, generation, environment).
    ingest: last group finished to the batch back in the trainer (publish, JetStream, replay's ingest and
    Redis write, Sample)."""
    if not groups:
        return {}
    leased = min(g.leased_at_unix_ns for g in groups)
    finished = max(g.finished_at_unix_ns for g in groups)
    return {"timing/train/lease_delay": (leased - synced_at_ns) / 1e9 if synced_at_ns else 0.0,
            "timing/train/rollout_span": (finished - leased) / 1e9,
            "timing/train/ingest": (sample_returned_ns - finished) / 1e9}


def _drop_rows_from(path: Path, step: int) -> None:
    """Rewrite a jsonl record without the rows of `step` and later (kept: rows without a step). A row the crash cut
    off mid-write is dropped with them."""
    if not path.exists():
        return
    rows = [r for r in read_rows(path) if r.get("step", -1) < step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self, trainer: Trainer) -> None:
        self.t = trainer

    async def Status(self, request, context):
        last = self.t.last_sync
        return trainer_pb2.TrainerServiceStatusResponse(
            version=self.t.version, weight_members=last.members_ok if last else [],
            last_sync_seconds=last.seconds if last else 0.0)


async def serve(cfg: FlywheelConfig) -> None:
    if cfg.algorithm == "distillation":  # before any rank starts: a teacher of another vocabulary is refused
        check_same_vocabulary(cfg.policy, cfg.teacher.model_name)
    if rank_from_env() is None and cfg.trainer.nproc_per_node > 1:
        code = launch_ranks(cfg, cfg.trainer.nproc_per_node)  # this process only watches the ranks
        if code:
            raise SystemExit(code)
        return
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    info = init_distributed(cfg.trainer.collective_timeout_s, trainer_device(cfg))
    try:
        ranks = Lockstep(RankWork(cfg, info), info.rank, info.world)
        if info.rank == 0:
            await _lead(cfg, ranks)
        else:
            for sig in (signal.SIGTERM, signal.SIGINT):  # rank 0 decides when to stop
                signal.signal(sig, signal.SIG_IGN)
            freeze_startup_heap()  # as run_service does on rank 0: a full collection would stall the lockstep
            ranks.follow()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if info.world > 1:  # everything is saved and closed; skip the interpreter's teardown, which takes
        logging.shutdown()  # seconds of CPU with a multi-rank gloo group and would break the 5 s stop rule
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


async def _lead(cfg: FlywheelConfig, ranks: Lockstep) -> None:
    setup_telemetry("trainer", cfg.run.name, cfg.telemetry)
    bus = await Bus.connect(cfg.addresses.nats_url, cfg.run.name, name="trainer", security=cfg.security)
    loop = asyncio.get_running_loop()

    def publish(announcement) -> None:  # called from the sync thread, once per epoch
        msg = types_pb2.WeightAnnouncement(**announcement.fields())
        asyncio.run_coroutine_threadsafe(bus.publish(bus.subjects.weights_announce, msg), loop).result(10)

    w = cfg.weight_sync
    sender = WeightSender(backend=w.backend, host=cfg.addresses.host, port=w.store_port,
                          bucket_bytes=w.bucket_size_mb << 20, publish=publish)
    trainer = Trainer(cfg, ranks, bus, sender)
    try:
        await run_service("trainer", cfg.addresses.trainer,
                          lambda server: trainer_pb2_grpc.add_TrainerServiceServicer_to_server(
                              TrainerServicer(trainer), server), trainer.run, security=cfg.security)
    finally:
        ranks.stop()
        sender.close()
        await bus.close()
