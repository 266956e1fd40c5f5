"""OpenRLHF's reward files and remote reward servers in Conveyor's scorer.

Unit tests of the reply reader, OpenRLHF's texts, the answer helpers, the buffer's filter score and the
learner's extra-log means (two gloo ranks); then real processes: reward files in the scorer's worker
process (a tensor, a dict with scores and extra_logs, a math file importing `openrlhf.utils`), a reward
server process behind two URLs sharing a message, a URL that is down; and one short `launch.local` run
whose reward file's `scores` drive dynamic filtering and whose `extra_logs` reach metrics.jsonl.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import pytest

from actors.answers import extract_boxed_answer, grade_answer
from actors.config import ScorerConfig
from actors.rewards import openrlhf_texts, read_reply
from actors.scorer import Scorer
from buffer.messages import ScoredRollout, encode_item
from buffer.service import scored_meta
from launch.ports import free_port_block
from learner.batching import score_stats
from tests.helpers.buffer import make_state
from tests.helpers.procs import ROOT, subprocess_env
from tests.helpers.reward_server import start_reward_server
from tests.helpers.scoring import make_rollout, roundtrip

# ---- the reply reader -------------------------------------------------------------------------


def test_read_reply_takes_a_list_or_openrlhfs_dict():
    assert read_reply([1, 0.5], 2, "f") == [(1.0, "", None, None), (0.5, "", None, None)]
    # scores per sample; an extra log per sample, one number for all, a list of one for all; a list
    # of the wrong length is left out; a non-finite entry is left out for its sample only
    out = read_reply({"rewards": [1.0, 0.0], "scores": [0.25, 0.75],
                      "extra_logs": {"a": [3, 4], "b": 2.0, "c": [5], "d": [1, 2, 3], "e": [float("nan"), 1]}}, 2, "f")
    assert [s.value for s in out] == [1.0, 0.0] and [s.filter_score for s in out] == [0.25, 0.75]
    assert [s.extra for s in out] == [{"a": 3.0, "b": 2.0, "c": 5.0}, {"a": 4.0, "b": 2.0, "c": 5.0, "e": 1.0}]


def test_read_reply_fails_samples_on_bad_rewards_or_scores():
    assert all("without `rewards`" in s.error for s in read_reply({"scores": [1.0]}, 1, "f"))
    out = read_reply({"rewards": [1.0, 2.0], "scores": [1.0, float("inf")]}, 2, "f")
    assert out[0] == (1.0, "", 1.0, None) and out[1].value is None and "non-finite" in out[1].error
    assert all(s.value is None and "3 rewards for 2" in s.error for s in read_reply({"rewards": [1, 2, 3]}, 2, "f"))


def test_openrlhf_texts_with_and_without_the_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    r = make_rollout("1+2=", "3", "3", tokenizer=tok)  # completion ids end with the end token
    assert openrlhf_texts([r]) == (["1+2=3"], ["1+2="])
    assert openrlhf_texts([r], tok) == ([f"1+2=3{tok.eos_token}"], ["1+2="])  # special tokens kept, as OpenRLHF


def test_answer_helpers():
    assert extract_boxed_answer(r"so \boxed{\frac{1}{2}} or \boxed{x^{2}}") == "x^{2}"  # the last, braces nested
    assert extract_boxed_answer("no box") is None and extract_boxed_answer(r"\boxed{cut") is None
    same = [("42", "42"), (r"\frac{1}{2}", "0.5"), ("1/2", r"\dfrac{1}{2}"), ("x=5", "5"), ("1,000", "1000"),
            (r"\sqrt{2}/2", r"\frac{\sqrt{2}}{2}"), ("(1,2)", "(1, 2)"), ("2x+2", "2(x+1)"), (r"5\text{ cm}", "5"),
            (r"50\%", "50"), ("3.0", "3")]
    different = [("41", "42"), ("(1,2)", "[1,2]"), ("(1,2)", "(1,2,3)"), (None, "1"), ("1", None), ("x", "y")]
    assert all(grade_answer(a, b) for a, b in same), [(a, b) for a, b in same if not grade_answer(a, b)]
    assert not any(grade_answer(a, b) for a, b in different)


# ---- the buffer's filter score and the learner's extra logs ----------------------------------


def test_scored_meta_reads_the_filter_score():
    r = make_rollout("q", "a", "x")
    meta = scored_meta(encode_item(ScoredRollout(r, reward=1.0, metadata={"filter_score": 0.5})), "x")
    assert meta.filter_score == 0.5 and meta.reward == 1.0
    for bad in ({}, {"filter_score": "high"}, {"filter_score": True}, {"filter_score": math.inf}):
        assert scored_meta(encode_item(ScoredRollout(r, reward=1.0, metadata=bad)), "x").filter_score is None


def test_dynamic_sampling_judges_the_filter_score_when_there_is_one(tmp_path):
    # group 0: rewards 0, 1 (a signal) but filter scores 1, 1 (none): filtered. Group 1: rewards 1, 1
    # but scores 0, 1: kept. Group 2: rewards 1, 1 and no scores: filtered by its rewards, as before.
    s = make_state(tmp_path, max_staleness=0, dynamic_filtering=True, prompts_per_step=3)
    g = s.lease("w", 3, now=0.0)
    plan = {0: ([0.0, 1.0], [1.0, 1.0]), 1: ([1.0, 1.0], [0.0, 1.0]), 2: ([1.0, 1.0], [None, None])}
    outcomes = {gid: [s.add_sample(gid, i, g.lease_id, False, 0, plan[gid][0][i], b"f", filter_score=plan[gid][1][i])
                      for i in range(2)][-1] for gid in (0, 1, 2)}
    assert outcomes == {0: "filtered", 1: "complete", 2: "filtered"}
    assert [x.reward for x in s.ready[0].samples] == [1.0, 1.0]  # the reward itself is what is trained on


def test_score_stats_means_the_extra_logs_over_the_samples_that_carry_them():
    from buffer.messages import Batch

    r = make_rollout("q", "a", "x")
    batch = Batch(0, 0, 1, [ScoredRollout(r, reward=1.0, scores={"reward_fn": 1.0}, metadata={"extra/len": 2.0}),
                            ScoredRollout(r, reward=0.0, scores={"reward_fn": 0.0}, metadata={"extra/len": 4.0,
                                                                                               "extra/x": 1.0}),
                            ScoredRollout(r, reward=0.0, scores={"reward_fn": 0.0}, metadata={"filter_score": 3.0})])
    # reward_fn: (1 + 0 + 0) / 3; len: (2 + 4) / 2; x: 1 / 1; the filter score is not logged
    assert score_stats(batch) == {"reward/reward_fn": 1 / 3, "reward/extra/len": 3.0, "reward/extra/x": 1.0}


def _reduce_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from learner.metrics import reduce_across_ranks

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    metrics = [{"loss/policy": 1.0, "reward/extra/a": 2.0}, {"loss/policy": 3.0, "reward/extra/a": 4.0,
                                                              "reward/extra/b": 5.0}][rank]
    first = reduce_across_ranks(metrics, "cpu")
    second = reduce_across_ranks({"loss/policy": float(rank)}, "cpu")  # no rank has extra keys: none gathered
    dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            json.dump([first, second], f)


def test_reduce_across_ranks_takes_extra_keys_some_ranks_lack(tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "reduced.json"
    mp.spawn(_reduce_rank, args=(free_port_block(1), str(out)), nprocs=2, join=True)
    first, second = json.loads(out.read_text())
    # a: mean of both ranks; b: only rank 1 has it
    assert first == {"loss/policy": 2.0, "reward/extra/a": 3.0, "reward/extra/b": 5.0}
    assert second == {"loss/policy": 0.5}


# ---- reward files in the scorer's worker process -----------------------------------------------

TENSOR_FILE = """
import torch

