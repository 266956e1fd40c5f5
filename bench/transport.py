"""Throughput of scored rollouts through a real replay buffer, against a bare ZeroMQ pipe.

    python bench/transport.py [--n 20000] [--warmup 2048] [--tokens 1024] [--group 8] [--per-step 32]
                              [--only-buffer] [--no-curve] [--profile-buffer PATH]

Four runs, each with a producer and a consumer process (multiprocessing, spawn start method):

  buffer  producer -> buffer (`python -m launch.buffer`, a process of its own, ready when it writes
          its ready file) -> consumer.
          The producer takes real leases, in bulk (up to a step's worth of groups per request),
          answers each group with one `scored` message of `--group` rollouts pushed to the
          buffer's ingest socket, and leases again. The consumer is a learner:
          `BufferClient.get_batch(step)` for step 0, 1, 2, ..., which also moves the buffer's
          version and so opens admission for more leases. Nothing in the buffer is switched off
          for the bench: admission control (max_staleness 16, so it bounds memory rather than
          throttling), lease checks, per-rollout validation, group completion and batch assembly
          all run as in training.
  curve   the buffer path again with CurveZMQ on every socket (a run's keys in a temporary
          folder; the producer leases as a generator and pushes as a scorer, the consumer is the
          learner): `curve_ratio` is its throughput over the plain buffer path's.
  raw     the same producer code sends the same frames (same sizes, same envelope) over a bare
          PUSH/PULL pair, and the consumer receives each message as `BufferClient` receives a
          reply (`common.channel.recv_frames`) and decodes it with `protocol.decode`, as
          `get_batch` does: the two runs differ by the buffer hop only. `ratio` compares these.
  raw_recv_only   the same, with a consumer that only receives: the bare transport.

A rollout carries `--tokens` completion tokens (ids, behaviour log-probs and versions as packed
arrays, ~12 KiB for 1,024 tokens) and a 16-token prompt. The producer msgpack-encodes each
rollout's map (the arrays are packed once; the ids change per rollout), as a scorer would.
Throughput counts the rollouts the consumer has decoded, after `--warmup` of them, over `--n` more.
CPU time per rollout is reported for every process (the buffer's read from /proc: `buffer` for the
whole process, `buffer_loop` for its main thread, the Python loop; the difference is libzmq's I/O
thread moving the bytes), and the control requests per rollout: wall-clock figures on a shared
machine move with the load, CPU per rollout much less.

Why the ratio stays under 0.5 where the CPUs are the limit (as on a 2-core machine, where both
runs keep both cores busy): the buffer path is the raw path twice over. Producer -> buffer is one
hop (a send, a receive and a check of every rollout), buffer -> consumer another (a send, a
receive and a decode), and each costs about what the raw path costs in all; the buffer's
bookkeeping and the control requests come on top. So `cpu_ratio`, the raw path's CPU per rollout
over the buffer path's (all processes), bounds `ratio` under load: it is what `ratio` is when
both runs are CPU-bound, and it moves much less with other load on the machine.

Progress goes to stderr; the last line on stdout is one JSON object:
`{"rollouts_per_s", "raw_rollouts_per_s", "ratio", "cpu_ratio", "tokens_per_rollout", "n", ...}`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from buffer.client import BufferClient  # noqa: E402 (after the path is set)
from common.ready import ENV as READY_ENV  # noqa: E402
from common.ready import read_ready
from launch.ports import free_port_block as free_base_port  # noqa: E402


def say(*args) -> None:
    print("[bench]", *args, file=sys.stderr, flush=True)


class Fabricator:
    """Scored-rollout frames with the arrays packed once; only the ids change between rollouts."""

    def __init__(self, tokens: int):
        import msgpack
        import numpy as np

        from buffer.messages import ID_DTYPE, LOGPROB_DTYPE, SCHEMA_VERSION

        rng = np.random.default_rng(0)
        self._versions = lambda v: np.full(tokens, v, ID_DTYPE).tobytes()
        self._versions_cache: dict[int, bytes] = {}
        self.packb = msgpack.packb
        self.v = SCHEMA_VERSION
        self.rollout = {
            "group_id": 0, "sample_index": 0, "lease_id": 0,
            "prompt_ids": rng.integers(0, 32000, 16).astype(ID_DTYPE).tobytes(),
            "completion_ids": rng.integers(0, 32000, tokens).astype(ID_DTYPE).tobytes(),
            "behav_logprobs": (-rng.random(tokens)).astype(LOGPROB_DTYPE).tobytes(),
            "versions": b"",
            "prompt": "What is 12 + 34? Answer with the digits reversed.",
            "completion": "", "label": "64", "finish_reason": "length", "worker_id": "bench",
        }
        self.scored = {"rollout": self.rollout, "reward": 1.0, "scores": {}, "ref_logprobs": None,
                       "failed": False, "error": "", "metadata": {}}

    def group(self, group_id: int, lease_id: int, n: int, version: int) -> list[bytes]:
        """One `scored` message: envelope + n rollout frames of group `group_id`."""
        r = self.rollout
        r["group_id"], r["lease_id"] = group_id, lease_id
        if version not in self._versions_cache:  # every token sampled by the weights of the lease's version
            self._versions_cache[version] = self._versions(version)
        r["versions"] = self._versions_cache[version]
        frames = [self.packb({"v": self.v, "type": "scored", "n": n})]
        for i in range(n):
            r["sample_index"] = i
            frames.append(self.packb(self.scored, use_bin_type=True))
        return frames


# --------------------------------------------------------------------------------------------
# the four processes' bodies; each reports to the parent over `out`:
#   ("progress", rollouts so far)   about once a second, from consumers
#   ("result", rollouts/s, rollouts measured)   from consumers, at the end
#   ("cpu", role, CPU seconds over the whole run)   from every process, at the end


class Meter:
    """A consumer's clock: starts after the warm-up, reports progress once a second."""

    def __init__(self, warmup: int, out):
        self.warmup, self.out = warmup, out
        self.t0 = self.at = None
        self.next_report = time.monotonic() + 1.0

    def add(self, got: int) -> None:
        if self.t0 is None and got >= self.warmup:
            self.t0, self.at = time.perf_counter(), got
        if time.monotonic() >= self.next_report:
            self.out.put(("progress", got))
            self.next_report = time.monotonic() + 1.0

    def done(self, got: int) -> None:
        self.out.put(("result", (got - self.at) / (time.perf_counter() - self.t0), got - self.at))


