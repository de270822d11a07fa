"""Property-based fuzzing of every public rpc and every NATS subject a service consumes (issue 14).

One `flywheel up` stack (LocalStack: NATS, Redis, the five services and the reward-model server as separate
processes, with the run's token and credentials) trains the toy run while hypothesis sends each rpc of
`RPCS` CASES requests with the run token, so that they reach the handlers: three quarters structurally valid
(fuzzing.messages: random values, extremes, nan and inf, huge strings, nested Structs, maps, unknown
fields, with hints that get them past the first checks) and a quarter malformed (fuzzing.malformed).
Each service then gets a request just under and one just over the message size limit. Every answer must
be OK or a clean status naming the client's mistake; UNKNOWN or INTERNAL (an exception escaped a
handler), DEADLINE_EXCEEDED (a hang), a health check that stalls while a batch runs (a handler blocking
its service's event loop) or a dead process fails. After each rpc its service must still answer its
health check and a normal request.

Then every NATS subject a service consumes gets NATS_CASES random and corrupted payloads: each consumer
must stay up, answer, and log no traceback; replay must dead-letter each malformed trajectory, and the
controller must not leave an event to be delivered again for ever. At the end no service may have logged
a traceback at all.

Requests that failed before their fix are kept as explicit examples (REGRESSIONS, NATS_REGRESSIONS), sent
first, every run. The suite sends 1,000 requests per rpc and 1,000 payloads per subject (about 3 minutes on a
2-core machine beside the rest of the suite; 2,000 each took 5.7 until `make test` went over its 35-minute
budget); the soak sends 10,000 (FLYWHEEL_FUZZ_CASES=10000, about 10 minutes alone).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import contract
from fuzzing import NASTY, Caller, Case, Prober, malformed, messages, rarely, varint
from hostile import RPCS as SERVICE_RPCS
from hostile import Rpc
from services.common.bus import Bus
from services.common.config import load_config
from services.common.errors import InvalidArgument
from services.common.pb.flywheel.v1 import (controller_pb2, environment_pb2, replay_pb2, rollout_pb2, trainer_pb2,
                                            types_pb2)
from services.common.security import RUN_TOKEN_KEY
from services.environment.server import MAX_PROMPTS
from services.local import LocalStack, read_restarts
from services.replay.ingest import REASON_HEADER
from services.rollout.main import check_group

pytestmark = pytest.mark.slow

CASES = int(os.environ.get("FLYWHEEL_FUZZ_CASES", 1_000))
"""Requests per rpc: three quarters structurally valid, one quarter malformed (FLYWHEEL_FUZZ_CASES=10000: the soak)."""
VALID_CASES, MALFORMED_CASES = CASES * 3 // 4, CASES // 4
BATCH = {"empty": 100, "flat": 50, "nested": 25}
"""Requests per hypothesis example, in flight together, by the shape of the request message: hypothesis
bounds the data one example may draw, and a bigger batch spreads its per-example cost over more requests."""
NATS_CASES = 1_000
"""Payloads per NATS subject."""
DEADLINE_S = 10.0
"""Per call. Commit waits up to 5 s for a trailing step report, Register up to 5 s to reach an address."""
DEADLINES_S = {"Step": 70.0, "Prompts": 60.0, "Generate": 60.0}
"""Step scores within the environment's own bounds (the math verifier's 60 s worker deadline, the code
sandbox's 10 s wall clock; the rollout gives Step 60 s), which random content can reach. Prompts may
generate 100,000 rows, seconds of work. Generate runs on the engine one batch at a time, the worker's own
groups included: a batch of 25 calls of up to 64 samples each queues for seconds on a loaded machine.
(A handler that blocks its service rather than its own call is caught by the health probes instead.)"""
HEALTH_DEADLINE_S = 5.0
"""A health check sent while a batch runs must be answered within this: else a handler blocks the loop."""
CLEAN = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
         grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE}
"""What a handler may answer a client's request. RESOURCE_EXHAUSTED is the transport's (a message past the
limit; a status message too long for its trailer), never a handler's, so it fails here too."""
RPCS = [*SERVICE_RPCS, Rpc("reward_model", "EnvironmentService/Step", environment_pb2.StepRequest)]
"""The services' rpcs and the reward-model server's Step (this stack starts that server; hostile.RPCS is also
the traffic of test_hostile_traffic.py, whose stack does not)."""
PROXIES = {"environment.Prompts", "controller.SubmitEnvironment", "rollout.Generate"}
"""Rpcs that call another server (a registered remote environment; the environment service, which Generate
calls when given an env_name) and answer UNAVAILABLE, by design, when it fails: a clean status from them while
their service stays up."""
SERVICES = ("controller", "environment", "replay", "rollout", "trainer", "reward_model")
PROCESS = {"controller": "controller", "environment": "environment", "replay": "replay", "rollout": "rollout-0",
           "trainer": "trainer", "reward_model": "reward_model"}
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
"""A jsonl_path that looks like a hub id ("org/name") must not send the fuzzer to the network."""
BACKGROUND_NICE = 19
"""The trainer's priority. Training takes a third of a 2-core machine; with the trainer niced, it (and the
rollout, which generates no further ahead than the trainer's step allows) yields to the handlers under test,
and goes on whenever they wait. The trainer's only rpc, Status, is a read of two fields."""
SETTINGS = dict(deadline=None, database=None, derandomize=True, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.large_base_example])

