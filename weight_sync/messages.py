"""The weight-sync control plane's wire format.

Every message is one ZeroMQ frame: a msgpack map with the schema version `v`, the message `type`
and its fields. No tensor ever travels here (the bytes go over the round's process group or
through files); the largest message is a round's manifest (names, dtypes, shapes, bucket layout).

Who sends what (request -> reply, over DEALER -> the service's ROUTER):

    generator:  register -> registered      poll -> round | idle      done -> ack
                unregister -> ack
    sender:     ready -> go                  pending_request -> go | idle
                round_result -> ack
    anyone:     status_request -> status     (anything malformed -> error)

`round_info` (inside `round` and handed to the engine's `receive_weights`) is a plain map, so
that it passes through vLLM's `collective_rpc` unchanged; `validate_round_info` checks it.

Anything malformed raises `ProtocolError` (and nothing else, whatever the bytes), which names the
field; the service answers it with an `error` and keeps serving. Error texts quote untrusted values
only through `short`, and a manifest's shapes are bounded before any arithmetic on them (a shape of
65,535 dims of 2**64-1 would otherwise cost seconds of big-integer products).
"""

from __future__ import annotations

import functools
import math
import reprlib
from dataclasses import dataclass, field
from typing import Any

import msgpack

from weight_sync.buckets import ManifestError, validate_manifest

SCHEMA_VERSION = 1
MAX_MESSAGE_BYTES = 64 << 20  # a manifest of 1e5 tensors is ~10 MB
MAX_STR = 1 << 16
MAX_ITEMS = 1 << 17
BACKENDS = ("gloo", "nccl", "disk")
MODES = ("finish", "interrupt")
# manifest bounds, checked field by field before `validate_manifest` multiplies anything
MAX_TENSORS = 1 << 16
MAX_NDIM = 16
MAX_DIM = 1 << 40  # one dimension's size, exclusive
MAX_MODEL_BYTES = 1 << 42  # all buckets together (4 TiB)