def identity(name: str) -> dict:
    """CURVE options for a socket of key `name` when the run has keys (the `--curve` row), else {}."""
    from common import curve

    if not os.environ.get(curve.KEYS_ENV):
        return {}
    os.environ[curve.NAME_ENV] = name
    return curve.client_options(name)


def produce_buffer(port: int, tokens: int, group: int, per_step: int, groups: int, out) -> None:
    import zmq

    from buffer.config import endpoints
    from buffer.messages import LeaseGrant
    from common.curve import apply

    fab = Fabricator(tokens)
    cpu0 = time.process_time()
    identity("gen-bench")  # it leases as a generator would ...
    client = BufferClient(port=port, timeout_s=30)
    push = apply(zmq.Context.instance().socket(zmq.PUSH), identity("scorer"))  # ... and pushes as a scorer
    push.setsockopt(zmq.SNDHWM, 1000)
    push.setsockopt(zmq.LINGER, 10000)
    push.connect(endpoints("127.0.0.1", port)["ingest"])
    sent, weights = 0, 0  # the version of the weights this generator "holds": the last one it was granted at
    while sent < groups:
        grant = client.lease("bench-producer", max_groups=per_step, version=weights)
        if not isinstance(grant, LeaseGrant):
            if grant.done:
                break
            # admission (the learner has not caught up), or our weights fell out of the staleness window
            weights = int(client.metrics()["buffer/version"])
            time.sleep(0.001)
            continue
        weights = grant.version
        for g in grant.groups:
            # the frames a scorer would push (same bytes as BufferClient.push_scored encodes)
            push.send_multipart(fab.group(g.group_id, grant.lease_id, group, grant.version))
        sent += len(grant.groups)
    out.put(("cpu", "producer", time.process_time() - cpu0))
    push.close()
    client.close()
    zmq.Context.instance().term()  # waits (LINGER) for queued messages: exiting without it drops them


def consume_buffer(port: int, total: int, warmup: int, out) -> None:
    identity("learner")
    client = BufferClient(port=port, timeout_s=60)
    meter = Meter(warmup, out)
    cpu0 = time.process_time()
    got, step = 0, 0
    while got < total:
        batch = client.get_batch(step, poll_s=0.001)
        got += len(batch.scored)  # decoded: read-only array views over the received frames
        step += 1
        meter.add(got)
    meter.done(got)
    out.put(("cpu", "consumer", time.process_time() - cpu0))
    client.close()


def produce_raw(port: int, tokens: int, group: int, groups: int, out) -> None:
    import zmq

    fab = Fabricator(tokens)
    cpu0 = time.process_time()
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 1000)
    push.setsockopt(zmq.LINGER, 10000)
    push.connect(f"tcp://127.0.0.1:{port}")
    for k in range(groups):
        push.send_multipart(fab.group(k, 1, group, 0))
    out.put(("cpu", "producer", time.process_time() - cpu0))
    push.close()
    zmq.Context.instance().term()  # waits (LINGER) for queued messages: exiting without it drops them


