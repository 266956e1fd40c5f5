"""Conveyor's wire protocol: every message that crosses a process boundary to or from the buffer.

A message is a list of ZeroMQ frames. Frame 0 is the envelope, a msgpack map with the schema
version `v`, the message `type` and the message's fields. Messages that carry rollouts
(`rollouts`, `scored`, `batch`) put each rollout in a frame of its own after the envelope, so the
buffer can keep the bytes it accepted and forward them to a learner without encoding them again
(`encode_batch`).

Each message is one `msgspec.Struct` below, and decoding is a typed msgspec decoder: the types
say what a valid message is (field types, bounds as `Meta` constraints, cross-field checks in
`__post_init__`, which also runs when a message is built in memory). Limits on a frame, a message
and its frame count are the `Limits` a decoder is given; limits on one field (an array's length, a
string's, a map's entries) are declared on the field (`MAX_TOKENS`, `MAX_STR`, `MAX_ITEMS`).

Token ids, log-probs and versions travel as packed little-endian arrays (msgpack `bin`), and
arrive as `numpy.frombuffer` views over the received bytes (read-only, not copies, not lists of
Python numbers). In memory, those fields are numpy arrays of the wire dtype. Nothing is pickled.
The buffer, which forwards the frames it accepts and never reads their arrays, checks a scored
rollout with `check_scored`: the same types and checks, the arrays left as the bytes they came as.
The field types and the rollout types live in `buffer.rollouts`, re-exported here.

Anything malformed raises `ProtocolError`, which names the field (`scored[3].rollout.versions`);
callers catch that one type and keep serving. Its text quotes untrusted values only through
`short` (bounded in length and depth).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Sequence, Union

import msgspec
import numpy as np
from msgspec import Meta, Struct

from buffer.rollouts import (  # noqa: F401 (the field types and rollouts are part of this module's API)
    MAX_ID,
    MAX_IMAGE_BYTES,
    MAX_IMAGES,
    MAX_ITEMS,
    MAX_STR,
    MAX_TOKENS,
    CheckedScored,
    Id,
    Ids,
    Images,
    LogProbs,
    Mask,
    Numbers,
    Rank,
    Rollout,
    Scalars,
    ScoredRollout,
    Seconds,
    Text,
    as_arrays,
)
from common.wire import (  # noqa: F401 (part of this module's API)
    GROUP_DTYPE,
    ID_DTYPE,
    LOGPROB_DTYPE,
    MASK_DTYPE,
    ProtocolError,
    field_decoder,
    pack_array,
    short,
)

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Limits:
    """Hard limits checked before decoding; a message past one is refused, not truncated.
    (The limits on one field are part of its type: `MAX_TOKENS`, `MAX_STR`, `MAX_ITEMS`.)"""

    max_message_bytes: int = 256 << 20  # all frames together
    max_frame_bytes: int = 64 << 20
    max_frames: int = 1 << 16  # rollouts per message + 1


DEFAULT_LIMITS = Limits()

# --------------------------------------------------------------------------------------------
# messages: the envelope is the message itself, tagged by `type`


class Message(Struct, tag_field="type", kw_only=True):
    v: int = SCHEMA_VERSION


class ChatMessage(Struct, array_like=True):
    """One message of a chat prompt, rendered by the generator with the tokenizer's chat template."""

    role: Text
    content: Text


class PromptGroup(Struct, array_like=True):
    """One prompt to sample `n_samples` completions of; `group_id` counts prompt groups over the run."""

    group_id: Id
    prompt: Text  # the prompt's text (with messages: their contents, for reward functions and logs)
    label: Text | None = None
    index: Id = 0  # row of the prompt dataset
    messages: Annotated[list[ChatMessage], Meta(max_length=MAX_ITEMS)] | None = None  # a chat prompt
    columns: Text = ""  # the dataset row's other columns, a JSON object (buffer/prompts.py), "" if none
    # a vision-language prompt's images, encoded; each "<image>" in its text or messages stands for
    # the next one (common.images)
    images: Images | None = None




class LeaseRequest(Message, tag="lease_request"):
    worker_id: Text
    max_groups: Annotated[int, Meta(ge=1, le=MAX_ITEMS)] = 1
    version: Id = 0  # the generator's current weights


class LeaseGrant(Message, tag="lease_grant"):
    lease_id: Id
    groups: Annotated[list[PromptGroup], Meta(max_length=MAX_ITEMS)]
    n_samples: Annotated[int, Meta(ge=1, le=1 << 16)]
    ttl_s: Seconds  # the lease expires this long after it was granted unless renewed
    version: Id  # the learner's version when granted
    # an evaluation lease (never trained on): sample at this temperature instead of the generator's
    temperature: Annotated[float, Meta(ge=0, le=100)] | None = None


class LeaseRenew(Message, tag="lease_renew"):
    lease_id: Id


