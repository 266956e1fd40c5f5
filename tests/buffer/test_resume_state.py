"""The buffer's side of a resume (`BufferState.resume`) and its state log, driven without sockets.

Each test builds a history by hand (who was leased, scored, served and dropped at which version),
then resumes as a restarted learner would (its checkpoint step and the groups its ledger holds),
and checks against the outcome worked out in the comment: nothing the learner trained is served
again, everything else comes back (ready or issued again), nothing newer than the checkpoint is
ever served, and staleness is never negative.
"""

import msgpack
import pytest

from buffer.messages import Wait
from buffer.rules import describe_wait
from buffer.state import RequestError, Sample
from buffer.store import StateStore
from tests.helpers.buffer import complete, make_state


def run_steps(s, n_steps, now=0.0):
    """Lease, score and serve `n_steps` steps in lockstep; returns {step: group ids served}."""
    served = {}
    for step in range(n_steps):
        s.set_version(step)
        g = s.lease("gen", s.cfg.prompts_per_step, now=now, version=step)
        for x in g.groups:
            complete(s, g, x.group_id, version=step)
        frames, _ = s.batch(step, 0, 1)
        served[step] = sorted({int(f.split(b"/")[0]) for f in frames})
    return served


def restored(tmp_path, s, **kw):
    """A new state restored from `s`'s log, as a restarted buffer would be."""
    s.store.close()
    saved = StateStore(str(tmp_path / "state")).load()
    s2 = make_state(tmp_path, **kw)
    s2.restore(saved, {gid: [Sample(f, 0, 1.0, 0) for f in frames] for gid, frames in saved.groups.items()})
    return s2, saved


def test_resume_reissues_what_steps_after_the_checkpoint_served(tmp_path):
    # 2 groups per step, max_staleness 1. Steps 0..4 ran (groups 2s, 2s+1 in step s); the learner
    # crashed after step 4 and its last checkpoint is step 3: it redoes steps 3 and 4, so groups
    # 6..9 (served in steps 3, 4) must come back, and 0..5 (its ledger) never again.
    store = StateStore(str(tmp_path / "state"))
    store.open()
    s = make_state(tmp_path, store=store)
    served = run_steps(s, 5)
    assert served[3] == [6, 7] and served[4] == [8, 9]
    s.set_version(5)
    s2, _ = restored(tmp_path, s)
    assert s2.awaiting_resume and s2.version == 5
    with pytest.raises(RequestError) as e:
        s2.batch(3, 0, 1)
    assert e.value.field == "resume"
    moved = s2.resume(3, {0, 1, 2, 3, 4, 5})
    assert moved["reissued"] == 4 and s2.version == 3 and not s2.awaiting_resume
    g = s2.lease("gen", 10, now=0.0, version=3)
    assert [x.group_id for x in g.groups][:4] == [6, 7, 8, 9]  # the redone steps' groups, oldest first
    assert s2.counters["reissued_after_resume"] == 4 and s2.counters["resumes"] == 1


def test_groups_with_tokens_newer_than_the_checkpoint_are_not_served(tmp_path):
    # Version 4 (from a lineage that no longer exists after a resume at step 3) sampled group 0;
    # version 3 sampled group 1. Resumed at 3: group 1 stays ready, group 0 is issued again.
    s = make_state(tmp_path, prompts_per_step=1, max_staleness=2)
    s.set_version(4)
    g = s.lease("gen", 2, now=0.0, version=4)
    complete(s, g, 0, version=4)
    complete(s, g, 1, version=3)
    s.resume(3, set())
    assert [x.group_id for x in s.ready] == [1]
    assert list(s.requeue)[0] == 0
    frames, stats = s.batch(3, 0, 1)
    assert frames == [b"1/0", b"1/1"] and stats["staleness_min"] == 0  # 3 - 3, never negative


def test_a_stale_drop_at_a_version_after_the_checkpoint_is_undone(tmp_path):
    # max_staleness 0. Group 0 (version 0) dropped stale when the version moved to 2; the learner
    # resumes at step 0, where it is not stale: it is issued again. A failed group stays dropped.
    s = make_state(tmp_path, prompts_per_step=1, max_staleness=0)
    g = s.lease("gen", 1, now=0.0, version=0)
    complete(s, g, 0, version=0)
    s.set_version(1)
    assert s.dropped == {0: ("dropped_stale", 1)}
    g = s.lease("gen", 1, now=0.0, version=1)
    assert s.group_failed(g.lease_id, 1)
    s.resume(0, set())
    assert s.dropped == {1: ("failed_groups", 1)} and list(s.requeue) == [0]
    assert s.k_live == 1  # group 0 live again, group 1 dropped for good


