"""Rollout frames: the field types every buffer message is made of, and the rollout types.

A rollout travels in a frame of its own (see `buffer.messages`). Token ids, log-probs, versions
and masks are packed little-endian arrays (msgpack `bin`) that arrive as `numpy.frombuffer` views
over the received bytes; `Rollout.__post_init__` takes a fast path for a frame just decoded and
well formed. `check_scored`'s types (`_CheckedRollout`, `CheckedScored`) are the same types with
the arrays left as the bytes they came as. `buffer.messages` re-exports everything here.
"""

from __future__ import annotations

import math
import typing
from typing import Annotated, Union

import numpy as np
from msgspec import Meta, Struct

from common.wire import ID_DTYPE, LOGPROB_DTYPE, MASK_DTYPE, ProtocolError

MAX_TOKENS = 1 << 20  # length of any one packed array
MAX_STR = 4 << 20  # prompt/completion text, error messages (characters)
MAX_ITEMS = 1 << 16  # prompt groups in a lease, entries in a metrics map
MAX_ID = 2**62
MAX_ROUTE_BYTES = 64 << 20  # a rollout's routes (a frame is at most as large: buffer.messages.Limits)
MAX_IMAGE_BYTES = 16 << 20  # one encoded image (PNG, JPEG, ...; a run's own bound: data.max_image_bytes)
MAX_IMAGES = 256  # images of one prompt or episode

# --------------------------------------------------------------------------------------------
# field types: what a field accepts off the wire (a packed array field also names its dtype)

Id = Annotated[int, Meta(ge=0, le=MAX_ID)]
Rank = Annotated[int, Meta(ge=0, le=1 << 16)]
Text = Annotated[str, Meta(max_length=MAX_STR)]
Seconds = Annotated[float, Meta(ge=0.0, le=1e9)]  # NaN fails `ge`
Ids = Annotated[memoryview, Meta(max_length=MAX_TOKENS * ID_DTYPE.itemsize), ID_DTYPE]  # (T,) int32
LogProbs = Annotated[memoryview, Meta(max_length=MAX_TOKENS * LOGPROB_DTYPE.itemsize), LOGPROB_DTYPE]  # (T,) f32
Mask = Annotated[memoryview, Meta(max_length=MAX_TOKENS), MASK_DTYPE]  # (T,) uint8, 0 or 1
# A mixture-of-experts rollout's routes: (P+T-1, layers, k) expert ids, uint8 or uint16 (`route_width`
# bytes each), packed; left as bytes (their shape is the rollout's, read by `Rollout.route_array`)
Routes = Annotated[memoryview, Meta(max_length=MAX_ROUTE_BYTES)]
Numbers = Annotated[dict[str, float], Meta(max_length=MAX_ITEMS)]
# A vision-language prompt's (or episode's) images, encoded as their files are (PNG, JPEG, ...), in
# the order of their placeholders in the token ids (common.images)
Images = Annotated[list[Annotated[bytes, Meta(max_length=MAX_IMAGE_BYTES)]], Meta(max_length=MAX_IMAGES)]
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


def as_arrays(obj: Struct) -> None:
    """Packed bytes (just decoded) -> read-only views; anything else (lists, arrays of another
    dtype, CPU tensors) -> contiguous arrays of the wire dtype."""
    fields = _PACKED.get(type(obj))
    if fields is None:
        fields = _PACKED[type(obj)] = _packed_fields(type(obj))
    for name, dtype in fields:
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


_PACKED: dict[type, tuple[tuple[str, np.dtype], ...]] = {}  # a Struct class -> its packed fields, read once
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