def reward_func(queries, prompts, labels):
    return torch.tensor([float(q.endswith(label)) for q, label in zip(queries, labels)])
"""
DICT_FILE = """
import torch

def reward_func(queries, prompts, labels, **kwargs):
    n_chars = torch.tensor([float(len(q) - len(p)) for q, p in zip(queries, prompts)])  # the completion's
    return {"rewards": n_chars, "scores": n_chars / 10,
            "extra_logs": {"prompt_len": torch.tensor([len(p) for p in prompts]), "batch_mean": n_chars.mean().item()}}
"""
MATH_FILE = """
import torch
from openrlhf.utils import extract_boxed_answer, grade_answer

def reward_func(queries, prompts, labels):
    answers = [extract_boxed_answer(q[len(p):]) for q, p in zip(queries, prompts)]
    rewards = torch.tensor([float(grade_answer(a, label)) for a, label in zip(answers, labels)])
    return {"rewards": rewards, "scores": rewards,
            "extra_logs": {"boxed": torch.tensor([float(a is not None) for a in answers])}}
"""
BOTH_FILE = """
def reward_fn(prompts, completions, labels):
    return [1.0] * len(prompts)

def reward_func(queries, prompts, labels):
    return [2.0] * len(prompts)
"""


def score_with(tmp_path, source: str, rollouts, **cfg):
    path = tmp_path / "reward_func.py"
    path.write_text(source)
    scorer = Scorer(ScorerConfig(kinds=["reward_fn"], reward_fn=str(path), **cfg))
    try:
        return scorer.reward_fn.signature, roundtrip(scorer.score(rollouts))
    finally:
        scorer.close()


def test_openrlhf_reward_file_returning_a_tensor(tmp_path):
    signature, out = score_with(tmp_path, TENSOR_FILE, [make_rollout("1+1=", "2", "2"), make_rollout("1+1=", "3", "2")])
    assert signature == "openrlhf"
    assert [s.reward for s in out] == [1.0, 0.0] and [s.metadata for s in out] == [{}, {}]


def test_openrlhf_reward_file_returning_scores_and_extra_logs(tmp_path):
    _, out = score_with(tmp_path, DICT_FILE, [make_rollout("ab", "xyz", None), make_rollout("abcd", "x", None)])
    # rewards 3 and 1 (completion lengths), scores a tenth of them, prompt_len per sample, batch_mean (3+1)/2 for all
    assert [s.reward for s in out] == [3.0, 1.0] and [s.scores for s in out] == [{"reward_fn": 3.0}, {"reward_fn": 1.0}]
    assert [s.metadata for s in out] == [
        {"filter_score": pytest.approx(0.3), "extra/prompt_len": 2.0, "extra/batch_mean": 2.0},
        {"filter_score": pytest.approx(0.1), "extra/prompt_len": 4.0, "extra/batch_mean": 2.0}]


def test_math_reward_file_imports_openrlhf_utils_without_openrlhf(tmp_path):
    assert "openrlhf" not in sys.modules
    rollouts = [make_rollout("1/2+0=", r"so \boxed{\frac{1}{2}}", "0.5"), make_rollout("1+1=", r"\boxed{3}", "2"),
                make_rollout("1+1=", "2", "2"), make_rollout("(1,2)?", r"\boxed{(1, 2)}", "(1,2)")]
    _, out = score_with(tmp_path, MATH_FILE, rollouts)
    assert [s.reward for s in out] == [1.0, 0.0, 0.0, 1.0]  # right, wrong, not boxed, a tuple
    assert [s.metadata["extra/boxed"] for s in out] == [1.0, 1.0, 0.0, 1.0]
    assert [s.metadata["filter_score"] for s in out] == [1.0, 0.0, 0.0, 1.0]


def test_conveyors_reward_fn_wins_when_a_file_defines_both(tmp_path):
    signature, out = score_with(tmp_path, BOTH_FILE, [make_rollout("q", "a", None)])
    assert signature == "conveyor" and out[0].reward == 1.0


def test_openrlhf_queries_are_decoded_with_the_policys_tokenizer(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    source = "def reward_func(queries, prompts, labels):\n    return [float(q.endswith('</s>')) for q in queries]\n"
    rollouts = [make_rollout("1+1=", "2", "2", tokenizer=tok)]
    assert score_with(tmp_path, source, rollouts)[1][0].reward == 0.0  # the completion's text has no end token
    assert score_with(tmp_path, source, rollouts, tokenizer=str(tiny_model_dir))[1][0].reward == 1.0


# ---- a remote reward server in OpenRLHF's protocol ----------------------------------------------


@pytest.fixture(scope="module")
def reward_server(tmp_path_factory):
    proc, ports = start_reward_server(tmp_path_factory.mktemp("reward_server"), n_ports=2)
    yield ports
    proc.kill()
    proc.wait()


def stats(port: int) -> dict:
    import httpx

    return httpx.get(f"http://127.0.0.1:{port}/stats").json()


def test_two_urls_share_a_message(reward_server):
    a, b = reward_server
    cfg = ScorerConfig(kinds=["remote"], remote_url=f"http://127.0.0.1:{a}/get_reward,http://127.0.0.1:{b}/get_reward",
                       remote_protocol="openrlhf", remote_backoff_s=0.01)
    assert len(cfg.remote_urls) == 2
    scorer = Scorer(cfg)
    try:
        rollouts = [make_rollout("1+1=", c, "2", sample_index=i) for i, c in enumerate(["2", "3", "22", "2"])]
        before = stats(a).get("/get_reward", 0)
        out = roundtrip(scorer.score(rollouts))
        # shards [0, 1] -> a, [2, 3] -> b; reward: the query ends with the label; score: len(query) % 2
        assert [s.metadata["extra/port"] for s in out] == [a, a, b, b]
        assert [s.reward for s in out] == [1.0, 0.0, 1.0, 1.0]
        assert [s.metadata["filter_score"] for s in out] == [1.0, 1.0, 0.0, 1.0]
        assert [s.metadata["extra/query_len"] for s in out] == [5.0, 5.0, 6.0, 5.0]
        assert stats(a)["/get_reward"] - before == 2  # one request per URL (the counts cover both ports)
        # the next message starts at the next URL: a one-sample message goes to b
        assert roundtrip(scorer.score(rollouts[:1]))[0].metadata["extra/port"] == b
    finally:
        scorer.close()


def test_a_url_that_is_down_fails_only_its_shard(reward_server):
    live, dead = reward_server[0], free_port_block(1)
    cfg = ScorerConfig(kinds=["remote"], remote_url=[f"http://127.0.0.1:{live}/get_reward",
                                                     f"http://127.0.0.1:{dead}/get_reward"],
                       remote_protocol="openrlhf", remote_retries=2, remote_backoff_s=0.01, remote_timeout_s=5)
    scorer = Scorer(cfg)
    try:
        out = scorer.score([make_rollout("1+1=", "2", "2", sample_index=i) for i in range(4)])
    finally:
        scorer.close()
    assert [s.failed for s in out] == [False, False, True, True]
    assert all(f"127.0.0.1:{dead}" in s.error and "failed after 2 attempt(s)" in s.error and "unreachable" in s.error
               for s in out[2:]), out[2].error


def test_a_refused_request_is_not_retried(reward_server):
    port = reward_server[0]
    scorer = Scorer(ScorerConfig(kinds=["remote"], remote_url=f"http://127.0.0.1:{port}/bad", remote_retries=3,
                                 remote_protocol="openrlhf", remote_backoff_s=0.01))
    before = stats(port).get("/bad", 0)
    try:
        out = scorer.score([make_rollout("q", "a", None)])
    finally:
        scorer.close()
    assert out[0].failed and "HTTP 400" in out[0].error and "failed after 1 attempt(s)" in out[0].error
    assert stats(port)["/bad"] - before == 1


# ---- a whole run --------------------------------------------------------------------------------

RUN_REWARD = """
import zlib

