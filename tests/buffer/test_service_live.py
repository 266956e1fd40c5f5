"""The replay buffer as a real process (`python -m launch.buffer`), driven with `BufferClient`.

A module-wide buffer serves the tests that do not depend on its history; the scenarios that need
a particular config (a short lease ttl, a given staleness, a state dir) start their own, which
takes a fraction of a second.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from buffer.client import BufferDone, BufferError, ResumeNeeded
from buffer.messages import Ack, BatchRequest, ScoredMsg, Wait, decode, encode
from buffer.store import StateStore
from launch.ports import free_port_block as free_base_port
from tests.helpers.buffer import answer, group_ids, scored, start_buffer, write_prompts

ROOT = Path(__file__).resolve().parents[2]


# ---- helpers ----------------------------------------------------------------------------------














# ---- the shared buffer ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def buffer(tmp_path_factory):
    b = start_buffer(tmp_path_factory.mktemp("shared"), n_prompts=200, prompts_per_step=4,
                     n_samples_per_prompt=2, max_staleness=1)
    yield b
    assert b.stop() == 0


def test_ready_file_names_the_endpoints(buffer):
    p = buffer.port
    assert buffer.ready["role"] == "buffer" and buffer.ready["pid"] == buffer.proc.pid
    assert buffer.ready["control"] == f"tcp://127.0.0.1:{p}"
    assert buffer.ready["ingest"] == f"tcp://127.0.0.1:{p + 1}"
    assert buffer.ready["relay_in"] == f"tcp://127.0.0.1:{p + 2}"
    assert buffer.ready["relay_out"] == f"tcp://127.0.0.1:{p + 3}"


def test_metrics_report_every_counter(buffer):
    with buffer.client() as c:
        m = c.metrics()
    for key in ("queued_groups", "leased_groups", "accepted_groups", "dropped_stale", "failed_groups", "late",
                "malformed", "version", "staleness_mean", "reissued", "filtered", "filter_cap_hits",
                "filter_pass_rate", "no_signal_groups"):
        assert f"buffer/{key}" in m, key
    assert m["buffer/total_groups"] == 200


def test_bad_requests_get_errors_naming_the_field(buffer):
    with buffer.client() as c:
        before = c.metrics()["buffer/malformed"]
        with pytest.raises(BufferError, match="batch_request.rank"):
            c.request(BatchRequest(0, rank=2, world_size=2))
        with pytest.raises(BufferError, match="batch_request.world_size"):
            c.request(BatchRequest(0, rank=0, world_size=3))  # 4 per step over 3 ranks
        with pytest.raises(BufferError, match="envelope.type"):
            c.request(Ack(1))  # a reply sent as a request
        with pytest.raises(BufferError, match="lease_renew.lease_id"):
            c.renew(123456)
        with pytest.raises(BufferError, match="sample_index"):
            c.submit_scored([scored(0, 5, 1)])  # 2 samples per prompt: index 5 cannot be
        # raw frames: garbage, a missing delimiter, a bad item in a scored message
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{buffer.port}")
        bad_item = encode(ScoredMsg([scored(0, 0, 1)]))
        bad_item[1] = bad_item[1][:-3]
        for frames, field in (([b"", b"\xc1\xc1"], "envelope"), ([encode(Ack(1))[0]], "message"),
                              ([b"", *bad_item], "scored[0]")):
            dealer.send_multipart(frames)
            assert dealer.poll(5000)
            reply = decode(dealer.recv_multipart()[1:])
            assert type(reply).__name__ == "Error" and reply.field == field
        dealer.close()
        after = c.metrics()
    assert after["buffer/malformed"] >= before + 4
    assert buffer.proc.poll() is None


def test_relay_forwards_rollouts_and_drops_malformed(buffer):
    with buffer.client() as gen, buffer.client() as scorer:
        assert scorer.pull_rollouts(timeout_s=0.2) == []  # connects the scorer side
        time.sleep(0.2)
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 1000)
        push.connect(f"tcp://127.0.0.1:{buffer.port + 2}")
        push.send_multipart([b"\xc1 not an envelope"])
        push.send_multipart(encode(ScoredMsg([scored(0, 0, 1)])))  # scored is not for the relay
        push.close()
        gen.push_rollouts([scored(7, i, 3).rollout for i in range(2)])
        got = scorer.pull_rollouts(timeout_s=5)
        assert [(r.group_id, r.sample_index) for r in got] == [(7, 0), (7, 1)]
        m = gen.metrics()
    assert m["buffer/malformed_relay"] >= 2 and m["buffer/relayed_rollouts"] >= 2


# ---- scenarios with their own buffer ----------------------------------------------------------


def test_leases_honour_admission(tmp_path):
    b = start_buffer(tmp_path, prompts_per_step=4, n_samples_per_prompt=2, max_staleness=1)
    try:
        with b.client() as c:
            # version 0, staleness 1, 4 per step: (0+1+1)*4 = 8 groups may be live
            g1 = c.lease("gen-0", max_groups=5)
            g2 = c.lease("gen-1", max_groups=5)
            assert [g.group_id for g in g1.groups] == [0, 1, 2, 3, 4]
            assert [g.group_id for g in g2.groups] == [5, 6, 7]
            w = c.lease("gen-0", max_groups=1)
            assert isinstance(w, Wait) and not w.done and "admission" in w.reason
            # a given-up group is dropped and no longer counts: one more admitted
            assert c.group_failed(g2.lease_id, 7, "prompt too long").accepted == 1
            assert [g.group_id for g in c.lease("gen-0", 5).groups] == [8]
            # the learner asks for step 1 (version 1): (1+1+1)*4 = 12 live; 8 live now
            answer(c, g1, [0, 1, 2, 3])
            assert len(c.get_batch(0).scored) == 8
            assert isinstance(c.request(BatchRequest(1)), Wait)  # the learner reaches step 1
            g4 = c.lease("gen-0", 10)
            assert [g.group_id for g in g4.groups] == [9, 10, 11, 12] and g4.version == 1
            m = c.metrics()
            assert (m["buffer/version"], m["buffer/live_groups"], m["buffer/admission_limit"]) == (1, 12, 12)
            assert m["buffer/failed_groups"] == 1
    finally:
        assert b.stop() == 0


def test_expired_lease_is_issued_again_and_its_late_results_refused(tmp_path):
    b = start_buffer(tmp_path, prompts_per_step=2, n_samples_per_prompt=2, max_staleness=2, lease_ttl_s=1.2)
    try:
        with b.client() as c:
            old = c.lease("slow-gen", 2)  # groups 0, 1
            assert c.submit_scored([scored(0, 0, old.lease_id)]).accepted == 1  # half of group 0
            kept = c.lease("busy-gen", 1)  # group 2, kept alive by renewing
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                c.renew(kept.lease_id)
                time.sleep(0.1)
            new = c.lease("other-gen", 3)
            # the expired groups come back first, same ids, under a new lease; then a fresh group
            assert [g.group_id for g in new.groups] == [0, 1, 3] and new.lease_id != old.lease_id
            assert [g.prompt for g in new.groups[:2]] == [g.prompt for g in old.groups]
            late = c.submit_scored([scored(0, 1, old.lease_id), scored(1, 0, old.lease_id)])
            assert (late.accepted, late.rejected) == (0, 2)
            answer(c, new, [0, 1])
            batch = c.get_batch(0, timeout_s=5)
            assert group_ids(batch) == [0, 1]
            assert {s.rollout.lease_id for s in batch.scored} == {new.lease_id}  # no sample of the old lease
            m = c.metrics()
            assert m["buffer/late"] == 2 and m["buffer/reissued"] == 2 and m["buffer/expired_leases"] == 1
            assert m["buffer/leased_groups"] == 2  # group 2 (renewed) and group 3
    finally:
        assert b.stop() == 0


def test_group_is_served_only_when_complete(tmp_path):
    b = start_buffer(tmp_path, prompts_per_step=1, n_samples_per_prompt=3, max_staleness=3)
    try:
        with b.client() as c:
            g = c.lease("gen", 2)
            c.push_scored([scored(0, 0, g.lease_id), scored(0, 2, g.lease_id)])  # 2 of 3, over ingest
            c.push_scored([scored(1, i, g.lease_id) for i in (2, 0, 1)])
            first = c.get_batch(0, timeout_s=5)
            assert group_ids(first) == [1]
            assert [s.rollout.sample_index for s in first.scored] == [0, 1, 2]  # in sample order
            with pytest.raises(TimeoutError):
                c.get_batch(1, timeout_s=0.3)  # group 0 is still missing sample 1
            dup = c.submit_scored([scored(0, 0, g.lease_id), scored(0, 1, g.lease_id)])
            assert (dup.accepted, dup.rejected) == (1, 1)  # sample 0 again is a duplicate
            second = c.get_batch(1, timeout_s=5)
            assert group_ids(second) == [0] and len(second.scored) == 3
            assert c.metrics()["buffer/duplicates"] == 1
    finally:
        assert b.stop() == 0


def test_stale_groups_are_dropped_not_served(tmp_path):
    b = start_buffer(tmp_path, prompts_per_step=2, n_samples_per_prompt=2, max_staleness=1)
    try:
        with b.client() as c:
            old = c.lease("gen", 4)  # groups 0..3 at version 0
            answer(c, old, [0, 1], version=0)
            # the learner is at step 3 already: tokens of version 0 are 3 versions old (> 1)
            c.set_version(3)
            answer(c, old, [2, 3], version=0)  # too old on arrival
            assert isinstance(c.lease("gen", 8), Wait)  # weights v0 could only give stale rollouts
            fresh = c.lease("gen", 8, version=3)
            assert fresh.version == 3
            answer(c, fresh, [g.group_id for g in fresh.groups[:2]])
            batch = c.get_batch(3, timeout_s=5)
            assert group_ids(batch) == [4, 5]  # never the stale 0..3
            assert batch.stats["staleness_max"] == 0
            m = c.metrics()
            assert m["buffer/dropped_stale"] == 4 and m["buffer/accepted_groups"] == 6
            assert m["buffer/staleness_mean"] == 0
    finally:
        assert b.stop() == 0


def test_two_ranks_get_disjoint_shares_that_cover_the_step(tmp_path):
    b = start_buffer(tmp_path, prompts_per_step=4, n_samples_per_prompt=2, max_staleness=1)
    try:
        with b.client() as rank0, b.client() as rank1, b.client() as gen:
            g = gen.lease("gen", 4)
            answer(gen, g)
            s0 = rank0.get_batch(0, rank=0, world_size=2, timeout_s=5)
            s1 = rank1.get_batch(0, rank=1, world_size=2, timeout_s=5)
            assert group_ids(s0) == [0, 1] and group_ids(s1) == [2, 3]  # whole groups, oldest first
            assert len(s0.scored) == len(s1.scored) == 4
            assert s0.stats["reward_mean"] == 0.5 and s1.stats["reward_mean"] == 2.5
            again = rank0.get_batch(0, rank=0, world_size=2)  # asked again: the same share
            assert [(s.rollout.group_id, s.rollout.sample_index) for s in again.scored] == \
                [(s.rollout.group_id, s.rollout.sample_index) for s in s0.scored]
            np.testing.assert_array_equal(again.scored[3].rollout.completion_ids, s0.scored[3].rollout.completion_ids)
            with pytest.raises(BufferError, match="world_size"):
                rank0.get_batch(0, rank=0, world_size=4)
            m = gen.metrics()
            assert m["buffer/served_groups"] == 4 and m["buffer/queued_groups"] == 0
    finally:
        assert b.stop() == 0


def test_failed_sample_drops_the_group_and_the_run_goes_on(tmp_path):
    b = start_buffer(tmp_path, n_prompts=6, prompts_per_step=2, n_samples_per_prompt=2, max_staleness=0)
    try:
        with b.client() as c:
            g = c.lease("gen", 5)
            assert [x.group_id for x in g.groups] == [0, 1]  # synchronous: one step's worth
            c.submit_scored([scored(0, 0, g.lease_id), scored(0, 1, g.lease_id, failed=True)])
            answer(c, g, [1])
            g2 = c.lease("gen", 5)
            assert [x.group_id for x in g2.groups] == [2]  # the dropped group's slot, a fresh prompt
            answer(c, g2)
            assert group_ids(c.get_batch(0, timeout_s=5)) == [1, 2]
            # and on to the end of the data
            assert isinstance(c.lease("gen", 2), Wait)  # 2 live at version 0
            c.request(BatchRequest(1))  # the learner reaches step 1: a step's worth more
            answer(c, c.lease("gen", 2, version=1))
            assert group_ids(c.get_batch(1, timeout_s=5)) == [3, 4]
            c.request(BatchRequest(2))
            last = c.lease("gen", 2, version=2)
            assert [x.group_id for x in last.groups] == [5]  # 6 prompts, 1 epoch
            answer(c, last)
            final = c.lease("gen", 2, version=2)
            assert isinstance(final, Wait) and final.done
            with pytest.raises(BufferDone):
                c.get_batch(2, timeout_s=5)  # group 5 alone cannot make a step of 2
            m = c.metrics()
            assert m["buffer/failed_groups"] == 1 and m["buffer/accepted_groups"] == 5
    finally:
        assert b.stop() == 0


def test_sigterm_writes_state_and_a_restart_resumes(tmp_path):
    state = tmp_path / "state"
    cfg = dict(prompts_per_step=2, n_samples_per_prompt=2, max_staleness=0, state_dir=str(state))
    b = start_buffer(tmp_path, n_prompts=10, **cfg)
    with b.client() as c:
        g = c.lease("gen", 2)  # groups 0, 1 (synchronous: 2 live)
        answer(c, g)
        assert group_ids(c.get_batch(0, timeout_s=5)) == [0, 1]
        c.set_version(1)  # the learner finished step 0
        g2 = c.lease("gen", 2, version=1)  # groups 2, 3
        assert [x.group_id for x in g2.groups] == [2, 3]
        answer(c, g2, [2])  # group 3 stays leased when the buffer stops
        kept = c.metrics()
    other = run_launcher("-m", "launch.buffer", "--buffer.prompts", str(tmp_path / "prompts.jsonl"),
                         "--buffer.port", str(free_base_port(4)), "--buffer.state_dir", str(state))
    assert other.returncode == 2 and "in use by another buffer" in other.stderr
    assert b.stop() == 0  # SIGTERM: state written, exit 0
    saved = StateStore.read(state / "buffer.log")  # what SIGTERM wrote
    assert sorted(saved.groups) == [2] and saved.open_groups == [3] and saved.version == 1
    assert saved.counters["accepted_groups"] == 3 and saved.bad_records == 0

    b2 = start_buffer(tmp_path, extra=("--resume",), **cfg)
    try:
        with b2.client() as c:
            m = c.metrics()
            assert m["buffer/queued_groups"] == 1 and m["buffer/issued_groups"] == 4
            assert m["buffer/accepted_groups"] == kept["buffer/accepted_groups"] == 3
            assert m["buffer/version"] == 1 and m["buffer/awaiting_resume"] == 1
            assert isinstance(c.lease("gen", 5), Wait)  # nothing leased before the learner's handshake
            with pytest.raises(ResumeNeeded):
                c.get_batch(1, timeout_s=5)
            c.resume(1, [0, 1])  # the learner resumes at step 1, whose lineage trained groups 0 and 1
            again = c.lease("gen", 5, version=1)
            assert [x.group_id for x in again.groups] == [3]  # the unanswered group, not a repeat of 0..2
            answer(c, again)
            batch = c.get_batch(1, timeout_s=5)
            assert group_ids(batch) == [2, 3]
            assert [s.reward for s in batch.scored] == [2.0, 2.0, 3.0, 3.0]  # group 2's bytes survived
            c.set_version(2)
            assert [x.group_id for x in c.lease("gen", 5, version=2).groups] == [4, 5]
    finally:
        assert b2.stop() == 0


# ---- the entry point --------------------------------------------------------------------------


def run_launcher(*args, timeout=20):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_help_is_fast_lists_the_config_and_imports_no_torch():
    t0 = time.monotonic()
    r = run_launcher("-X", "importtime", "-m", "launch.buffer", "--help")
    took = time.monotonic() - t0
    assert r.returncode == 0 and took < 2.0
    assert "--buffer.max_staleness" in r.stdout and "Versions a sample may lag" in r.stdout
    assert "--resume" in r.stdout
    imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines()}
    assert "torch" not in imported and "zmq" not in imported


def test_config_and_prompt_errors_exit_2_with_a_clear_message(tmp_path):
    r = run_launcher("-m", "launch.buffer", "--buffer.max_stalenes", "3")
    assert r.returncode == 2 and "did you mean 'max_staleness'" in r.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": "ok"}\n{"label": "no prompt"}\n')
    r = run_launcher("-m", "launch.buffer", "--buffer.prompts", str(bad), "--buffer.port", str(free_base_port(4)))
    assert r.returncode == 2 and f"{bad}:3" in r.stderr and "prompt" in r.stderr
    r = run_launcher("-m", "launch.buffer", "--buffer.prompts", str(write_prompts(tmp_path / "p.jsonl", 2)),
                     "--buffer.state_dir", str(tmp_path / "nothing-here"), "--resume")
    assert r.returncode == 2 and "no saved buffer state" in r.stderr


def test_state_folder_size_does_not_grow_with_the_run(tmp_path):
    # 4 groups of 2 rollouts (~300 tokens each) per step, lockstep; the log is compacted whenever it
    # has grown by 0.05 MB. The folder's largest size over steps 15..30 and over steps 285..300 (10x
    # further into the run) stay within 1.5x of each other: it follows what is in flight.
    state = tmp_path / "state"
    b = start_buffer(tmp_path, n_prompts=2000, prompts_per_step=4, n_samples_per_prompt=2, max_staleness=0,
                     state_dir=str(state), compact_mb=0.05, log_level="info",
                     log_interval_s=3600)  # (no summary's counters record: the log is what the requests wrote)

    def folder_bytes() -> int:
        return sum(p.stat().st_size for p in state.iterdir() if p.is_file())

    sizes = {}
    try:
        with b.client() as c:
            for step in range(300):
                g = c.lease("gen", 4, version=step)
                c.submit_scored([scored(x.group_id, i, g.lease_id, step, t=300) for x in g.groups for i in range(2)])
                c.get_batch(step, timeout_s=5)
                c.set_version(step + 1)
                # The buffer compacts at the end of the loop pass that answered set_version: one more
                # round trip, and that pass (and any compaction) is over. Without it, or with the
                # timed summary's records in the log, the size at a step was 62 KB or 94 KB by chance.
                c.metrics()
                sizes[step] = folder_bytes()
            m = c.metrics()
    finally:
        assert b.stop() == 0
    early = max(sizes[s] for s in range(15, 30))
    late = max(sizes[s] for s in range(285, 300))
    assert m["buffer/served_groups"] == 1200
    # The log is compacted every second or third step, by where the 0.05 MB threshold falls among a
    # step's records; a window's peak is then 62 KB or 94 KB (two or three steps of rollouts), in
    # either window, in about one run of six. 94/62 = 1.50: the bar is 1.6, and the size is also
    # held to the threshold's scale below; a log that grew with the run would be ~6 MB by the end.
    assert late <= 1.6 * early, (early, late)
    assert sizes[299] < 4 * 0.05e6  # and about the threshold, not 300 steps of rollouts (~6 MB)
    print(f"state folder: max {early} bytes over steps 15-30, {late} over steps 285-300")