class ProtocolError(ValueError):
    """A message that cannot be decoded; `field` names the offending part (e.g. `ready.version`)."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


# (a copy of `buffer.protocol.short`: neither package may import the other)
_SHORT = reprlib.Repr()  # (keyword arguments only from Python 3.12)
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict = 2, 60, 60, 4, 4


def short(v: Any) -> str:
    """A repr of an untrusted value fit for an error message: at most ~80 characters, 2 levels deep."""
    return _SHORT.repr(v)


def _refusing(decoder):
    """`decoder`, raising `ProtocolError` and only that on any input: a value nested past the
    recursion limit or of a type no reader expected is a malformed message, not a bug to crash on.
    (A copy of `buffer.protocol._refusing`: neither package may import the other.)"""

    @functools.wraps(decoder)
    def wrapper(*args, **kwargs):
        try:
            return decoder(*args, **kwargs)
        except ProtocolError:
            raise
        except (RecursionError, TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as e:
            raise ProtocolError("message", f"cannot be decoded ({type(e).__name__})") from None

    return wrapper


# --------------------------------------------------------------------------------------------
# field readers


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


def _float(d: dict, key: str, where: str, lo: float = -math.inf, hi: float = math.inf) -> float:
    v = _get(d, key, where)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ProtocolError(f"{where}.{key}", f"expected number, got {type(v).__name__}")
    v = float(v)
    if not math.isfinite(v) or not lo <= v <= hi:
        raise ProtocolError(f"{where}.{key}", f"{v} outside [{lo}, {hi}]")
    return v


def _bool(d: dict, key: str, where: str) -> bool:
    v = _get(d, key, where)
    if not isinstance(v, bool):
        raise ProtocolError(f"{where}.{key}", f"expected bool, got {type(v).__name__}")
    return v


def _str(d: dict, key: str, where: str, choices: tuple = (), nonempty: bool = False) -> str:
    v = _get(d, key, where)
    if not isinstance(v, str):
        raise ProtocolError(f"{where}.{key}", f"expected str, got {type(v).__name__}")
    if len(v) > MAX_STR:
        raise ProtocolError(f"{where}.{key}", f"{len(v)} characters > limit {MAX_STR}")
    if choices and v not in choices:
        raise ProtocolError(f"{where}.{key}", f"{short(v)} is not one of {list(choices)}")
    if nonempty and not v:
        raise ProtocolError(f"{where}.{key}", "empty")
    return v


def _str_list(d: dict, key: str, where: str) -> list[str]:
    v = _get(d, key, where)
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ProtocolError(f"{where}.{key}", "expected list of str")
    return v


def _int_list(d: dict, key: str, where: str) -> list[int]:
    v = _get(d, key, where)
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise ProtocolError(f"{where}.{key}", "expected list of int")
    return v


def _scalars(d: dict, key: str, where: str) -> dict:
    v = d.get(key) or {}
    if not isinstance(v, dict):
        raise ProtocolError(f"{where}.{key}", f"expected map, got {type(v).__name__}")
    for k, x in v.items():
        if not isinstance(k, str):
            raise ProtocolError(f"{where}.{key}", f"key {short(k)} is not a string")
        if isinstance(x, list):  # flat lists only: a deep one would fail when `status` encodes it
            if not all(isinstance(y, (int, float, str, bool)) for y in x):
                raise ProtocolError(f"{where}.{key}.{k}", "expected a list of scalars")
        elif x is not None and not isinstance(x, (int, float, str, bool)):
            raise ProtocolError(f"{where}.{key}.{k}", f"unsupported value type {type(x).__name__}")
    return v


def _manifest(d: dict, key: str, where: str) -> dict:
    m, where = _get(d, key, where), f"{where}.{key}"
    _bound_shapes(m, where)
    try:
        validate_manifest(m, where, max_tensors=MAX_TENSORS)
    except ManifestError as e:
        raise ProtocolError(e.field, e.problem) from None
    total = sum(m["buckets"])
    if total > MAX_MODEL_BYTES:
        raise ProtocolError(f"{where}.buckets", f"{total} bytes in all > limit {MAX_MODEL_BYTES}")
    return m


def _bound_shapes(m: Any, where: str) -> None:
    """Constant work per field: at most MAX_TENSORS tensors and buckets, MAX_NDIM dims each below
    MAX_DIM, so the products `validate_manifest` takes stay small integers."""
    if not isinstance(m, dict):
        return  # validate_manifest names it
    for key in ("buckets", "tensors"):
        v = m.get(key)
        if isinstance(v, list) and len(v) > MAX_TENSORS:
            raise ProtocolError(f"{where}.{key}", f"{len(v)} entries > limit {MAX_TENSORS}")
    tensors = m.get("tensors")
    for i, t in enumerate(tensors if isinstance(tensors, list) else ()):
        shape = t[2] if isinstance(t, list) and len(t) == 5 else None
        if not isinstance(shape, list):
            continue  # validate_manifest names it
        if len(shape) > MAX_NDIM:
            raise ProtocolError(f"{where}.tensors[{i}].shape", f"{len(shape)} dims > limit {MAX_NDIM}")
        for s in shape:
            if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < MAX_DIM:
                raise ProtocolError(f"{where}.tensors[{i}].shape", f"size {short(s)} not in [0, {MAX_DIM})")


# --------------------------------------------------------------------------------------------
# messages


@dataclass
class Register:
    """A generator announces itself; `world_size`: its engine's workers (one group rank each)."""

    worker_id: str
    engine_kind: str  # "vllm" | "transformers" | ...
    world_size: int = 1
    version: int = -1  # the version its weights are at (-1: the initial checkpoint)


@dataclass
class Registered:
    current_version: int  # -1: nothing published yet
    mode: str


@dataclass
class Poll:
    worker_id: str
    version: int  # what the generator holds now


@dataclass
class Offer:
    """Reply to `poll`: a round this generator should join now (wire type `round`)."""

    info: dict


@dataclass
class Idle:
    current_version: int
    retry_after_s: float = 0.5


@dataclass
class Done:
    """A generator loaded (ok) or gave up on (not ok) the round of `version`."""

    worker_id: str
    version: int
    ok: bool = True
    load_s: float = 0.0
    error: str = ""


@dataclass
class Unregister:
    worker_id: str


@dataclass
class Ready:
    """Learner rank 0: version N is packed; `manifest` describes its buckets."""

    sender_id: str
    version: int
    backend: str  # gloo | nccl | disk
    manifest: dict
    host: str = ""  # rendezvous store (group backends)
    port: int = 0
    path: str = ""  # the version's folder (disk backend)
    can_catch_up: bool = False  # the sender keeps these weights and serves catch-up rounds
    timeout_s: float = 120.0
    join_timeout_s: float = 10.0


