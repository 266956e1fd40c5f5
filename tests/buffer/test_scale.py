"""What keeps the control plane flat at a thousand generators (`bench/scale.py` measures it): lease
expiry driven by a heap of deadlines rather than a scan of every lease at each request, and the
weight-sync service's own account of a publish round's fan-out. Driven directly, without sockets."""

import json

from buffer.config import BufferConfig
from buffer.messages import LeaseGrant
from buffer.prompts import load_prompts
from buffer.state import BufferState
from weight_sync import buckets as bk
from weight_sync.config import WeightSyncConfig
from weight_sync.messages import Done, Offer, Poll, Ready, Register, RoundResult
from weight_sync.state import SyncState


def make_state(tmp_path, **kw) -> BufferState:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "label": str(i)}) + "\n" for i in range(40)))
    cfg = BufferConfig(prompts=str(path), prompts_per_step=4, n_samples_per_prompt=1, max_staleness=4,
                       shuffle_seed=None, lease_ttl_s=10.0, **kw)
    cfg.validate()
    return BufferState(cfg, load_prompts(cfg.prompts))


def test_lease_expiry_follows_grants_and_renewals(tmp_path):
    st = make_state(tmp_path)
    a = st.lease("a", 1, now=0.0)  # expires at 10
    b = st.lease("b", 1, now=1.0)  # expires at 11
    c = st.lease("c", 1, now=2.0)  # answered at 3: never expires
    assert all(isinstance(x, LeaseGrant) for x in (a, b, c))
    st.renew(a.lease_id, now=5.0)  # a now expires at 15; its first deadline (10) must not take it
    st.renew(a.lease_id, now=6.0)  # ... at 16 (two stale entries in the heap now)
    assert st.add_sample(c.groups[0].group_id, 0, c.lease_id, False, 0, 1.0, b"x", now=3.0) == "complete"
    assert st.expire(10.5) == []  # a renewed, b not due yet, c answered
    assert st.expire(11.0) == [b.groups[0].group_id] and b.lease_id not in st.leases
    assert st.expire(15.9) == [] and a.lease_id in st.leases
    assert st.expire(16.0) == [a.groups[0].group_id]  # once, though three of its entries were due
    assert st.counters["expired_leases"] == 2 and not st.leases and not st.expiries
    # expired groups go to the front of the queue, oldest first, and are issued again
    again = st.lease("d", 2, now=17.0)
    assert [g.group_id for g in again.groups] == sorted([a.groups[0].group_id, b.groups[0].group_id])


def test_expired_leases_come_back_in_grant_order(tmp_path):
    st = make_state(tmp_path)
    grants = [st.lease(f"g{i}", 1, now=float(i % 2)) for i in range(4)]  # deadlines 10, 11, 10, 11
    back = st.expire(20.0)
    assert back == [g.groups[0].group_id for g in grants] == [0, 1, 2, 3]


def _ready(version: int) -> Ready:
    return Ready(sender_id="learner0", version=version, backend="gloo", manifest=bk.plan([("w", "float32", [4])], 64),
                 host="127.0.0.1", port=4000)


def test_the_service_reports_a_rounds_fanout_once_every_member_took_its_offer():
    clock = type("Clock", (), {"t": 100.0, "__call__": lambda self: self.t})()
    s = SyncState(WeightSyncConfig(), clock)
    for w in ("a", "b", "c"):
        s.handle(Register(w, "sim", 1, -1))
    go = s.handle(_ready(1))
    clock.t = 100.25
    assert isinstance(s.handle(Poll("a", -1)), Offer) and isinstance(s.handle(Poll("b", -1)), Offer)
    assert s.status()["last_fanout"] == {}  # c has not polled yet
    clock.t = 100.5
    assert isinstance(s.handle(Poll("c", -1)), Offer)
    assert s.status()["last_fanout"] == {"round_id": go.round_id, "version": 1, "members": 3, "fanout_s": 0.5}
    # a round whose offer one member never picked up: closed with it missed, no fan-out claimed
    for w in ("a", "b", "c"):
        s.handle(Done(w, 1, True, 0.0))
    go2 = s.handle(_ready(2))
    s.handle(Poll("a", 1))
    s.handle(Poll("b", 1))
    s.handle(RoundResult(go2.round_id, 2, ["a", "b"], ["c"], []))
    assert s.status()["last_fanout"]["round_id"] == go.round_id
