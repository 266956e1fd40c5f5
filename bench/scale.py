"""The control plane at scale: a real buffer and a real weight-sync service against N simulated generators.

    python bench/scale.py [--n 64,256,1024] [--quick] [--seconds 30] [--batch-s 8] [--poll-s 0.2]
                          [--round-s 4] [--procs 2] [--probe 4] [--nofile 1024] [--nice 10]

For each N: `python -m launch.buffer` and `python -m launch.weight_sync` start as processes of their
own (ready when they write their ready files, as the launchers see them), then the simulation, every
part of it speaking the real wire protocol with the project's own message types and encoders:

  generators  N asyncio clients, spread over `--procs` processes. Each registers with the weight-sync
              service, then loops: lease one prompt group (`lease_request`, reporting the version it
              holds), "generate" for about `--batch-s` seconds (renewing the lease every third of its
              ttl, as `actors/generator.py` does), push `--group` rollouts of `--tokens` tokens to the
              relay (`relay_in`), lease again. Beside that loop, every `--poll-s` it polls the service
              (`generator.weight_sync_poll_s`, interrupt mode: the fastest a real generator polls); an
              offered round is answered at once with `done` (no bytes move: no process group is joined).
  probe       `--probe` more generators doing the same (batches 8x shorter, for enough round trips)
              in a process of their own, not niced: their lease round trips and the time they see a
              round are the services' latency under the load, without the crowd's own event-loop
              delay on top (512 generators on one niced Python loop read replies late).
  scorers     two processes pulling from `relay_out`, decoding each rollout as a scorer does, and
              pushing it scored to `ingest` (the path every scored rollout takes).
  learner     fetches step after step (`batch_request`, which moves the buffer's version), and every
              `--round-s` publishes the version it is at (`ready` to the weight-sync service: a
              round to every registered generator, manifest of a 7B Llama, 291 tensors), closing each
              round (`round_result`) after a join window.

The crowd, scorers and learner run at nice `--nice`: on a machine with fewer cores than roles, the
services get the CPU first, as they would on their own hosts; the services are started with a soft
RLIMIT_NOFILE of `--nofile` (1024: what most distributions give a process), the limit a real
deployment meets first. What is measured, over `--seconds` after a `--warmup`:

  lease_ms        lease round trip (p50, p99) seen by the probe, and by the crowd (`crowd_lease_ms`)
  ingest_per_s    scored rollouts the buffer accepted per second (its own counter, read at both ends)
  fanout_s        per round: from the learner sending `ready` to the last generator holding its
                  offer; `fanout_seen` the share of generators that saw each round;
                  `service_fanout_s` the service's own account (`status()["last_fanout"]`: from
                  `ready` to the last offer handed out, which waits on the crowd's polls), and
                  `probe_fanout_s` the same seen by the probe generators
  cpu_s           each service's CPU seconds over the window (from /proc), and per generator per second

Progress goes to stderr; the last line on stdout is one JSON object with a record per N.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.transport import cpu_seconds, say  # noqa: E402 (after the path is set)
from common.ready import ENV as READY_ENV  # noqa: E402
from common.ready import read_ready
from launch.ports import free_port_block  # noqa: E402

HOST = "127.0.0.1"
TIMEOUT_S = 30.0  # a request unanswered this long counts as an error (and the socket is replaced)


def manifest_7b():
    """The bucket layout of a Llama-7B shape in bf16 (what a real round's offer carries)."""
    from weight_sync.buckets import plan

    h, f, v, layers = 4096, 11008, 32000, 32
    specs = [("model.embed_tokens.weight", "bfloat16", [v, h])]
    for i in range(layers):
        p = f"model.layers.{i}."
        specs += [(p + f"self_attn.{x}_proj.weight", "bfloat16", [h, h]) for x in "qkvo"]
        specs += [(p + f"mlp.{x}_proj.weight", "bfloat16", s) for x, s in
                  (("gate", [f, h]), ("up", [f, h]), ("down", [h, f]))]
        specs += [(p + f"{x}.weight", "bfloat16", [h]) for x in ("input_layernorm", "post_attention_layernorm")]
    specs += [("model.norm.weight", "bfloat16", [h]), ("lm_head.weight", "bfloat16", [v, h])]
    return plan(specs, 256 << 20)


def raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# --------------------------------------------------------------------------------------------
# the simulated generators (one asyncio loop per process)


class Requester:
    """One DEALER's request/reply, awaited (the async twin of `common.channel.Channel`)."""

    def __init__(self, ctx, endpoint: str):
        self.ctx, self.endpoint, self.sock = ctx, endpoint, None

    def _socket(self):
        import zmq

        if self.sock is None:
            self.sock = self.ctx.socket(zmq.DEALER)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.connect(self.endpoint)
        return self.sock

    async def __call__(self, frames: list) -> list:
        sock = self._socket()
        await sock.send_multipart([b"", *frames], copy=False)
        if not await sock.poll(int(TIMEOUT_S * 1000)):
            sock.close(0)
            self.sock = None
            raise TimeoutError(f"no reply from {self.endpoint} within {TIMEOUT_S}s")
        return (await sock.recv_multipart())[1:]


class Record:
    """What one process of generators saw; sent to the parent as a plain dict at the end."""

    def __init__(self):
        self.lease_rtts: list[float] = []
        self.seen: dict[int, list[float]] = {}  # round id -> when each generator got its offer
        self.leased: dict[str, int] = {}  # worker id -> leases granted
        self.pushed = 0
        self.errors: dict[str, int] = {}

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


async def one_generator(wid: str, a: dict, ctx, rec: Record, stop: asyncio.Event) -> None:
    import numpy as np
    import zmq

    from buffer import protocol as bp
    from weight_sync import messages as wm

    await asyncio.sleep(random.uniform(0, a["ramp_s"]))  # generators join over the first seconds
    ctl = Requester(ctx, f"tcp://{HOST}:{a['buffer_port']}")
    ws = Requester(ctx, f"tcp://{HOST}:{a['ws_port']}")
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.setsockopt(zmq.SNDHWM, 100)
    push.connect(f"tcp://{HOST}:{a['buffer_port'] + 2}")  # relay_in
    holds = {"version": 0}

    async def ask_ws(msg):
        reply = wm.decode((await ws([wm.encode(msg)]))[0])
        if isinstance(reply, wm.Error):
            raise RuntimeError(reply.message)
        return reply

    async def weights() -> None:
        registered = False
        while not stop.is_set():
            try:
                if not registered:
                    registered = bool(await ask_ws(wm.Register(wid, "sim", 1, -1)))
                reply = await ask_ws(wm.Poll(wid, holds["version"]))
                if isinstance(reply, wm.Offer):
                    rec.seen.setdefault(reply.info.round_id, []).append(time.monotonic())
                    holds["version"] = max(holds["version"], reply.info.version)
                    await ask_ws(wm.Done(wid, reply.info.version, True, 0.0))
            except (TimeoutError, RuntimeError) as e:
                rec.error(f"weight_sync {type(e).__name__}")
            await asyncio.sleep(a["poll_s"])

    rng = np.random.default_rng(abs(hash(wid)) % (1 << 32))
    tokens = a["tokens"]
    completion = rng.integers(0, 32000, tokens).astype(bp.ID_DTYPE)
    logprobs = (-rng.random(tokens)).astype(bp.LOGPROB_DTYPE)
    prompt = rng.integers(0, 32000, 64).astype(bp.ID_DTYPE)
    task = asyncio.ensure_future(weights())
    try:
        while not stop.is_set():
            t = time.monotonic()
            try:
                reply = bp.decode(await ctl(bp.encode(bp.LeaseRequest(wid, 1, holds["version"]))))
            except TimeoutError:
                rec.error("lease timeout")
                continue
            if a["t0"] <= t <= a["t1"]:
                rec.lease_rtts.append(time.monotonic() - t)
            if isinstance(reply, bp.Wait):
                if reply.done:
                    break
                await asyncio.sleep(reply.retry_after_s)
                continue
            if not isinstance(reply, bp.LeaseGrant):
                rec.error(f"lease {type(reply).__name__}")
                await asyncio.sleep(1.0)
                continue
            rec.leased[wid] = rec.leased.get(wid, 0) + 1
            end = time.monotonic() + a["batch_s"] * random.uniform(0.75, 1.25)
            while (left := end - time.monotonic()) > 0:  # "generating", the lease renewed as it goes
                await asyncio.sleep(min(left, reply.ttl_s / 3))
                if end - time.monotonic() > 0:
                    ack = bp.decode(await ctl(bp.encode(bp.LeaseRenew(reply.lease_id))))
                    if not isinstance(ack, bp.Ack):
                        rec.error("renew refused")
            versions = np.full(tokens, reply.version, bp.ID_DTYPE)
            rollouts = [bp.Rollout(g.group_id, i, reply.lease_id, prompt, completion, logprobs, versions,
                                   prompt=g.prompt, label=g.label, finish_reason="length", worker_id=wid)
                        for g in reply.groups for i in range(reply.n_samples)]
            await push.send_multipart(bp.encode(bp.RolloutsMsg(rollouts)), copy=False)
            rec.pushed += len(rollouts)
    finally:
        stop.set()
        await asyncio.gather(task, return_exceptions=True)
        push.close(0)


def generators_main(ids: list[str], a: dict, nice: int, out) -> None:
    """A process of simulated generators: one event loop, one coroutine pair per generator."""
    import zmq
    import zmq.asyncio

    os.nice(nice)
    raise_nofile()

    async def main() -> Record:
        ctx = zmq.asyncio.Context()
        ctx.setsockopt(zmq.LINGER, 0)
        ctx.set(zmq.MAX_SOCKETS, 4 * len(ids) + 64)  # three sockets a generator (libzmq's default: 1023)
        rec = Record()
        stops = [asyncio.Event() for _ in ids]
        tasks = [asyncio.ensure_future(one_generator(w, a, ctx, rec, s)) for w, s in zip(ids, stops)]
        await asyncio.sleep(max(0.0, a["t1"] + 0.5 - time.monotonic()))
        for s in stops:
            s.set()
        _, late = await asyncio.wait(tasks, timeout=2.0)  # (one mid-batch is cut short)
        for t in late:
            t.cancel()
        for d in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(d, Exception) and not isinstance(d, asyncio.CancelledError):
                rec.error(f"generator {type(d).__name__}: {str(d)[:100]}")
        ctx.destroy(0)
        return rec

    rec = asyncio.run(main())
    out.put(("generators", {"lease_rtts": rec.lease_rtts, "seen": rec.seen, "leased": rec.leased,
                            "pushed": rec.pushed, "errors": rec.errors, "cpu_s": time.process_time(),
                            "probe": nice == 0}))


# --------------------------------------------------------------------------------------------
# scorers and the learner


def scorer_main(a: dict, nice: int, out) -> None:
    """Pull raw rollouts from the relay, score them (reward 1), push them to ingest, until t1."""
    import zmq

    from buffer import protocol as bp
    from common.channel import recv_frames, send_frames

    os.nice(nice)
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(f"tcp://{HOST}:{a['buffer_port'] + 3}")  # relay_out
    push.connect(f"tcp://{HOST}:{a['buffer_port'] + 1}")  # ingest
    n = 0
    while time.monotonic() < a["t1"] + 1.0:
        if not pull.poll(200):
            continue
        msg = bp.decode([f.buffer for f in recv_frames(pull)])
        send_frames(push, bp.encode(bp.ScoredMsg([bp.ScoredRollout(r, 1.0, {"exact": 1.0}) for r in msg.rollouts])))
        n += len(msg.rollouts)
    out.put(("scorer", {"scored": n, "cpu_s": time.process_time()}))
    ctx.destroy(0)


def learner_main(a: dict, nice: int, out) -> None:
    """Take step after step; every round_s, publish the version as a weight round and close it."""
    from buffer import protocol as bp
    from buffer.client import BufferClient
    from weight_sync import messages as wm
    from weight_sync.client import ask, channel

    os.nice(nice)
    client = BufferClient(HOST, a["buffer_port"], timeout_s=TIMEOUT_S)
    ws = channel(HOST, a["ws_port"], TIMEOUT_S)
    manifest = manifest_7b()
    step, rounds, closing = 0, [], []
    next_round = a["t0"] - a["warmup_s"] / 2
    while time.monotonic() < a["t1"]:
        reply = client.request(bp.BatchRequest(step, 0, 1))
        if isinstance(reply, bp.Batch):
            step += 1
        now = time.monotonic()
        if now >= next_round:
            next_round = now + a["round_s"]
            go = ask(ws, wm.Ready("learner-0", step, "gloo", manifest, HOST, 1, timeout_s=60.0))
            rounds.append({"round_id": go.round_id, "version": step, "t": now, "members": len(go.members)})
            closing.append((now + a["join_s"], go))
        while closing and closing[0][0] <= now:
            go = closing.pop(0)[1]
            fanout = ask(ws, wm.StatusRequest()).values["last_fanout"]  # the service's own account
            if fanout.get("round_id") == go.round_id:
                next(r for r in rounds if r["round_id"] == go.round_id)["service_fanout_s"] = fanout["fanout_s"]
            ask(ws, wm.RoundResult(go.round_id, go.version, [m.worker_id for m in go.members], [], []))
        if not isinstance(reply, bp.Batch):
            time.sleep(min(reply.retry_after_s, 0.05))
    out.put(("learner", {"steps": step, "rounds": rounds, "cpu_s": time.process_time()}))
    client.close()
    ws.close()


# --------------------------------------------------------------------------------------------
# one N


def start_service(cmd: list[str], ready: Path, log: Path, nofile: int) -> subprocess.Popen:
    def limit():  # a stock machine's soft limit (the service may raise it up to the hard one)
        if nofile:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(log, "w"), preexec_fn=limit,
                            env={**os.environ, "PYTHONPATH": str(ROOT), READY_ENV: str(ready)})
    deadline = time.monotonic() + 60
    while read_ready(ready) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{cmd[2]} did not start (exit {proc.poll()}):\n{log.read_text()[-2000:]}")
        time.sleep(0.05)
    return proc


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run_one(n: int, args, tmp: Path) -> dict:
    from buffer.client import BufferClient

    pps = max(2, n // 4)  # about a step every batch_s / 4 seconds
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{k // 100} + {k % 100}", "label": str(k)}) + "\n"
                               for k in range(10000)))
    bport, wport = free_port_block(4), free_port_block(1)
    buf = start_service([sys.executable, "-m", "launch.buffer", "--buffer.port", str(bport), "--buffer.prompts",
                         str(prompts), "--buffer.prompts_per_step", str(pps), "--buffer.n_samples_per_prompt",
                         str(args.group), "--buffer.max_staleness", "8", "--buffer.lease_ttl_s", str(args.ttl_s),
                         "--buffer.max_epochs", "100", "--buffer.curve", "off", "--buffer.log_level", "warning"],
                        tmp / f"buffer-{n}.ready", tmp / f"buffer-{n}.log", args.nofile)
    ws = start_service([sys.executable, "-m", "launch.weight_sync", "--weight_sync.port", str(wport),
                        "--weight_sync.curve", "off", "--weight_sync.mode", "interrupt"],
                       tmp / f"ws-{n}.ready", tmp / f"ws-{n}.log", args.nofile)
    procs = []
    try:
        start = time.monotonic() + 2.0  # (the processes below import what they need meanwhile)
        t0 = start + args.warmup
        a = {"buffer_port": bport, "ws_port": wport, "t0": t0, "t1": t0 + args.seconds, "ramp_s": args.ramp_s,
             "batch_s": args.batch_s, "poll_s": args.poll_s, "tokens": args.tokens, "round_s": args.round_s,
             "join_s": args.join_s, "warmup_s": args.warmup}
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        ids = [f"sim-{i}" for i in range(n)]
        for k in range(args.procs):
            procs.append(ctx.Process(target=generators_main, args=(ids[k::args.procs], a, args.nice, out)))
        if args.probe:  # (leasing 8x as often as the crowd: enough round trips for a p99)
            procs.append(ctx.Process(target=generators_main, args=([f"probe-{i}" for i in range(args.probe)],
                                                                  {**a, "batch_s": a["batch_s"] / 8}, 0, out)))
        procs += [ctx.Process(target=scorer_main, args=(a, args.nice, out)) for _ in range(2)]
        procs.append(ctx.Process(target=learner_main, args=(a, args.nice, out)))
        for p in procs:
            p.start()
        say(f"N={n}: {len(procs)} simulation processes; measuring {args.seconds:.0f}s after {args.warmup:.0f}s")
        time.sleep(max(0.0, t0 - time.monotonic()))
        with BufferClient(HOST, bport, timeout_s=TIMEOUT_S) as c:
            m0, cpu0 = c.metrics(), (cpu_seconds(buf.pid), cpu_seconds(ws.pid))
            time.sleep(max(0.0, a["t1"] - time.monotonic()))
            m1, cpu1 = c.metrics(), (cpu_seconds(buf.pid), cpu_seconds(ws.pid))
        reports = [out.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for s in (buf, ws):
            s.terminate()
            s.wait(15)
    return summarise(n, args, reports, m0, m1, cpu0, cpu1, a)


def summarise(n, args, reports, m0, m1, cpu0, cpu1, a) -> dict:
    gens = [r for kind, r in reports if kind == "generators"]
    crowd = [r for r in gens if not r["probe"]]
    probe = [r for r in gens if r["probe"]]
    learner = next(r for kind, r in reports if kind == "learner")
    seen: dict[int, list[float]] = {}
    probe_seen: dict[int, list[float]] = {}
    for r in gens:
        for rid, ts in r["seen"].items():
            (probe_seen if r["probe"] else seen).setdefault(int(rid), []).extend(ts)
    fanouts, shares, service, probe_fanouts = [], [], [], []
    for rd in learner["rounds"]:
        if a["t0"] <= rd["t"] <= a["t1"] - args.join_s:  # rounds the window saw through
            ts = seen.get(rd["round_id"], [])
            shares.append(len(ts) / n)
            fanouts.append(max(ts) - rd["t"] if ts else float("inf"))
            service.append(rd.get("service_fanout_s", float("inf")))  # inf: not every offer taken in join_s
            probe_fanouts += [t - rd["t"] for t in probe_seen.get(rd["round_id"], [])]
    leased = sum(len(r["leased"]) for r in crowd)
    window = a["t1"] - a["t0"]
    errors: dict[str, int] = {}
    for r in gens:
        for k, v in r["errors"].items():
            errors[k] = errors.get(k, 0) + v
    cpu_buf, cpu_ws = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]

    def ms(xs):
        return {"p50": round(1e3 * pct(xs, 0.5), 2), "p99": round(1e3 * pct(xs, 0.99), 2), "n": len(xs)}

    return {
        "n": n,
        "lease_ms": ms([x for r in probe for x in r["lease_rtts"]]),
        "crowd_lease_ms": ms([x for r in crowd for x in r["lease_rtts"]]),
        "ingest_per_s": round((m1["buffer/accepted_rollouts"] - m0["buffer/accepted_rollouts"]) / window, 1),
        "leases_per_s": round((m1["buffer/leases"] - m0["buffer/leases"]) / window, 1),
        "fanout_s": {"max": round(max(fanouts, default=float("nan")), 3),
                     "p50": round(pct(fanouts, 0.5), 3), "rounds": len(fanouts)},
        "service_fanout_s": {"max": round(max(service, default=float("nan")), 3),
                             "p50": round(pct(service, 0.5), 3)},
        "probe_fanout_s": {"max": round(max(probe_fanouts, default=float("nan")), 3),
                           "p50": round(pct(probe_fanouts, 0.5), 3)},
        "fanout_seen": round(min(shares, default=float("nan")), 4),
        "generators_leased": leased,
        "cpu_s": {"buffer": round(cpu_buf, 2), "weight_sync": round(cpu_ws, 2),
                  "buffer_ms_per_gen_s": round(1e3 * cpu_buf / n / window, 3),
                  "weight_sync_ms_per_gen_s": round(1e3 * cpu_ws / n / window, 3),
                  "simulation": round(sum(r["cpu_s"] for _, r in reports), 1)},
        "steps": learner["steps"],
        "errors": errors,
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", default="64,256,1024", help="comma-separated numbers of simulated generators")
    p.add_argument("--quick", action="store_true", help="a smoke run: N=16, 6 s measured")
    p.add_argument("--seconds", type=float, default=30.0, help="measured window per N")
    p.add_argument("--warmup", type=float, default=8.0, help="seconds before the window (generators join)")
    p.add_argument("--ramp-s", type=float, default=4.0, help="generators join over this many seconds")
    p.add_argument("--batch-s", type=float, default=8.0, help="a simulated batch's generation time (+-25%%)")
    p.add_argument("--group", type=int, default=8, help="samples per prompt group (rollouts per lease)")
    p.add_argument("--tokens", type=int, default=1024, help="completion tokens per rollout")
    p.add_argument("--ttl-s", type=float, default=6.0, help="lease ttl (renewed every third of it)")
    p.add_argument("--poll-s", type=float, default=0.2, help="weight-sync poll interval per generator")
    p.add_argument("--round-s", type=float, default=4.0, help="seconds between published rounds")
    p.add_argument("--join-s", type=float, default=2.0, help="a round's join window before it is closed")
    p.add_argument("--procs", type=int, default=2, help="processes the simulated generators share")
    p.add_argument("--probe", type=int, default=8, help="generators in the un-niced probe process")
    p.add_argument("--nofile", type=int, default=1024, help="soft RLIMIT_NOFILE the services start with (0: ours)")
    p.add_argument("--nice", type=int, default=10, help="niceness of the simulation (not the probe)")
    p.add_argument("--logs", default="", help="keep the services' logs in this folder")
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.seconds, args.warmup, args.ramp_s, args.batch_s = "16", 6.0, 4.0, 1.0, 2.0
    raise_nofile()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.logs:
            Path(args.logs).mkdir(parents=True, exist_ok=True)
            tmp = args.logs
        for n in [int(x) for x in args.n.split(",")]:
            r = run_one(n, args, Path(tmp))
            say(f"N={n}: lease p50 {r['lease_ms']['p50']} ms p99 {r['lease_ms']['p99']} ms (crowd p99 "
                f"{r['crowd_lease_ms']['p99']} ms); ingest {r['ingest_per_s']}/s; fan-out max {r['fanout_s']['max']} s "
                f"(seen by {r['fanout_seen']:.1%}; service {r['service_fanout_s']['max']} s, probe "
                f"{r['probe_fanout_s']['max']} s); CPU buffer {r['cpu_s']['buffer']} s, weight sync "
                f"{r['cpu_s']['weight_sync']} s; errors {r['errors']}")
            results.append(r)
    print(json.dumps({"results": results, "args": vars(args)}))


if __name__ == "__main__":
    main()