@dataclass
class Go:
    """Reply to `ready` (a publish round) or `pending_request` (a catch-up round)."""

    round_id: int
    version: int
    members: list  # [[worker_id, first_rank, world_size], ...]; the sender is rank 0
    world_size: int
    catch_up: bool = False
    cancelled: list = field(default_factory=list)  # unclaimed catch-up rounds to abort (ids)


@dataclass
class PendingRequest:
    sender_id: str
    version: int  # the version the sender can serve (-1: none)
    next_within_s: float = 1.0  # the sender asks again within this; catch-ups are offered meanwhile


@dataclass
class RoundResult:
    round_id: int
    version: int
    ok: list  # worker ids that received every bucket
    missed: list  # never joined (busy or gone): catch up later
    failed: list  # joined, then dropped out: treated as dead until they poll again
    stats: dict = field(default_factory=dict)


@dataclass
class StatusRequest:
    pass


@dataclass
class Status:
    values: dict


@dataclass
class Ack:
    info: str = ""


@dataclass
class Error:
    message: str
    field: str = ""


def _members(d: dict, where: str) -> list:
    v = _get(d, "members", where)
    if not isinstance(v, list):
        raise ProtocolError(f"{where}.members", "expected list")
    for i, m in enumerate(v):
        if not (isinstance(m, list) and len(m) == 3 and isinstance(m[0], str)
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in m[1:])):
            raise ProtocolError(f"{where}.members[{i}]", "expected [worker_id, first_rank >= 1, world_size >= 1]")
    return v


_DECODERS = {
    "register": lambda d: Register(_str(d, "worker_id", "register", nonempty=True),
                                   _str(d, "engine_kind", "register", nonempty=True),
                                   _int(d, "world_size", "register", 1, 4096), _int(d, "version", "register", -1)),
    "registered": lambda d: Registered(_int(d, "current_version", "registered", -1),
                                       _str(d, "mode", "registered", MODES)),
    "poll": lambda d: Poll(_str(d, "worker_id", "poll", nonempty=True), _int(d, "version", "poll", -1)),
    "round": lambda d: Offer(validate_round_info(_get(d, "info", "round"), "round.info")),
    "idle": lambda d: Idle(_int(d, "current_version", "idle", -1), _float(d, "retry_after_s", "idle", 0, 3600)),
    "done": lambda d: Done(_str(d, "worker_id", "done", nonempty=True), _int(d, "version", "done", -1),
                           _bool(d, "ok", "done"), _float(d, "load_s", "done", 0), _str(d, "error", "done")),
    "unregister": lambda d: Unregister(_str(d, "worker_id", "unregister", nonempty=True)),
    "ready": lambda d: _ready(d),
    "go": lambda d: Go(_int(d, "round_id", "go", 0), _int(d, "version", "go", 0), _members(d, "go"),
                       _int(d, "world_size", "go", 1, 1 << 20), _bool(d, "catch_up", "go"),
                       _int_list(d, "cancelled", "go")),
    "pending_request": lambda d: PendingRequest(_str(d, "sender_id", "pending_request", nonempty=True),
                                                _int(d, "version", "pending_request", -1),
                                                _float(d, "next_within_s", "pending_request", 0, 1e6)),
    "round_result": lambda d: RoundResult(_int(d, "round_id", "round_result", 0), _int(d, "version", "round_result", 0),
                                          _str_list(d, "ok", "round_result"), _str_list(d, "missed", "round_result"),
                                          _str_list(d, "failed", "round_result"), _scalars(d, "stats", "round_result")),
    "status_request": lambda d: StatusRequest(),
    "status": lambda d: Status(_status_values(d)),
    "ack": lambda d: Ack(_str(d, "info", "ack")),
    "error": lambda d: Error(_str(d, "message", "error"), _str(d, "field", "error")),
}

_TYPE_NAMES = {
    Register: "register", Registered: "registered", Poll: "poll", Offer: "round", Idle: "idle", Done: "done",
    Unregister: "unregister", Ready: "ready", Go: "go", PendingRequest: "pending_request",
    RoundResult: "round_result", StatusRequest: "status_request", Status: "status", Ack: "ack", Error: "error",
}


