"""The weight-sync control plane's wire format: one `msgspec.Struct` per message.

Every message is one ZeroMQ frame: a msgpack map with the schema version `v`, the message `type`
and its fields. No tensor ever travels here (the bytes go over the round's process group or
through files); the largest message is a round's manifest (names, dtypes, shapes, bucket layout).

Who sends what (request -> reply, over DEALER -> the service's ROUTER):

    generator:  register -> registered      poll -> round | idle      done -> ack
                unregister -> ack
    sender:     ready -> go                  pending_request -> go | idle
                round_result -> ack
    anyone:     status_request -> status     (anything malformed -> error)

A version is either the full weights (HF names) or, from a LoRA learner, a LoRA adapter: its
tensors under peft's names (`base_model.model.<module>.lora_A.weight`, `...lora_B.weight`) and an
`Adapter` (rank, alpha, modules) on `ready` and `RoundInfo`, which the receiver needs to build it.

`RoundInfo` (inside `round`) is what a generator's engine receives to join a round; it crosses
vLLM's `collective_rpc` as a plain map (`to_builtins`) and is checked again on the far side
(`round_info`).

Decoding is typed: the envelope first (`v`, `type`), then the message's own decoder, whose type
bounds every field (lengths, ranges, choices) and whose `__post_init__` checks what spans fields.
Anything malformed raises `ProtocolError` (and nothing else, whatever the bytes), naming the field
(`ready.manifest.tensors[0].shape`); the service answers it with an `error` and keeps serving. A
manifest's shapes are bounded by its type before any arithmetic (`weight_sync.buckets`).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

from common.wire import ProtocolError, TypedDecoder, refusing, short
from weight_sync.buckets import TENSOR_FIELDS, Manifest

SCHEMA_VERSION = 1
MAX_MESSAGE_BYTES = 64 << 20  # a manifest of 1e5 tensors is ~10 MB
MAX_STR = 1 << 16

Backend = Literal["gloo", "nccl", "disk"]
Mode = Literal["finish", "interrupt"]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STR)]  # worker and sender ids, engine kinds
Text = Annotated[str, msgspec.Meta(max_length=MAX_STR)]
Secret = Annotated[str, msgspec.Meta(max_length=64, pattern="^[0-9a-f]*$")]
Version = Annotated[int, msgspec.Meta(ge=-1, le=2**62)]  # -1: the initial checkpoint / nothing yet
Published = Annotated[int, msgspec.Meta(ge=0, le=2**62)]  # a version somebody published
RoundId = Annotated[int, msgspec.Meta(ge=0, le=2**62)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Timeout = Annotated[float, msgspec.Meta(ge=0.001, le=1e6)]
Seconds = Annotated[float, msgspec.Meta(ge=0, le=1e9)]
Count = Annotated[int, msgspec.Meta(ge=0, le=2**62)]
Workers = Annotated[int, msgspec.Meta(ge=1, le=4096)]  # one engine's workers (tensor-parallel ranks)
GroupSize = Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]


class Msg(msgspec.Struct, tag_field="type", kw_only=True):
    """Every message: its `type` (the tag) and the schema version."""

    v: int = SCHEMA_VERSION


# ---- the round a generator joins ------------------------------------------------------------


class Adapter(msgspec.Struct):
    """A version that is a LoRA adapter (peft's `adapter_config.json`, the keys a loader needs):
    the update of module m is (lora_alpha / r) * B_m @ A_m, for every m in target_modules."""

    r: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
    lora_alpha: Annotated[float, msgspec.Meta(gt=0, le=1e9)]
    target_modules: Annotated[list[Name], msgspec.Meta(min_length=1, max_length=1 << 16)]

    @property
    def scale(self) -> float:
        return self.lora_alpha / self.r



class SameHost(msgspec.Struct):
    """The sender's shared-memory segment (`weight_sync/shm.py`): members on its host read the
    version there instead of joining the broadcast."""

    path: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    nonce: Annotated[int, msgspec.Meta(ge=0, lt=1 << 62)]  # also in the segment's header
    host: Text  # the sender's `shm.host_id()`
    force: bool = False  # weight_sync.same_host='shm': a same-host member must not fall back
    ipc: Annotated[bytes, msgspec.Meta(max_length=1024)] = b""  # the slot on the sender's CUDA device


class RoundInfo(msgspec.Struct):
    """One member's view of a round: what to receive, from where, as which group ranks."""

    round_id: RoundId
    version: Published
    backend: Backend
    mode: Mode  # how the generator applies it (copied from the service's config)
    timeout_s: Timeout
    catch_up: bool
    manifest: Manifest
    bucket_bytes: Count = 0  # the largest bucket
    host: Text = ""  # the sender's rendezvous store (group backends)
    port: Port = 0
    path: Text = ""  # the version's folder (disk backend)
    rank: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 0  # this generator's first group rank
    local_world_size: Workers = 1
    world_size: GroupSize = 1
    adapter: Adapter | None = None  # the tensors are a LoRA adapter, not the full weights
    shm: SameHost | None = None  # members on the sender's host may read the version here
    secret: Secret = ""  # the sender's rendezvous keys are under it (round.RoundStore)

    def __post_init__(self):
        if self.backend == "disk":
            if not self.path:
                raise ProtocolError("round_info.path", "the disk backend needs the version's folder")
            return
        if not self.host or not self.port:
            raise ProtocolError("round_info.port", f"backend {self.backend} needs the rendezvous host and port")
        if self.world_size < 2 or not 1 <= self.rank < self.world_size:
            raise ProtocolError("round_info.rank", f"rank {self.rank} not in [1, world_size={self.world_size})")
        if self.rank + self.local_world_size > self.world_size:
            raise ProtocolError("round_info.rank", f"ranks {self.rank}..{self.rank + self.local_world_size - 1} "
                                                   f"do not fit world_size {self.world_size}")


class Member(msgspec.Struct, array_like=True):
    """A round's member on the wire: `[worker_id, first_rank, world_size]` (the sender is rank 0)."""

    worker_id: Name
    first_rank: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    world_size: Workers

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.world_size)


