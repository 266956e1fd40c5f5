"""DAPO's dynamic sampling in the buffer (`buffer.dynamic_filtering`): the rule against values worked
out by hand, the bookkeeping driven without sockets (admission, the cap, the end of the data,
resume), then a real buffer process on a task where half the groups have constant rewards, killed
with SIGKILL and restarted from its state dir, and audited with `launch.ledger`.
"""

import logging

from buffer.messages import LeaseGrant, Wait
from buffer.rules import describe_wait, filter_verdict, no_signal
from buffer.store import StateStore
from launch.ledger import audit
from learner.ledger import Ledger
from tests.helpers.buffer import make_state, scored, start_buffer

# ---- the rule ---------------------------------------------------------------------------------


def test_no_signal_rule():
    # all equal (to within 1e-6 of their size): no signal, whatever the range
    assert no_signal([1.0, 1.0, 1.0]) and no_signal([0.0, 1e-9]) and no_signal([1000.0, 1000.0 + 1e-4])
    assert not no_signal([0.0, 1.0]) and not no_signal([0.0, 1e-3])
    # range (0.2, 0.8), on the mean, strictly inside: mean 0.25 passes, 0.2 and 0.8 do not
    assert not no_signal([0.0, 0.0, 0.0, 1.0], [0.2, 0.8])
    assert no_signal([0.0, 0.0, 0.0, 0.0, 1.0], [0.2, 0.8]) and no_signal([1.0, 1.0, 1.0, 1.0, 0.0], [0.2, 0.8])


def test_filter_verdict_counts_the_cap():
    # cap 4 per version: the 4th filtered group is allowed (3 used), the 5th is not
    assert filter_verdict([0.0, 1.0], None, 0, 4) == "keep"
    assert filter_verdict([1.0, 1.0], None, 3, 4) == "filter"
    assert filter_verdict([1.0, 1.0], None, 4, 4) == "capped"
    assert filter_verdict([1.0, 1.0], None, 0, 0) == "off"


# ---- the bookkeeping --------------------------------------------------------------------------


def answer(s, grant, constant=lambda gid: gid % 2 == 0, version=0):
    """Every group of `grant`: rewards 1, 1 for the groups `constant` picks, else 0, 1."""
    for x in grant.groups:
        gid = x.group_id
        for i in range(s.cfg.n_samples_per_prompt):
            s.add_sample(gid, i, grant.lease_id, False, version, 1.0 if constant(gid) else float(i),
                         f"{gid}/{i}".encode())


def test_filtered_groups_free_admission_for_replacements(tmp_path):
    # 2 per step, synchronous: 2 live at version 0. Groups 0, 1 leased; 0 is constant: filtered,
    # which frees its slot, so group 2 is leased (constant: filtered), then 3: step 0 is [1, 3].
    s = make_state(tmp_path, max_staleness=0, dynamic_filtering=True)
    g = s.lease("w", 4, now=0.0)
    assert [x.group_id for x in g.groups] == [0, 1]
    answer(s, g)
    assert s.dropped == {0: ("filtered", 0)} and s.k_live == 1
    assert isinstance(s.batch(0, 0, 1), Wait)
    why = describe_wait(s.metrics(now=0.0))
    assert "dynamic sampling filtered 1 groups" in why and "50% of groups pass" in why
    g = s.lease("w", 4, now=0.0)
    assert [x.group_id for x in g.groups] == [2]
    answer(s, g)
    g = s.lease("w", 4, now=0.0)
    assert [x.group_id for x in g.groups] == [3]
    answer(s, g)
    frames, stats = s.batch(0, 0, 1)
    assert frames == [b"1/0", b"1/1", b"3/0", b"3/1"] and stats["filtered"] == 2 and stats["filter_pass_rate"] == 0.5
    m = s.metrics()
    assert (m["buffer/filtered"], m["buffer/no_signal_groups"], m["buffer/filter_cap_hits"]) == (2, 2, 0)
    # off: the same groups are counted as without signal, and trained
    s = make_state(tmp_path, max_staleness=0)
    g = s.lease("w", 2, now=0.0)
    answer(s, g)
    assert len(s.ready) == 2 and s.counters["no_signal_groups"] == 1 and s.counters["filtered"] == 0


