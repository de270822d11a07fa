"""Hypothesis strategies for fuzzing Flywheel's public rpcs and NATS subjects, and a raw-bytes gRPC caller.

`messages(descriptor, hints)` builds structurally valid messages of any type by walking its descriptor:
integers at and near their extremes, floats with nan and ±inf, any unicode (now and then a string of
megabytes), repeated fields, nested messages (google.protobuf.Struct included), maps, oneofs, and
well-formed unknown fields appended to the wire bytes. `hints` steer named fields towards values a
service recognises (a live environment name, a step near the trainer's), mixed with random ones, so
requests get past the first check of a handler. `malformed(descriptor)` makes bytes that are not a
valid encoding, or are one only by accident: random bytes, valid messages truncated or corrupted, bad
varints and lengths, wire types 6 and 7, field number 0, invalid UTF-8 in string fields, unbalanced
and over-deep groups, nesting past protobuf's recursion limit.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

F = FieldDescriptor
INT_BOUNDS = {
    F.TYPE_INT32: (-2**31, 2**31 - 1), F.TYPE_SINT32: (-2**31, 2**31 - 1), F.TYPE_SFIXED32: (-2**31, 2**31 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1), F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_INT64: (-2**63, 2**63 - 1), F.TYPE_SINT64: (-2**63, 2**63 - 1), F.TYPE_SFIXED64: (-2**63, 2**63 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_FIXED64: (0, 2**64 - 1),
}
MAX_DEPTH = 4
"""Message nesting generated below the request (a Struct inside a Struct inside ...)."""
HUGE_CHARS = 1 << 20
"""The longest random string: 1 Mi characters, up to 4 MiB of UTF-8, well inside the 256 MiB message limit
(test_fuzz.py sends each service a request just under the limit, and one just over it, on their own)."""
NASTY = ["", " ", "\x00", "\n", "\r\n\r\n", "\u202e", "\ufeff", "\U0001f600" * 8, "../../../../etc/passwd",
         "/dev/zero", "%s%n%x", "{0}{1}", "${HOME}", "'; DROP TABLE x; --", "<script>", "\\", "\\x00",
         "null", "true", "nan", "inf", "-1", "1e309", "[]", "{}", '{"a": 1}', "a" * 300, "é" * 100]


def _integers(lo: int, hi: int) -> SearchStrategy[int]:
    edges = sorted({lo, lo + 1, hi - 1, hi, 0, 1, min(max(-1, lo), hi), hi // 2, lo // 2})
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi))


def rarely(rare: SearchStrategy, usual: SearchStrategy, one_in: int) -> SearchStrategy:
    """`rare` about once in `one_in` draws, else `usual`. (Keyed on a middle value: hypothesis draws the
    bounds of a range, 0 above all, many times more often than the rest.)"""
    key = one_in // 2 + 1 if one_in > 2 else 0
    return st.integers(0, one_in - 1).flatmap(lambda n: rare if n == key else usual)


HUGE_TEXT = st.builds(lambda unit, n: (unit * (n // len(unit) + 1))[:n], st.text(min_size=1, max_size=4),
                      st.integers(1 << 16, HUGE_CHARS))
TEXT = rarely(HUGE_TEXT, st.one_of(st.text(max_size=24), st.sampled_from(NASTY)), 400)
BYTES = rarely(st.builds(lambda b, n: b * n, st.binary(min_size=1, max_size=4), st.integers(1 << 16, 1 << 21)),
                st.binary(max_size=32), 400)


def scalars(field: FieldDescriptor) -> SearchStrategy:
    """Values of one scalar (or enum) field, edge cases included."""
    t = field.type
    if t in INT_BOUNDS:
        return _integers(*INT_BOUNDS[t])
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_DOUBLE:
        return st.one_of(st.sampled_from([0.0, -0.0, math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324]),
                         st.floats())
    if t == F.TYPE_FLOAT:
        return st.one_of(st.sampled_from([0.0, math.nan, math.inf, -math.inf, 3.4028234e38, 1e-45]),
                         st.floats(width=32))
    if t == F.TYPE_STRING:
        return TEXT
    if t == F.TYPE_BYTES:
        return BYTES
    if t == F.TYPE_ENUM:  # proto3 enums are open: unknown numbers decode too
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]),
                         _integers(-2**31, 2**31 - 1))
    raise TypeError(f"no strategy for {field.full_name} (type {t})")


Hints = Mapping[str, SearchStrategy]
"""Field full name ("flywheel.v1.SampleRequest.step") or bare name ("env_name") -> values to mix in."""


def _hinted(field: FieldDescriptor, hints: Hints, plain: SearchStrategy) -> SearchStrategy:
    hint = hints.get(field.full_name, hints.get(field.name))
    return plain if hint is None else st.one_of(hint, plain)


def _unknown_field(descriptor: Descriptor) -> SearchStrategy[bytes]:
    """One well-formed field the message does not know: a number it may know with a scalar wire type
    (decoded as its value, or kept as unknown where the wire type does not match), or a length-delimited
    field with a number it does not have."""
    known = {f.number for f in descriptor.fields}

    def encode(number: int, wire: int, value) -> bytes:
        tag = varint(number << 3 | wire)
        if wire == 0:
            return tag + varint(value % 2**64)
        if wire == 1:
            return tag + struct.pack("<Q", value % 2**64)
        if wire == 5:
            return tag + struct.pack("<I", value % 2**32)
        return tag + varint(len(value)) + value

    return st.one_of(
        st.builds(encode, st.integers(1, 2**29 - 1), st.sampled_from([0, 1, 5]), st.integers(0, 2**64 - 1)),
        st.builds(encode, st.integers(1, 2**29 - 1).filter(lambda n: n not in known), st.just(2),
                  st.binary(max_size=16)))


class Case:
    """One request: a message plus well-formed unknown fields after it on the wire. Its repr is Python that
    builds it again, so a failing case can be pasted into a regression list."""

    __slots__ = ("message", "unknown")

    def __init__(self, message: Message, unknown: bytes = b"") -> None:
        self.message, self.unknown = message, unknown

    @property
    def payload(self) -> bytes:
        return self.message.SerializeToString() + self.unknown

    def __repr__(self) -> str:
        return f"Case({python(self.message)}{f', {self.unknown!r}' if self.unknown else ''})"


def python(value) -> str:
    """A Python expression for a message (`rollout_pb2.GenerateRequest(n=1, ...)`) or a field value."""
    if isinstance(value, Message):
        module = value.DESCRIPTOR.file.name.rsplit("/", 1)[-1].removesuffix(".proto") + "_pb2"
        args = []
        for field, v in value.ListFields():
            if field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
                shown = "{" + ", ".join(f"{python(k)}: {python(x)}" for k, x in v.items()) + "}"
            elif field.is_repeated:
                shown = "[" + ", ".join(python(x) for x in v) + "]"
            else:
                shown = python(v)
            args.append(f"{field.name}={shown}")
        return f"{module}.{value.DESCRIPTOR.name}({', '.join(args)})"
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({str(value)!r})"
    if isinstance(value, (str, bytes)) and len(value) > 200:
        for period in range(1, 9):  # HUGE_TEXT repeats a short unit
            unit, times = value[:period], len(value) // period
            if unit * times + value[:len(value) % period] == value:
                rest = value[:len(value) % period]
                return f"{unit!r} * {times}" + (f" + {rest!r}" if rest else "")
        return f"{value[:200]!r}  # ... {len(value)} in all"
    return repr(value)


class _Builder:
    """Strategies for every message type reachable from one descriptor, cached per (type, depth)."""

    def __init__(self, hints: Hints) -> None:
        self.hints = hints
        self.cache: dict[tuple[str, int], SearchStrategy] = {}

    def message(self, descriptor: Descriptor, depth: int = 0) -> SearchStrategy[Message]:
        key = (descriptor.full_name, depth)
        if key not in self.cache:
            self.cache[key] = self._build(descriptor, depth)
        return self.cache[key]

    def _value(self, field: FieldDescriptor, depth: int) -> SearchStrategy:
        plain = self.message(field.message_type, depth + 1) if field.type == F.TYPE_MESSAGE else scalars(field)
        return _hinted(field, self.hints, plain)

    def _build(self, descriptor: Descriptor, depth: int) -> SearchStrategy[Message]:
        cls = _message_class(descriptor)
        if depth > MAX_DEPTH:
            return st.just(cls())
        plans = []
        oneofs = {o.full_name: [f.name for f in o.fields] for o in descriptor.oneofs}
        for field in descriptor.fields:
            if field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
                entry = field.message_type.fields_by_name
                keys = _hinted(field, self.hints, scalars(entry["key"]))
                plans.append((field, st.dictionaries(keys, self._value(entry["value"], depth), max_size=4)))
            elif field.is_repeated:
                plans.append((field, st.lists(self._value(field, depth), max_size=4 if depth else 6)))
            else:
                plans.append((field, self._value(field, depth)))

        @st.composite
        def build(draw) -> Message:
            msg = cls()
            chosen = {name: draw(st.sampled_from([None, *fields])) for name, fields in oneofs.items()}
            for field, values in plans:
                oneof = field.containing_oneof
                if oneof is not None and chosen[oneof.full_name] != field.name:
                    continue
                if oneof is None and draw(st.integers(0, 3)) == 1:
                    continue  # unset (proto3 default): a quarter of the fields of a message
                _assign(msg, field, draw(values))
            return msg

        return build()


def _message_class(descriptor: Descriptor) -> type[Message]:
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(descriptor)


def _assign(msg: Message, field: FieldDescriptor, value) -> None:
    target = getattr(msg, field.name)
    if field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
        value_f = field.message_type.fields_by_name["value"]
        for k, v in value.items():
            if value_f.type == F.TYPE_MESSAGE:
                target[k].CopyFrom(v)
            else:
                target[k] = v
    elif field.is_repeated:
        if field.type == F.TYPE_MESSAGE:
            for v in value:
                target.add().CopyFrom(v)
        else:
            target.extend(value)
    elif field.type == F.TYPE_MESSAGE:
        target.CopyFrom(value)
    else:
        setattr(msg, field.name, value)


def messages(descriptor: Descriptor, hints: Hints | None = None) -> SearchStrategy[Case]:
    """Structurally valid requests of `descriptor`'s type; one in four carries unknown fields too."""
    body = _Builder(hints or {}).message(descriptor)
    unknown = rarely(st.lists(_unknown_field(descriptor), min_size=1, max_size=3).map(b"".join), st.just(b""), 4)
    return st.builds(Case, body, unknown)


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _nested(depth: int, number: int = 1) -> bytes:
    """`depth` length-delimited fields, each inside the one before: past the decoder's recursion limit
    where `number` is a message field at every level (Struct.fields -> Value.struct_value -> ...)."""
    inner = b""
    for _ in range(depth):
        inner = varint(number << 3 | 2) + varint(len(inner)) + inner
    return inner


