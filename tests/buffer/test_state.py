"""Admission control, the stale-drop rule and the share split, against values worked out by hand;
then the buffer's bookkeeping (`buffer.state.BufferState`) driven directly, without sockets."""


import pytest

from buffer.messages import Wait
from buffer.prompts import PromptOrder, PromptsError, load_prompts
from buffer.rules import admission_limit, admits, is_stale, share_bounds
from buffer.state import RequestError, Sample
from buffer.store import StateStore
from tests.helpers.buffer import complete, make_state

# ---- the rules --------------------------------------------------------------------------------


def test_admission_at_version_0():
    # version 0, max_staleness 1, 8 prompts per step: (0 + 1 + 1) * 8 = 16 groups may be live,
    # so groups 0..15 are admitted and group 16 is not.
    assert admission_limit(0, 1, 8) == 16
    assert all(admits(k, 0, 1, 8) for k in range(16))
    assert not admits(16, 0, 1, 8)


def test_drops_make_room_for_as_many_new_groups():
    # 16 issued, 3 dropped -> k_live = 13: 3 more are admitted (k_live 13, 14, 15), the 4th is not.
    issued, dropped = 16, 3
    more = 0
    while admits(issued - dropped, 0, 1, 8):
        issued += 1
        more += 1
    assert more == 3 and issued == 19


def test_admission_moves_with_the_version():
    # synchronous (max_staleness 0), 4 per step: version 0 -> 4 live; version 2 -> (2+0+1)*4 = 12.
    assert admission_limit(0, 0, 4) == 4
    assert admission_limit(2, 0, 4) == 12
    assert admits(11, 2, 0, 4) and not admits(12, 2, 0, 4)
    # max_staleness 3, 2 per step, version 5: (5+3+1)*2 = 18
    assert admission_limit(5, 3, 2) == 18


def test_stale_rule():
    # step 5, max_staleness 2: tokens from version 3 or later may train, version 2 may not.
    assert not is_stale(3, 5, 2)
    assert not is_stale(5, 5, 2)
    assert is_stale(2, 5, 2)
    # synchronous: only the step's own version
    assert not is_stale(4, 4, 0) and is_stale(3, 4, 0)


