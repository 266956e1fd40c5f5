"""The weight-sync configuration: section `weight_sync:` of the run config.

One section serves three readers: the service (`python -m launch.weight_sync`), the sender on
learner rank 0 (`WeightSender.from_config`) and the generators' clients (host/port only).
"""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("auto", "gloo", "nccl", "disk")
MODES = ("finish", "interrupt")


@dataclass
class WeightSyncConfig:
    """Section `weight_sync:` of the run config."""

    # ---- service ---------------------------------------------------------------------------
    host: str = "127.0.0.1"
    """Interface the service binds (and the address senders and generators connect to)."""
    port: int = 5600
    """The service's control socket (ZeroMQ ROUTER)."""
    mode: str = "finish"
    """How generators apply a round: `finish` (load between batches) or `interrupt` (pause
    in-flight requests, load, resume: partial rollouts then mix versions, and their token versions
    say so). Copied into every round_info; the generator acts on it."""
    stale_after_s: float = 600.0
    """A generator not heard from (register, poll, done) for this long is left out of new rounds
    until it polls again. Longer than a generator's slowest batch."""
    catch_up: bool = True
    """Serve a generator that is behind the current version (a newcomer, or one that missed a round)
    a catch-up round from the sender's retained weights (or the latest disk snapshot)."""

    # ---- sender (learner rank 0) -----------------------------------------------------------
    backend: str = "auto"
    """`gloo` (CPU), `nccl` (GPU), `auto` (nccl when CUDA is available, else gloo), or `disk`
    (safetensors in `disk_dir`; no process group)."""
    timeout_s: float = 120.0
    """A publish (and a catch-up round) never blocks the learner longer than this: members that
    have not received every bucket by then are dropped."""
    join_timeout_s: float = 2.0
    """How long a publish waits for its members to show up: the most the learner blocks on
    generators. A generator joins at its next poll (after its current batch in `finish` mode); one
    still busy then gets a catch-up round at its next poll, served by the sender's background
    thread. Longer: more generators share one broadcast; shorter: the learner waits less."""
    bucket_mb: float = 256.0
    """Size of one broadcast bucket (MiB). Larger tensors travel in a bucket of their own."""
    keep_latest: bool = True
    """Keep the latest packed weights on rank 0 (one model copy in host memory) to serve catch-up
    rounds without the learner; off: a generator that is behind waits for the next publish."""
    serve_in_background: bool = True
    """Serve catch-up rounds from a thread of the sender, so the learner never calls anything for
    them; off: the learner calls `sender.serve_pending()` once per step."""
    serve_interval_s: float = 0.25
    """How often the background thread asks the service for pending catch-up rounds."""
    advertise_host: str = ""
    """Address generators use to reach the sender's rendezvous store; empty: the address of the
    interface that reaches the service."""
    disk_dir: str = ""
    """Shared folder for the `disk` backend (one sub-folder per version)."""
    disk_keep: int = 2
    """Versions kept in `disk_dir`; older ones are deleted."""
    max_attempts: int = 3
    """Broadcast attempts per round: a member dying mid-round makes the others' broadcast fail, and
    they retry without it (all within `timeout_s`)."""

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * (1 << 20))

    def validate(self) -> None:
        errs = []
        if not 0 < self.port < 65536:
            errs.append(f"weight_sync.port={self.port} must be in 1..65535")
        if self.mode not in MODES:
            errs.append(f"weight_sync.mode={self.mode!r} must be one of {list(MODES)}")
        if self.backend not in BACKENDS:
            errs.append(f"weight_sync.backend={self.backend!r} must be one of {list(BACKENDS)}")
        if self.backend == "disk" and not self.disk_dir:
            errs.append("weight_sync.backend='disk' needs weight_sync.disk_dir")
        if self.timeout_s <= 0:
            errs.append(f"weight_sync.timeout_s={self.timeout_s} must be > 0")
        if not 0 < self.join_timeout_s <= self.timeout_s:
            errs.append(f"weight_sync.join_timeout_s={self.join_timeout_s} must be in "
                        f"(0, timeout_s={self.timeout_s}]")
        if self.bucket_bytes < 1024:
            errs.append(f"weight_sync.bucket_mb={self.bucket_mb} is below 1 KiB")
        if self.stale_after_s <= 0:
            errs.append(f"weight_sync.stale_after_s={self.stale_after_s} must be > 0")
        if self.serve_interval_s <= 0:
            errs.append(f"weight_sync.serve_interval_s={self.serve_interval_s} must be > 0")
        if self.disk_keep < 1:
            errs.append(f"weight_sync.disk_keep={self.disk_keep} must be >= 1")
        if self.max_attempts < 1:
            errs.append(f"weight_sync.max_attempts={self.max_attempts} must be >= 1")
        if errs:
            raise ValueError("; ".join(errs))


def endpoint(host: str, port: int) -> str:
    """The service's ZeroMQ endpoint."""
    return f"tcp://{host}:{port}"