def _struct_nested(depth: int) -> bytes:
    """A google.protobuf.Struct `depth` levels deep: fields{"k": Value{struct_value: Struct{...}}}."""
    inner = b""
    for _ in range(depth):
        value = varint(5 << 3 | 2) + varint(len(inner)) + inner  # Value.struct_value = 5
        entry = b"\x0a\x01k" + varint(2 << 3 | 2) + varint(len(value)) + value  # map entry: key 1, value 2
        inner = varint(1 << 3 | 2) + varint(len(entry)) + entry  # Struct.fields = 1
    return inner


def _struct_paths(descriptor: Descriptor, prefix: tuple[int, ...] = (), seen: frozenset = frozenset()):
    """Field-number paths from `descriptor` to each google.protobuf.Struct field it can reach."""
    for field in descriptor.fields:
        if field.type != F.TYPE_MESSAGE:
            continue
        sub = field.message_type
        path = (*prefix, field.number)
        if sub.full_name == "google.protobuf.Struct":
            yield path
        elif sub.full_name not in seen and not sub.GetOptions().map_entry:
            yield from _struct_paths(sub, path, seen | {descriptor.full_name})


def _wrap(path: Sequence[int], inner: bytes) -> bytes:
    for number in reversed(path):
        inner = varint(number << 3 | 2) + varint(len(inner)) + inner
    return inner


