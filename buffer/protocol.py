"""Conveyor's wire protocol: every message that crosses a process boundary.

A message is a list of ZeroMQ frames. Frame 0 is a msgpack map, the envelope, with the schema
version `v` and the message `type`. Messages that carry rollouts (`rollouts`, `scored`, `batch`)
put each rollout in a frame of its own after the envelope, so the buffer can keep the bytes it
accepted and forward them to a learner without encoding them again.

Token ids, log-probs and versions travel as packed little-endian arrays (msgpack `bin`), decoded
with `numpy.frombuffer`: a read-only view, not a list of Python numbers. Nothing is pickled.

Anything malformed raises `ProtocolError`, which names the field; callers catch that one type and
keep serving. Its text quotes untrusted values only through `short` (bounded in length and depth:
the repr of a list nested 1,000 deep raises RecursionError).
"""

from __future__ import annotations

import functools
import math
import reprlib
from dataclasses import dataclass, field
from typing import Any, Sequence

import msgpack
import numpy as np

SCHEMA_VERSION = 1

ID_DTYPE = np.dtype("<i4")  # token ids and policy versions
LOGPROB_DTYPE = np.dtype("<f4")  # log-probs
GROUP_DTYPE = np.dtype("<i8")  # prompt group ids in a `resume` handshake


