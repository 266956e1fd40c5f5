"""A member killed mid-broadcast: the learner's sender survives and the next round reaches the rest.

    .venv/bin/python bench/killed_member.py [--backend gloo|nccl] [--timeout 60] [--mb 4] [--bucket-mb 0.0625]

Four processes: this one runs the weight-sync service (in a thread) and watches; a sender process
(learner rank 0's side: the real `WeightSender`); two member processes ("survivor" and "doomed",
receiving with the real `receive_buckets`). Round 1: "doomed" takes the first bucket and then
SIGKILLs itself, the others still broadcasting. Round 2: the sender publishes again. Exits 0 only
when the sender process is still alive after round 1 and exits cleanly after round 2, "doomed"
died by SIGKILL, and round 2 reached "survivor" bit for bit; the last line printed is one JSON
object with the rounds' stats.

`--backend nccl` needs three GPUs, one per rank (NCCL refuses two ranks on one device): the sender
takes GPU 0, the members GPUs 1 and 2 (each process gets its own CUDA_VISIBLE_DEVICES). With
torch's default `TORCH_NCCL_ASYNC_ERROR_HANDLING=3` (SkipCleanUp in ProcessGroupNCCL.hpp's
ErrorHandlingMode; torch's docs: "tearing down process without cleaning up NCCL communicator"), a
collective the watchdog finds timed out ends its whole process: that is what this checks the
sender against. `--backend gloo` runs on CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SURVIVOR, DOOMED = "survivor", "doomed"
DIED_AT_BUCKET = 1  # "doomed" kills itself once this many buckets of round 1 arrived


def weights(version: int, mb: float, device: str = "cpu") -> list:
    """The model version `version` stands for: seeded tensors of several shapes (~`mb` MiB fp32) plus
    `version`, so that every member can check what it got."""
    import torch

    g = torch.Generator().manual_seed(0)
    rows = max(1, int(mb * (1 << 20) / 4 / 1024 / 4))
    named = [(f"layers.{i}.weight", torch.randn(rows, 1024, generator=g)) for i in range(4)]
    named += [("norm.weight", torch.randn(1000, generator=g)), ("steps", torch.arange(7, dtype=torch.int64))]
    return [(n, (t + version).to(device)) for n, t in named]


def _device(backend: str) -> str:
    return "cuda" if backend == "nccl" else "cpu"


# ---------------------------------------------------------------------------------------------
# a member process


def _die_after_buckets(n: int) -> None:
    """Make the n-th bucket this process receives the last thing it does: SIGKILL mid-broadcast."""
    import weight_sync.round as R

    make_group = R.make_group

    class Dying:
        def __init__(self, pg):
            self.pg, self.seen = pg, 0

        def broadcast(self, t, root):
            work = self.pg.broadcast(t, root)
            work.wait()
            self.seen += 1
            if self.seen >= n:
                print(json.dumps({"event": "dying", "buckets": self.seen}), flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return work

    R.make_group = lambda *a, **k: Dying(make_group(*a, **k))


def member(a) -> None:
    import torch

    from weight_sync import buckets as bk
    from weight_sync.client import GeneratorSyncClient
    from weight_sync.receiver import RoundMissed, receive_buckets

    if a.worker_id == DOOMED:
        _die_after_buckets(DIED_AT_BUCKET)
    dev = _device(a.backend)
    ws = GeneratorSyncClient("127.0.0.1", a.port, a.worker_id, timeout_s=30)
    ws.register("bench")
    print(json.dumps({"event": "registered"}), flush=True)
    deadline = time.monotonic() + a.timeout * 3
    while time.monotonic() < deadline:
        info = ws.poll()
        if info is None:
            time.sleep(0.01)
            continue
        try:
            bufs, stats = receive_buckets(info, device=dev)
        except RoundMissed as e:
            print(json.dumps({"event": "missed", "version": info.version, "error": str(e)}), flush=True)
            continue
        want = weights(info.version, a.mb, dev)
        same = all(torch.equal(got, sent) for (_, got), (_, sent) in zip(bk.unpack(info.manifest, bufs), want,
                                                                           strict=True))
        ws.done(info.version, ok=same)
        print(json.dumps({"event": "round", "version": info.version, "exact": same, "via": stats.get("via"),
                          "recv_s": round(stats.get("recv_s", 0.0), 3)}), flush=True)
        if info.version >= 2:
            break
    ws.close()


# ---------------------------------------------------------------------------------------------
# the sender process (learner rank 0's side)


def sender(a) -> None:
    from weight_sync.sender import WeightSender

    s = WeightSender("127.0.0.1", a.port, timeout_s=a.timeout, join_timeout_s=a.timeout / 2,
                     bucket_mb=a.bucket_mb, serve_in_background=False, same_host="broadcast",
                     backend=a.backend, sender_id="learner0")
    dev = _device(a.backend)
    for version in (1, 2):
        stats = s.publish(version, weights(version, a.mb, dev))
        keep = ("version", "members", "ok", "failed", "missed", "attempts", "buckets", "total_s", "error")
        print("ROUND " + json.dumps({k: stats.get(k) for k in keep}), flush=True)
    s.close()
    print("SENDER_DONE", flush=True)


# ---------------------------------------------------------------------------------------------
# this process: the service, and the verdict


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--timeout", type=float, default=60.0, help="a round's timeout (s); every wait is bounded by it")
    p.add_argument("--mb", type=float, default=4.0, help="the model's size (MiB)")
    p.add_argument("--bucket-mb", type=float, default=1 / 16, help="small buckets: many broadcasts per round")
    p.add_argument("--role", default="main", choices=["main", "sender", "member"], help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--worker-id", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.role == "member":
        member(a)
        return 0
    if a.role == "sender":
        sender(a)
        return 0

    from launch.ports import free_port_block
    from weight_sync.config import WeightSyncConfig
    from weight_sync.service import WeightSyncService

    if a.backend == "nccl":
        import torch

        n = torch.cuda.device_count()
        if n < 3:
            print(f"killed_member: --backend nccl needs 3 GPUs, one per rank (NCCL refuses two ranks on one "
                  f"device); this machine has {n}", file=sys.stderr)
            return 2
    port = free_port_block(1)
    svc = WeightSyncService(WeightSyncConfig(port=port))
    svc.start()
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # under NCCL each rank its own GPU: the sender GPU 0, the members GPUs 1 and 2
    base = [sys.executable, __file__, "--backend", a.backend, "--port", str(port), "--timeout", str(a.timeout),
            "--mb", str(a.mb), "--bucket-mb", str(a.bucket_mb)]

    def start(role: str, wid: str, gpu: int):
        e = dict(env, CUDA_VISIBLE_DEVICES=str(gpu)) if a.backend == "nccl" else env
        return subprocess.Popen(base + ["--role", role, "--worker-id", wid], env=e, stdout=subprocess.PIPE,
                                text=True, start_new_session=True)

    procs = {SURVIVOR: start("member", SURVIVOR, 1), DOOMED: start("member", DOOMED, 2)}
    result: dict = {"backend": a.backend, "pass": False}
    try:
        deadline = time.monotonic() + a.timeout
        while not {SURVIVOR, DOOMED} <= set(svc.state.generators) and time.monotonic() < deadline:
            if any(pr.poll() is not None for pr in procs.values()):
                break
            time.sleep(0.05)
        if not {SURVIVOR, DOOMED} <= set(svc.state.generators):
            result["error"] = f"members not registered within {a.timeout}s: {sorted(svc.state.generators)}"
            return _finish(result, procs)
        procs["sender"] = start("sender", "learner0", 0)
        rounds, alive_after_round1 = [], None
        # round 1, then round 2: the sender reports each; it must still be there between them
        for line in _lines(procs["sender"], time.monotonic() + 3 * a.timeout):
            if line.startswith("ROUND "):
                rounds.append(json.loads(line[len("ROUND "):]))
                if len(rounds) == 1:
                    alive_after_round1 = procs["sender"].poll() is None
            elif line.startswith("SENDER_DONE"):
                break
        sender_rc = _wait(procs["sender"], 30)
        doomed_rc = _wait(procs[DOOMED], 30)
        survivor_rc = _wait(procs[SURVIVOR], a.timeout)
        events = [json.loads(x) for x in procs[SURVIVOR].stdout.read().splitlines() if x.startswith("{")]
        got = [e for e in events if e["event"] == "round"]
        result.update(
            sender_rc=sender_rc, sender_alive_after_round1=alive_after_round1, doomed_rc=doomed_rc,
            survivor_rc=survivor_rc, rounds=rounds,
            survivor_rounds=[(e["version"], e["exact"]) for e in got])
        checks = {
            "the doomed member died by SIGKILL": doomed_rc == -signal.SIGKILL,
            "the sender survived round 1": bool(alive_after_round1) and len(rounds) >= 1,
            "the sender finished round 2 and exited 0": len(rounds) == 2 and sender_rc == 0,
            "round 2 reached the survivor bit for bit": (2, True) in result["survivor_rounds"]
            and len(rounds) == 2 and SURVIVOR in rounds[1]["ok"],
        }
        result["failed_checks"] = [k for k, ok in checks.items() if not ok]
        result["round1_served_survivor"] = bool(rounds) and SURVIVOR in rounds[0]["ok"]
        result["pass"] = not result["failed_checks"]
        return _finish(result, procs)
    finally:
        for pr in procs.values():
            _kill(pr)
        svc.stop()


def _lines(proc, deadline: float):
    """The process's stdout lines until it ends or `deadline` (a thread reads, so the wait is bounded)."""
    import queue
    import threading

    q: queue.SimpleQueue = queue.SimpleQueue()

    def pump():
        for line in proc.stdout:
            q.put(line)
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    while time.monotonic() < deadline:
        try:
            line = q.get(timeout=max(0.01, min(1.0, deadline - time.monotonic())))
        except queue.Empty:
            continue
        if line is None:
            return
        yield line.rstrip("\n")


def _wait(proc, timeout_s: float):
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return None


def _kill(proc) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


def _finish(result: dict, procs: dict) -> int:
    print(json.dumps(result))
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
