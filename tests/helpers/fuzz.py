"""The fuzz corpus: every message kind of the buffer's wire, odd values, and the ways to break a frame."""

from __future__ import annotations

import random

import msgpack
import numpy as np

from buffer.messages import (
    Ack,
    Batch,
    Error,
    GroupFailed,
    LeaseGrant,
    LeaseRenew,
    LeaseRequest,
    Metrics,
    MetricsRequest,
    PromptGroup,
    RolloutsMsg,
    ScoredMsg,
    Wait,
    encode,
)
from tests.helpers.buffer import scored

ODD_VALUES = [None, True, False, 0, -1, 1.5, float("nan"), float("inf"), 2**63, -(2**63), "", "x" * 50, b"",
              b"\x00" * 7, [], [1, "a"], {}, {"k": None}, {"k": [1]}, {1: 2}]


def corpus() -> list[list[bytes]]:
    """Real encoded messages of every type, as mutation seeds (ids far from the live test's own)."""
    s = scored(10_000, 1, 10_000, t=8)
    s.ref_logprobs = np.zeros(8)
    s.scores = {"a": 1.0}
    s.metadata = {"m": "x", "n": None}
    msgs = [ScoredMsg([s, scored(10_001, 0, 10_000)]), RolloutsMsg([s.rollout]), LeaseRequest("fuzz", 1, 0),
            LeaseRenew(10_000), Wait("w"), MetricsRequest(), Metrics({"a": 1.0}), Ack(1, 2, "i"), Error("e", "f"),
            LeaseGrant(3, [PromptGroup(1, "p", None, 0)], 4, 1.0, 0), GroupFailed(10_000, 10_000, "r"),
            Batch(1, 0, 1, [s], {"x": 1.0})]
    return [encode(m) for m in msgs]


def mutate(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    frames = list(frames)
    j = rng.randrange(len(frames))
    k = rng.random()
    if k < 0.25:  # truncate
        frames[j] = frames[j][: rng.randrange(len(frames[j]) + 1)]
    elif k < 0.5:  # flip bytes
        b = bytearray(frames[j])
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        frames[j] = bytes(b)
    elif k < 0.8:  # a field of the wrong type (or a missing one), re-encoded
        d = msgpack.unpackb(frames[j], raw=False)
        if isinstance(d, dict) and d:
            target = d["rollout"] if isinstance(d.get("rollout"), dict) and rng.random() < 0.6 else d
            key = rng.choice(sorted(target))
            if rng.random() < 0.15:
                del target[key]
            else:
                target[key] = rng.choice(ODD_VALUES)
            frames[j] = msgpack.packb(d, use_bin_type=True)
    elif k < 0.9:  # frames dropped or repeated
        if rng.random() < 0.5 and len(frames) > 1:
            del frames[j]
        else:
            frames.insert(j, frames[j])
    else:  # junk appended
        frames[j] = frames[j] + rng.randbytes(rng.randint(1, 8))
    return frames


def random_message(rng: random.Random) -> list[bytes]:
    return [rng.randbytes(rng.choice((0, 1, 2, 5, 16, 64, 300))) for _ in range(rng.randint(1, 4))]
