"""A weight-sync group whose peer never comes costs the round, not the process (one GPU is enough).

    .venv/bin/python bench/absent_peer.py [--backend nccl|gloo] [--deadline 5] [--survive 80]

The learner's side of a round, alone: this process builds a two-rank weight-sync group exactly as
a round does (`weight_sync.round.RoundStore.group`: on NCCL a non-blocking communicator made at
set-up, CleanUpOnly error handling while it is built) and broadcasts through it with the round's
bounded waits (`Bounded`), but rank 1 never arrives. It checks that

1. the set-up or the broadcast fails by the round's deadline (plus a little), not at torch's
   30-minute default;
2. the process is still alive `--survive` seconds later: past the collective's own timeout and
   the NCCL watchdog's pause before it acts, which with torch's default
   TORCH_NCCL_ASYNC_ERROR_HANDLING=3 would end the process (ProcessGroupNCCL.hpp, ErrorHandlingMode);
3. a new group (a world of one) broadcasts afterwards: the next round can run.

Exits 0 only then; the last line is a JSON object (`"pass": true`). Two ranks cannot share a GPU
under NCCL, which is why the peer is absent rather than killed: bench/killed_member.py kills one
mid-broadcast where three GPUs are at hand. `--backend gloo` runs the same code on CPUs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    ap.add_argument("--deadline", type=float, default=5.0, help="the round's bound on set-up and broadcast, s")
    ap.add_argument("--survive", type=float, default=80.0,
                    help="then stay alive this long (the op timeout + NCCL's watchdog pause), s")
    args = ap.parse_args()

    import os

    from weight_sync.groups import Bounded, failed_group, nccl_env
    from weight_sync.round import RoundStore, store_server

    os.environ.update(nccl_env(args.deadline))  # as the launcher gives the learner (launch/roles.py)
    import torch

    device = "cuda:0" if args.backend == "nccl" else "cpu"
    server = store_server("127.0.0.1", 30.0)
    out: dict = {"backend": args.backend, "deadline_s": args.deadline}

    # 1. rank 1 of 2 never comes
    rs = RoundStore("127.0.0.1", server.port, 1, 30.0)
    t0 = time.monotonic()
    deadline = t0 + args.deadline
    error = None
    pg = None
    try:
        pg = rs.group(args.backend, 0, 0, 2, deadline, op_timeout_s=args.deadline, device=device)
        Bounded(pg, deadline).broadcast(torch.ones(1 << 20, device=device), 0).wait()
    except Exception as e:
        error = e
        failed_group(pg, e)
        pg = None
    out["failed_after_s"] = round(time.monotonic() - t0, 2)
    out["error"] = f"{type(error).__name__}: {error}"[:300] if error else ""
    bounded = error is not None and out["failed_after_s"] < args.deadline + 10

    # 2. still alive past the collective's timeout and the watchdog's pause
    time.sleep(args.survive)
    out["alive_after_s"] = round(time.monotonic() - t0, 1)

    # 3. the next round: a fresh group works
    rs2 = RoundStore("127.0.0.1", server.port, 2, 30.0)
    t = torch.arange(1 << 16, dtype=torch.float32, device=device)
    pg = rs2.group(args.backend, 0, 0, 1, time.monotonic() + 30, op_timeout_s=30, device=device)
    Bounded(pg, time.monotonic() + 30).broadcast(t, 0).wait()
    out["next_round_ok"] = bool(torch.equal(t.cpu(), torch.arange(1 << 16, dtype=torch.float32)))
    out["pass"] = bool(bounded and out["next_round_ok"])
    print(json.dumps(out))
    return 0 if out["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