REGRESSIONS: dict[str, list[Case]] = {
    "rollout.Generate": [
        # ValueError from transformers: `top_k` has to be a strictly positive integer (INTERNAL)
        Case(rollout_pb2.GenerateRequest(messages=[types_pb2.ChatMessage()], n=1,
                                         sampling=types_pb2.SamplingParams(top_k=-2147483648))),
        # ... `temperature` has to be a strictly positive float; and top_p -inf
        Case(rollout_pb2.GenerateRequest(messages=[types_pb2.ChatMessage(content="copy 3")], n=2,
                                         sampling=types_pb2.SamplingParams(temperature=float("nan")))),
        Case(rollout_pb2.GenerateRequest(messages=[types_pb2.ChatMessage(content="copy 3")], n=2,
                                         sampling=types_pb2.SamplingParams(top_p=float("-inf")))),
        # temperature 1.4e-45: logits / T overflow, "probability tensor contains either `inf`, `nan`" (INTERNAL)
        Case(rollout_pb2.GenerateRequest(messages=[types_pb2.ChatMessage()], n=1,
                                         sampling=types_pb2.SamplingParams(temperature=1e-45))),
        # ValueError from transformers: no tokens match stop string '@' (INTERNAL)
        Case(rollout_pb2.GenerateRequest(messages=[types_pb2.ChatMessage()], n=1,
                                         sampling=types_pb2.SamplingParams(stop_strings=["@"]))),
        # A prompt of megabytes was tokenized on the event loop: seconds in which the worker answered nothing
        # (every other call of the batch, and its health check, ran past the deadline)
        Case(rollout_pb2.GenerateRequest(messages=[types_pb2.ChatMessage(content="p\U000f3753" * (1 << 20))], n=1)),
        # With an environment: one nobody registered (the environment service's NOT_FOUND, passed on as
        # INVALID_ARGUMENT, not the handler's UNKNOWN), and turns without one
        Case(rollout_pb2.GenerateRequest(messages=[types_pb2.ChatMessage(content="copy 3")], n=2, env_name="nope")),
        Case(rollout_pb2.GenerateRequest(messages=[types_pb2.ChatMessage(content="copy 3")], n=1, max_turns=3)),
        Case(rollout_pb2.GenerateRequest(messages=[types_pb2.ChatMessage(content="copy 3")], n=2,
                                         env_name="sliding_puzzle", max_turns=1000)),
    ],
    "environment.Step": [
        # from_struct: ValueError: Fail to serialize NaN for Value.number_value (INTERNAL)
        Case(environment_pb2.StepRequest(env_name="toy", episodes=[environment_pb2.Episode(
            metadata={"ground_truth": float("nan")})])),
        Case(environment_pb2.StepRequest(env_name="toy_copy", episodes=[environment_pb2.Episode(
            messages=[types_pb2.ChatMessage(role="assistant", content="3")], metadata={"x": float("inf")})])),
        # A NOT_FOUND quoting a name of megabytes: its status message passed gRPC's trailer limit and the
        # client got RESOURCE_EXHAUSTED ("received metadata size exceeds hard limit") instead
        Case(environment_pb2.StepRequest(env_name="\U000fca01" * 700_000, episodes=[environment_pb2.Episode()])),
    ],
    "environment.Register": [
        Case(environment_pb2.RegisterRequest(name="é" * 700_000, kind="toy_copy")),
    ],
    "environment.Prompts": [
        # 100,000 puzzles (then the most one call could ask for) generated and encoded on the event loop: ~10 s
        # in which Step calls and health checks waited
        Case(environment_pb2.PromptsRequest(env_name="sliding_puzzle", count=MAX_PROMPTS)),
    ],
    "controller.RemoveEnvironment": [
        Case(controller_pb2.RemoveEnvironmentRequest(name="\u202e" * 1_000_000)),
    ],
}
"""rpc name -> requests a fuzz run failed on before the fix (sent first, every run)."""


