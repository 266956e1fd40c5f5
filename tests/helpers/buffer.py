"""A replay buffer for tests: as a real process (`start_buffer`, `BufferProc`), or its bookkeeping alone
(`make_state`), and the scored rollouts that feed it (`scored`, `answer`, `complete`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from buffer.client import BufferClient
from buffer.config import BufferConfig
from buffer.messages import Ack, LeaseGrant, Rollout, ScoredRollout
from buffer.prompts import load_prompts
from buffer.state import BufferState
from common.ready import ENV as READY_ENV
from common.ready import read_ready
from launch.ports import free_port_block as free_base_port
from tests.helpers.procs import ROOT


def make_state(tmp_path, n_prompts=40, store=None, **kw):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "label": str(i)}) + "\n" for i in range(n_prompts)))
    cfg = BufferConfig(prompts=str(path), **{"prompts_per_step": 2, "n_samples_per_prompt": 2,
                                             "max_staleness": 1, "shuffle_seed": None, **kw})
    cfg.validate()
    return BufferState(cfg, load_prompts(cfg.prompts), store)


def complete(state, grant, gid, version=0, reward=1.0):
    """Answer every sample of group `gid` under `grant`; the frame stands in for the wire bytes."""
    out = [state.add_sample(gid, i, grant.lease_id, False, version, reward, f"{gid}/{i}".encode())
           for i in range(state.cfg.n_samples_per_prompt)]
    assert out[-1] == "complete"


class BufferProc:
    """A running `python -m launch.buffer`; `stop()` sends SIGTERM and returns the exit code."""

    def __init__(self, proc: subprocess.Popen, port: int, log: Path, ready: dict):
        self.proc, self.port, self.log, self.ready = proc, port, log, ready

    def client(self, timeout_s: float = 10.0) -> BufferClient:
        return BufferClient(port=self.port, timeout_s=timeout_s)

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        if code != 0:  # shown with the failing test: how it ended (a native crash's stacks included)
            print(f"buffer exited {code}; the end of {self.log}:\n{self.log.read_text()[-6000:]}")
        return code


def write_prompts(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"{i} + {i}", "label": str(2 * i)}) + "\n" for i in range(n)))
    return path


def start_buffer(tmp_path: Path, n_prompts: int = 64, extra: tuple = (), config: Path | None = None,
                 rows: list[dict] | None = None, **cfg) -> BufferProc:
    """Start a buffer (from the run config file `config`, if given) with `--buffer.KEY VALUE` for
    each of `cfg`; wait for its ready file. Its prompts: `rows` when given, else `n_prompts` sums."""
    prompts = tmp_path / "prompts.jsonl"
    if rows is not None:
        prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif not prompts.exists():
        write_prompts(prompts, n_prompts)
    cfg = {"prompts": str(prompts), "shuffle_seed": "none", "log_level": "debug", **cfg}
    for attempt in range(3):  # another process may take the ports between the check and the bind
        port = free_base_port(4)
        log = tmp_path / f"buffer-{port}.log"
        ready = tmp_path / f"buffer-{port}.ready"
        args = [a for k, v in cfg.items() for a in (f"--buffer.{k}", str(v))]
        head = [str(config)] if config else []
        proc = subprocess.Popen([sys.executable, "-m", "launch.buffer", *head, "--buffer.port", str(port),
                                 *args, *extra],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(log, "w"), text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT), READY_ENV: str(ready)})
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            record = read_ready(ready)
            if record is not None:
                return BufferProc(proc, port, log, record)
            time.sleep(0.02)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.returncode != 1:  # 1: a port was taken (try others); anything else is a failure
            raise RuntimeError(f"buffer did not start:\n{log.read_text()}")
    raise RuntimeError("buffer could not bind after 3 tries")


def scored(gid: int, index: int, lease_id: int, version: int = 0, reward: float = 1.0, t: int = 6,
           failed: bool = False) -> ScoredRollout:
    r = Rollout(gid, index, lease_id, np.array([1, 2, 3]), np.arange(t) + 100 * gid + index, -np.ones(t) / (index + 1),
                np.full(t, version), prompt=f"{gid}", completion=f"{gid}.{index}", worker_id="test")
    return ScoredRollout(r, reward=reward, failed=failed, error="scorer crashed" if failed else "")


def answer(client: BufferClient, grant: LeaseGrant, gids=None, version=None, n=None) -> Ack:
    """Every sample of the given groups of `grant`, scored, over the acknowledged control path."""
    gids = [g.group_id for g in grant.groups] if gids is None else gids
    v = grant.version if version is None else version
    n = grant.n_samples if n is None else n
    return client.submit_scored([scored(g, i, grant.lease_id, v, reward=float(g)) for g in gids for i in range(n)])


def group_ids(batch) -> list[int]:
    ids = [s.rollout.group_id for s in batch.scored]
    return sorted(set(ids), key=ids.index)


def started(buffer: BufferProc) -> tuple[subprocess.Popen, int]:
    """(the process, its port): for tests that drive the buffer process directly."""
    return buffer.proc, buffer.port