def test_a_log_behind_the_learner_defers_to_the_ledger(tmp_path):
    # The buffer lost its last records (a machine crash without fsync): it knows groups 0..1 as
    # issued, but the learner's ledger says steps 0..1 trained 0..3. No trained group comes back,
    # and fresh ids start after the highest trained one.
    s = make_state(tmp_path)
    g = s.lease("gen", 2, now=0.0, version=0)
    s.resume(2, {0, 1, 2, 3})
    assert s.next_group == 4 and not s.requeue and not s.ready
    g = s.lease("gen", 2, now=0.0, version=2)
    assert [x.group_id for x in g.groups] == [4, 5]


def test_resume_at_the_current_point_is_a_no_op(tmp_path):
    # a fresh learner (step 0) and a fresh buffer: leases already granted stay valid
    s = make_state(tmp_path)
    g = s.lease("gen", 2, now=0.0, version=0)
    assert s.resume(0, set())["noop"] == 1
    complete(s, g, 0)
    assert [x.group_id for x in s.ready] == [0]


def test_leases_need_weights_within_the_staleness_window(tmp_path):
    s = make_state(tmp_path, max_staleness=1)
    s.set_version(3)
    assert isinstance(s.lease("gen", 1, now=0.0, version=1), Wait)  # 1 < 3 - 1: all would be stale
    assert isinstance(s.lease("gen", 1, now=0.0, version=4), Wait)  # newer than the learner
    assert s.counters["refused_old_weights"] == 1 and s.counters["refused_future_weights"] == 1
    assert s.lease("gen", 1, now=0.0, version=2).groups
    assert "older than max_staleness" in describe_wait(s.metrics(now=1.0))


def test_rollouts_from_a_future_version_are_refused(tmp_path):
    s = make_state(tmp_path)
    g = s.lease("gen", 1, now=0.0, version=0)
    assert s.add_sample(0, 0, g.lease_id, False, 0, 1.0, b"x", max_version=2) == "future"
    assert s.counters["future_rollouts"] == 1 and 0 in s.pending


def test_diagnosis_names_admission_and_silent_producers(tmp_path):
    s = make_state(tmp_path)  # 2 per step, staleness 1: 4 live at version 0
    s.lease("gen", 4, now=0.0, version=0)
    m = s.metrics(now=100.0)
    why = describe_wait(m)
    assert "admission limit reached at version 0 (4 live groups, limit 4)" in why
    assert "no generator has asked for a lease for 100s" in why
    assert "4 leased" in why and "no scored rollout has arrived yet" in why


def _history_log(tmp_path):
    store = StateStore(str(tmp_path / "state"))
    store.open()
    s = make_state(tmp_path, store=store)
    run_steps(s, 3)
    s.set_version(3)
    g = s.lease("gen", 2, now=0.0, version=3)
    complete(s, g, g.groups[0].group_id, version=3)
    assert s.group_failed(g.lease_id, g.groups[1].group_id)
    store.close()
    return store.path.read_bytes()


def test_a_log_cut_at_any_byte_restores_cleanly(tmp_path):
    data = _history_log(tmp_path)
    full = StateStore.read(tmp_path / "state" / "buffer.log")
    ends = []
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(data)
    for _ in unpacker:
        ends.append(unpacker.tell())
    cut_dir = tmp_path / "cut"
    cut_dir.mkdir()
    for n in range(len(data) + 1):
        (cut_dir / "buffer.log").write_bytes(data[:n])
        r = StateStore.read(cut_dir / "buffer.log")
        whole = sum(1 for e in ends if e <= n)  # records entirely inside the first n bytes
        assert r.records == whole and r.bad_records == 0, n
        assert r.next_group <= full.next_group and r.version <= full.version
        if n == len(data):
            assert (r.next_group, r.version, r.dropped, sorted(r.groups)) == (
                full.next_group, full.version, full.dropped, sorted(full.groups))
    # and loading a torn log (which rewrites it) gives a log that reads back the same
    (cut_dir / "buffer.log").write_bytes(data[: ends[-2] + 3])
    st = StateStore(str(cut_dir))
    first = st.load()
    again = StateStore.read(cut_dir / "buffer.log")
    assert (again.next_group, again.version, sorted(again.groups), again.open_groups, again.dropped) == (
        first.next_group, first.version, sorted(first.groups), first.open_groups, first.dropped)


