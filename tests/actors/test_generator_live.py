"""Generators as real processes between a real buffer and a real scorer.

buffer (launch.buffer) --lease--> generator (launch.generator) --relay--> scorer (launch.scorer)
--scored--> buffer; the test reads the accepted groups back with `get_batch(step=0)` (each test
sets prompts_per_step to the number of groups it expects accepted, so step 0 holds them all).
"""

from __future__ import annotations

import signal
import time
from collections import Counter

import numpy as np
import pytest

from buffer.client import BufferClient, BufferDone
from tests.helpers.buffer import start_buffer, started
from tests.helpers.procs import ARITHMETIC, start_role, stop, wait_exit

PROMPTS = [{"prompt": f"{a}+{b}=", "label": str(a + b)[::-1]} for a, b in
           [(12, 34), (56, 21), (40, 40), (99, 11), (23, 45), (70, 18)]]
LONG = {"prompt": "0123456789" * 6 + "1+2=", "label": "3"}  # 64 tokens






def check_rollouts(batch, n_samples: int, worker_id: str, tokenizer, expect_groups: int):
    """Whole groups of n samples, each rollout complete and self-consistent."""
    groups = Counter(s.rollout.group_id for s in batch.scored)
    assert len(groups) == expect_groups and set(groups.values()) == {n_samples}, groups
    labels = {p["prompt"]: p["label"] for p in PROMPTS + [LONG]}
    for s in batch.scored:
        r = s.rollout
        t = len(r.completion_ids)
        assert t >= 1 and len(r.behav_logprobs) == t and len(r.versions) == t
        assert np.all(r.versions == 0)  # no weight sync here: the initial weights, version 0
        assert np.all(np.isfinite(r.behav_logprobs)) and np.all(r.behav_logprobs <= 0)
        assert r.worker_id == worker_id and r.finish_reason in ("stop", "length")
        assert r.label == labels[r.prompt]
        assert r.completion == tokenizer.decode(list(r.completion_ids), skip_special_tokens=True)
        assert not s.failed and s.scores.keys() == {"reward_fn"}
    for g in groups:
        assert sorted(s.rollout.sample_index for s in batch.scored if s.rollout.group_id == g) == list(range(n_samples))