@dataclass
class FuzzStack:
    stack: LocalStack
    callers: dict[str, Caller]
    files: dict[str, str]

    @property
    def cfg(self):
        return self.stack.cfg

    def alive(self, service: str) -> bool:
        return self.stack.children.procs[PROCESS[service]].poll() is None

    def send(self, rpc: Rpc, payloads: list[bytes]):
        return self.callers[rpc.service].send(rpc.path, payloads, DEADLINES_S.get(rpc.short, DEADLINE_S))

    def health(self, service: str) -> grpc.StatusCode:
        request = health_pb2.HealthCheckRequest().SerializeToString()
        return self.callers[service].send("/grpc.health.v1.Health/Check", [request], HEALTH_DEADLINE_S)[0].code

    def tail(self, service: str) -> str:
        return self.stack.children.tail(PROCESS[service])


def _dataset_files(root: Path) -> dict[str, str]:
    """Datasets a SubmitEnvironment may name: good, junk, the wrong shape, empty, a directory."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "good.jsonl").write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"copy {i}"}],
                                                         "metadata": {"ground_truth": str(i)}}) + "\n"
                                             for i in range(5)))
    (root / "junk.jsonl").write_bytes(b"\x00\xff not json\n{\"messages\": 3}\n")
    (root / "list.json").write_text("[1, 2, 3]")
    (root / "empty.jsonl").write_text("")
    (root / "dir").mkdir(exist_ok=True)
    return {name: str(root / name) for name in ("good.jsonl", "junk.jsonl", "list.json", "empty.jsonl", "dir")}


@pytest.fixture(scope="module")
def fz(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("fuzz")
    # A checkpoint every step keeps Commit's wait for a trailing report short (it waits for the next one).
    # The reward-model environment (weight 0: registered, never leased) makes the stack start its server too.
    rm_rows = run_dir / "rm.jsonl"
    rm_rows.write_text(json.dumps({"messages": [{"role": "user", "content": "copy 3"}]}) + "\n")
    cfg = load_config(None, ["grpo.max_num_steps=100000", "checkpointing.save_period=1",
                             "checkpointing.keep_top_k=1", "env.reward_model.model_name=tiny",
                             f"environments=[{{name: toy, kind: toy_copy}}, {{name: rm, kind: reward_model, weight: 0, "
                             f"dataset: {rm_rows}}}]"])
    with LocalStack(cfg, run_dir) as stack:
        stack.children.env |= OFFLINE
        stack.start_services()
        # The run goes on at the pace of a background job: the fuzz is about handlers, not training speed.
        os.setpriority(os.PRIO_PGRP, stack.children.procs["trainer"].pid, BACKGROUND_NICE)
        token = stack.cfg.security.run_token.get_secret_value()
        callers = {s: Caller(getattr(stack.cfg.addresses, s), [(RUN_TOKEN_KEY, token)],
                             stack.cfg.security.max_message_mb) for s in SERVICES}
        fuzz = FuzzStack(stack, callers, _dataset_files(run_dir / "datasets"))
        try:
            deadline = time.monotonic() + 300
            for service in SERVICES:
                while fuzz.health(service) != grpc.StatusCode.OK:
                    assert fuzz.alive(service), f"{service} exited while starting:\n{fuzz.tail(service)}"
                    assert time.monotonic() < deadline, f"{service} not serving after 300 s"
                    time.sleep(0.5)
            yield fuzz
        finally:
            for caller in callers.values():
                caller.close()


def _hints(fz: FuzzStack) -> dict:
    """Values that get requests past the first check of a handler, mixed with random ones."""
    cfg, a = fz.cfg, fz.cfg.addresses
    names = st.sampled_from([cfg.environments[0].name, "toy_copy", "math", "code", "exact_match", "sliding_puzzle",
                             "fuzz-a", "fuzz_b", "fuzz-c", "../x", "A", ""])
    kinds = st.sampled_from(["toy_copy", "math", "code", "exact_match", "sliding_puzzle", "", "nope"])
    addresses = st.sampled_from([*(getattr(a, s) for s in SERVICES), a.nats_url.removeprefix("nats://"),
                                 a.redis_url.removeprefix("redis://").split("/")[0], "127.0.0.1:1", "[::1]:1",
                                 "localhost:0", "127.0.0.1:65535", "127.0.0.1:99999", "unix:/nonexistent",
                                 ":", "127.0.0.1:", ""])
    paths = st.sampled_from([*fz.files.values(), "/etc/passwd", "/dev/null", "/dev/zero", "/proc/self/environ",
                             "/", "/nonexistent.jsonl", "org/name", "relative.jsonl", ""])
    steps = st.one_of(st.integers(-2, 64), st.integers(-2, 3000))
    chat = st.builds(types_pb2.ChatMessage, role=st.sampled_from(["user", "system", "assistant", ""]),
                     content=st.sampled_from(["copy 3", "3", "", "\\boxed{2}", "\u202e"]))
    spec = st.builds(controller_pb2.EnvironmentSpec, name=names, kind=kinds, jsonl_path=st.just("") | paths,
                     weight=st.sampled_from([0.0, 1.0]), rows=st.lists(st.builds(
                         types_pb2.DatasetRow, messages=st.lists(chat, min_size=1, max_size=2)), max_size=3))
    return {
        "spec": spec, "name": names, "env_name": names, "kind": kinds, "address": addresses, "jsonl_path": paths,
        "flywheel.v1.SampleRequest.step": steps, "flywheel.v1.CommitRequest.step": steps,
        "prompts_per_step": st.just(cfg.grpo.num_prompts_per_step),
        "max_staleness": st.just(cfg.grpo.max_staleness),
        "count": rarely(st.just(MAX_PROMPTS), st.integers(1, 300), 1000), "offset": st.integers(0, 10**6),
        "n": rarely(st.just(64), st.integers(1, 8), 20),
        "role": st.sampled_from(["user", "assistant", "system", "environment"]),
        "content": st.sampled_from(["copy 3", "3", "<action>up</action>", "\\boxed{2}", *NASTY[:10]]),
        "weight": st.sampled_from([0.0, 0.5, 1.0]), "max_turns": st.integers(0, 3),
        "timeout_seconds": st.sampled_from([0.0, 0.5, 1.0, 1e-9, 1e308, math.inf]),
        "max_new_tokens": st.integers(0, 8), "temperature": st.sampled_from([0.0, 0.5, 1.0, 2.0, 1e-30]),
        "top_p": st.sampled_from([0.0, 0.5, 1.0]), "top_k": st.integers(0, 5),
        "google.protobuf.Struct.fields": st.sampled_from(["ground_truth", "game_state", "num_moves", "max_moves",
                                                          "tests", "board"]),
    }


def _failures(fz: FuzzStack, rpc: Rpc, payloads: list[bytes], answers, prober: Prober) -> list[str]:
    bad = [f"{a.code.name} after {a.seconds:.1f} s: {a.details[:300]!r} (request {p[:120]!r}"
           f"{'...' if len(p) > 120 else ''}, {len(p)} bytes)"
           for p, a in zip(payloads, answers) if a.code not in CLEAN
           and not (a.code == grpc.StatusCode.UNAVAILABLE and rpc.name in PROXIES and _from_handler(a.details))]
    bad += [f"{rpc.service} {f} while the batch ran" for f in prober.failures]
    if not fz.alive(rpc.service):
        bad.append(f"{rpc.service} exited:\n{fz.tail(rpc.service)}")
    return bad


def _batch(rpc: Rpc) -> int:
    fields = rpc.request.DESCRIPTOR.fields
    return BATCH["empty" if not fields else "nested" if any(f.message_type for f in fields) else "flat"]


def _from_handler(details: str) -> bool:
    """A typed Unavailable names the remote; gRPC's own (a dead or unreachable server) does not."""
    return details.startswith(("remote environment ", "environment service at "))


