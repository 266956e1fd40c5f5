"""Checking a scored-rollout frame on the buffer's hot path, and reading what the bookkeeping needs.

`protocol.decode_item` checks a frame field by field and builds `ScoredRollout`/`Rollout` objects
with four numpy views; at ~12 KiB per rollout that is most of the buffer's CPU per rollout. The
buffer only needs six fields and a yes/no, so `scored_meta` does the same checks inline on the
unpacked map for the common shape of a frame, and hands anything unusual (a missing key, a wrong
type, a limit passed, metadata of odd types) to `decode_item`, which stays the authority: it
either accepts the frame or raises the `ProtocolError` that names the field. The fast path may
refuse more than `decode_item` does (it then falls back), never less;
`tests/test_buffer_fuzz.py` checks that on mutated frames.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import msgpack
import numpy as np

from buffer.protocol import ID_DTYPE, LOGPROB_DTYPE, Limits, decode_item

_MAX_ID = 2**62  # protocol._int's default bound
_MAX_SAMPLE_INDEX = 1 << 20
_STRS = ("prompt", "completion", "finish_reason", "worker_id")
assert ID_DTYPE.itemsize == LOGPROB_DTYPE.itemsize == 4  # lengths are compared in bytes below


class ScoredMeta(NamedTuple):
    group_id: int
    sample_index: int
    lease_id: int
    failed: bool
    min_version: int | None  # oldest token's policy version; None for an empty completion
    reward: float
    error: str
    max_version: int | None = None  # newest token's policy version; None for an empty completion


def scored_meta(frame: bytes, where: str, limits: Limits) -> ScoredMeta:
    """The bookkeeping fields of a valid scored-rollout frame; `ProtocolError` for an invalid one."""
    try:
        meta = _fast(frame, limits)
    except Exception:  # any surprise in the fast path: let the full decoder judge
        meta = None
    if meta is not None:
        return meta
    item = decode_item(frame, "scored", where, limits)
    r = item.rollout
    return ScoredMeta(r.group_id, r.sample_index, r.lease_id, item.failed,
                      int(r.versions.min()) if len(r.versions) else None, item.reward, item.error,
                      int(r.versions.max()) if len(r.versions) else None)


def _fast(frame: bytes, L: Limits) -> ScoredMeta | None:
    """None unless the frame is plainly valid (by the same rules as `ScoredRollout.from_wire`)."""
    if len(frame) > L.max_frame_bytes:
        return None
    d = msgpack.unpackb(frame, raw=False, strict_map_key=True, max_bin_len=L.max_frame_bytes,
                        max_str_len=L.max_str_bytes, max_array_len=L.max_items, max_map_len=L.max_items,
                        max_ext_len=0)
    if type(d) is not dict:
        return None
    r, failed, reward, error = d["rollout"], d["failed"], d["reward"], d["error"]
    if type(r) is not dict or type(failed) is not bool or type(error) is not str or len(error) > L.max_str_bytes:
        return None
    if type(reward) is float:
        if not failed and not math.isfinite(reward):
            return None
    elif type(reward) is not int:
        return None
    scores = d.get("scores")
    if scores is not None:
        if type(scores) is not dict or len(scores) > L.max_items:
            return None
        for k, x in scores.items():
            if type(k) is not str or type(x) not in (float, int):
                return None
    metadata = d.get("metadata")
    if metadata is not None:
        if type(metadata) is not dict or len(metadata) > L.max_items:
            return None
        for k, x in metadata.items():
            if type(k) is not str or (x is not None and type(x) not in (float, int, str, bool)):
                return None

    gid, si, lid = r["group_id"], r["sample_index"], r["lease_id"]
    if type(gid) is not int or type(si) is not int or type(lid) is not int:
        return None
    if not (0 <= gid <= _MAX_ID and 0 <= si <= _MAX_SAMPLE_INDEX and 0 <= lid <= _MAX_ID):
        return None
    prompt_ids, completion_ids = r["prompt_ids"], r["completion_ids"]
    behav, versions = r["behav_logprobs"], r["versions"]
    ref = d.get("ref_logprobs")
    if (type(prompt_ids) is not bytes or type(completion_ids) is not bytes or type(behav) is not bytes
            or type(versions) is not bytes or (ref is not None and type(ref) is not bytes)):
        return None
    nbytes = len(completion_ids)
    if (len(prompt_ids) % 4 or nbytes % 4 or len(behav) != nbytes or len(versions) != nbytes
            or (ref is not None and len(ref) != nbytes)
            or len(prompt_ids) // 4 > L.max_tokens or nbytes // 4 > L.max_tokens):
        return None
    for key in _STRS:
        v = r[key]
        if type(v) is not str or len(v) > L.max_str_bytes:
            return None
    label = r.get("label")
    if label is not None and (type(label) is not str or len(label) > L.max_str_bytes):
        return None
    if nbytes:
        v = np.frombuffer(versions, ID_DTYPE)
        return ScoredMeta(gid, si, lid, failed, int(v.min()), float(reward), error, int(v.max()))
    return ScoredMeta(gid, si, lid, failed, None, float(reward), error, None)