class RoundStats(msgspec.Struct):
    """What the sender reports of a round (kept in the service's status as `last_round`)."""

    bytes: Count = 0
    buckets: Count = 0
    tensors: Count = 0
    attempts: Count = 0
    catch_up: bool = False
    gather_s: Seconds = 0.0  # the learner's gather, each tensor copied into the sender's buckets
    join_s: Seconds = 0.0  # waiting for members to show up
    broadcast_s: Seconds = 0.0  # every attempt: ready + setup + transfer + confirm
    ready_s: Seconds = 0.0  # from the roster until every member of it said ready
    setup_s: Seconds = 0.0
    transfer_s: Seconds = 0.0
    confirm_s: Seconds = 0.0
    shm_s: Seconds = 0.0  # writing the version into the shared-memory segment (same-host members)
    same_host: Count = 0  # members served by the same-host slot instead of the broadcast


# ---- generator <-> service ------------------------------------------------------------------


class Register(Msg, tag="register"):
    """A generator announces itself; `world_size`: its engine's workers (one group rank each)."""

    worker_id: Name
    engine_kind: Name  # "vllm" | "transformers" | ...
    world_size: Workers = 1
    version: Version = -1  # the version its weights are at


class Registered(Msg, tag="registered"):
    current_version: Version  # -1: nothing published yet
    mode: Mode


class Poll(Msg, tag="poll"):
    worker_id: Name
    version: Version  # what the generator holds now


class Offer(Msg, tag="round"):
    """Reply to `poll`: a round this generator should join now."""

    info: RoundInfo


class Idle(Msg, tag="idle"):
    current_version: Version
    retry_after_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 0.5


class Done(Msg, tag="done"):
    """A generator loaded (ok) or gave up on (not ok) the round of `version`."""

    worker_id: Name
    version: Version
    ok: bool = True
    load_s: Seconds = 0.0
    error: Text = ""


class Unregister(Msg, tag="unregister"):
    worker_id: Name


# ---- sender <-> service ---------------------------------------------------------------------


class Ready(Msg, tag="ready"):
    """Learner rank 0: version N is packed; `manifest` describes its buckets."""

    sender_id: Name
    version: Published
    backend: Backend
    manifest: Manifest
    host: Text = ""  # rendezvous store (group backends)
    port: Port = 0
    path: Text = ""  # the version's folder (disk backend)
    can_catch_up: bool = False  # the sender keeps these weights and serves catch-up rounds
    timeout_s: Timeout = 120.0
    join_timeout_s: Timeout = 10.0
    adapter: Adapter | None = None  # the tensors are a LoRA adapter, not the full weights
    shm: SameHost | None = None  # the sender's shared-memory segment, for members on its host
    secret: Secret = ""  # the rendezvous keys' prefix (round.RoundStore): only the round's members get it

    def __post_init__(self):
        if self.backend == "disk" and not self.path:
            raise ProtocolError("ready.path", "the disk backend needs the version's folder")
        if self.backend != "disk" and (not self.host or not self.port):
            raise ProtocolError("ready.port", f"backend {self.backend} needs the rendezvous host and port")


class Go(Msg, tag="go"):
    """Reply to `ready` (a publish round) or `pending_request` (a catch-up round)."""

    round_id: RoundId
    version: Published
    members: list[Member]
    world_size: GroupSize
    catch_up: bool = False
    cancelled: list[RoundId] = []  # unclaimed catch-up rounds to abort