import torch
from openrlhf.utils import extract_boxed_answer, grade_answer  # stood in: OpenRLHF is not installed

def reward_func(queries, prompts, labels):
    completions = [q[len(p):] for q, p in zip(queries, prompts)]
    rewards = torch.tensor([zlib.crc32(c.encode()) % 7 / 7 for c in completions])  # differ within a group
    judged = torch.tensor([int(label[-1]) % 2 == 1 for label in labels])  # odd last digit: the reward is judged
    scores = torch.where(judged, rewards, torch.zeros_like(rewards))  # even: one score for the group: filtered
    return {"rewards": rewards, "scores": scores,
            "extra_logs": {"completion_len": torch.tensor([float(len(c)) for c in completions]), "const": 2.0}}
"""


@pytest.mark.slow
def test_a_run_whose_reward_file_scores_drive_dynamic_filtering(tmp_path, tiny_model_dir):
    """The demo's async GRPO, 3 steps on the tiny model, scored by an OpenRLHF reward file whose rewards
    differ within a group but whose scores are one constant for the prompts with an even label: such
    groups are filtered (none is left accepted), though their rewards alone would pass; the
    file's extra_logs are in metrics.jsonl, and its scores in the accepted samples' metadata."""
    from demo.arithmetic import make_problems

    problems = make_problems(64, seed=5)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in problems))
    reward = tmp_path / "reward_func.py"
    reward.write_text(textwrap.dedent(RUN_REWARD))
    run_dir, steps = tmp_path / "run", 3
    proc = subprocess.run(
        [sys.executable, "-m", "launch.local", str(ROOT / "examples" / "demo.yaml"), "--run.run_dir", str(run_dir),
         "--learner.model_path", str(tiny_model_dir), "--learner.total_steps", str(steps), "--learner.save_every", "0",
         "--buffer.prompts", str(prompts), "--buffer.prompts_per_step", "4", "--buffer.n_samples_per_prompt", "4",
         "--generator.groups_per_lease", "4", "--buffer.dynamic_filtering", "true", "--scorer.reward_fn", str(reward)],
        cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps))
    for r in rows:
        assert r["reward/extra/const"] == 2.0 and 0.0 <= r["reward/extra/completion_len"] <= 5.0, r
    assert rows[-1]["buffer/filtered"] > 0  # the even-label groups, whose rewards alone would have passed
    label_of = {p["prompt"]: p["label"] for p in problems}
    samples = [s for group in _stored_groups(run_dir / "buffer_state") for s in group]
    assert samples, "no group was left queued (the generators run a step ahead of the learner)"
    for s in samples:
        assert int(label_of[s.rollout.prompt][-1]) % 2 == 1  # kept: odd labels only
        assert s.metadata["filter_score"] == pytest.approx(s.reward, abs=1e-6)
        assert s.metadata["extra/const"] == 2.0


def _stored_groups(state_dir):
    """The scored rollouts of the groups the buffer had accepted and not served when the run ended (its
    state log keeps those for a resume)."""
    import msgpack

    from buffer.messages import decode_item
    from buffer.store import LOG_NAME

    with open(state_dir / LOG_NAME, "rb") as f:
        return [[decode_item(bytes(x), "scored") for x in rec[2]]
                for rec in msgpack.Unpacker(f, raw=False, strict_map_key=False) if rec[0] == "group"]
