"""The replay buffer's records of a prompt group on its way (`PendingGroup` while its samples come
in, `ReadyGroup` once complete), of a lease and of a step's batch, and the error a request that
cannot be served raises. `buffer/state.py` keeps them; `buffer/service.py` reads `Sample`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Sample:
    """An accepted scored rollout: its wire bytes (served as they came) and what batching needs."""

    frame: bytes  # (or the `zmq.Frame` it came in: anything with the buffer protocol and a len)
    min_version: int  # oldest token's policy version
    reward: float
    max_version: int = -1  # newest token's policy version (-1: none, or not known)
    filter_score: float | None = None  # judged by dynamic sampling instead of the reward (rules.FILTER_SCORE)

    @property
    def judged(self) -> float:
        """What dynamic sampling judges: the filter score when the scorer gave one, else the reward."""
        return self.reward if self.filter_score is None else self.filter_score


@dataclass
class PendingGroup:
    group_id: int
    lease_id: int  # the group's current lease: results for any other lease are late
    version: int  # learner version at grant; stands in for the token versions of empty completions
    samples: dict[int, Sample] = field(default_factory=dict)


@dataclass
class ReadyGroup:
    group_id: int
    samples: list[Sample]  # by sample index
    min_version: int = field(init=False)  # oldest token of the group: what staleness is judged by

    max_version: int = field(init=False)  # newest token: a version after a resume point voids the group

    def __post_init__(self) -> None:
        self.min_version = min(s.min_version for s in self.samples)
        self.max_version = max(max(s.max_version, s.min_version) for s in self.samples)

    def __lt__(self, other: "ReadyGroup") -> bool:  # heap order: oldest group first
        return self.group_id < other.group_id


@dataclass
class Lease:
    lease_id: int
    worker_id: str
    group_ids: set[int]  # still pending under this lease
    expires_at: float
    renewed_at: float = 0.0  # granted or last renewed


@dataclass
class StepBatch:
    step: int
    world_size: int
    shares: list[list[bytes]]  # frames per rank
    stats: list[dict[str, float]]  # per rank
    group_ids: list[int]
    fetched: set[int] = field(default_factory=set)


class RequestError(Exception):
    """A request that is well-formed but cannot be served; becomes an `Error` reply naming `field`."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message
