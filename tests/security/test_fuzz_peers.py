"""10,000 malformed messages on each socket the buffer fuzz (tests/security/test_buffer_fuzz.py) leaves out:
the buffer's relay input (generators -> scorers), a scorer's pull of rollouts, and a generator's
requests to the weight-sync service. Seeded, so a failure reproduces.

What must hold for each: the receiving side refuses every malformed message with a counted
`ProtocolError`, never another exception (the relay checks a message's envelope and leaves its
rollouts to the scorer, so on that path the two count between them); it keeps serving; and \
every valid message sent among the
junk arrives, unchanged. The scorer and the buffer are real processes; the far side of each is a
raw ZeroMQ socket in the test that sends what no honest peer would.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq

from buffer.client import BufferClient
from buffer.messages import Rollout, RolloutsMsg, ScoredMsg, decode, encode
from common.wire import ProtocolError
from launch.ports import free_port_block
from tests.helpers.buffer import start_buffer
from tests.helpers.fuzz import mutate, random_message
from tests.helpers.procs import ROOT, subprocess_env
from weight_sync import messages as wsm
from weight_sync.client import GeneratorSyncClient, WeightSyncError

N = 10_000


def _rollout(gid: int, i: int = 0, lease: int = 0, t: int = 4) -> Rollout:
    return Rollout(gid, i, lease, np.arange(1, 4), np.arange(4, 4 + t), -np.ones(t) / 4, np.zeros(t),
                   prompt="1+1=", completion="2", label="2", worker_id="gen")


def _junk(rng: random.Random, seeds: list[list[bytes]]) -> list[bytes]:
    return random_message(rng) if rng.random() < 0.3 else mutate(rng, rng.choice(seeds))


def _same(a: Rollout, b: Rollout) -> bool:
    return ((a.group_id, a.sample_index, a.lease_id, a.prompt, a.completion) ==
            (b.group_id, b.sample_index, b.lease_id, b.prompt, b.completion)
            and np.array_equal(a.completion_ids, b.completion_ids)
            and np.array_equal(a.behav_logprobs, b.behav_logprobs))


def test_the_relay_refuses_junk_from_generators_and_forwards_every_valid_message(tmp_path):
    b = start_buffer(tmp_path, n_prompts=16, prompts_per_step=4, n_samples_per_prompt=1)
    rng = random.Random(11)
    seeds = [encode(RolloutsMsg([_rollout(90_000 + k, lease=90_000)])) for k in range(4)]
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"tcp://127.0.0.1:{b.port + 2}")
    scorer = BufferClient(port=b.port, timeout_s=10)
    try:
        scorer.pull_rollouts(timeout_s=0.2)  # (the relay reads only while a scorer can take its output)
        valid, got, bad_sent, refused = {}, {}, 0, 0

        def take(timeout_s: float) -> None:  # as a scorer pulls: a message it cannot read is counted
            nonlocal refused
            try:
                while batch := scorer.pull_rollouts(timeout_s=timeout_s):
                    got.update((r.group_id, r) for r in batch if r.prompt == "valid")  # (not a mutant's)
                    timeout_s = 0
            except ProtocolError:
                refused += 1

        for i in range(N):
            if i % 500 == 0:
                r = _rollout(i, lease=1)
                r.prompt = "valid"
                valid[i] = r
                push.send_multipart(encode(RolloutsMsg([r])))
            else:
                frames = _junk(rng, seeds)
                try:
                    decode(frames)
                except ProtocolError:
                    bad_sent += 1
                push.send_multipart(frames)
            if i % 20 == 0:
                take(0)
        deadline = time.monotonic() + 30
        while not set(valid) <= set(got) and time.monotonic() < deadline:
            take(0.5)
        assert set(valid) <= set(got), f"lost {sorted(set(valid) - set(got))}"
        assert all(_same(got[g], r) for g, r in valid.items())
        with b.client() as c:
            deadline = time.monotonic() + 10
            while (m := c.metrics())["buffer/malformed_relay"] + refused < bad_sent and time.monotonic() < deadline:
                take(0.1)
        # the relay reads each message's envelope and passes its rollouts on; the scorer checks
        # those: between them every malformed message is refused, and counted
        assert m["buffer/malformed_relay"] + refused == bad_sent > N // 2 and m["buffer/internal_errors"] == 0
        assert b.proc.poll() is None
    finally:
        push.close(0)
        scorer.close()
        assert b.stop() == 0
    assert "Traceback" not in b.log.read_text()


@pytest.mark.slow
def test_a_scorer_skips_junk_on_its_pull_and_scores_every_valid_message(tmp_path):
    """The scorer's far side is the test: a PUSH where the buffer's relay_out would be, a PULL where
    its ingest would be."""
    port = free_port_block(4)
    ctx = zmq.Context.instance()
    relay_out, ingest = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    for s, offset in ((relay_out, 3), (ingest, 1)):
        s.setsockopt(zmq.LINGER, 0)
        s.bind(f"tcp://127.0.0.1:{port + offset}")
    fn = tmp_path / "reward.py"
    fn.write_text("def reward_fn(p, c, l):\n    return [float(x == y) for x, y in zip(c, l)]\n")
    log = tmp_path / "scorer.log"
    proc = subprocess.Popen([sys.executable, "-m", "launch.scorer", "--scorer.reward_fn", str(fn),
                             "--scorer.buffer_port", str(port), "--scorer.poll_s", "0.2", "--scorer.log_every_s", "1"],
                            cwd=ROOT, env=subprocess_env(), stderr=open(log, "w"))
    rng = random.Random(12)
    seeds = [encode(RolloutsMsg([_rollout(90_000 + k)])) for k in range(4)]
    try:
        relay_out.send_multipart(encode(RolloutsMsg([_rollout(0)])))  # waits until the scorer is connected
        valid, scored = {0}, {}
        for i in range(1, N):
            if i % 500 == 0:
                valid.add(i)
                relay_out.send_multipart(encode(RolloutsMsg([_rollout(i)])))
            else:
                relay_out.send_multipart(_junk(rng, seeds))
        deadline = time.monotonic() + 60
        while not valid <= set(scored) and time.monotonic() < deadline and proc.poll() is None:
            if ingest.poll(500):
                msg = decode(ingest.recv_multipart())
                assert isinstance(msg, ScoredMsg)
                scored.update((s.rollout.group_id, s) for s in msg.scored)
        assert valid <= set(scored), f"not scored: {sorted(valid - set(scored))}\n{log.read_text()[-2000:]}"
        assert all(scored[g].reward == 1.0 and not scored[g].failed for g in valid)
        assert proc.poll() is None, log.read_text()[-2000:]
    finally:
        proc.terminate()
        code = proc.wait(30)
        relay_out.close(0)
        ingest.close(0)
    text = log.read_text()
    assert code == 0 and "Traceback" not in text, text[-2000:]
    assert "skipped a malformed rollouts message" in text


def test_the_weight_sync_client_raises_only_protocol_errors_on_junk_replies():
    """A service that answers every request with junk: each `poll` raises `ProtocolError` (or the
    service's own `WeightSyncError` for a well-formed `error`) or returns what a poll returns,
    never anything else; the generator's hook skips such a poll and keeps its weights."""
    import threading

    from actors.weight_hook import WeightSyncHook

    port = free_port_block(1)
    ctx = zmq.Context.instance()
    service = ctx.socket(zmq.ROUTER)
    service.setsockopt(zmq.LINGER, 0)
    service.bind(f"tcp://127.0.0.1:{port}")
    rng = random.Random(13)
    seeds = [[wsm.encode(m)] for m in (wsm.Idle(3, 0.5), wsm.Registered(3, "finish"), wsm.Error("no", "poll.x"),
                                     wsm.Ack())]
    stop = threading.Event()

    def serve():  # (one thread owns the service socket)
        while not stop.is_set():
            if service.poll(100):
                ident, *_ = service.recv_multipart()
                service.send_multipart([ident, b"", *_junk(rng, seeds)])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = GeneratorSyncClient("127.0.0.1", port, "gen-0", timeout_s=5, context=ctx)
    kinds = {}
    try:
        for _ in range(N):
            try:
                reply = client.poll()
            except (ProtocolError, WeightSyncError) as e:
                kinds[type(e).__name__] = kinds.get(type(e).__name__, 0) + 1
            else:
                assert reply is None or isinstance(reply, wsm.RoundInfo)
                kinds["answered"] = kinds.get("answered", 0) + 1
        assert kinds.get("ProtocolError", 0) > N // 2 and kinds.get("answered", 0) > 0, kinds
        hook = WeightSyncHook(client)  # (its poll path only: no engine, no process group)
        for _ in range(50):
            hook.poll(engine=None)  # a junk reply is skipped (no seed mutates into an offer)
        assert hook.skipped > 0
    finally:
        stop.set()
        thread.join(5)
        client.close()
        service.close(0)
