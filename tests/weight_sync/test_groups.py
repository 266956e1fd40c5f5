"""Weight-sync groups: what they are built with (so a failure costs a round, not the process), that
every wait of a round ends by its deadline, and that a group is kept for the next round when its
members come back.

The NCCL decisions are pure functions checked here against the values torch 2.14's
ProcessGroupNCCL calls for (weight_sync/groups.py names the source); the bounds and the kept groups
run for real over gloo, in threads and processes of this machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch

import weight_sync.groups as R
from tests.helpers.procs import subprocess_env
from weight_sync.client import GeneratorSyncClient
from weight_sync.receiver import receive_named_tensors
from weight_sync.round import RoundStore, store_server, wait_key
from weight_sync.sender import WeightSender

# ---------------------------------------------------------------------------------------------
# what a group is built with (pure)


def test_nccl_env_is_torchs_defaults_made_explicit_plus_the_nonblocking_bound():
    # ASYNC_ERROR_HANDLING 3 (SkipCleanUp) and ENABLE_MONITORING 1 are torch's own defaults: the
    # process's other groups behave as without them; the round's 120 s bound torch's waits for a
    # non-blocking communicator (default 30 min); a fraction of a second rounds up
    assert R.nccl_env(120) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_ENABLE_MONITORING": "1",
                               "TORCH_NCCL_NONBLOCKING_TIMEOUT": "120"}
    assert R.nccl_env(0.2)["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "1"
    assert R.nccl_env(90.5)["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "91"


def test_group_env_and_options_per_backend():
    # NCCL: 2 = CleanUpOnly (abort the communicators, never tear the process down), no heartbeat
    # monitor; gloo needs nothing
    assert R.group_env("nccl") == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_ENABLE_MONITORING": "0"}
    assert R.group_env("gloo") == {}
    assert R.group_options("gloo", 30) == {"timeout": timedelta(seconds=30)}
    assert R.group_options("nccl", 30) == {"timeout": timedelta(seconds=30), "blocking": 0,
                                           "is_high_priority_stream": False}
    assert R.group_options("gloo", 0)["timeout"] == timedelta(seconds=0.1)  # never 0: that is "no bound"
    with pytest.raises(ValueError, match="disk"):
        R.group_options("disk", 30)


def test_an_nccl_group_is_constructed_under_its_env_which_is_restored(monkeypatch):
    """A stand-in for ProcessGroupNCCL (this CPU build has none) records what the constructor
    saw: the variables of `group_env` and the options of `group_options`; afterwards the process's
    values are back (torch's default for a variable that was not set)."""
    import torch.distributed as dist

    seen = {}

    class Config:
        blocking = -1

    class Options:
        def __init__(self, is_high_priority_stream=False):
            self.is_high_priority_stream = is_high_priority_stream
            self.config = Config()
            self._timeout = None

    class FakeNCCL:
        def __init__(self, store, rank, size, opts):
            seen.update({k: os.environ.get(k) for k in R.group_env("nccl")},
                        blocking=opts.config.blocking, timeout=opts._timeout,
                        high=opts.is_high_priority_stream, rank=rank, size=size)

    FakeNCCL.Options = Options
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    monkeypatch.delenv("TORCH_NCCL_ENABLE_MONITORING", raising=False)
    R.make_group("nccl", None, 1, 3, 7.0)
    assert seen == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_ENABLE_MONITORING": "0", "blocking": 0,
                    "timeout": timedelta(seconds=7), "high": False, "rank": 1, "size": 3}
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert os.environ["TORCH_NCCL_ENABLE_MONITORING"] == "1"  # left at torch's default, not removed


def test_scoped_env_restores_on_error(monkeypatch):
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    with pytest.raises(RuntimeError):
        with R.scoped_env({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}):
            assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
            raise RuntimeError("constructor failed")
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


def test_abort_at_fires_only_past_the_deadline():
    class Group:
        aborted = 0

        def abort(self):
            self.aborted += 1

    pg = Group()
    with R.AbortAt(pg, time.monotonic() + 5) as guard:
        pass
    assert not guard.fired and pg.aborted == 0
    t0 = time.monotonic()
    with R.AbortAt(pg, t0 + 0.2) as guard:
        while not guard.fired and time.monotonic() < t0 + 5:  # a call stuck past the deadline
            time.sleep(0.01)
    assert guard.fired and pg.aborted == 1 and 0.2 <= time.monotonic() - t0 < 2
    R.abort_group(object())  # a group without abort (a test's stand-in): nothing, no error