def test_share_split():
    # 8 groups over 2 ranks: [0, 4) and [4, 8); over 4 ranks: 2 each.
    assert [share_bounds(8, 2, r) for r in range(2)] == [(0, 4), (4, 8)]
    assert [share_bounds(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # shares are disjoint and cover the batch
    for n, w in ((6, 3), (12, 4), (5, 1)):
        covered = [i for r in range(w) for i in range(*share_bounds(n, w, r))]
        assert covered == list(range(n))


# ---- prompts ----------------------------------------------------------------------------------


def test_prompt_order_shuffles_each_epoch_with_seed_plus_epoch():
    order = PromptOrder(5, seed=3, epochs=2)
    assert order.total == 10
    epoch0 = [order.row(k) for k in range(5)]
    epoch1 = [order.row(k) for k in range(5, 10)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(5))
    assert epoch0 == [PromptOrder(5, seed=3, epochs=2).row(k) for k in range(5)]  # reproducible
    assert epoch1 == [PromptOrder(5, seed=4, epochs=1).row(k) for k in range(5)]  # seed + epoch
    assert [PromptOrder(5, None, 2).row(k) for k in range(10)] == [0, 1, 2, 3, 4] * 2


def test_load_prompts_reads_labels_and_names_the_bad_line(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "a", "label": "x", "extra": 1}\n\n{"prompt": "b", "label": 7}\n{"prompt": "c"}\n')
    rows = load_prompts(str(p))
    assert [(r.text, r.label, r.index) for r in rows] == [("a", "x", 0), ("b", "7", 1), ("c", None, 2)]
    for bad, why in (('{"prompt": "a"}\n{"prompt": 3}\n', "prompt"), ('{"prompt": "a"}\nnot json\n', "JSON"),
                     ('{"prompt": "a"}\n[1]\n', "object")):
        p.write_text(bad)
        with pytest.raises(PromptsError) as e:
            load_prompts(str(p))
        assert f"{p}:2" in str(e.value) and why in str(e.value)


# ---- the bookkeeping --------------------------------------------------------------------------






def test_lease_grants_follow_admission_and_drops(tmp_path):
    s = make_state(tmp_path)  # 2 per step, staleness 1: 4 live groups at version 0
    g = s.lease("w", 3, now=0.0)
    assert [x.group_id for x in g.groups] == [0, 1, 2] and g.version == 0 and g.n_samples == 2
    assert [x.prompt for x in g.groups] == ["p0", "p1", "p2"]  # file order (shuffle_seed None)
    g2 = s.lease("w", 3, now=0.0)
    assert [x.group_id for x in g2.groups] == [3]
    w = s.lease("w", 1, now=0.0)
    assert isinstance(w, Wait) and not w.done and "admission" in w.reason
    # a failed group is dropped: k_live 4 -> 3, one more is admitted
    assert s.group_failed(g.lease_id, 1)
    assert not s.group_failed(g.lease_id, 1)  # not its to give up twice
    assert [x.group_id for x in s.lease("w", 5, now=0.0).groups] == [4]
    # the learner moves to version 1: (1+1+1)*2 = 6 live allowed, 4 live -> 2 more
    s.set_version(1)
    assert [x.group_id for x in s.lease("w", 5, now=0.0).groups] == [5, 6]


def test_expired_lease_goes_back_to_the_front_and_late_results_are_refused(tmp_path):
    s = make_state(tmp_path, lease_ttl_s=10.0)
    a = s.lease("a", 2, now=0.0)  # groups 0, 1
    assert s.add_sample(0, 0, a.lease_id, False, 0, 1.0, b"old") == "accepted"  # partial
    s.renew(a.lease_id, now=5.0)  # now expires at 15
    assert s.expire(now=14.0) == []
    assert s.expire(now=15.0) == [0, 1]
    with pytest.raises(RequestError):
        s.renew(a.lease_id, now=15.0)
    b = s.lease("b", 3, now=15.0)
    # the two expired groups first, same ids, new lease; then a fresh one (no admission needed for them)
    assert [x.group_id for x in b.groups] == [0, 1, 2] and b.lease_id != a.lease_id
    assert s.counters["reissued"] == 2
    assert s.add_sample(0, 1, a.lease_id, False, 0, 1.0, b"late") == "late"
    complete(s, b, 0)
    # the partial sample of the expired lease did not survive: the group is all lease b's
    assert [x.frame for x in s.ready[0].samples] == [b"0/0", b"0/1"]
    assert s.counters["late"] == 1


def test_duplicates_failed_samples_and_completeness(tmp_path):
    s = make_state(tmp_path, n_samples_per_prompt=3)
    g = s.lease("w", 2, now=0.0)
    assert s.add_sample(0, 0, g.lease_id, False, 0, 1.0, b"a") == "accepted"
    assert s.add_sample(0, 0, g.lease_id, False, 0, 1.0, b"a") == "duplicate"
    assert s.add_sample(0, 2, g.lease_id, False, 0, 1.0, b"c") == "accepted"
    assert not s.ready  # 2 of 3 samples: not servable
    assert s.add_sample(0, 1, g.lease_id, False, 0, 1.0, b"b") == "complete"
    assert [x.frame for x in s.ready[0].samples] == [b"a", b"b", b"c"]  # by sample index
    assert s.add_sample(1, 0, g.lease_id, True, None, float("nan"), b"") == "failed"
    assert s.add_sample(1, 1, g.lease_id, False, 0, 1.0, b"x") == "late"  # the group is gone
    assert (s.counters["duplicates"], s.counters["failed_groups"], s.k_live) == (1, 1, 1)
    assert g.lease_id not in s.leases  # every group of the lease answered


def test_batches_split_by_rank_are_idempotent_and_checked(tmp_path):
    s = make_state(tmp_path, prompts_per_step=4, max_staleness=3)
    g = s.lease("w", 4, now=0.0)
    assert isinstance(s.batch(0, 0, 2), Wait)
    for k in range(4):
        complete(s, g, k, reward=float(k))
    with pytest.raises(RequestError) as e:
        s.batch(0, 0, 3)  # 4 groups cannot be split over 3 ranks
    assert e.value.field == "batch_request.world_size"
    with pytest.raises(RequestError) as e:
        s.batch(0, 2, 2)
    assert e.value.field == "batch_request.rank"
    f0, st0 = s.batch(0, 0, 2)
    f1, st1 = s.batch(0, 1, 2)
    assert f0 == [b"0/0", b"0/1", b"1/0", b"1/1"] and f1 == [b"2/0", b"2/1", b"3/0", b"3/1"]
    assert st0["reward_mean"] == 0.5 and st1["reward_mean"] == 2.5 and st0["groups"] == 2
    assert s.batch(0, 0, 2) == (f0, st0)  # asked again: the same share
    with pytest.raises(RequestError):
        s.batch(0, 0, 4)  # assembled for 2 ranks


def test_stale_groups_are_dropped_never_served(tmp_path):
    s = make_state(tmp_path, prompts_per_step=1, max_staleness=1)  # 2 live at version 0
    g = s.lease("w", 2, now=0.0)
    complete(s, g, 0, version=0)
    complete(s, g, 1, version=0)
    # step 2 accepts tokens from version 1 on (2 - 1): both groups are too old
    w = s.batch(2, 0, 1)
    assert isinstance(w, Wait) and s.counters["dropped_stale"] == 2 and not s.ready
    # the drops freed their admission slots: at version 2, (2+1+1)*1 = 4 live, 0 live now
    g2 = s.lease("w", 10, now=0.0)
    assert [x.group_id for x in g2.groups] == [2, 3, 4, 5]
    complete(s, g2, 2, version=2)
    frames, stats = s.batch(2, 0, 1)
    assert frames == [b"2/0", b"2/1"] and stats["staleness_max"] == 0.0
    # a group already too old when it arrives is dropped on arrival
    complete(s, g2, 3, version=0)
    assert s.counters["dropped_stale"] == 3


def test_end_of_data_answers_done(tmp_path):
    s = make_state(tmp_path, n_prompts=3, prompts_per_step=2, max_staleness=5)
    g = s.lease("w", 10, now=0.0)
    assert [x.group_id for x in g.groups] == [0, 1, 2]
    w = s.lease("w", 1, now=0.0)
    assert isinstance(w, Wait) and not w.done  # groups are still out: one may expire and come back
    for k in range(3):
        complete(s, g, k)
    assert s.lease("w", 1, now=0.0).done
    assert isinstance(s.batch(0, 0, 1), tuple)
    w = s.batch(1, 0, 1)  # one group left, two needed, nothing more will come
    assert isinstance(w, Wait) and w.done


def test_overflow_drops_the_oldest_complete_group(tmp_path):
    s = make_state(tmp_path, prompts_per_step=1, max_staleness=5, max_queued_groups=2)
    g = s.lease("w", 3, now=0.0)
    for k in range(3):
        complete(s, g, k)
    assert [x.group_id for x in sorted(s.ready)] == [1, 2]
    assert s.counters["dropped_overflow"] == 1 and s.k_live == 2


def test_state_log_restores_unserved_groups_and_counters(tmp_path):
    store = StateStore(str(tmp_path / "state"))
    store.open()
    s = make_state(tmp_path, store=store, prompts_per_step=1, max_staleness=5)
    g = s.lease("w", 5, now=0.0)  # groups 0..4
    for k in (0, 1, 2):
        complete(s, g, k)
    assert s.group_failed(g.lease_id, 4)  # dropped: never issued again
    s.batch(0, 0, 1)  # group 0 served (its only rank fetched it)
    s.set_version(1)
    store.counters(s.counters)
    store.close()
    with open(store.path, "ab") as f:
        f.write(b"\x93\xa5group")  # a record cut short by a kill: ignored

    saved = StateStore(str(tmp_path / "state")).load()
    assert saved.next_group == 5 and saved.version == 1 and saved.next_lease_id == g.lease_id + 1
    assert sorted(saved.groups) == [1, 2] and saved.groups[1] == [b"1/0", b"1/1"]
    assert saved.open_groups == [3]  # leased, never answered: to be issued again
    assert saved.counters["accepted_groups"] == 3 and saved.dropped == {4: ("failed_groups", 0)}
    assert saved.served == {0: [0]}

    s2 = make_state(tmp_path, prompts_per_step=1, max_staleness=5)
    s2.restore(saved, {gid: [Sample(f, 0, 1.0) for f in frames] for gid, frames in saved.groups.items()})
    assert [x.group_id for x in sorted(s2.ready)] == [1, 2] and s2.k_live == 4
    assert isinstance(s2.lease("w", 2, now=0.0), Wait)  # nothing leased before the learner's handshake
    s2.resume(1, {0})  # the learner's checkpoint at step 1 trained group 0
    g2 = s2.lease("w", 2, now=0.0)
    assert [x.group_id for x in g2.groups] == [3, 5]  # 3 again, then fresh ids: no id issued twice
    # the log was compacted on load and still restores the same
    again = StateStore(str(tmp_path / "state")).load()
    assert sorted(again.groups) == [1, 2] and again.open_groups == [3] and again.next_group == 5