class ProtocolError(ValueError):
    """A message that cannot be decoded; `field` names the offending part (e.g. `scored[3].reward`)."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


@dataclass(frozen=True)
class Limits:
    """Hard limits applied before and while decoding; a message past one is refused, not truncated."""

    max_message_bytes: int = 256 << 20  # all frames together
    max_frame_bytes: int = 64 << 20
    max_frames: int = 1 << 16  # rollouts per message + 1
    max_tokens: int = 1 << 20  # length of any one packed array
    max_str_bytes: int = 4 << 20  # prompt/completion text, error messages
    max_items: int = 1 << 16  # prompt groups in a lease, entries in a metrics map


DEFAULT_LIMITS = Limits()

_SHORT = reprlib.Repr()  # (keyword arguments only from Python 3.12)
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict = 2, 60, 60, 4, 4


def short(v: Any) -> str:
    """A repr of an untrusted value fit for an error message: at most ~80 characters, 2 levels deep."""
    return _SHORT.repr(v)


# --------------------------------------------------------------------------------------------
# field readers: each checks one field and names it in the error


def _get(d: dict, key: str, where: str) -> Any:
    try:
        return d[key]
    except KeyError:
        raise ProtocolError(f"{where}.{key}", "missing") from None


def _int(d: dict, key: str, where: str, lo: int = -(2**62), hi: int = 2**62) -> int:
    v = _get(d, key, where)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ProtocolError(f"{where}.{key}", f"expected int, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise ProtocolError(f"{where}.{key}", f"{v} outside [{lo}, {hi}]")
    return v


def _float(d: dict, key: str, where: str, finite: bool = True) -> float:
    v = _get(d, key, where)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ProtocolError(f"{where}.{key}", f"expected number, got {type(v).__name__}")
    v = float(v)
    if finite and not math.isfinite(v):
        raise ProtocolError(f"{where}.{key}", f"not finite ({v})")
    return v


def _bool(d: dict, key: str, where: str) -> bool:
    v = _get(d, key, where)
    if not isinstance(v, bool):
        raise ProtocolError(f"{where}.{key}", f"expected bool, got {type(v).__name__}")
    return v


def _str(d: dict, key: str, where: str, limits: Limits, optional: bool = False) -> str | None:
    v = d.get(key) if optional else _get(d, key, where)
    if v is None and optional:
        return None
    if not isinstance(v, str):
        raise ProtocolError(f"{where}.{key}", f"expected str, got {type(v).__name__}")
    if len(v) > limits.max_str_bytes:
        raise ProtocolError(f"{where}.{key}", f"{len(v)} characters > limit {limits.max_str_bytes}")
    return v


def _array(d: dict, key: str, where: str, dtype: np.dtype, limits: Limits, optional: bool = False):
    v = d.get(key) if optional else _get(d, key, where)
    if v is None and optional:
        return None
    if not isinstance(v, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"{where}.{key}", f"expected packed {dtype.str} bytes, got {type(v).__name__}")
    if len(v) % dtype.itemsize:
        raise ProtocolError(f"{where}.{key}", f"{len(v)} bytes is not a whole number of {dtype.str}")
    n = len(v) // dtype.itemsize
    if n > limits.max_tokens:
        raise ProtocolError(f"{where}.{key}", f"{n} elements > limit {limits.max_tokens}")
    return np.frombuffer(v, dtype=dtype)


def _scalar_map(d: dict, key: str, where: str, limits: Limits, values=(int, float, str, bool),
                allow_none: bool = True) -> dict:
    v = d.get(key)
    if v is None:
        v = {}
    if not isinstance(v, dict):
        raise ProtocolError(f"{where}.{key}", f"expected map, got {type(v).__name__}")
    if len(v) > limits.max_items:
        raise ProtocolError(f"{where}.{key}", f"{len(v)} entries > limit {limits.max_items}")
    for k, x in v.items():
        if not isinstance(k, str):
            raise ProtocolError(f"{where}.{key}", f"key {short(k)} is not a string")
        if x is None and allow_none:
            continue
        if not isinstance(x, values):
            raise ProtocolError(f"{where}.{key}.{k}", f"unsupported value type {type(x).__name__}")
    return v


def pack_array(a: Any, dtype: np.dtype) -> bytes:
    """Little-endian bytes of `a` as `dtype` (accepts lists, numpy arrays and CPU tensors)."""
    if hasattr(a, "detach"):  # torch tensor, without importing torch here
        a = a.detach().cpu().numpy()
    return np.ascontiguousarray(a, dtype=dtype).tobytes()


# --------------------------------------------------------------------------------------------
# rollouts


@dataclass
class Rollout:
    """One sampled completion of one prompt, as a generator produced it."""

    group_id: int  # the prompt group (k-th prompt leased in the run)
    sample_index: int  # 0 .. n_samples_per_prompt-1 within the group
    lease_id: int  # the lease it answers; results of an expired lease are refused
    prompt_ids: np.ndarray  # (P,) int32
    completion_ids: np.ndarray  # (T,) int32
    behav_logprobs: np.ndarray  # (T,) float32, log mu(token) after temperature/top-p
    versions: np.ndarray  # (T,) int32, policy version that produced each token
    prompt: str = ""
    completion: str = ""
    label: str | None = None
    finish_reason: str = ""  # "stop" | "length" | ...
    worker_id: str = ""

    def to_wire(self) -> dict:
        return {
            "group_id": self.group_id,
            "sample_index": self.sample_index,
            "lease_id": self.lease_id,
            "prompt_ids": pack_array(self.prompt_ids, ID_DTYPE),
            "completion_ids": pack_array(self.completion_ids, ID_DTYPE),
            "behav_logprobs": pack_array(self.behav_logprobs, LOGPROB_DTYPE),
            "versions": pack_array(self.versions, ID_DTYPE),
            "prompt": self.prompt,
            "completion": self.completion,
            "label": self.label,
            "finish_reason": self.finish_reason,
            "worker_id": self.worker_id,
        }

    @classmethod
    def from_wire(cls, d: Any, where: str, limits: Limits = DEFAULT_LIMITS) -> "Rollout":
        if not isinstance(d, dict):
            raise ProtocolError(where, f"expected map, got {type(d).__name__}")
        r = cls(
            group_id=_int(d, "group_id", where, 0),
            sample_index=_int(d, "sample_index", where, 0, 1 << 20),
            lease_id=_int(d, "lease_id", where, 0),
            prompt_ids=_array(d, "prompt_ids", where, ID_DTYPE, limits),
            completion_ids=_array(d, "completion_ids", where, ID_DTYPE, limits),
            behav_logprobs=_array(d, "behav_logprobs", where, LOGPROB_DTYPE, limits),
            versions=_array(d, "versions", where, ID_DTYPE, limits),
            prompt=_str(d, "prompt", where, limits),
            completion=_str(d, "completion", where, limits),
            label=_str(d, "label", where, limits, optional=True),
            finish_reason=_str(d, "finish_reason", where, limits),
            worker_id=_str(d, "worker_id", where, limits),
        )
        t = len(r.completion_ids)
        for name in ("behav_logprobs", "versions"):
            if len(getattr(r, name)) != t:
                raise ProtocolError(f"{where}.{name}", f"length {len(getattr(r, name))} != completion length {t}")
        return r

    @property
    def min_version(self) -> int:
        """Oldest policy version among the tokens (the one staleness is measured by)."""
        return int(self.versions.min()) if len(self.versions) else -1


@dataclass
class ScoredRollout:
    """A rollout with its reward and, when a reference scorer ran, the reference log-probs."""

    rollout: Rollout
    reward: float = 0.0  # total reward the learner uses (sum of the weighted components)
    scores: dict[str, float] = field(default_factory=dict)  # each reward component by name
    ref_logprobs: np.ndarray | None = None  # (T,) float32 under the frozen reference model
    failed: bool = False  # scoring failed; the buffer drops the group and counts it
    error: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)  # scalars only

    def to_wire(self) -> dict:
        return {
            "rollout": self.rollout.to_wire(),
            "reward": float(self.reward),
            "scores": {k: float(v) for k, v in self.scores.items()},
            "ref_logprobs": None if self.ref_logprobs is None else pack_array(self.ref_logprobs, LOGPROB_DTYPE),
            "failed": self.failed,
            "error": self.error,
            "metadata": self.metadata,
        }

    @classmethod
    def from_wire(cls, d: Any, where: str, limits: Limits = DEFAULT_LIMITS) -> "ScoredRollout":
        if not isinstance(d, dict):
            raise ProtocolError(where, f"expected map, got {type(d).__name__}")
        failed = _bool(d, "failed", where)
        s = cls(
            rollout=Rollout.from_wire(_get(d, "rollout", where), f"{where}.rollout", limits),
            # a failed sample may carry a non-finite reward (that may be why it failed)
            reward=_float(d, "reward", where, finite=not failed),
            scores=_scalar_map(d, "scores", where, limits, values=(int, float), allow_none=False),
            ref_logprobs=_array(d, "ref_logprobs", where, LOGPROB_DTYPE, limits, optional=True),
            failed=failed,
            error=_str(d, "error", where, limits),
            metadata=_scalar_map(d, "metadata", where, limits),
        )
        if s.ref_logprobs is not None and len(s.ref_logprobs) != len(s.rollout.completion_ids):
            raise ProtocolError(
                f"{where}.ref_logprobs",
                f"length {len(s.ref_logprobs)} != completion length {len(s.rollout.completion_ids)}",
            )
        return s


# --------------------------------------------------------------------------------------------
# control messages


@dataclass
class PromptGroup:
    """One prompt to sample `n_samples` completions of; `group_id` counts prompt groups over the run."""

    group_id: int
    prompt: str
    label: str | None = None
    index: int = 0  # row of the prompt dataset


@dataclass
class LeaseRequest:
    worker_id: str
    max_groups: int = 1
    version: int = 0  # the generator's current weights


@dataclass
class LeaseGrant:
    lease_id: int
    groups: list[PromptGroup]
    n_samples: int
    ttl_s: float  # the lease expires this long after it was granted unless renewed
    version: int  # the learner's version when granted


@dataclass
class LeaseRenew:
    lease_id: int


@dataclass
class GroupFailed:
    """A generator gives up on a group (e.g. a prompt refused as too long); not re-issued."""

    lease_id: int
    group_id: int
    reason: str


@dataclass
class Wait:
    """No lease or batch right now; ask again after `retry_after_s`. `done`: there never will be."""

    reason: str
    retry_after_s: float = 0.1
    done: bool = False


@dataclass
class RolloutsMsg:
    """Generator -> scorers (through the buffer's relay)."""

    rollouts: list[Rollout]


@dataclass
class ScoredMsg:
    """Scorer -> buffer."""

    scored: list[ScoredRollout]


@dataclass
class BatchRequest:
    """A learner rank asks for its share of step `step`'s batch; `step` is also the learner's version."""

    step: int
    rank: int = 0
    world_size: int = 1


@dataclass
class Batch:
    step: int
    rank: int
    world_size: int
    scored: list[ScoredRollout]  # whole groups, oldest first
    stats: dict[str, float] = field(default_factory=dict)  # staleness etc. of this share


@dataclass
class SetVersion:
    version: int


@dataclass
class Resume:
    """The learner, started from its checkpoint at `step` (0: from scratch), says where its lineage
    stands: `trained` are the groups it trained in steps 0..step-1 (its ledger), (K,) int64. The
    buffer puts itself at that point (`BufferState.resume`) and answers `Ack`."""

    step: int
    trained: Any = ()


@dataclass
class MetricsRequest:
    pass


@dataclass
class Metrics:
    values: dict[str, float]


@dataclass
class Ack:
    accepted: int = 0
    rejected: int = 0
    info: str = ""


@dataclass
class Error:
    """Reply to a request that could not be served; `field` names the bad part when there is one."""

    message: str
    field: str = ""


# --------------------------------------------------------------------------------------------
# encode / decode

_ITEM_TYPES = {"rollouts": (RolloutsMsg, Rollout, "rollouts"), "scored": (ScoredMsg, ScoredRollout, "scored")}


def _pack(obj: dict) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def encode_item(item: Rollout | ScoredRollout) -> bytes:
    """One rollout frame (what `rollouts`, `scored` and `batch` messages carry after the envelope)."""
    return _pack(item.to_wire())


def encode(msg: Any) -> list[bytes]:
    """The frames of `msg`."""
    head = {"v": SCHEMA_VERSION}
    if isinstance(msg, RolloutsMsg):
        return [_pack({**head, "type": "rollouts", "n": len(msg.rollouts)}), *map(encode_item, msg.rollouts)]
    if isinstance(msg, ScoredMsg):
        return [_pack({**head, "type": "scored", "n": len(msg.scored)}), *map(encode_item, msg.scored)]
    if isinstance(msg, Batch):
        return encode_batch(msg.step, msg.rank, msg.world_size, [encode_item(s) for s in msg.scored], msg.stats)
    if isinstance(msg, LeaseGrant):
        body = {
            "lease_id": msg.lease_id,
            "groups": [[g.group_id, g.prompt, g.label, g.index] for g in msg.groups],
            "n_samples": msg.n_samples,
            "ttl_s": float(msg.ttl_s),
            "version": msg.version,
        }
        return [_pack({**head, "type": "lease_grant", **body})]
    if isinstance(msg, Resume):
        return [_pack({**head, "type": "resume", "step": msg.step, "trained": pack_array(msg.trained, GROUP_DTYPE)})]
    name = _TYPE_NAMES.get(type(msg))
    if name is None:
        raise TypeError(f"not a protocol message: {type(msg).__name__}")
    return [_pack({**head, "type": name, **msg.__dict__})]


def encode_batch(step: int, rank: int, world_size: int, item_frames: Sequence[bytes], stats: dict) -> list[bytes]:
    """A `batch` message from already-encoded scored-rollout frames (the buffer forwards what it accepted)."""
    env = {"v": SCHEMA_VERSION, "type": "batch", "step": step, "rank": rank, "world_size": world_size,
           "n": len(item_frames), "stats": {k: float(v) for k, v in stats.items()}}
    return [_pack(env), *item_frames]


def _refusing(decoder):
    """`decoder`, raising `ProtocolError` and only that on any input: a value nested past the
    recursion limit or of a type no reader expected is a malformed message, not a bug to crash on."""

    @functools.wraps(decoder)
    def wrapper(*args, **kwargs):
        try:
            return decoder(*args, **kwargs)
        except ProtocolError:
            raise
        except (RecursionError, TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as e:
            raise ProtocolError("message", f"cannot be decoded ({type(e).__name__})") from None

    return wrapper


def _unpack(frame: Any, where: str, limits: Limits) -> Any:
    try:
        return msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            max_bin_len=limits.max_frame_bytes,
            max_str_len=limits.max_str_bytes,
            max_array_len=limits.max_items,
            max_map_len=limits.max_items,
            max_ext_len=0,
        )
    except (ValueError, msgpack.UnpackException, TypeError) as e:
        raise ProtocolError(where, f"not valid msgpack ({type(e).__name__}: {e})") from None


@_refusing
def decode_item(frame: Any, kind: str, where: str = "item", limits: Limits = DEFAULT_LIMITS):
    """One rollout frame; `kind` is `rollouts` (-> Rollout) or `scored` (-> ScoredRollout)."""
    cls = Rollout if kind == "rollouts" else ScoredRollout
    if len(frame) > limits.max_frame_bytes:
        raise ProtocolError(where, f"{len(frame)} bytes > frame limit {limits.max_frame_bytes}")
    return cls.from_wire(_unpack(frame, where, limits), where, limits)


@_refusing
def decode_envelope(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> tuple[str, dict]:
    """Check sizes and the envelope; return (type, envelope map) without decoding item frames."""
    if not frames:
        raise ProtocolError("message", "no frames")
    if len(frames) > limits.max_frames:
        raise ProtocolError("message", f"{len(frames)} frames > limit {limits.max_frames}")
    total = 0
    for i, f in enumerate(frames):
        n = len(f)
        if n > limits.max_frame_bytes:
            raise ProtocolError(f"frame[{i}]", f"{n} bytes > frame limit {limits.max_frame_bytes}")
        total += n
    if total > limits.max_message_bytes:
        raise ProtocolError("message", f"{total} bytes > message limit {limits.max_message_bytes}")
    env = _unpack(frames[0], "envelope", limits)
    if not isinstance(env, dict):
        raise ProtocolError("envelope", f"expected map, got {type(env).__name__}")
    v = env.get("v")
    if v != SCHEMA_VERSION:
        raise ProtocolError("envelope.v", f"schema version {short(v)}, this side speaks {SCHEMA_VERSION}")
    kind = env.get("type")
    if not isinstance(kind, str):  # a list or map here would make the lookups below raise TypeError
        raise ProtocolError("envelope.type", f"expected str, got {type(kind).__name__}")
    if kind not in _DECODERS and kind not in _ITEM_TYPES and kind != "batch":
        raise ProtocolError("envelope.type", f"unknown message type {short(kind)}")
    if kind in _ITEM_TYPES or kind == "batch":
        n = _int(env, "n", kind, 0, limits.max_frames)
        if n != len(frames) - 1:
            raise ProtocolError(f"{kind}.n", f"says {n} items, message has {len(frames) - 1}")
    elif len(frames) != 1:
        raise ProtocolError("message", f"{kind} takes one frame, got {len(frames)}")
    return kind, env


@_refusing
def decode(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> Any:
    """Frames -> message object. Raises `ProtocolError` (and only that) on anything malformed."""
    kind, env = decode_envelope(frames, limits)
    if kind in _ITEM_TYPES:
        msg_cls, _, attr = _ITEM_TYPES[kind]
        items = [decode_item(f, kind, f"{attr}[{i}]", limits) for i, f in enumerate(frames[1:])]
        return msg_cls(items)
    if kind == "batch":
        items = [decode_item(f, "scored", f"batch[{i}]", limits) for i, f in enumerate(frames[1:])]
        stats = _scalar_map(env, "stats", "batch", limits, values=(int, float), allow_none=False)
        return Batch(
            step=_int(env, "step", "batch", 0),
            rank=_int(env, "rank", "batch", 0),
            world_size=_int(env, "world_size", "batch", 1),
            scored=items,
            stats={k: float(v) for k, v in stats.items()},
        )
    return _DECODERS[kind](env, limits)


def _lease_grant(d: dict, limits: Limits) -> LeaseGrant:
    raw = _get(d, "groups", "lease_grant")
    if not isinstance(raw, list):
        raise ProtocolError("lease_grant.groups", "expected list")
    groups = []
    for i, g in enumerate(raw):
        where = f"lease_grant.groups[{i}]"
        if not (isinstance(g, list) and len(g) == 4):
            raise ProtocolError(where, "expected [group_id, prompt, label, index]")
        gd = dict(zip(("group_id", "prompt", "label", "index"), g))
        groups.append(PromptGroup(_int(gd, "group_id", where, 0), _str(gd, "prompt", where, limits),
                                  _str(gd, "label", where, limits, optional=True), _int(gd, "index", where, 0)))
    return LeaseGrant(
        lease_id=_int(d, "lease_id", "lease_grant", 0),
        groups=groups,
        n_samples=_int(d, "n_samples", "lease_grant", 1, 1 << 16),
        ttl_s=_float(d, "ttl_s", "lease_grant"),
        version=_int(d, "version", "lease_grant", 0),
    )


_DECODERS = {
    "lease_request": lambda d, L: LeaseRequest(
        _str(d, "worker_id", "lease_request", L), _int(d, "max_groups", "lease_request", 1, L.max_items),
        _int(d, "version", "lease_request", 0)),
    "lease_grant": _lease_grant,
    "lease_renew": lambda d, L: LeaseRenew(_int(d, "lease_id", "lease_renew", 0)),
    "group_failed": lambda d, L: GroupFailed(
        _int(d, "lease_id", "group_failed", 0), _int(d, "group_id", "group_failed", 0),
        _str(d, "reason", "group_failed", L)),
    "wait": lambda d, L: Wait(_str(d, "reason", "wait", L), _float(d, "retry_after_s", "wait"), _bool(d, "done", "wait")),
    "batch_request": lambda d, L: BatchRequest(
        _int(d, "step", "batch_request", 0), _int(d, "rank", "batch_request", 0, 1 << 16),
        _int(d, "world_size", "batch_request", 1, 1 << 16)),
    "set_version": lambda d, L: SetVersion(_int(d, "version", "set_version", 0)),
    "resume": lambda d, L: Resume(_int(d, "step", "resume", 0), _array(d, "trained", "resume", GROUP_DTYPE, L)),
    "metrics_request": lambda d, L: MetricsRequest(),
    "metrics": lambda d, L: Metrics({k: float(v) for k, v in _scalar_map(
        d, "values", "metrics", L, values=(int, float), allow_none=False).items()}),
    "ack": lambda d, L: Ack(_int(d, "accepted", "ack", 0), _int(d, "rejected", "ack", 0), _str(d, "info", "ack", L)),
    "error": lambda d, L: Error(_str(d, "message", "error", L), _str(d, "field", "error", L)),
}

_TYPE_NAMES = {
    LeaseRequest: "lease_request",
    LeaseRenew: "lease_renew",
    GroupFailed: "group_failed",
    Wait: "wait",
    BatchRequest: "batch_request",
    SetVersion: "set_version",
    MetricsRequest: "metrics_request",
    Metrics: "metrics",
    Ack: "ack",
    Error: "error",
}