def test_abort_is_safe_on_gloo():
    # ProcessGroupGloo inherits Backend's abort, a no-op: the failure path may call it on any group
    store = store_server("127.0.0.1", 5.0)
    pg = R.make_group("gloo", torch.distributed.PrefixStore("solo", store), 0, 1, 5.0)
    R.abort_group(pg)
    t = torch.ones(4)
    pg.broadcast(t, 0).wait()


def test_sender_groups_offer_keep_and_retire():
    g = R.SenderGroups(limit=2)
    retired = []
    orig = R.retire
    R.retire = retired.append
    try:
        g.keep("a", [("g0", 0), ("g1", 0)], "pgA")
        assert g.offer([("g1", 0), ("g0", 0)]) == ("a", (("g0", 0), ("g1", 0)))  # same members, any order
        assert g.offer([("g0", 0)]) == ("", ())
        g.keep("b", [("g1", 0), ("g2", 0)], "pgB")  # g1 moved on: "a" is retired
        assert retired == ["pgA"] and g.offer([("g0", 0), ("g1", 0)]) == ("", ())
        g.keep("c", [("g3", 0)], "pgC")
        g.keep("d", [("g4", 0)], "pgD")  # beyond the limit of 2: the oldest ("b") goes
        assert retired == ["pgA", "pgB"] and len(g) == 2
        assert g.forget("c") == "pgC" and g.forget("c") is None
    finally:
        R.retire = orig


def test_member_groups_hold_only_the_offered_group_as_the_same_rank():
    m = R.MemberGroups()
    where = ("10.0.0.1", 1234)
    m.keep(where, "s", "G", 1, "pg1")
    m.keep(where, "s", "G", 2, "pg2")  # a second generator of this process (threads)
    assert m.holds(where, "s", "G", 1) == "pg1" and m.holds(where, "s", "G", 2) == "pg2"
    assert m.holds(where, "s", "G", 3) is None  # another group rank: not this process's
    assert m.holds(where, "other secret", "G", 1) is None  # a restarted sender
    assert m.holds(where, "s", "", 1) is None  # nothing offered
    assert m.forget(where, 1) == "pg1" and m.holds(where, "s", "G", 1) is None


# ---------------------------------------------------------------------------------------------
# bounded waits, over gloo


def _store_pair(timeout_s: float = 10.0):
    server = store_server("127.0.0.1", timeout_s)
    return server, RoundStore("127.0.0.1", server.port, 1, timeout_s, "ab" * 16)


def test_group_setup_ends_at_the_deadline_when_a_member_never_comes():
    """Rank 0 builds a 2-rank group; rank 1 never does: the set-up raises by the deadline."""
    _, rs = _store_pair()
    t0 = time.monotonic()
    with pytest.raises(Exception):
        rs.group("gloo", 0, 0, 2, t0 + 1.0)
    assert time.monotonic() - t0 < 3.0


def test_a_collective_ends_at_the_deadline_when_a_member_never_calls_it():
    """Both ranks build the group (threads); rank 1 then never takes part: rank 0's wait through
    `Bounded` ends by the deadline, with an error."""
    _, rs = _store_pair()
    member = RoundStore("127.0.0.1", rs.port, 1, 10.0, "ab" * 16)
    groups = {}
    t = threading.Thread(target=lambda: groups.update(m=member.group("gloo", 0, 1, 2, time.monotonic() + 10, 30)))
    t.start()
    pg = rs.group("gloo", 0, 0, 2, time.monotonic() + 10, 30)
    t.join(10)
    assert "m" in groups
    deadline = time.monotonic() + 0.5
    with pytest.raises(RuntimeError, match="timed out"):
        R.Bounded(pg, deadline).broadcast(torch.ones(1000), 0).wait()
    assert time.monotonic() - deadline < 1.0
    with pytest.raises(TimeoutError):  # past the deadline already: not even waited for
        R.Bounded(pg, deadline).broadcast(torch.ones(10), 0).wait()
    R.dispose(pg, 0.0)
    R.dispose(groups.pop("m"), 0.0)


