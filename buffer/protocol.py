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

Anything malformed raises `ProtocolError`, which names the field (`scored[3].rollout.versions`);
callers catch that one type and keep serving. Its text quotes untrusted values only through
`short` (bounded in length and depth).
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Sequence, Union

import msgspec
import numpy as np
from msgspec import Meta, Struct

from common.wire import GROUP_DTYPE, ID_DTYPE, LOGPROB_DTYPE, MASK_DTYPE, ProtocolError, field_decoder, short
from common.wire import pack_array  # noqa: F401 (part of this module's API, as before)

SCHEMA_VERSION = 1

MAX_TOKENS = 1 << 20  # length of any one packed array
MAX_STR = 4 << 20  # prompt/completion text, error messages (characters)
MAX_ITEMS = 1 << 16  # prompt groups in a lease, entries in a metrics map
MAX_ID = 2**62


@dataclass(frozen=True)
class Limits:
    """Hard limits checked before decoding; a message past one is refused, not truncated.
    (The limits on one field are part of its type: `MAX_TOKENS`, `MAX_STR`, `MAX_ITEMS`.)"""

    max_message_bytes: int = 256 << 20  # all frames together
    max_frame_bytes: int = 64 << 20
    max_frames: int = 1 << 16  # rollouts per message + 1


DEFAULT_LIMITS = Limits()

# --------------------------------------------------------------------------------------------
# field types: what a field accepts off the wire (a packed array field also names its dtype)

Id = Annotated[int, Meta(ge=0, le=MAX_ID)]
Rank = Annotated[int, Meta(ge=0, le=1 << 16)]
Text = Annotated[str, Meta(max_length=MAX_STR)]
Seconds = Annotated[float, Meta(ge=0.0, le=1e9)]  # NaN fails `ge`
Ids = Annotated[memoryview, Meta(max_length=MAX_TOKENS * ID_DTYPE.itemsize), ID_DTYPE]  # (T,) int32
LogProbs = Annotated[memoryview, Meta(max_length=MAX_TOKENS * LOGPROB_DTYPE.itemsize), LOGPROB_DTYPE]  # (T,) f32
Mask = Annotated[memoryview, Meta(max_length=MAX_TOKENS), MASK_DTYPE]  # (T,) uint8, 0 or 1
Numbers = Annotated[dict[str, float], Meta(max_length=MAX_ITEMS)]
Scalars = Annotated[dict[str, Union[int, float, str, bool, None]], Meta(max_length=MAX_ITEMS)]


def _packed_fields(cls: type) -> tuple[tuple[str, np.dtype], ...]:
    """(name, dtype) of the packed-array fields of a Struct class, read from their annotations."""
    out = []
    for name, hint in typing.get_type_hints(cls, include_extras=True).items():
        for t in (hint, *typing.get_args(hint)):  # `LogProbs | None` too
            dtypes = [m for m in getattr(t, "__metadata__", ()) if isinstance(m, np.dtype)]
            if dtypes:
                out.append((name, dtypes[0]))
                break
    return tuple(out)


def _as_arrays(obj: Struct) -> None:
    """Packed bytes (just decoded) -> read-only views; anything else (lists, arrays of another
    dtype, CPU tensors) -> contiguous arrays of the wire dtype."""
    for name, dtype in _PACKED[type(obj)]:
        v = getattr(obj, name)
        if isinstance(v, (memoryview, bytes)):  # decoded, or packed by the caller
            n = v.nbytes if type(v) is memoryview else len(v)
            if n % dtype.itemsize:
                raise ProtocolError(name, f"{n} bytes is not a whole number of {dtype.str} values")
            setattr(obj, name, _frombuffer(v, dtype))
        elif v is not None and not (type(v) is np.ndarray and v.dtype == dtype and v.flags.c_contiguous):
            if hasattr(v, "detach"):  # torch tensor, without importing torch here
                v = v.detach().cpu().numpy()
            setattr(obj, name, np.ascontiguousarray(v, dtype))


_frombuffer = np.frombuffer


_ID, _LP = ID_DTYPE.itemsize, LOGPROB_DTYPE.itemsize


def _decoded_and_whole(r: "Rollout") -> bool:
    """A rollout just decoded (its packed fields the memoryviews msgspec makes) and well formed: each
    a whole number of values, the per-token ones as long as the completion. Else the general path."""
    p, c, b, v, m = r.prompt_ids, r.completion_ids, r.behav_logprobs, r.versions, r.action_mask
    if type(p) is not memoryview or type(c) is not memoryview or type(b) is not memoryview \
            or type(v) is not memoryview or (m is not None and type(m) is not memoryview):
        return False
    t = c.nbytes // _ID
    return not (p.nbytes % _ID or c.nbytes % _ID) and b.nbytes == t * _LP and v.nbytes == t * _ID \
        and (m is None or m.nbytes == t)


def _same_length(obj: Struct, names: tuple[str, ...], t: int) -> None:
    for name in names:
        v = getattr(obj, name)
        if v is not None and len(v) != t:
            raise ProtocolError(name, f"length {len(v)} != completion length {t}")


# --------------------------------------------------------------------------------------------
# rollouts: one frame each