def _crafted(descriptor: Descriptor) -> list[bytes]:
    """Hand-made encodings that are wrong in one known way each."""
    out = [
        b"\x0a\xff\xff\xff\xff\x0f",  # a length that runs past the end
        b"\x08" + b"\xff" * 10 + b"\x01",  # an 11-byte varint
        b"\x08\x80",  # a varint cut off
        b"\x0e\x00", b"\x0f\x00",  # wire types 6 and 7
        b"\x00\x01", b"\x02\x00",  # field number 0
        b"\x0b", b"\x0c", b"\x0b\x14",  # a group never ended, an end without a start, the wrong end
        b"\x0b" * 200 + b"\x0c" * 200,  # unknown groups nested past the recursion limit
        b"\x09\x01\x02", b"\x0d\x01",  # fixed64 / fixed32 cut off
        b"\xfa\xff\xff\xff\x7f\x00",  # field number 2^29 - 1 ... with wire type 2, empty: valid, unknown
        b"\xf8\xff\xff\xff\xff\x01\x00",  # field number beyond 2^29 - 1
    ]
    for field in descriptor.fields:
        tag = field.number << 3
        if field.type == F.TYPE_STRING:
            out += [varint(tag | 2) + b"\x02\xff\xfe", varint(tag | 2) + b"\x03\xed\xa0\x80",  # invalid UTF-8
                    varint(tag | 2) + b"\x02\xc0\xaf"]  # overlong encoding
        if field.type == F.TYPE_MESSAGE:
            out += [varint(tag | 2) + b"\x03\x0a\x05a",  # a nested message whose own length is wrong
                    varint(tag | 2) + varint(3000) + b"\x00" * 3000,  # nested field number 0
                    varint(tag | 0) + b"\x01",  # a message field sent as a varint
                    _nested(120, field.number)]  # may or may not nest: the field's own number at each level
        if field.type in INT_BOUNDS or field.type == F.TYPE_BOOL:
            out += [varint(tag | 2) + b"\x01\x01",  # a scalar sent length-delimited (packed: one element)
                    varint(tag | 2) + b"\x05\x01",  # ... with a length past the end
                    varint(tag | 5) + b"\x01\x00\x00\x00"]  # ... as fixed32
    for path in _struct_paths(descriptor):
        out += [_wrap(path, _struct_nested(150)), _wrap(path, _struct_nested(60))]  # past and within the limit
    return out


