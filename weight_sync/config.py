"""The weight-sync configuration: section `weight_sync:` of the run config.

One section serves three readers: the service (`python -m launch.weight_sync`), the sender on
learner rank 0 (`WeightSender.from_config`) and the generators' clients (host/port only, through
`WeightSyncAddress`).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from common.config import Endpoint, Section
from common.curve import Mode as CurveMode

BACKENDS = ("auto", "gloo", "nccl", "disk")
MODES = ("finish", "interrupt")


class WeightSyncConfig(Section):
    """Section `weight_sync:` of the run config."""

    section: ClassVar[str] = "weight_sync"

    # ---- service ---------------------------------------------------------------------------
    host: str = "127.0.0.1"
    """Interface the service binds (and the address senders and generators connect to)."""
    port: int = Field(5600, gt=0, lt=65536)
    """The service's control socket (ZeroMQ ROUTER)."""
    curve: CurveMode = "auto"
    """CurveZMQ on the control socket (common/curve.py): `auto` = on exactly when `host` is not
    loopback, `on` also on loopback, `off` never. On, it needs the run's keys (`CONVEYOR_KEYS`)."""
    mode: Literal["finish", "interrupt"] = "finish"
    """How generators apply a round: `finish` (load between batches) or `interrupt` (pause
    in-flight requests, load, resume: partial rollouts then mix versions, and their token versions
    say so). Copied into every round_info; the generator acts on it."""
    stale_after_s: float = Field(600.0, gt=0)
    """A generator not heard from (register, poll, done) for this long is left out of new rounds
    until it polls again. Longer than a generator's slowest batch."""
    catch_up: bool = True
    """Serve a generator that is behind the current version (a newcomer, or one that missed a round)
    a catch-up round from the sender's retained weights (or the latest disk snapshot)."""

    # ---- sender (learner rank 0) -----------------------------------------------------------
    backend: Literal["auto", "gloo", "nccl", "disk"] = "auto"
    """`gloo` (CPU), `nccl` (GPU), `auto` (nccl when CUDA is available, else gloo), or `disk`
    (safetensors in `disk_dir`; no process group)."""
    timeout_s: float = Field(120.0, gt=0)
    """A publish (and a catch-up round) never blocks the learner longer than this: members that
    have not received every bucket by then are dropped."""
    join_timeout_s: float = Field(2.0, gt=0)
    """How long a publish waits for its members to show up: the most the learner blocks on
    generators. A generator joins at its next poll (after its current batch in `finish` mode); one
    still busy then gets a catch-up round at its next poll, served by the sender's background
    thread. Longer: more generators share one broadcast; shorter: the learner waits less."""
    bucket_mb: float = Field(256.0, ge=1 / 1024)
    """Size of one broadcast bucket (MiB; at least 1 KiB). Larger tensors travel in a bucket of their own."""
    keep_latest: bool = True
    """Keep the latest packed weights on rank 0 (one model copy in host memory) to serve catch-up
    rounds without the learner; off: a generator that is behind waits for the next publish."""
    serve_in_background: bool = True
    """Serve catch-up rounds from a thread of the sender, so the learner never calls anything for
    them; off: the learner calls `sender.serve_pending()` once per step."""
    serve_interval_s: float = Field(0.25, gt=0)
    """How often the background thread asks the service for pending catch-up rounds."""
    advertise_host: str = ""
    """Address generators use to reach the sender's rendezvous store; empty: the address of the
    interface that reaches the service."""
    disk_dir: str = ""
    """Shared folder for the `disk` backend (one sub-folder per version)."""
    disk_keep: int = Field(2, ge=1)
    """Versions kept in `disk_dir`; older ones are deleted."""
    same_host: Literal["auto", "broadcast", "shm"] = "auto"
    """How generators on learner rank 0's machine get the weights: `auto` (the default) = through
    the sender's shared-memory segment when they can open it (same hostname and boot id, same
    `/dev/shm`), else the broadcast; `broadcast` = always the broadcast; `shm` = same-host
    generators must use the segment (one that cannot open it misses the round instead of falling
    back)."""
    shm_dir: str = "/dev/shm"
    """Folder of the shared-memory segment (a tmpfs; two version slots of the model's size)."""
    setup_timeout_s: float = Field(10.0, gt=0)
    """How long building one attempt's group may take: a member that joined and then never builds
    it (hung) costs the others this much, not the whole round (they retry without it)."""
    max_attempts: int = Field(3, ge=1)
    """Broadcasts a member is given per round: a member dying mid-round makes the others' broadcast
    fail, and they retry without it (all within `timeout_s`)."""
    group_size: int = Field(0, ge=0)
    """Members per broadcast group: 0 = every member of a round in one group; K = groups of at most
    K, served one after another (a group's set-up, which grows with its size on NCCL, and a slow or
    dying member then concern K members, not all; the learner sends the bytes once per group).
    docs/scaling.md has the plan beyond this (relays per node)."""

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * (1 << 20))

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.host, self.port)

    def problems(self) -> list[str]:
        errs = []
        if self.backend == "disk" and not self.disk_dir:
            errs.append("weight_sync.backend='disk' needs weight_sync.disk_dir")
        if self.join_timeout_s > self.timeout_s:
            errs.append(f"weight_sync.join_timeout_s={self.join_timeout_s} must be in "
                        f"(0, timeout_s={self.timeout_s}]")
        return errs


class WeightSyncAddress(Section):
    """The weight-sync service's address, declared once for the roles that dial it (generators,
    learner rank 0). Launchers copy the run's `weight_sync:` section into it."""

    weight_sync_host: str = "127.0.0.1"
    """Address of the weight-sync service."""
    weight_sync_port: int = Field(0, ge=0, lt=65536)
    """Its port; 0: no weight sync (a generator keeps its initial weights, a learner publishes nothing)."""

    @property
    def weight_sync_endpoint(self) -> Endpoint:
        return Endpoint(self.weight_sync_host, self.weight_sync_port)


def endpoint(host: str, port: int) -> str:
    """The service's ZeroMQ endpoint."""
    return Endpoint(host, port).url()