class Rollout(Struct):
    """One sampled completion of one prompt, as a generator produced it."""

    group_id: Id  # the prompt group (k-th prompt leased in the run)
    sample_index: Annotated[int, Meta(ge=0, le=1 << 20)]  # 0 .. n_samples_per_prompt-1 within the group
    lease_id: Id  # the lease it answers; results of an expired lease are refused
    prompt_ids: Ids  # (P,) int32
    completion_ids: Ids  # (T,) int32
    behav_logprobs: LogProbs  # (T,) float32, log mu(token) after temperature/top-p
    versions: Ids  # (T,) int32, policy version that produced each token
    prompt: Text = ""
    completion: Text = ""
    label: Text | None = None
    finish_reason: Text = ""  # "stop" | "length" | ...
    worker_id: Text = ""
    # A multi-turn episode: the completion is every turn after the prompt, the policy's and the
    # environment's (tool results, feedback), as token ids in order. 1 marks a token the policy
    # sampled (trained on, with its behaviour log-prob and version), 0 one the environment added
    # (context only: behaviour log-prob 0, the version of the policy turn before it, so staleness
    # is the policy's). The policy's turns are the runs of 1s. None: every token is the policy's.
    action_mask: Mask | None = None  # (T,) uint8
    env_reward: float | None = None  # an episode's environment reward (the sum of its steps'), for a scorer

    def __post_init__(self) -> None:
        if _decoded_and_whole(self):  # (the hot path: a frame just decoded, well formed)
            self.prompt_ids = _frombuffer(self.prompt_ids, ID_DTYPE)
            self.completion_ids = _frombuffer(self.completion_ids, ID_DTYPE)
            self.behav_logprobs = _frombuffer(self.behav_logprobs, LOGPROB_DTYPE)
            self.versions = _frombuffer(self.versions, ID_DTYPE)
            if self.action_mask is not None:
                self.action_mask = _frombuffer(self.action_mask, MASK_DTYPE)
            return
        _as_arrays(self)
        _same_length(self, ("behav_logprobs", "versions", "action_mask"), len(self.completion_ids))

    def version_range(self) -> tuple[int, int] | None:
        """(oldest, newest) policy version among the tokens; None for an empty completion."""
        v = self.versions  # an array, or (after `check_scored`) the bytes it came as
        b = v.tobytes() if type(v) is memoryview else np.ascontiguousarray(v, ID_DTYPE).tobytes()
        if not b:
            return None
        first = b[:_ID]
        if b == first * (len(b) // _ID):  # one version made every token (the common case): ~10x cheaper
            only = int.from_bytes(first, "little", signed=True)
            return only, only
        every = _frombuffer(b, ID_DTYPE)
        return int(every.min()), int(every.max())

    @property
    def min_version(self) -> int:
        """Oldest policy version among the tokens (the one staleness is measured by); -1 if none."""
        return self.version_range()[0] if len(self.versions) else -1


class ScoredRollout(Struct):
    """A rollout with its reward and, when a reference scorer ran, the reference log-probs."""

    rollout: Rollout
    reward: float = 0.0  # total reward the learner uses (sum of the weighted components)
    scores: Numbers = {}  # each reward component by name
    ref_logprobs: LogProbs | None = None  # (T,) float32 under the frozen reference model
    failed: bool = False  # scoring failed; the buffer drops the group and counts it
    error: Text = ""
    metadata: Scalars = {}  # scalars only

    def __post_init__(self) -> None:
        # a failed sample may carry a non-finite reward (that may be why it failed)
        if not self.failed and not math.isfinite(self.reward):
            raise ProtocolError("reward", f"not finite ({self.reward})")
        if self.ref_logprobs is not None:
            _as_arrays(self)
            _same_length(self, ("ref_logprobs",), len(self.rollout.completion_ids))


# `check_scored`'s types: Rollout's and ScoredRollout's fields, constraints and checks, the packed
# arrays left as the memoryviews msgspec decoded. What they refuse is decoded again into the real
# types, which say what is wrong (tests/test_buffer_fuzz.py checks that both agree on mutants).


class _Refused(ValueError):
    pass


class _CheckedRollout(Rollout):
    def __post_init__(self) -> None:
        if not _decoded_and_whole(self):
            raise _Refused


class _CheckedScored(ScoredRollout):
    rollout: _CheckedRollout

    def __post_init__(self) -> None:
        ref = self.ref_logprobs
        if (not self.failed and not math.isfinite(self.reward)) or (
                ref is not None and ref.nbytes != self.rollout.completion_ids.nbytes // _ID * _LP):
            raise _Refused


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
        _as_arrays(self)


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


_PACKED = {cls: _packed_fields(cls) for cls in (Rollout, ScoredRollout, Resume)}
_HEADERS = {"rollouts": (RolloutsHeader, Rollout), "scored": (ScoredHeader, ScoredRollout),
            "batch": (BatchHeader, ScoredRollout)}
_CONTROL = (LeaseRequest, LeaseGrant, LeaseRenew, GroupFailed, Wait, BatchRequest, SetVersion, Resume,
            MetricsRequest, Metrics, EvalRequest, EvalReport, Ack, Error)
_TYPES = {cls.__struct_config__.tag: cls for cls in _CONTROL} | {k: h for k, (h, _) in _HEADERS.items()}
TYPE_NAMES = frozenset(_TYPES)

# --------------------------------------------------------------------------------------------
# encode


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):  # a packed array (already of its wire dtype: see `_as_arrays`)
        return obj.data if obj.flags.c_contiguous else obj.tobytes()
    raise TypeError(f"cannot encode {type(obj).__name__}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode_item(item: Rollout | ScoredRollout) -> bytes:
    """One rollout frame (what `rollouts`, `scored` and `batch` messages carry after the envelope)."""
    # arrays assigned after construction (never converted) get the wire dtype here
    _as_arrays(item)
    if isinstance(item, ScoredRollout):
        _as_arrays(item.rollout)
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
            _as_arrays(msg)
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
_CHECK = msgspec.msgpack.Decoder(_CheckedScored)


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