def test_cap_lets_groups_through_until_the_version_moves(tmp_path, caplog):
    # max_rounds 1 x 2 per step = 2 filtered per version, every group constant, 4 live at version 0:
    # groups 0, 1 filtered, 2, 3 kept (the cap, said once); at version 1 filtering starts again.
    s = make_state(tmp_path, max_staleness=1, dynamic_filtering=True, dynamic_filtering_max_rounds=1)
    everything = lambda gid: True  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="buffer"):
        answer(s, s.lease("w", 4, now=0.0), everything)
    assert s.dropped == {0: ("filtered", 0), 1: ("filtered", 0)}
    assert (s.counters["filter_cap_hits"], s.counters["unfiltered_past_cap"]) == (1, 2)
    warned = [r.getMessage() for r in caplog.records if "dynamic_filtering_max_rounds=1" in r.getMessage()]
    assert len(warned) == 1 and "version 0" in warned[0]
    frames, _ = s.batch(0, 0, 1)
    assert frames == [b"2/0", b"2/1", b"3/0", b"3/1"]  # training still gets its batch
    s.set_version(1)
    answer(s, s.lease("w", 2, now=0.0, version=1), everything, version=1)
    assert s.counters["filtered"] == 4 and s.metrics()["buffer/filtered_this_version"] == 2


def test_end_of_data_with_filtered_groups_answers_done(tmp_path):
    # 3 prompts, 2 per step: groups 0 and 2 constant -> filtered; only group 1 is left for step 0
    s = make_state(tmp_path, n_prompts=3, max_staleness=1, dynamic_filtering=True)
    answer(s, s.lease("w", 4, now=0.0))
    assert s.lease("w", 1, now=0.0).done
    w = s.batch(0, 0, 1)
    assert w.done and "1 of 2 groups left (2 filtered by dynamic sampling)" in w.reason


def test_filtered_groups_stay_filtered_through_restore_and_resume(tmp_path):
    # Filtered at version 1 (after the resume point 0): final all the same, never issued again;
    # the counts come back from the drop records even though no counters record was written.
    store = StateStore(str(tmp_path / "state"))
    store.open()
    s = make_state(tmp_path, store=store, max_staleness=1, dynamic_filtering=True)
    s.set_version(1)
    answer(s, s.lease("w", 6, now=0.0, version=1), version=1)  # 0..5: 0, 2, 4 filtered
    store.close()
    saved = StateStore(str(tmp_path / "state")).load()
    assert saved.counters == {} and saved.dropped == {0: ("filtered", 1), 2: ("filtered", 1), 4: ("filtered", 1)}
    s2 = make_state(tmp_path, max_staleness=1, dynamic_filtering=True)
    s2.restore(saved, {})
    assert s2.counters["filtered"] == 3 and s2.filtered_now == 3
    s2.resume(0, set())
    assert sorted(s2.requeue) == [1, 3, 5] and s2.k_live == 3  # version-1 tokens: issued again; filtered: not


# ---- a live buffer ----------------------------------------------------------------------------


def generate(c, step: int, constant) -> list[int]:
    """Lease and answer (as generator and scorer) until admission says wait; the ids leased."""
    leased = []
    while isinstance(g := c.lease("gen", 8, version=step), LeaseGrant):
        c.submit_scored([scored(x.group_id, i, g.lease_id, step, 1.0 if constant(x.group_id) else float(i))
                         for x in g.groups for i in range(g.n_samples)])
        leased += [x.group_id for x in g.groups]
    return leased


def train(c, step: int, ledger: Ledger) -> list[int]:
    """Fetch step `step` as the learner would and write its ledger line; the groups, checked informative."""
    batch = c.get_batch(step, timeout_s=10)
    rewards: dict[int, list[float]] = {}
    for s in batch.scored:
        rewards.setdefault(s.rollout.group_id, []).append(s.reward)
    assert len(rewards) == 4 and all(len(set(r)) > 1 for r in rewards.values()), rewards
    assert batch.stats["staleness_max"] == 0  # the replacements' extra leases kept within max_staleness 0
    ledger.append(step, list(rewards))
    c.set_version(step + 1)
    return list(rewards)