class GroupFailed(Message, tag="group_failed"):
    """A generator gives up on a group (e.g. a prompt refused as too long); not re-issued."""

    lease_id: Id
    group_id: Id
    reason: Text


class Wait(Message, tag="wait"):
    """No lease or batch right now; ask again after `retry_after_s`. `done`: there never will be."""

    reason: Text
    retry_after_s: Seconds = 0.1
    done: bool = False


class BatchRequest(Message, tag="batch_request"):
    """A learner rank asks for its share of step `step`'s batch; `step` is also the learner's version."""

    step: Id
    rank: Rank = 0
    world_size: Annotated[int, Meta(ge=1, le=1 << 16)] = 1


class SetVersion(Message, tag="set_version"):
    version: Id


class Resume(Message, tag="resume"):
    """The learner, started from its checkpoint at `step` (0: from scratch), says where its lineage
    stands: `trained` are the groups it trained in steps 0..step-1 (its ledger), (K,) int64. The
    buffer puts itself at that point (`BufferState.resume`) and answers `Ack`."""

    step: Id
    trained: Annotated[memoryview, GROUP_DTYPE] = b""  # (K,) int64

    def __post_init__(self) -> None:
        as_arrays(self)


class MetricsRequest(Message, tag="metrics_request"):
    pass


class EvalRequest(Message, tag="eval_request"):
    """The learner asks for the evaluation of the policy at `version` (which it has published):
    answered `Wait` while the round runs (started by the first request), then `EvalReport`."""

    version: Id


class EvalReport(Message, tag="eval_report"):
    version: Id
    values: Numbers  # eval/pass@1, eval/pass@k, eval/reward_mean, ...


class Metrics(Message, tag="metrics"):
    values: Numbers


class Ack(Message, tag="ack"):
    accepted: Id = 0
    rejected: Id = 0
    info: Text = ""


class Error(Message, tag="error"):
    """Reply to a request that could not be served; `field` names the bad part when there is one."""

    message: Text
    field: Text = ""


# envelopes of the messages whose rollouts follow in frames of their own


class RolloutsHeader(Message, tag="rollouts"):
    n: Annotated[int, Meta(ge=0, le=MAX_ITEMS)]  # rollout frames after this one


class ScoredHeader(Message, tag="scored"):
    n: Annotated[int, Meta(ge=0, le=MAX_ITEMS)]


class BatchHeader(Message, tag="batch"):
    step: Id
    rank: Rank
    world_size: Annotated[int, Meta(ge=1, le=1 << 16)]
    n: Annotated[int, Meta(ge=0, le=MAX_ITEMS)]
    stats: Numbers = {}  # staleness etc. of this share


class RolloutsMsg(Struct):
    """Generator -> scorers (through the buffer's relay)."""

    rollouts: list[Rollout]


class ScoredMsg(Struct):
    """Scorer -> buffer."""

    scored: list[ScoredRollout]


class Batch(Struct):
    """A learner rank's share of one step: its `BatchHeader`'s fields, and the rollouts."""

    step: int
    rank: int
    world_size: int
    scored: list[ScoredRollout]  # whole groups, oldest first
    stats: dict[str, float] = {}


_HEADERS = {"rollouts": (RolloutsHeader, Rollout), "scored": (ScoredHeader, ScoredRollout),
            "batch": (BatchHeader, ScoredRollout)}
_CONTROL = (LeaseRequest, LeaseGrant, LeaseRenew, GroupFailed, Wait, BatchRequest, SetVersion, Resume,
            MetricsRequest, Metrics, EvalRequest, EvalReport, Ack, Error)
_TYPES = {cls.__struct_config__.tag: cls for cls in _CONTROL} | {k: h for k, (h, _) in _HEADERS.items()}
TYPE_NAMES = frozenset(_TYPES)

