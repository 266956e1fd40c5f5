"""The replay buffer's configuration and the addresses it binds."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BufferConfig:
    """Section `buffer:` of the run config."""

    host: str = "127.0.0.1"
    """Interface the buffer binds (and the address clients use); 127.0.0.1 unless roles span machines."""
    port: int = 5555
    """Control socket (ROUTER: leases, batches, metrics). The next three ports are the ingest socket
    (PULL, scored rollouts), the relay input (PULL, raw rollouts from generators) and the relay
    output (PUSH, to scorers)."""
    prompts: str = ""
    """Prompt dataset: JSONL, one object per line with `prompt` and optional `label`."""
    prompts_per_step: int = 8
    """Prompt groups in one learner step's batch (all ranks together)."""
    n_samples_per_prompt: int = 4
    """Completions sampled per prompt (the group size)."""
    max_staleness: int = 1
    """Versions a sample may lag the learner when trained on (0 = synchronous)."""
    lease_ttl_s: float = 60.0
    """A lease not answered (or renewed) within this many seconds is issued again."""
    max_epochs: int = 1
    """Passes over the prompt dataset; after the last the buffer answers `done`."""
    shuffle_seed: int | None = 0
    """Seed for the order prompts are leased in each epoch; None keeps file order."""
    state_dir: str = ""
    """Where accepted groups and counters are persisted (empty: not persisted)."""
    max_queued_groups: int = 4096
    """Complete groups held for learners at most; past it the oldest are dropped and counted."""
    log_interval_s: float = 30.0
    """Seconds between the info-level summaries the buffer logs."""
    fsync: str = "never"
    """When the state log is fsynced (records always reach the OS before the buffer answers, so a
    killed buffer loses nothing it acknowledged; this is about a lost machine): `never`, `batch`
    (once per pass of the loop that wrote anything; ~1 fsync per request burst), `record` (after
    every record: the safest, one disk flush per lease and group, slow on network disks), or an
    interval in seconds such as `5`."""
    compact_mb: float = 64.0
    """Rewrite the state log while running once it has grown by this many MB (and by more than its
    size after the last rewrite): disk use follows what is in flight, not the run's length."""
    log_level: str = "info"
    """Logging level of the buffer process: debug (a line per lease and batch), info, warning."""

    def validate(self) -> None:
        errs = []
        if not 0 < self.port < 65533:
            errs.append(f"buffer.port={self.port} must leave room for port+3 below 65536")
        if self.prompts_per_step < 1:
            errs.append(f"buffer.prompts_per_step={self.prompts_per_step} must be >= 1")
        if self.n_samples_per_prompt < 1:
            errs.append(f"buffer.n_samples_per_prompt={self.n_samples_per_prompt} must be >= 1")
        if self.max_staleness < 0:
            errs.append(f"buffer.max_staleness={self.max_staleness} must be >= 0")
        if self.lease_ttl_s <= 0:
            errs.append(f"buffer.lease_ttl_s={self.lease_ttl_s} must be > 0")
        if self.max_epochs < 1:
            errs.append(f"buffer.max_epochs={self.max_epochs} must be >= 1")
        if self.max_queued_groups < self.prompts_per_step:
            errs.append(f"buffer.max_queued_groups={self.max_queued_groups} must be >= "
                        f"buffer.prompts_per_step={self.prompts_per_step} (a step's batch must fit)")
        if self.log_interval_s <= 0:
            errs.append(f"buffer.log_interval_s={self.log_interval_s} must be > 0")
        try:
            fsync_policy(self.fsync)
        except ValueError as e:
            errs.append(str(e))
        if self.compact_mb <= 0:
            errs.append(f"buffer.compact_mb={self.compact_mb} must be > 0")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            errs.append(f"buffer.log_level={self.log_level!r} must be one of debug, info, warning, error")
        if errs:
            raise ValueError("; ".join(errs))


def fsync_policy(value: str) -> float | None:
    """`buffer.fsync` as seconds between fsyncs: None never, 0.0 every record, -1.0 every loop pass."""
    v = str(value).strip().lower()
    if v == "never":
        return None
    if v == "record":
        return 0.0
    if v == "batch":
        return -1.0
    try:
        seconds = float(v[:-1] if v.endswith("s") else v)
    except ValueError:
        raise ValueError(f"buffer.fsync={value!r} must be never, batch, record or a number of seconds") from None
    if not seconds > 0:
        raise ValueError(f"buffer.fsync={value!r}: an interval must be > 0 seconds")
    return seconds



def endpoints(host: str, port: int) -> dict[str, str]:
    """The four ZeroMQ endpoints of a buffer at `host:port`."""
    return {
        "control": f"tcp://{host}:{port}",
        "ingest": f"tcp://{host}:{port + 1}",
        "relay_in": f"tcp://{host}:{port + 2}",
        "relay_out": f"tcp://{host}:{port + 3}",
    }