def consume_raw(port: int, total: int, warmup: int, decode_items: bool, out) -> None:
    import zmq

    from buffer.messages import decode
    from common.channel import recv_frames

    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 1000)
    pull.bind(f"tcp://127.0.0.1:{port}")
    out.put(("bound",))
    meter = Meter(warmup, out)
    cpu0 = time.process_time()
    got = 0
    while got < total:
        frames = [f.buffer for f in recv_frames(pull)]  # as the buffer's client receives a reply
        got += len(decode(frames).scored) if decode_items else len(frames) - 1
        meter.add(got)
    meter.done(got)
    out.put(("cpu", "consumer", time.process_time() - cpu0))
    pull.close()


# --------------------------------------------------------------------------------------------


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User + system CPU time of a process (or of its thread `tid`), from /proc (Linux)."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def collect(name: str, out, procs: list, total: int, stall_s: float = 60.0) -> tuple[float, int, dict]:
    """Read the processes' reports until the consumer's result and every CPU figure are in."""
    result, cpu = None, {}
    while result is None or len(cpu) < len(procs):
        try:
            msg = out.get(timeout=stall_s)
        except queue.Empty:
            dead = [f"{p.name} exit {p.exitcode}" for p in procs if not p.is_alive()]
            for p in procs:
                p.kill()
            raise RuntimeError(f"{name}: nothing reported for {stall_s:.0f}s ({', '.join(dead) or 'all alive'})")
        if msg[0] == "progress":
            say(f"{name}: {msg[1]:,} / {total:,} rollouts")
        elif msg[0] == "result":
            result = msg[1:]
        elif msg[0] == "cpu":
            cpu[msg[1]] = msg[2]
    for p in procs:
        p.join(30)
    return result[0], result[1], cpu


def run_buffer(args, ctx, curve: bool = False) -> tuple[float, int, dict]:
    """The buffer path; with `curve`, every socket speaks CurveZMQ with a run's keys."""
    groups = -(-(args.n + args.warmup) // args.group)
    groups = -(-groups // args.per_step) * args.per_step  # whole steps
    total = groups * args.group
    port = free_base_port(4)
    with tempfile.TemporaryDirectory() as tmp:
        from common.curve import KEYS_ENV, NAME_ENV, make_keys

        os.environ.pop(NAME_ENV, None)
        if curve:  # (the processes started below inherit the folder)
            os.environ[KEYS_ENV] = str(make_keys(Path(tmp) / "keys"))
        else:
            os.environ.pop(KEYS_ENV, None)
        prompts = Path(tmp) / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": f"{k // 10} + {k % 10}", "label": str(k)}) + "\n"
                                   for k in range(groups)))
        prof = ["-m", "cProfile", "-o", args.profile_buffer] if args.profile_buffer else []
        cmd = [sys.executable, *prof, "-m", "launch.buffer", "--buffer.port", str(port),
               "--buffer.prompts", str(prompts), "--buffer.prompts_per_step", str(args.per_step),
               "--buffer.n_samples_per_prompt", str(args.group),
               "--buffer.max_staleness", "16", "--buffer.log_level", "warning",
               "--buffer.curve", "on" if curve else "off"]
        ready = Path(tmp) / "ready.json"
        buf = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                               env={**os.environ, "PYTHONPATH": str(ROOT), READY_ENV: str(ready)})
        try:
            deadline = time.monotonic() + 60
            while read_ready(ready) is None:  # the buffer's explicit ready signal
                if buf.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"buffer did not start (exit status {buf.poll()})")
                time.sleep(0.05)
            buffer_cpu0 = cpu_seconds(buf.pid), cpu_seconds(buf.pid, buf.pid)
            out = ctx.Queue()
            procs = [ctx.Process(target=consume_buffer, args=(port, total, args.warmup, out), name="consumer"),
                     ctx.Process(target=produce_buffer, name="producer",
                                 args=(port, args.tokens, args.group, args.per_step, groups, out))]
            for p in procs:
                p.start()
            rate, n, cpu = collect("buffer path", out, procs, total)
            # the buffer's Python loop runs on its main thread; libzmq moves the bytes on its own threads
            cpu["buffer"] = cpu_seconds(buf.pid) - buffer_cpu0[0]
            cpu["buffer_loop"] = cpu_seconds(buf.pid, buf.pid) - buffer_cpu0[1]
            identity("admin")
            with BufferClient(port=port, timeout_s=10) as c:
                requests = c.metrics()["buffer/requests"]
            say(f"buffer path: {requests / total:.3f} control requests per rollout")
        finally:
            buf.terminate()
            buf.wait(10)
            os.environ.pop(KEYS_ENV, None)
            os.environ.pop(NAME_ENV, None)
    return rate, n, {k: 1e6 * v / total for k, v in cpu.items()}