class PendingRequest(Msg, tag="pending_request"):
    sender_id: Name
    version: Version  # the version the sender can serve (-1: none)
    next_within_s: Annotated[float, msgspec.Meta(ge=0, le=1e6)] = 1.0  # it asks again within this


class RoundResult(Msg, tag="round_result"):
    round_id: RoundId
    version: Published
    ok: list[Text]  # worker ids that received every bucket
    missed: list[Text]  # never joined (busy or gone): catch up later
    failed: list[Text]  # joined, then dropped out: treated as dead until they poll again
    stats: RoundStats = msgspec.field(default_factory=RoundStats)


# ---- anyone ---------------------------------------------------------------------------------


class StatusRequest(Msg, tag="status_request"):
    pass


class Status(Msg, tag="status"):
    values: dict[str, Any]


class Ack(Msg, tag="ack"):
    info: Text = ""


class Error(Msg, tag="error"):
    message: Text
    field: Text = ""


MESSAGES = (Register, Registered, Poll, Offer, Idle, Done, Unregister, Ready, Go, PendingRequest, RoundResult,
            StatusRequest, Status, Ack, Error)
_DECODERS = {cls.__struct_config__.tag: msgspec.msgpack.Decoder(cls) for cls in MESSAGES}


# --------------------------------------------------------------------------------------------
# encode / decode


class _Envelope(msgspec.Struct):
    v: Any = None
    type: Any = None


_ENVELOPE = TypedDecoder(_Envelope, MAX_MESSAGE_BYTES, "envelope")
_ENCODER = msgspec.msgpack.Encoder()


def encode(msg: Msg) -> bytes:
    """The one frame of `msg`."""
    if not isinstance(msg, Msg):
        raise TypeError(f"not a weight-sync message: {type(msg).__name__}")
    return _ENCODER.encode(msg)


@refusing
def decode(frames: Any) -> Msg:
    """One frame (or a one-frame list) -> message. Raises `ProtocolError` (only) when malformed."""
    if isinstance(frames, (list, tuple)):
        if len(frames) != 1:
            raise ProtocolError("message", f"expected 1 frame, got {len(frames)}")
        frames = frames[0]
    env = _ENVELOPE.decode(frames)
    if env.v != SCHEMA_VERSION:
        raise ProtocolError("envelope.v", f"schema version {short(env.v)}, this side speaks {SCHEMA_VERSION}")
    if not isinstance(env.type, str):
        raise ProtocolError("envelope.type", f"expected str, got {type(env.type).__name__}")
    decoder = _DECODERS.get(env.type)
    if decoder is None:
        raise ProtocolError("envelope.type", f"unknown message type {short(env.type)}")
    try:
        return decoder.decode(frames)
    except msgspec.DecodeError as e:
        raise _refused(e, env.type) from None


@refusing
def round_info(info: Any) -> RoundInfo:
    """`info` as a checked `RoundInfo` (a plain map, as `collective_rpc` delivers it, is converted)."""
    if isinstance(info, RoundInfo):
        return info
    try:
        return msgspec.convert(info, RoundInfo)
    except msgspec.ValidationError as e:
        raise _refused(e, "round_info") from None


def to_builtins(info: RoundInfo) -> dict:
    """A round as a plain map (what crosses vLLM's `collective_rpc`)."""
    return msgspec.to_builtins(info)


_AT = re.compile(r"^(.*?)(?: - at `\$(.*)`)?$", re.S)
_MISSING = re.compile(r"missing required field `(\w+)`")
# positions of array-like structs on the wire, named in errors: tensors[3][2] -> tensors[3].shape
_POSITIONS = {"tensors": TENSOR_FIELDS, "members": Member.__struct_fields__}
_POSITION = re.compile(r"\b(tensors|members)\[(\d+)\]\[(\d+)\].*")


def _refused(e: msgspec.DecodeError, kind: str) -> ProtocolError:
    """msgspec's "Expected `int` >= 1 - at `$.world_size`" as ProtocolError("register.world_size", ...).

    A type's own check (`__post_init__`) raised a `ProtocolError` naming `<type>.<part>`; msgspec
    says where that struct sat (`$.manifest`), so the field becomes `<kind>.manifest.<part>`."""
    m = _AT.match(str(e))
    problem, path = m.group(1), (m.group(2) or "").lstrip(".")
    path = _POSITION.sub(lambda p: f"{p[1]}[{p[2]}].{_POSITIONS[p[1]][int(p[3])]}", path)
    cause = e.__cause__
    if isinstance(cause, ProtocolError):
        own = cause.field.partition(".")[2]
        return ProtocolError(".".join(x for x in (kind, path, own) if x), cause.problem)
    missing = _MISSING.search(problem)
    if missing:
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
    return ProtocolError(f"{kind}.{path}" if path else kind, short(problem) if len(problem) > 200 else problem)