def _ready(d: dict) -> Ready:
    w = "ready"
    r = Ready(
        sender_id=_str(d, "sender_id", w, nonempty=True),
        version=_int(d, "version", w, 0),
        backend=_str(d, "backend", w, BACKENDS),
        manifest=_manifest(d, "manifest", w),
        host=_str(d, "host", w),
        port=_int(d, "port", w, 0, 65535),
        path=_str(d, "path", w),
        can_catch_up=_bool(d, "can_catch_up", w),
        timeout_s=_float(d, "timeout_s", w, 0.001, 1e6),
        join_timeout_s=_float(d, "join_timeout_s", w, 0.001, 1e6),
    )
    if r.backend == "disk" and not r.path:
        raise ProtocolError(f"{w}.path", "the disk backend needs the version's folder")
    if r.backend != "disk" and (not r.host or not r.port):
        raise ProtocolError(f"{w}.port", f"backend {r.backend} needs the rendezvous host and port")
    return r


def _status_values(d: dict) -> dict:
    v = _get(d, "values", "status")
    if not isinstance(v, dict):
        raise ProtocolError("status.values", f"expected map, got {type(v).__name__}")
    return v


@_refusing
def validate_round_info(info: Any, where: str = "round_info") -> dict:
    """Check a round_info map (what a generator's engine receives); return it unchanged."""
    if not isinstance(info, dict):
        raise ProtocolError(where, f"expected map, got {type(info).__name__}")
    _int(info, "round_id", where, 0)
    _int(info, "version", where, 0)
    backend = _str(info, "backend", where, BACKENDS)
    _str(info, "mode", where, MODES)
    _float(info, "timeout_s", where, 0.001, 1e6)
    _bool(info, "catch_up", where)
    _manifest(info, "manifest", where)
    if backend == "disk":
        _str(info, "path", where, nonempty=True)
    else:
        _str(info, "host", where, nonempty=True)
        _int(info, "port", where, 1, 65535)
        ws = _int(info, "world_size", where, 2, 1 << 20)
        lws = _int(info, "local_world_size", where, 1, 4096)
        rank = _int(info, "rank", where, 1, ws - 1)
        if rank + lws > ws:
            raise ProtocolError(f"{where}.rank", f"ranks {rank}..{rank + lws - 1} do not fit world_size {ws}")
    return info


# --------------------------------------------------------------------------------------------
# encode / decode


def encode(msg: Any) -> bytes:
    """The one frame of `msg`."""
    name = _TYPE_NAMES.get(type(msg))
    if name is None:
        raise TypeError(f"not a weight-sync message: {type(msg).__name__}")
    return msgpack.packb({"v": SCHEMA_VERSION, "type": name, **msg.__dict__}, use_bin_type=True)


@_refusing
def decode(frames: Any) -> Any:
    """One frame (or a one-frame list) -> message object. Raises `ProtocolError` (only) when malformed."""
    if isinstance(frames, (list, tuple)):
        if len(frames) != 1:
            raise ProtocolError("message", f"expected 1 frame, got {len(frames)}")
        frames = frames[0]
    if len(frames) > MAX_MESSAGE_BYTES:
        raise ProtocolError("message", f"{len(frames)} bytes > limit {MAX_MESSAGE_BYTES}")
    try:
        d = msgpack.unpackb(frames, raw=False, strict_map_key=True, max_str_len=MAX_STR, max_bin_len=MAX_STR,
                            max_array_len=MAX_ITEMS, max_map_len=MAX_ITEMS, max_ext_len=0)
    except (ValueError, msgpack.UnpackException, TypeError) as e:
        raise ProtocolError("envelope", f"not valid msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(d, dict):
        raise ProtocolError("envelope", f"expected map, got {type(d).__name__}")
    if d.get("v") != SCHEMA_VERSION:
        raise ProtocolError("envelope.v", f"schema version {short(d.get('v'))}, this side speaks {SCHEMA_VERSION}")
    kind = d.get("type")
    if not isinstance(kind, str):  # a list or map here would make the lookup below raise TypeError
        raise ProtocolError("envelope.type", f"expected str, got {type(kind).__name__}")
    if kind not in _DECODERS:
        raise ProtocolError("envelope.type", f"unknown message type {short(kind)}")
    return _DECODERS[kind](d)