def run_raw(args, ctx, decode_items: bool) -> tuple[float, int, dict]:
    groups = -(-(args.n + args.warmup) // args.group)
    total = groups * args.group
    port = free_base_port(1)
    out = ctx.Queue()
    cons = ctx.Process(target=consume_raw, args=(port, total, args.warmup, decode_items, out), name="consumer")
    cons.start()
    if out.get(timeout=60) != ("bound",):
        raise RuntimeError("raw consumer did not start")
    prod = ctx.Process(target=produce_raw, args=(port, args.tokens, args.group, groups, out), name="producer")
    prod.start()
    rate, n, cpu = collect("bare PUSH/PULL" + (" + decode" if decode_items else ""), out, [cons, prod], total)
    return rate, n, {k: 1e6 * v / total for k, v in cpu.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=20000, help="rollouts measured (after the warm-up)")
    p.add_argument("--warmup", type=int, default=2048, help="rollouts before the clock starts")
    p.add_argument("--tokens", type=int, default=1024, help="completion tokens per rollout")
    p.add_argument("--group", type=int, default=8, help="rollouts per prompt group (one message each)")
    p.add_argument("--per-step", type=int, default=32, help="prompt groups per learner batch")
    p.add_argument("--profile-buffer", metavar="PATH", default="",
                   help="run the buffer under cProfile, stats to PATH (read with python -m pstats)")
    p.add_argument("--only-buffer", action="store_true", help="skip the bare PUSH/PULL runs")
    p.add_argument("--no-curve", action="store_true", help="skip the buffer path with CurveZMQ on")
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")

    say(f"buffer path: {args.n} rollouts of {args.tokens} tokens, groups of {args.group}, "
        f"{args.per_step} groups per batch")
    rate, n, cpu = run_buffer(args, ctx)
    say(f"buffer path: {rate:,.0f} rollouts/s; CPU us per rollout: {_fmt(cpu)}")
    curve_rate, curve_cpu = float("nan"), {}
    if not args.no_curve:
        curve_rate, _, curve_cpu = run_buffer(args, ctx, curve=True)
        say(f"buffer path, CurveZMQ: {curve_rate:,.0f} rollouts/s ({curve_rate / rate:.2f}x without); "
            f"CPU us per rollout: {_fmt(curve_cpu)}")
    if args.only_buffer:
        return
    raw, _, raw_cpu = run_raw(args, ctx, decode_items=True)
    say(f"bare PUSH/PULL, consumer decodes: {raw:,.0f} rollouts/s; CPU us per rollout: {_fmt(raw_cpu)}")
    recv_only, _, recv_cpu = run_raw(args, ctx, decode_items=False)
    say(f"bare PUSH/PULL, receive only: {recv_only:,.0f} rollouts/s; CPU us per rollout: {_fmt(recv_cpu)}")
    print(json.dumps({"rollouts_per_s": round(rate), "raw_rollouts_per_s": round(raw),
                      "ratio": round(rate / raw, 3), "tokens_per_rollout": args.tokens, "n": n,
                      "raw_recv_only_rollouts_per_s": round(recv_only),
                      "ratio_to_recv_only": round(rate / recv_only, 3),
                      "cpu_ratio": round(_total(raw_cpu) / _total(cpu), 3),
                      "curve_rollouts_per_s": round(curve_rate) if curve_cpu else None,
                      "curve_ratio": round(curve_rate / rate, 3) if curve_cpu else None,
                      "cpu_us_per_rollout": {"buffer_path": _round(cpu), "buffer_path_curve": _round(curve_cpu),
                                             "raw": _round(raw_cpu),
                                             "raw_recv_only": _round(recv_cpu)},
                      "load_avg_1m": os.getloadavg()[0]}))


def _fmt(cpu: dict) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in sorted(cpu.items()))


def _total(cpu: dict) -> float:
    """CPU per rollout of all the processes (`buffer_loop` is part of `buffer`)."""
    return sum(v for k, v in cpu.items() if k != "buffer_loop")


def _round(cpu: dict) -> dict:
    return {k: round(v, 1) for k, v in sorted(cpu.items())}


if __name__ == "__main__":
    main()