MEMBER = """
import os, sys, time, torch
import weight_sync.groups as R
from weight_sync.round import RoundStore
port, die = int(sys.argv[1]), sys.argv[2] == "die"
rs = RoundStore("127.0.0.1", port, 1, 10.0, "ab" * 16)
pg = R.Bounded(rs.group("gloo", 0, 1, 2, time.monotonic() + 10, 30), time.monotonic() + 20)
buf = torch.empty(1 << 16)
pg.broadcast(buf, 0).wait()
rs.report(0, 1, ok=True)
if die:
    os._exit(17)  # after the first bucket, as a generator killed mid-round
time.sleep(30)
"""


@pytest.mark.parametrize("how", ["dies", "stalls"])
def test_a_member_that_dies_or_stalls_mid_broadcast_costs_the_sender_the_deadline_at_most(how):
    """A member process receives the first bucket, then dies (gloo: "connection closed", at once)
    or stalls alive (never takes the second bucket: the sender's wait ends at the deadline)."""
    _, rs = _store_pair()
    proc = subprocess.Popen([sys.executable, "-c", MEMBER, str(rs.port), "die" if how == "dies" else "stall"],
                            env=subprocess_env(), cwd=os.path.dirname(os.path.dirname(R.__file__)))
    try:
        pg = rs.group("gloo", 0, 0, 2, time.monotonic() + 10, 30)
        group = R.Bounded(pg, time.monotonic() + 10)
        group.broadcast(torch.ones(1 << 16), 0).wait()
        assert wait_key(rs.store, "a0/done/1", time.monotonic() + 10)  # the member has the first bucket
        if how == "dies":
            assert proc.wait(10) == 17
        deadline = time.monotonic() + 1.0
        t0 = time.monotonic()
        with pytest.raises(Exception) as e:
            with R.AbortAt(pg, deadline):
                R.Bounded(pg, deadline).broadcast(torch.ones(1 << 20), 0).wait()  # 4 MiB: more than a socket buffer
        assert time.monotonic() - t0 < 2.0, e.value
        R.failed_group(pg, e.value)
        del pg, group
    finally:
        proc.kill()
        proc.wait(10)


# ---------------------------------------------------------------------------------------------
# kept groups, through the real sender, service and receivers


def test_a_group_is_kept_while_its_members_come_back(weight_sync_service):
    """Two generators (threads) take three rounds: round 1 builds the group, round 2 uses it again
    (no set-up), round 3 after one of them left builds a new one; every round's weights arrive."""
    svc, port = weight_sync_service
    rounds = 3
    named = [(f"layer{i}.w", torch.randn(64, 64)) for i in range(4)]
    got: dict[str, list] = {"g0": [], "g1": []}
    leave = threading.Event()

    def generator(wid):
        ws = GeneratorSyncClient("127.0.0.1", port, wid)
        ws.register("transformers")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (wid == "g1" and leave.is_set()):
            info = ws.poll()
            if info is None:
                time.sleep(0.005)
                continue
            tensors, stats = receive_named_tensors(info)
            ws.done(info.version)
            got[wid].append((info.version, all(torch.equal(a, b * info.version) for (_, a), (_, b)
                                               in zip(tensors, named))))
            if len(got[wid]) == rounds or (wid == "g1" and len(got[wid]) == 2):
                break
        if wid == "g1":
            ws.unregister()
        ws.close()

    threads = {w: threading.Thread(target=generator, args=(w,)) for w in got}
    for t in threads.values():
        t.start()
    while len(svc.state.generators) < 2:
        time.sleep(0.01)
    sender = WeightSender("127.0.0.1", port, timeout_s=20, bucket_mb=16 / 1024, join_timeout_s=5,
                          serve_in_background=False, same_host="broadcast")
    try:
        stats = []
        for v in (1, 2):
            stats.append(sender.publish(v, [(n, t * v) for n, t in named]))
        threads["g1"].join(20)
        assert "g1" not in svc.state.generators  # it left
        stats.append(sender.publish(3, [(n, t * 3) for n, t in named]))
        threads["g0"].join(20)
        assert [s["ok"] for s in stats] == [["g0", "g1"], ["g0", "g1"], ["g0"]], stats
        assert [s.get("groups_reused", 0) for s in stats] == [0, 1, 0]
        assert [s["attempts"] for s in stats] == [1, 1, 1]
        assert got == {"g0": [(1, True), (2, True), (3, True)], "g1": [(1, True), (2, True)]}
        assert len(sender._groups) == 1  # round 3's group; round 1's went when g0 moved on
    finally:
        sender.close()