# --------------------------------------------------------------------------------------------
# encode


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):  # a packed array (already of its wire dtype: see `as_arrays`)
        return obj.data if obj.flags.c_contiguous else obj.tobytes()
    raise TypeError(f"cannot encode {type(obj).__name__}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode_item(item: Rollout | ScoredRollout) -> bytes:
    """One rollout frame (what `rollouts`, `scored` and `batch` messages carry after the envelope)."""
    # arrays assigned after construction (never converted) get the wire dtype here
    as_arrays(item)
    if isinstance(item, ScoredRollout):
        as_arrays(item.rollout)
    return _ENCODER.encode(item)


def encode(msg: Any) -> list[bytes]:
    """The frames of `msg`."""
    if isinstance(msg, RolloutsMsg):
        return [_ENCODER.encode(RolloutsHeader(n=len(msg.rollouts))), *map(encode_item, msg.rollouts)]
    if isinstance(msg, ScoredMsg):
        return [_ENCODER.encode(ScoredHeader(n=len(msg.scored))), *map(encode_item, msg.scored)]
    if isinstance(msg, Batch):
        return encode_batch(msg.step, msg.rank, msg.world_size, [encode_item(s) for s in msg.scored], msg.stats)
    if isinstance(msg, Message) and not isinstance(msg, (RolloutsHeader, ScoredHeader, BatchHeader)):
        if isinstance(msg, Resume):
            as_arrays(msg)
        return [_ENCODER.encode(msg)]
    raise TypeError(f"not a protocol message: {type(msg).__name__}")


def encode_batch(step: int, rank: int, world_size: int, item_frames: Sequence[bytes], stats: dict) -> list[bytes]:
    """A `batch` message from already-encoded scored-rollout frames (the buffer forwards what it accepted)."""
    head = BatchHeader(step=step, rank=rank, world_size=world_size, n=len(item_frames),
                       stats={k: float(v) for k, v in stats.items()})
    return [_ENCODER.encode(head), *item_frames]


# --------------------------------------------------------------------------------------------
# decode


class _Head(Struct):
    """What is read of an envelope before its type is known."""

    v: Union[int, None] = None
    type: Union[str, None] = None


_HEAD = field_decoder(_Head)
_DECODERS = {kind: field_decoder(cls) for kind, cls in _TYPES.items()}
_ITEMS = {"rollouts": field_decoder(Rollout), "scored": field_decoder(ScoredRollout)}
_CHECK = msgspec.msgpack.Decoder(CheckedScored)


def _size(f: Any, where: str) -> int:
    try:
        return f.nbytes if isinstance(f, memoryview) else len(f)
    except TypeError:
        raise ProtocolError(where, f"expected bytes, got {type(f).__name__}") from None


def _within_frame_limit(frame: Any, where: str, limits: Limits) -> None:
    n = _size(frame, where)
    if n > limits.max_frame_bytes:
        raise ProtocolError(where, f"{n} bytes > frame limit {limits.max_frame_bytes}")


def decode_item(frame: Any, kind: str, where: str = "item", limits: Limits = DEFAULT_LIMITS):
    """One rollout frame; `kind` is `rollouts` (-> Rollout) or `scored`/`batch` (-> ScoredRollout)."""
    _within_frame_limit(frame, where, limits)
    return _ITEMS["rollouts" if kind == "rollouts" else "scored"](frame, where)


def check_scored(frame: Any, where: str = "item", limits: Limits = DEFAULT_LIMITS) -> ScoredRollout:
    """A scored-rollout frame checked as `decode_item(frame, "scored")` checks it (the same frames
    accepted, the same errors for the others) at about half the cost: the packed arrays stay the
    memoryviews msgspec decoded, over `frame`, instead of becoming numpy arrays. What the buffer
    reads of an item it accepts is its ids, reward and `version_range`, never its arrays."""
    _within_frame_limit(frame, where, limits)
    try:
        return _CHECK.decode(frame)
    except (msgspec.DecodeError, RecursionError):  # (ValidationError is a DecodeError)
        return _ITEMS["scored"](frame, where)  # raises what decoding into the type says is wrong


def decode_envelope(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> tuple[str, Message]:
    """Check sizes and the envelope; return (type, envelope) without decoding item frames."""
    if not frames:
        raise ProtocolError("message", "no frames")
    if len(frames) > limits.max_frames:
        raise ProtocolError("message", f"{len(frames)} frames > limit {limits.max_frames}")
    total = 0
    for i, f in enumerate(frames):
        n = _size(f, f"frame[{i}]")
        if n > limits.max_frame_bytes:
            raise ProtocolError(f"frame[{i}]", f"{n} bytes > frame limit {limits.max_frame_bytes}")
        total += n
    if total > limits.max_message_bytes:
        raise ProtocolError("message", f"{total} bytes > message limit {limits.max_message_bytes}")
    head = _HEAD(frames[0], "envelope")
    if head.v != SCHEMA_VERSION:
        raise ProtocolError("envelope.v", f"schema version {short(head.v)}, this side speaks {SCHEMA_VERSION}")
    kind = head.type
    if kind not in _TYPES:
        raise ProtocolError("envelope.type", f"unknown message type {short(kind)}")
    env = _DECODERS[kind](frames[0], kind)
    if kind in _HEADERS:
        if env.n != len(frames) - 1:
            raise ProtocolError(f"{kind}.n", f"says {env.n} items, message has {len(frames) - 1}")
    elif len(frames) != 1:
        raise ProtocolError("message", f"{kind} takes one frame, got {len(frames)}")
    return kind, env


def decode(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> Any:
    """Frames -> message object. Raises `ProtocolError` (and only that) on anything malformed."""
    kind, env = decode_envelope(frames, limits)
    if kind not in _HEADERS:
        return env
    item = _ITEMS["rollouts" if kind == "rollouts" else "scored"]
    items = [item(f, f"{kind}[{i}]") for i, f in enumerate(frames[1:])]
    if kind == "rollouts":
        return RolloutsMsg(items)
    if kind == "scored":
        return ScoredMsg(items)
    return Batch(env.step, env.rank, env.world_size, items, env.stats)