def _routes_ok(r: "Rollout") -> str:
    """Why a rollout's routes do not fit it ("" if they do, or if it has none)."""
    if r.routes is None:
        return ""
    n = r.routes.nbytes if type(r.routes) is memoryview else len(r.routes)
    rows = len(r.prompt_ids) + len(r.completion_ids) - 1 if type(r.prompt_ids) is not memoryview \
        else (r.prompt_ids.nbytes + r.completion_ids.nbytes) // _ID - 1
    if r.route_layers < 1 or r.route_k < 1:
        return f"route_layers={r.route_layers} and route_k={r.route_k} must be >= 1 with routes"
    want = rows * r.route_layers * r.route_k * r.route_width
    if n != want:
        return (f"{n} bytes, not the {want} of {rows} tokens x {r.route_layers} layers x {r.route_k} experts "
                f"x {r.route_width} bytes (every token but the last, prompt included)")
    return ""


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
    # what an OpenRLHF agent said of the episode besides its reward (actors.envs.api.episode_info):
    # "filter_score" (its `scores`, judged by dynamic filtering) and "extra/<name>" (its `extra_logs`)
    env_info: Annotated[dict[str, float], Meta(max_length=64)] = {}
    columns: Text = ""  # the prompt's dataset row's other columns, a JSON object, for reward functions
    # A mixture-of-experts engine's routes (routing replay): the experts each token but the last of
    # prompt + completion was routed to in each MoE layer, for the learner's forwards to reuse
    routes: Routes | None = None
    route_layers: Annotated[int, Meta(ge=0, le=4096)] = 0
    route_k: Annotated[int, Meta(ge=0, le=256)] = 0
    route_width: Annotated[int, Meta(ge=1, le=2)] = 1  # bytes per expert id: 1 (< 256 experts) or 2
    # A vision-language rollout's images: the prompt's, then any an environment returned, in the
    # order of their placeholders in prompt + completion; the learner computes pixels from them
    images: Images | None = None

    def __post_init__(self) -> None:
        if self.routes is not None:
            why = _routes_ok(self)
            if why:
                raise ProtocolError("routes", why)
        if _decoded_and_whole(self):  # (the hot path: a frame just decoded, well formed)
            self.prompt_ids = _frombuffer(self.prompt_ids, ID_DTYPE)
            self.completion_ids = _frombuffer(self.completion_ids, ID_DTYPE)
            self.behav_logprobs = _frombuffer(self.behav_logprobs, LOGPROB_DTYPE)
            self.versions = _frombuffer(self.versions, ID_DTYPE)
            if self.action_mask is not None:
                self.action_mask = _frombuffer(self.action_mask, MASK_DTYPE)
            return
        as_arrays(self)
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

    def route_array(self) -> np.ndarray | None:
        """(P+T-1, layers, k) expert ids of the routes (a view over their bytes), or None."""
        if self.routes is None:
            return None
        flat = np.frombuffer(self.routes, np.uint8 if self.route_width == 1 else np.dtype("<u2"))
        return flat.reshape(-1, self.route_layers, self.route_k)

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
    teacher_logprobs: LogProbs | None = None  # (T,) float32 under a teacher model (on-policy distillation)

    def __post_init__(self) -> None:
        # a failed sample may carry a non-finite reward (that may be why it failed)
        if not self.failed and not math.isfinite(self.reward):
            raise ProtocolError("reward", f"not finite ({self.reward})")
        if self.ref_logprobs is not None or self.teacher_logprobs is not None:
            as_arrays(self)
            _same_length(self, ("ref_logprobs", "teacher_logprobs"), len(self.rollout.completion_ids))


# `check_scored`'s types: Rollout's and ScoredRollout's fields, constraints and checks, the packed
# arrays left as the memoryviews msgspec decoded. What they refuse is decoded again into the real
# types, which say what is wrong (tests/security/test_buffer_fuzz.py checks that both agree on mutants).


class _Refused(ValueError):
    pass


class _CheckedRollout(Rollout):
    def __post_init__(self) -> None:
        if not _decoded_and_whole(self) or _routes_ok(self):
            raise _Refused


class CheckedScored(ScoredRollout):
    rollout: _CheckedRollout

    def __post_init__(self) -> None:
        n = self.rollout.completion_ids.nbytes // _ID * _LP
        if (not self.failed and not math.isfinite(self.reward)) or any(
                lp is not None and lp.nbytes != n for lp in (self.ref_logprobs, self.teacher_logprobs)):
            raise _Refused