def _fuzz(fz: FuzzStack, rpc: Rpc, cases, regressions: list, tally: Counter, count: int) -> None:
    """`count` requests drawn from `cases` in batches, after each regression on its own."""
    size = _batch(rpc)

    @settings(max_examples=-(-count // size), **SETTINGS)
    @given(batch=st.lists(cases, min_size=size, max_size=size))
    def fuzz(batch):
        payloads = [c.payload if isinstance(c, Case) else c for c in batch]
        with Prober(fz.callers[rpc.service], HEALTH_DEADLINE_S).watching() as prober:
            answers = fz.send(rpc, payloads)
        tally.update(a.code.name for a in answers)
        bad = _failures(fz, rpc, payloads, answers, prober)
        assert not bad, f"{rpc.name}: {len(bad)} failures in a batch of {len(batch)}:\n" + "\n".join(bad[:5])

    for case in regressions:
        fuzz = example(batch=[case])(fuzz)
    fuzz()


def _rpc(name: str) -> Rpc:
    return next(r for r in RPCS if r.name == name)


NORMAL = {
    "controller": (_rpc("controller.Status"), controller_pb2.StatusRequest()),
    "environment": (_rpc("environment.Step"), environment_pb2.StepRequest(env_name="toy_copy", episodes=[
        environment_pb2.Episode(messages=[types_pb2.ChatMessage(role="user", content="copy 3"),
                                          types_pb2.ChatMessage(role="assistant", content="3")],
                                metadata={"ground_truth": "3"})])),
    "replay": (_rpc("replay.Stats"), replay_pb2.StatsRequest()),
    "rollout": (_rpc("rollout.Generate"), rollout_pb2.GenerateRequest(
        messages=[types_pb2.ChatMessage(role="user", content="copy 3")], n=2)),
    "trainer": (_rpc("trainer.Status"), trainer_pb2.TrainerServiceStatusRequest()),
    "reward_model": (_rpc("reward_model.Step"), environment_pb2.StepRequest(env_name="rm", episodes=[
        environment_pb2.Episode(messages=[types_pb2.ChatMessage(role="user", content="copy 3"),
                                          types_pb2.ChatMessage(role="assistant", content="3")])])),
}
"""A request each service must still answer OK after the fuzzing."""


def _assert_serving(fz: FuzzStack, service: str) -> None:
    assert fz.alive(service), f"{service} exited:\n{fz.tail(service)}"
    assert fz.health(service) == grpc.StatusCode.OK, f"{service} fails its health check"
    rpc, request = NORMAL[service]
    answer = fz.send(rpc, [request.SerializeToString()])[0]
    assert answer.code == grpc.StatusCode.OK, f"{rpc.name}: a normal request: {answer.code.name} {answer.details}"


@pytest.mark.parametrize("rpc", RPCS, ids=lambda r: r.name)
def test_random_valid_requests_get_a_clean_answer(fz, rpc):
    tally: Counter = Counter()
    started = time.monotonic()
    _fuzz(fz, rpc, messages(rpc.request.DESCRIPTOR, _hints(fz)), REGRESSIONS.get(rpc.name, []), tally,
          VALID_CASES)
    print(f"\n{rpc.name}: {sum(tally.values())} valid requests in {time.monotonic() - started:.0f} s: "
          f"{dict(tally)}")
    assert sum(tally.values()) >= VALID_CASES
    _assert_serving(fz, rpc.service)


@pytest.mark.parametrize("rpc", RPCS, ids=lambda r: r.name)
def test_malformed_requests_get_a_clean_answer(fz, rpc):
    tally: Counter = Counter()
    started = time.monotonic()
    cases = malformed(rpc.request.DESCRIPTOR, messages(rpc.request.DESCRIPTOR, _hints(fz)))
    _fuzz(fz, rpc, cases, [], tally, MALFORMED_CASES)
    print(f"\n{rpc.name}: {sum(tally.values())} malformed requests in {time.monotonic() - started:.0f} s: "
          f"{dict(tally)}")
    assert sum(tally.values()) >= MALFORMED_CASES
    _assert_serving(fz, rpc.service)


@pytest.mark.parametrize("service", SERVICES)
def test_requests_at_the_message_size_limit_get_a_clean_answer(fz, service):
    """Just under security.max_message_mb (the bulk in an unknown field, so that no handler has megabytes
    of work to do), and just over it: RESOURCE_EXHAUSTED from gRPC, and the service goes on."""
    rpc = next(r for r in RPCS if r.service == service)
    limit = fz.cfg.security.max_message_mb << 20
    field = b"\xfa\xff\xff\xff\x07"  # field 2^28 - 1, length-delimited: unknown to every request
    for size, expected in ((limit - 4096, CLEAN), (limit + 4096, {grpc.StatusCode.RESOURCE_EXHAUSTED})):
        filler = size - len(field) - 5
        payload = field + varint(filler) + bytes(filler)
        answer = fz.callers[service].send(rpc.path, [payload], 60)[0]
        del payload
        assert answer.code in expected, (rpc.name, size, answer.code.name, answer.details[:300])
    _assert_serving(fz, service)


# --- NATS --------------------------------------------------------------------------------------------

NATS_SUBJECTS = {
    "work": (types_pb2.PromptGroup, ("rollout",)),
    "trajectories": (types_pb2.TrajectoryGroup, ("replay",)),
    "heartbeat": (types_pb2.RolloutHeartbeat, ("controller", "trainer")),
    "weights_loaded": (types_pb2.WeightLoaded, ("controller",)),
    "train_step": (types_pb2.StepReport, ("controller", "replay")),
    "stale": (types_pb2.StaleGroups, ("controller",)),
    "filtered": (types_pb2.StaleGroups, ("controller",)),
    "weights_announce": (types_pb2.WeightAnnouncement, ("rollout",)),
}
"""Subject (a `Subjects` property) -> the message it carries and the services that consume it."""
JETSTREAM = {"work", "trajectories", "stale", "filtered", "weights_announce"}
NATS_BATCH = 50
NATS_REGRESSIONS: dict[str, list[bytes]] = {
    "work": [
        # A PromptGroup with num_generations 2^31 - 1: the worker built that many episodes (its memory)
        types_pb2.PromptGroup(group_id="g", env_name="toy", num_generations=2**31 - 1, target_step=0,
                              messages=[types_pb2.ChatMessage(role="user", content="copy 1")]).SerializeToString(),
        b"\x0a\xff\xff\xff\xff\x0f",  # undecodable: the task raised, the message came back every 30 s for ever
        # No messages: "Cannot apply chat template to an empty conversation", handed back and run again every
        # second for ever, a traceback each time
        types_pb2.PromptGroup(group_id="g", env_name="toy", num_generations=1).SerializeToString(),
    ],
    "train_step": [
        # The controller took step 2^63 - 1 as the trainer's: every later lease (a stale group's prompt leased
        # again for trained_step + 1) raised "Value out of range", and the event came back every 10 s
        types_pb2.StepReport(step=2**63 - 1).SerializeToString(),
    ],
    "stale": [
        # Undecodable: the controller's handler raised, and the event came back every 10 s for ever, a traceback
        # each time
        b"\x0a\xff\xff\xff\xff\x0f",
    ],
    "trajectories": [
        # Undecodable, 1 MiB - 100 bytes: its dead letter (the bytes plus replay's headers) passed NATS's
        # max_payload, the server closed replay's connection, the publish timed out and replay exited; the
        # message, never acked, would have killed every restart too
        b"\xff" * ((1 << 20) - 100),
    ],
}


class Publisher:
    """A NATS connection with the run's credentials, on its own event loop thread."""

    def __init__(self, fz: FuzzStack) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        cfg = fz.cfg
        self.bus: Bus = self.run(Bus.connect(cfg.addresses.nats_url, cfg.run.name, name="fuzzer",
                                             security=cfg.security))

    def run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(120)

    def publish(self, subject: str, payloads: list[bytes]) -> None:
        async def go() -> None:
            for payload in payloads:
                if subject in JETSTREAM:
                    await self.bus.js.publish(getattr(self.bus.subjects, subject), payload)
                else:
                    await self.bus.nc.publish(getattr(self.bus.subjects, subject), payload)
            await self.bus.nc.flush()

        self.run(go())

    def close(self) -> None:
        self.run(self.bus.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


@pytest.fixture(scope="module")
def publisher(fz):
    pub = Publisher(fz)
    yield pub
    pub.close()


def _payloads(fz: FuzzStack, subject: str, message_type, max_payload: int):
    """Random bytes, corrupted and hand-made encodings of the subject's message, and now and then a payload
    at NATS's max_payload (replay publishes a dead letter with its bytes plus headers). Not forgeries: a
    payload that happens to be a work item a worker runs, or a trajectory replay stores, is a forged lease
    or trajectory, and what those do to a run is out of the threat model (docs/security.md: holders of the
    NATS credentials). A forged work item for an environment nobody serves, for one, is handed back and
    tried again every second, as a real one is while its environment service restarts."""
    near_limit = st.builds(lambda unit, cut: (unit * (max_payload // len(unit) + 1))[:max_payload - cut],
                           st.binary(min_size=1, max_size=8), st.integers(0, 64))
    usual = malformed(message_type.DESCRIPTOR, messages(message_type.DESCRIPTOR)).map(lambda p: p[:max_payload])
    return rarely(near_limit, usual, 100).filter(lambda p: not _forged(fz, subject, p))


def _forged(fz: FuzzStack, subject: str, payload: bytes) -> bool:
    try:
        if subject == "work":
            check_group(types_pb2.PromptGroup.FromString(payload), fz.cfg)
        elif subject == "trajectories":
            return not contract.violations(payload)
        else:
            return False
    except (DecodeError, InvalidArgument):
        return False
    return True


def _stats(fz: FuzzStack) -> replay_pb2.StatsResponse:
    replay = fz.callers["replay"]
    stats = replay.channel.unary_unary("/flywheel.v1.ReplayService/Stats",
                                       response_deserializer=replay_pb2.StatsResponse.FromString)
    return stats(replay_pb2.StatsRequest().SerializeToString(), timeout=10, metadata=replay.metadata)


@pytest.mark.parametrize("subject", NATS_SUBJECTS)
def test_random_payloads_on_a_consumed_subject_leave_its_consumers_running(fz, publisher, subject):
    message_type, consumers = NATS_SUBJECTS[subject]
    max_payload = publisher.bus.nc.max_payload
    sent = Counter()
    dead_lettered_before = _stats(fz).dead_lettered
    tracebacks_before = {s: _tracebacks(fz, s) for s in consumers}

    @settings(max_examples=NATS_CASES // NATS_BATCH, **SETTINGS)
    @given(batch=st.lists(_payloads(fz, subject, message_type, max_payload), min_size=NATS_BATCH,
                          max_size=NATS_BATCH))
    def fuzz(batch):
        publisher.publish(subject, batch)
        sent["payloads"] += len(batch)
        if subject == "trajectories":
            sent["malformed"] += sum(map(_malformed, batch))
        dead = [s for s in consumers if not fz.alive(s)]
        assert not dead, f"{dead} exited after payloads on {subject}:\n" + "\n".join(fz.tail(s) for s in dead)

    for payload in NATS_REGRESSIONS.get(subject, []):
        fuzz = example(batch=[payload])(fuzz)
    fuzz()
    assert sent["payloads"] >= NATS_CASES
    for service in consumers:
        _assert_serving(fz, service)
    tracebacks = {s: _tracebacks(fz, s) - tracebacks_before[s] for s in consumers}
    print(f"\n{subject}: {dict(sent)}; tracebacks logged: {tracebacks}")
    assert not any(tracebacks.values()), f"{subject}: a stray payload is a rate-limited warning, not a traceback"
    if subject in ("stale", "filtered"):  # each is handled or dropped, none redelivered for ever
        consumer = f"controller-{subject}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            info = publisher.run(publisher.bus.js.consumer_info(publisher.bus.subjects.stream("events"), consumer))
            if info.num_pending == 0 and info.num_ack_pending == 0:
                break
            time.sleep(0.5)
        assert info.num_pending == 0 and info.num_ack_pending == 0, info
    if subject == "trajectories":  # replay's design: every malformed trajectory is dead-lettered, with its reason
        expected = sent["malformed"]
        deadline = time.monotonic() + 120
        while _stats(fz).dead_lettered < dead_lettered_before + expected and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _stats(fz).dead_lettered - dead_lettered_before == expected
        last = publisher.run(publisher.bus.js.get_last_msg(publisher.bus.subjects.stream("state"),
                                                           publisher.bus.subjects.dead_letter))
        assert last.headers and last.headers.get(REASON_HEADER), last.headers


def _log(fz: FuzzStack, service: str) -> str:
    log = fz.stack.children.run_dir / "logs" / f"{PROCESS[service]}.log"
    return log.read_text(errors="replace") if log.exists() else ""


def _tracebacks(fz: FuzzStack, service: str) -> int:
    return _log(fz, service).count("Traceback")


def _traceback_excerpts(fz: FuzzStack, service: str, lines: int = 25) -> str:
    """Each traceback in a service's log with the lines before and after it: what escaped, and where."""
    text = _log(fz, service).splitlines()
    starts = [i for i, line in enumerate(text) if "Traceback" in line]
    return "\n...\n".join("\n".join(text[max(0, i - 3):i + lines]) for i in starts)


def _malformed(payload: bytes) -> bool:
    """What replay must dead-letter, by the proto's contract (contract.py), not by replay's own decode_group."""
    return bool(contract.violations(payload))


def test_every_service_still_answers_after_the_fuzzing_and_none_logged_a_traceback(fz):
    for service in SERVICES:
        _assert_serving(fz, service)
    escaped = {s: n for s in SERVICES if (n := _tracebacks(fz, s))}
    assert not escaped, f"tracebacks in the logs of {escaped}: an exception escaped somewhere:\n" + "\n\n".join(
        f"--- {s} ---\n{_traceback_excerpts(fz, s)}" for s in escaped)
    # The supervisor restarts a crashed service, which then answers again: only its record tells of the crash.
    assert not read_restarts(fz.stack.children.run_dir), read_restarts(fz.stack.children.run_dir)