def test_live_buffer_filters_half_the_groups_survives_kill_9_and_audits(tmp_path):
    # 4 per step, synchronous, even group ids constant. Steps 0..2 each take 8 groups: 4 trained, 4
    # filtered. Step 3 is half done (24, 26 filtered; 25, 27 queued) when the buffer is killed.
    half = lambda gid: gid % 2 == 0  # noqa: E731
    cfg = dict(prompts_per_step=4, n_samples_per_prompt=2, max_staleness=0, dynamic_filtering="true",
               state_dir=str(tmp_path / "state"))
    run_dir = tmp_path / "run"
    ledger = Ledger(run_dir)
    ledger.start(0)
    b = start_buffer(tmp_path, n_prompts=64, **cfg)
    with b.client() as c:
        for step in range(3):
            generate(c, step, half)
            assert sorted(train(c, step, ledger)) == list(range(8 * step + 1, 8 * step + 8, 2))
        g = c.lease("gen", 4, version=3)
        assert [x.group_id for x in g.groups] == [24, 25, 26, 27]
        c.submit_scored([scored(x.group_id, i, g.lease_id, 3, 1.0 if half(x.group_id) else float(i))
                         for x in g.groups for i in range(2)])
        before = c.metrics()
    assert (before["buffer/filtered"], before["buffer/filtered_this_version"]) == (14, 2)
    assert before["buffer/queued_groups"] == 2 and before["buffer/filter_pass_rate"] == 14 / 28
    b.proc.kill()
    b.proc.wait()

    b = start_buffer(tmp_path, extra=("--resume",), **cfg)
    try:
        with b.client() as c:
            m = c.metrics()
            # the drops after the last counters record (step 2's) come back from their records
            assert (m["buffer/filtered"], m["buffer/filtered_this_version"]) == (14, 2)
            assert m["buffer/queued_groups"] == 2 and m["buffer/issued_groups"] == 28
            c.resume(3, ledger.trained())
            leased = generate(c, 3, half)
            assert leased == [28, 29, 30, 31]  # nothing trained, filtered or queued is issued again
            m = c.metrics()  # the cap's count of version 3 went on from the 2 before the kill
            assert (m["buffer/filtered"], m["buffer/filtered_this_version"], m["buffer/filter_cap_hits"]) == (16, 4, 0)
            assert sorted(train(c, 3, ledger)) == [25, 27, 29, 31]
    finally:
        assert b.stop() == 0
    ledger.close()
    report = audit(run_dir, tmp_path / "state")
    assert report["groups_trained"] == 16 and report["groups_filtered"] == 16
    assert report["groups_dropped"] == {"filtered": 16}
    assert (report["groups_lost"], report["groups_trained_twice"], report["groups_in_flight"]) == (0, 0, 0)


def test_live_buffer_cap_on_an_all_constant_task(tmp_path):
    # 2 per step, max_rounds 1: per step 2 groups filtered, then 2 (constant) pass; steps go on
    b = start_buffer(tmp_path, n_prompts=40, prompts_per_step=2, n_samples_per_prompt=2, max_staleness=0,
                     dynamic_filtering="true", dynamic_filtering_max_rounds=1)
    try:
        with b.client() as c:
            for step in range(2):
                if step:
                    c.set_version(step)
                assert generate(c, step, lambda gid: True) == list(range(4 * step, 4 * step + 4))
                assert [s.rollout.group_id for s in c.get_batch(step, timeout_s=10).scored] == [
                    4 * step + 2, 4 * step + 2, 4 * step + 3, 4 * step + 3]
            m = c.metrics()
    finally:
        assert b.stop() == 0
    assert (m["buffer/filtered"], m["buffer/filter_cap_hits"], m["buffer/unfiltered_past_cap"]) == (4, 2, 4)
    assert b.log.read_text().count("raise buffer.dynamic_filtering_max_rounds") == 2  # once per version