def malformed(descriptor: Descriptor, valid: SearchStrategy[Case]) -> SearchStrategy[bytes]:
    """Bytes that are not (or only by chance) an encoding of `descriptor`'s message."""
    crafted = _crafted(descriptor)

    def mutate(payload: bytes, how: int, at: int, junk: bytes) -> bytes:
        at = at % (len(payload) + 1)
        if how == 0:
            return payload[:at]  # truncated
        if how == 1:
            return payload[:at] + junk + payload[at:]  # bytes inserted
        if how == 2 and payload:
            i = at % len(payload)
            return payload[:i] + bytes([payload[i] ^ (junk[:1] or b"\xff")[0]]) + payload[i + 1:]  # a byte flipped
        if how == 3:
            return payload[:at] + b"\xff" * 10 + payload[at:]  # a run of continuation bytes
        return payload + payload[:at]  # a tail repeated

    mutated = st.builds(mutate, valid.map(lambda c: c.payload), st.integers(0, 4), st.integers(0, 2**16),
                        st.binary(min_size=1, max_size=8))
    return st.one_of(st.binary(min_size=1, max_size=128), mutated, st.sampled_from(crafted),
                     st.builds(lambda a, b: a + b, st.sampled_from(crafted), st.binary(max_size=16)))


@dataclass(frozen=True, slots=True)
class Answer:
    code: grpc.StatusCode
    details: str
    seconds: float


class Caller:
    """Blocking client of one service: raw bytes in, status out, many calls in flight at once."""

    def __init__(self, address: str, metadata: Sequence[tuple[str, str]], max_message_mb: int) -> None:
        limit = max_message_mb << 20
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", limit),
                                                                ("grpc.max_receive_message_length", limit)])
        self.metadata = tuple(metadata)
        self._calls: dict[str, grpc.UnaryUnaryMultiCallable] = {}

    def _call(self, path: str) -> grpc.UnaryUnaryMultiCallable:
        if path not in self._calls:
            self._calls[path] = self.channel.unary_unary(path)  # no serializers: bytes both ways
        return self._calls[path]

    def send(self, path: str, payloads: Sequence[bytes], timeout_s: float, concurrency: int = 64) -> list[Answer]:
        """Every payload, at most `concurrency` in flight; answers in order."""
        answers: list[Answer | None] = [None] * len(payloads)
        slots = threading.Semaphore(concurrency)
        left = [len(payloads)]
        lock, finished = threading.Lock(), threading.Event()

        def settle(i: int, started: float, future) -> None:
            err = future.exception()
            answers[i] = Answer(grpc.StatusCode.OK if err is None else err.code(),
                                "" if err is None else (err.details() or ""), time.monotonic() - started)
            slots.release()
            with lock:
                left[0] -= 1
                if not left[0]:
                    finished.set()

        call = self._call(path)
        for i, payload in enumerate(payloads):
            slots.acquire()
            started = time.monotonic()
            future = call.future(payload, timeout=timeout_s, metadata=self.metadata)
            future.add_done_callback(lambda f, i=i, started=started: settle(i, started, f))
        if payloads:
            finished.wait()
        return answers  # type: ignore[return-value]

    def close(self) -> None:
        self.channel.close()


@dataclass
class Prober:
    """Health checks of one service every `every_s` while a batch runs: a handler that blocks the service's
    event loop (rather than only its own call) shows as a slow or failed probe."""

    caller: Caller
    deadline_s: float = 5.0
    every_s: float = 0.25
    failures: list[str] = dataclasses.field(default_factory=list)

    @contextmanager
    def watching(self):
        from grpc_health.v1 import health_pb2

        stop = threading.Event()
        request = health_pb2.HealthCheckRequest().SerializeToString()

        def probe() -> None:
            while not stop.wait(self.every_s):
                answer = self.caller.send("/grpc.health.v1.Health/Check", [request], self.deadline_s)[0]
                if answer.code != grpc.StatusCode.OK:
                    self.failures.append(f"health check: {answer.code.name} after {answer.seconds:.1f} s")

        thread = threading.Thread(target=probe, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()