def test_compaction_while_running_keeps_what_a_restart_needs(tmp_path):
    # a tiny compaction threshold: the log is rewritten many times during 40 steps, stays small,
    # and a restart from it sees the same state as the live buffer
    store = StateStore(str(tmp_path / "state"), fsync="batch", compact_bytes=200)
    store.open()
    s = make_state(tmp_path, n_prompts=200, store=store)
    sizes = []
    for step in range(40):
        s.set_version(step)
        g = s.lease("gen", 2, now=0.0, version=step)
        for x in g.groups:
            complete(s, g, x.group_id, version=step)
        s.batch(step, 0, 1)
        store.flush()
        store.maybe_compact(s)
        sizes.append(store.size)
    g = s.lease("gen", 2, now=0.0, version=39)  # two groups in flight at the end
    complete(s, g, g.groups[0].group_id, version=39)
    assert store.compactions >= 5
    assert max(sizes[20:]) <= 1.5 * max(sizes[:20])  # the log does not grow with the run
    store.close()
    r = StateStore.read(store.path)
    assert r.next_group == s.next_group and r.version == s.version
    assert sorted(r.groups) == [g.groups[0].group_id] and r.open_groups == [g.groups[1].group_id]


def test_a_group_record_is_written_from_its_frames_as_msgpack(tmp_path):
    # `StateStore.group` writes the record's header and the frames where they lie (writev, at most
    # IOV_MAX buffers a call); the bytes must be what msgpack makes of ["group", id, frames], for every
    # size class of msgpack's array and bin headers and for a group of more buffers than one call takes
    store = StateStore(str(tmp_path))
    store.open()
    want = b""
    for gid, sizes in ((0, []), (7, [0, 1, 255]), (2**40, [256, 65535, 65536] + [3] * 14), (9, [2] * 700)):
        frames = [bytes([k % 251]) * n for k, n in enumerate(sizes)]
        store.group(gid, [memoryview(f) for f in frames])
        want += msgpack.packb(["group", gid, frames], use_bin_type=True)
    store.close()
    assert (tmp_path / "buffer.log").read_bytes() == want and store.size == len(want)
    assert StateStore.read(tmp_path / "buffer.log").groups[9] == [bytes([k % 251]) * 2 for k in range(700)]


def test_a_full_disk_stops_the_log_and_everything_written_before_it_restores(tmp_path):
    # steps 0..2 run on a tmpfs, then the disk is filled to its last byte: a record that does not fit
    # raises OutOfDisk naming the log, and is cut off again (the log ends with the last whole record).
    # With the ballast gone, a restarted buffer restores every record written before the failure.
    from common.disk import OutOfDisk
    from tests.helpers.disk import fill, tmpfs

    with tmpfs(tmp_path / "disk", 4) as disk:
        store = StateStore(str(disk / "state"))
        store.open()
        s = make_state(tmp_path, store=store)
        run_steps(s, 3)
        s.set_version(3)
        g = s.lease("gen", 2, now=0.0, version=3)
        complete(s, g, g.groups[0].group_id, version=3)  # acknowledged: one group accepted, one in flight
        before = store.path.read_bytes()
        ballast = fill(disk)
        with pytest.raises(OutOfDisk) as e:
            for _ in range(100):  # (the log's last page may take a record or two)
                store.counters({f"c{i}": i for i in range(300)})
        assert e.value.path == str(store.path) and e.value.free == 0
        after = StateStore.read(store.path)
        assert after.bad_records == 0 and store.size == store.path.stat().st_size >= len(before)
        ballast.unlink()
        store.close()
        r = StateStore(str(disk / "state")).load()
        assert r.bad_records == 0 and r.version == 3
        assert g.groups[0].group_id in r.groups and g.groups[1].group_id in r.open_groups
        assert sorted(r.groups) == sorted(after.groups) and r.next_group == after.next_group >= 8


def test_a_rewrite_that_meets_a_full_disk_leaves_the_old_log(tmp_path):
    from common.disk import OutOfDisk
    from tests.helpers.disk import fill, tmpfs

    with tmpfs(tmp_path / "disk", 4) as disk:
        store = StateStore(str(disk / "state"))
        store.open()
        s = make_state(tmp_path, store=store)
        g = s.lease("gen", 2, now=0.0, version=0)
        for x in g.groups:  # two accepted groups of 128 KiB frames: a snapshot needs 512 KiB
            for i in range(s.cfg.n_samples_per_prompt):
                s.add_sample(x.group_id, i, g.lease_id, False, 0, 1.0, bytes(128 << 10))
        old = store.path.read_bytes()
        fill(disk, leave=200 << 10)
        with pytest.raises(OutOfDisk) as e:
            store.snapshot(s)
        assert e.value.path == str(store.path.with_suffix(".tmp"))
        assert store.path.read_bytes() == old and not store.path.with_suffix(".tmp").exists()
        assert sorted(StateStore.read(store.path).groups) == [x.group_id for x in g.groups]
        store.close()