@pytest.mark.slow
def test_vllm_generator_end_to_end(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    from learner.modeling import completion_logprobs, load_causal_lm

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    buffer, port = started(start_buffer(tmp_path, rows=PROMPTS + [LONG], n_samples_per_prompt=3, prompts_per_step=7,
                                shuffle_seed="none", lease_ttl_s=30))
    scorer, scorer_log = start_role(tmp_path, "scorer", "scorer", port, reward_fn=ARITHMETIC, poll_s=0.2)
    gen, gen_log = start_role(tmp_path, "generator", "generator", port, model=tiny_model_dir, engine="vllm",
                              worker_id="gen-vllm", groups_per_lease=2, max_new_tokens=12, temperature=1.0,
                              prompt_max_len=32, long_prompt="truncate", log_every_s=1)
    client = BufferClient("127.0.0.1", port, timeout_s=10)
    try:
        # The generator exits by itself once the buffer says every group is answered.
        assert wait_exit(gen, gen_log, 150) == 0, gen_log.read_text()[-4000:]
        batch = client.get_batch(step=0, timeout_s=10)
        check_rollouts(batch, 3, "gen-vllm", tok, expect_groups=7)
        m = client.metrics()
        # leases honoured: 7 groups in leases of 2 -> 4 leases, none expired, every group accepted
        assert m["buffer/leases"] == 4 and m["buffer/expired_leases"] == 0, m
        assert m["buffer/accepted_groups"] == 7 and m["buffer/failed_groups"] == 0, m
        # the long prompt kept its last prompt_max_len tokens
        long_r = [s.rollout for s in batch.scored if s.rollout.prompt == LONG["prompt"]]
        assert all(list(r.prompt_ids) == tok.encode(LONG["prompt"])[-32:] for r in long_r)
        # behaviour log-probs as the learner computes them (temperature 1)
        rs = [s.rollout for s in batch.scored]
        ref = completion_logprobs(load_causal_lm(str(tiny_model_dir)), [r.prompt_ids for r in rs],
                                  [r.completion_ids for r in rs], temperature=1.0)
        gap = max(float(np.abs(r.behav_logprobs - e.numpy()).max()) for r, e in zip(rs, ref))
        assert gap < 1e-4, f"rollout behav_logprobs vs completion_logprobs: largest gap {gap:.3g}"
        log = gen_log.read_text()
        assert "buffer is done" in log and "truncated=1" in log, log[-3000:]
    finally:
        client.close()
        for p in (gen, scorer, buffer):
            stop(p)


@pytest.mark.slow
def test_transformers_generator_refuses_long_prompts(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    buffer, port = started(start_buffer(tmp_path, rows=PROMPTS + [LONG], n_samples_per_prompt=2, prompts_per_step=6,
                                shuffle_seed="none", lease_ttl_s=30))
    scorer, _ = start_role(tmp_path, "scorer", "scorer", port, reward_fn=ARITHMETIC, poll_s=0.2)
    gen, gen_log = start_role(tmp_path, "generator", "generator", port, model=tiny_model_dir,
                              engine="transformers", worker_id="gen-hf", groups_per_lease=4, max_new_tokens=12,
                              temperature=0.7, top_k=20, prompt_max_len=32, long_prompt="refuse")
    client = BufferClient("127.0.0.1", port, timeout_s=10)
    try:
        assert wait_exit(gen, gen_log, 90) == 0, gen_log.read_text()[-4000:]
        batch = client.get_batch(step=0, timeout_s=10)
        check_rollouts(batch, 2, "gen-hf", tok, expect_groups=6)
        assert LONG["prompt"] not in {s.rollout.prompt for s in batch.scored}
        m = client.metrics()
        assert m["buffer/failed_groups"] == 1 and m["buffer/accepted_groups"] == 6, m
        assert "refused=1" in gen_log.read_text()
    finally:
        client.close()
        for p in (gen, scorer, buffer):
            stop(p)


@pytest.mark.slow
def test_killed_generator_leases_are_reissued(tmp_path, tiny_model_dir):
    buffer, port = started(start_buffer(tmp_path, rows=PROMPTS, n_samples_per_prompt=2, prompts_per_step=6,
                                shuffle_seed="none", lease_ttl_s=2))
    scorer, _ = start_role(tmp_path, "scorer", "scorer", port, reward_fn=ARITHMETIC, poll_s=0.2)
    # A long batch (up to 400 tokens per sample) so that the kill lands while it is generated.
    doomed, doomed_log = start_role(tmp_path, "generator", "doomed", port, model=tiny_model_dir,
                                    engine="transformers", worker_id="doomed", groups_per_lease=3,
                                    max_new_tokens=400)
    client = BufferClient("127.0.0.1", port, timeout_s=10)
    survivor = None
    try:
        deadline = time.monotonic() + 60
        while "lease 1:" not in doomed_log.read_text():
            assert doomed.poll() is None and time.monotonic() < deadline, doomed_log.read_text()[-3000:]
            time.sleep(0.02)
        doomed.send_signal(signal.SIGKILL)
        doomed.wait()
        survivor, survivor_log = start_role(tmp_path, "generator", "survivor", port, model=tiny_model_dir,
                                            engine="transformers", worker_id="survivor", groups_per_lease=3,
                                            max_new_tokens=8)
        assert wait_exit(survivor, survivor_log, 90) == 0, survivor_log.read_text()[-4000:]
        batch = client.get_batch(step=0, timeout_s=10)
        # every prompt accepted exactly once, all from the survivor
        groups = Counter(s.rollout.group_id for s in batch.scored)
        assert groups == {g: 2 for g in range(6)}, groups
        assert {s.rollout.worker_id for s in batch.scored} == {"survivor"}
        m = client.metrics()
        assert m["buffer/expired_leases"] >= 1 and m["buffer/reissued"] == 3, m
        assert m["buffer/accepted_groups"] == 6 and m["buffer/duplicates"] == 0, m
        with pytest.raises(BufferDone):  # nothing beyond the 6 groups
            client.get_batch(step=1, timeout_s=5)
    finally:
        client.close()
        for p in (survivor, scorer, buffer):
            if p is not None:
                stop(p)


@pytest.mark.slow
def test_sigterm_finishes_the_batch_in_flight_then_exits(tmp_path, tiny_model_dir):
    # max_staleness 0 and 2 prompts per step: the first lease of 2 groups is all the buffer admits
    buffer, port = started(start_buffer(tmp_path, rows=PROMPTS, n_samples_per_prompt=2, prompts_per_step=2,
                                        max_staleness=0, shuffle_seed="none", lease_ttl_s=30))
    scorer, _ = start_role(tmp_path, "scorer", "scorer", port, reward_fn=ARITHMETIC, poll_s=0.2)
    gen, gen_log = start_role(tmp_path, "generator", "generator", port, model=tiny_model_dir,
                              engine="transformers", worker_id="gen-term", groups_per_lease=2, max_new_tokens=100)
    client = BufferClient("127.0.0.1", port, timeout_s=10)
    try:
        deadline = time.monotonic() + 60
        while "lease 1:" not in gen_log.read_text():
            assert gen.poll() is None and time.monotonic() < deadline, gen_log.read_text()[-3000:]
            time.sleep(0.02)
        gen.send_signal(signal.SIGTERM)  # while the batch is being generated
        assert wait_exit(gen, gen_log, 60) == 0, gen_log.read_text()[-3000:]
        log = gen_log.read_text()
        assert "SIGTERM: finishing the batch in flight" in log and "total:" in log, log[-3000:]
        batch = client.get_batch(step=0, timeout_s=20)  # the batch in flight was pushed and scored
        assert Counter(s.rollout.group_id for s in batch.scored) == {0: 2, 1: 2}
        assert client.metrics()["buffer/leases"] == 1  # no lease taken after the signal
    finally:
        client.close()
        for p in (gen, scorer, buffer):
            stop(p)
