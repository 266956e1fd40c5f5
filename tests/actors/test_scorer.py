"""Scorers: reward function, reward model, remote reward, reference log-probs, and failures (a reward
function that raises, hangs past its timeout or kills its worker process).

Unit tests call `Scorer.score` directly; the last test runs `python -m launch.scorer` between a real
buffer and rollouts pushed by the test.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch

from actors.config import ScorerConfig
from actors.scorer import Scorer
from buffer.client import BufferClient
from buffer.messages import LOGPROB_DTYPE
from launch.ports import free_port_block
from tests.helpers.buffer import start_buffer, started
from tests.helpers.procs import ARITHMETIC, ROOT, stop, subprocess_env
from tests.helpers.scoring import make_rollout, roundtrip


def test_arithmetic_reward_fn():
    cfg = ScorerConfig(kinds=["reward_fn"], reward_fn=ARITHMETIC)
    rollouts = [
        make_rollout("12+34=", "64", "64"),  # exact: 1
        make_rollout("12+34=", "64\nmore text", "64"),  # up to the first newline: 1
        make_rollout("12+34=", "46", "64"),  # wrong: 0
        make_rollout("12+34=", "64", None),  # no label: 0
        make_rollout("12+34=", " 64 ", "64"),  # surrounding spaces ignored: 1
    ]
    out = roundtrip(Scorer(cfg).score(rollouts))
    assert [s.reward for s in out] == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert [s.scores for s in out] == [{"reward_fn": v} for v in (1.0, 1.0, 0.0, 0.0, 1.0)]
    assert not any(s.failed for s in out) and all(s.ref_logprobs is None for s in out)


def test_overlong_penalty_formula():
    # max_new_tokens 10, buffer 4: no penalty up to 10 - 4 = 6 tokens; 7 -> -(1/4) * 0.5 = -0.125,
    # 8 -> -0.25, 10 -> -0.5 (the factor), past the limit it stays at -0.5; buffer 0 is off.
    from actors.rewards import overlong_penalty

    assert [overlong_penalty(n, 10, 4, 0.5) for n in (0, 6, 7, 8, 10, 12)] == [0.0, 0.0, -0.125, -0.25, -0.5, -0.5]
    assert overlong_penalty(10, 10, 0, 1.0) == 0.0


def test_overlong_punishment_is_one_more_reward_component():
    # make_rollout adds an end token: "64" is 3 ids, "64 more" 8. max_new_tokens 8, buffer 4:
    # expected 4, so 3 ids -> 0 and 8 ids -> -min(4 / 4, 1) * 2 = -2.0, added to the reward once.
    cfg = ScorerConfig(kinds=["reward_fn"], reward_fn=ARITHMETIC, max_new_tokens=8, overlong_buffer_len=4,
                       overlong_penalty_factor=2.0)
    scorer = Scorer(cfg)
    try:
        out = roundtrip(scorer.score([make_rollout("12+34=", "64", "64"), make_rollout("12+34=", "64 more", "64")]))
    finally:
        scorer.close()
    assert [s.scores for s in out] == [{"reward_fn": 1.0, "overlong": 0.0}, {"reward_fn": 0.0, "overlong": -2.0}]
    assert [s.reward for s in out] == [1.0, -2.0]


BAD_FNS = {
    # raises for one sample only: the scorer retries one by one, so only that one fails
    "raises": "def reward_fn(p, c, l):\n    if any(x == 'boom' for x in c):\n        raise RuntimeError('kaboom')\n"
              "    return [1.0] * len(c)\n",
    "nan": "def reward_fn(p, c, l):\n    return [float('nan') if x == 'boom' else 2.0 for x in c]\n",
    "short": "def reward_fn(p, c, l):\n    return [1.0] * (len(c) - 1)\n",
    "strings": "def reward_fn(p, c, l):\n    return ['1' for x in c]\n",
}


@pytest.mark.parametrize("kind", sorted(BAD_FNS))
def test_bad_reward_fn_marks_samples_failed_and_scorer_keeps_going(tmp_path, kind):
    path = tmp_path / f"{kind}.py"
    path.write_text(BAD_FNS[kind])
    scorer = Scorer(ScorerConfig(kinds=["reward_fn"], reward_fn=str(path)))
    batch = [make_rollout("q", "ok", "x", sample_index=0), make_rollout("q", "boom", "x", sample_index=1),
             make_rollout("q", "ok", "x", sample_index=2)]
    out = roundtrip(scorer.score(batch))  # must not raise; failed samples still encode
    expect_failed = {"raises": [False, True, False], "nan": [False, True, False],
                     "short": [True, True, True], "strings": [True, True, True]}[kind]
    assert [s.failed for s in out] == expect_failed
    why = {"raises": "RuntimeError: kaboom", "nan": "non-finite", "short": "returned 2 rewards for 3 samples",
           "strings": "not a number"}[kind]
    for s in out:
        if s.failed:
            assert why in s.error and s.error.startswith("reward_fn:"), s.error
            assert "reward_fn" not in s.scores
        else:
            assert s.error == "" and s.reward == {"raises": 1.0, "nan": 2.0}[kind]
    assert scorer.failures["reward_fn"] == sum(expect_failed) == scorer.failed
    # the same scorer scores the next message normally when the function behaves
    again = scorer.score([make_rollout("q", "ok", "x")])
    assert again[0].failed is (kind in ("short", "strings"))  # those two fail on any input



def gone(pid: int, within_s: float = 5.0) -> bool:
    """Whether process `pid` has exited (a zombie counts: it runs nothing) within `within_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.05)
    return False


# sleeps "forever" on a completion "hang", raises on "boom", else reward = len(completion)
HANGS = ("import time\n"
         "def reward_fn(p, c, l):\n"
         "    if 'boom' in c:\n        raise RuntimeError('kaboom')\n"
         "    if 'hang' in c:\n        time.sleep(3600)\n"
         "    return [float(len(x)) for x in c]\n")


def test_hanging_reward_fn_times_out_and_a_fresh_worker_takes_the_next_call(tmp_path):
    path = tmp_path / "hangs.py"
    path.write_text(HANGS)
    scorer = Scorer(ScorerConfig(kinds=["reward_fn"], reward_fn=str(path), reward_fn_timeout_s=1.0))
    try:
        first_worker = scorer.reward_fn.proc.pid
        t0 = time.monotonic()
        out = scorer.score([make_rollout("q", "ok", None, sample_index=i) if i != 1 else
                            make_rollout("q", "hang", None, sample_index=1) for i in range(3)])
        took = time.monotonic() - t0
        assert took < 5.0, f"a 1 s timeout took {took:.1f}s"
        assert all(s.failed for s in out)  # the batch fails: no sample-by-sample retry after a timeout
        timed_out = "reward_fn: reward_fn did not return within 1s (worker killed)"
        assert all(s.error == timed_out for s in out), out[0].error
        assert scorer.timeouts == 1 and scorer.crashes == 0 and scorer.failures["reward_fn"] == 3
        assert gone(first_worker), "the timed-out worker is still running"

        again = scorer.score([make_rollout("q", "ab", None), make_rollout("q", "abc", None, sample_index=1)])
        assert [(s.failed, s.reward) for s in again] == [(False, 2.0), (False, 3.0)]
        assert scorer.reward_fn.proc.pid != first_worker

        # A raise sends the scorer sample by sample; the first timeout there ends the search, so the
        # samples after it fail with it untried (else each "hang" would cost another second).
        out = scorer.score([make_rollout("q", c, None, sample_index=i)
                            for i, c in enumerate(["boom", "hang", "hang", "ok"])])
        assert [s.error for s in out] == ["reward_fn: reward_fn raised RuntimeError: kaboom"] + [timed_out] * 3
        assert scorer.timeouts == 2
    finally:
        scorer.close()


@pytest.mark.parametrize("how,why", [("os._exit(3)", "reward_fn worker died (exit code 3)"),
                                     ("ctypes.string_at(0)", "reward_fn worker died (killed by signal 11")])
def test_reward_fn_worker_that_dies_fails_the_call_and_is_restarted(tmp_path, how, why):
    path = tmp_path / "dies.py"
    path.write_text(f"import ctypes, os\ndef reward_fn(p, c, l):\n    if 'die' in c:\n        {how}\n"
                    "    return [1.0] * len(c)\n")
    scorer = Scorer(ScorerConfig(kinds=["reward_fn"], reward_fn=str(path)))
    try:
        out = scorer.score([make_rollout("q", "ok", None), make_rollout("q", "die", None, sample_index=1)])
        assert all(s.failed and s.error.startswith(f"reward_fn: {why}") for s in out), out[0].error
        assert scorer.crashes == 1 and scorer.timeouts == 0
        again = scorer.score([make_rollout("q", "ok", None)])
        assert not again[0].failed and again[0].reward == 1.0
    finally:
        scorer.close()


def test_close_stops_the_worker_and_what_it_started(tmp_path):
    pid_file = tmp_path / "child.pid"
    path = tmp_path / "spawner.py"  # leaves a child process running, as a sandboxed code runner might
    path.write_text("import subprocess\n"
                    "def reward_fn(p, c, l):\n"
                    f"    open({str(pid_file)!r}, 'w').write(str(subprocess.Popen(['sleep', '600']).pid))\n"
                    "    return [1.0] * len(c)\n")
    scorer = Scorer(ScorerConfig(kinds=["reward_fn"], reward_fn=str(path)))
    worker = scorer.reward_fn.proc.pid
    assert scorer.score([make_rollout("q", "ok", None)])[0].reward == 1.0
    child = int(pid_file.read_text())
    assert not gone(child, within_s=0.2)
    scorer.close()
    assert gone(worker) and gone(child), "close() left a process behind"
    scorer.close()  # a second close is harmless


def test_reward_fn_file_errors_raise_at_start(tmp_path):
    with pytest.raises(FileNotFoundError, match="no_such.py"):
        Scorer(ScorerConfig(kinds=["reward_fn"], reward_fn=str(tmp_path / "no_such.py")))
    (tmp_path / "empty.py").write_text("x = 1\n")
    with pytest.raises(AttributeError, match=r"empty\.py.*defines no callable `reward_fn`"):
        Scorer(ScorerConfig(kinds=["reward_fn"], reward_fn=str(tmp_path / "empty.py")))
    (tmp_path / "broken.py").write_text("import no_such_module_here\n")
    with pytest.raises(ImportError, match=r"broken\.py.*ModuleNotFoundError"):
        Scorer(ScorerConfig(kinds=["reward_fn"], reward_fn=str(tmp_path / "broken.py")))

def test_reward_model_last_token_score_batched(tmp_path, tiny_model_dir):
    from transformers import AutoConfig, AutoTokenizer, LlamaForSequenceClassification

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.num_labels = 1
    torch.manual_seed(0)
    rm = LlamaForSequenceClassification(config).eval()
    rm_dir = tmp_path / "rm"
    rm.save_pretrained(rm_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.save_pretrained(rm_dir)

    scorer = Scorer(ScorerConfig(kinds=["reward_model"], reward_model=str(rm_dir), reward_model_weight=2.0,
                                 batch_size=3))
    texts = [("12+34=", "64"), ("hello", " world, a longer completion"), ("a", "b"), ("7*8=", "56"), ("x", "yz")]
    out = scorer.score([make_rollout(p, c, None, sample_index=i) for i, (p, c) in enumerate(texts)])
    # Reference: each text alone, unpadded; the score head's output at the last token.
    with torch.no_grad():
        alone = [rm(input_ids=torch.tensor([tok.encode(p + c)])).logits[0, 0].item() for p, c in texts]
    got = [s.scores["reward_model"] for s in out]
    assert np.allclose(got, alone, atol=1e-5), f"batched {got} vs one by one {alone}"
    assert len(set(np.round(got, 6))) == len(got)  # the texts are told apart
    assert [s.reward for s in out] == pytest.approx([2.0 * g for g in got])


class _RewardServer:
    """A local HTTP reward service: reward = len(completion), or a scripted failure."""

    def __init__(self):
        self.requests = 0
        self.fail_first = 0  # answer this many requests with HTTP 503
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                outer.requests += 1
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if outer.requests <= outer.fail_first:
                    self.send_response(503)
                    self.end_headers()
                    return
                data = json.dumps({"rewards": [float(len(c)) for c in body["completions"]]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_remote_reward_combined_with_reward_fn():
    server = _RewardServer()
    try:
        cfg = ScorerConfig(kinds=["reward_fn", "remote"], reward_fn=ARITHMETIC, remote_url=server.url,
                           remote_weight=0.5, remote_backoff_s=0.01)
        scorer = Scorer(cfg)
        out = scorer.score([make_rollout("1+1=", "2", "2"), make_rollout("1+1=", "three", "2")])
        # reward = 1.0 * exact match + 0.5 * len(completion): 1 + 0.5*1 = 1.5; 0 + 0.5*5 = 2.5
        assert [s.reward for s in out] == [1.5, 2.5]
        assert out[1].scores == {"reward_fn": 0.0, "remote": 5.0}
        assert server.requests == 1  # one request per message, not per sample

        server.fail_first = server.requests + 2  # the next two attempts get 503, the third succeeds
        out = scorer.score([make_rollout("1+1=", "2", "2")])
        assert not out[0].failed and out[0].scores["remote"] == 1.0
        assert server.requests == 4
    finally:
        server.close()


def test_remote_reward_unreachable_fails_samples_quickly():
    port = free_port_block(1)  # nothing listens there
    cfg = ScorerConfig(kinds=["remote"], remote_url=f"http://127.0.0.1:{port}/score", remote_retries=3,
                       remote_backoff_s=0.05, remote_timeout_s=2.0)
    scorer = Scorer(cfg)
    t0 = time.monotonic()
    out = scorer.score([make_rollout("q", "a", None), make_rollout("q", "b", None)])
    assert time.monotonic() - t0 < 5.0
    assert all(s.failed for s in out)
    assert "failed after 3 attempt(s)" in out[0].error and "unreachable" in out[0].error, out[0].error


def test_reference_logprobs_equal_learner_function(tiny_model_dir):
    from transformers import AutoTokenizer

    from learner.modeling import completion_logprobs, load_causal_lm

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    scorer = Scorer(ScorerConfig(kinds=["reward_fn", "reference"], reward_fn=ARITHMETIC,
                                 reference=str(tiny_model_dir), batch_size=2))
    rollouts = [make_rollout("12+34=", "64", "64", tokenizer=tok),
                make_rollout("a much longer prompt here", "x", "y", tokenizer=tok),
                make_rollout("7=", "a longer completion than the others", "7", tokenizer=tok)]
    out = roundtrip(scorer.score(rollouts))
    model = load_causal_lm(str(tiny_model_dir))
    expect = completion_logprobs(model, [r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts],
                                 temperature=1.0)
    for s, e in zip(out, expect):
        assert s.ref_logprobs is not None and s.ref_logprobs.dtype == LOGPROB_DTYPE
        assert len(s.ref_logprobs) == len(s.rollout.completion_ids)
        gap = np.abs(s.ref_logprobs - e.numpy()).max()
        assert gap < 1e-5, f"reference log-probs differ from completion_logprobs by {gap:.3g}"
        assert "reference" not in s.scores  # a reference is not a reward component
    assert [s.reward for s in out] == [1.0, 0.0, 0.0]


# --------------------------------------------------------------------------------------------
# a real scorer process between a real buffer and the test






@pytest.mark.slow
def test_scorer_process_scores_for_the_buffer(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    fn = tmp_path / "reward.py"  # arithmetic, except that a completion "boom" makes it raise
    fn.write_text(f"import runpy\nar = runpy.run_path({ARITHMETIC!r})\n"
                  "def reward_fn(p, c, l):\n"
                  "    if 'boom' in c:\n        raise ValueError('boom')\n"
                  "    return ar['reward_fn'](p, c, l)\n")
    buffer, port = started(start_buffer(tmp_path,
                                        rows=[{"prompt": "12+34=", "label": "64"}, {"prompt": "1+1=", "label": "2"}],
                                        n_samples_per_prompt=2, prompts_per_step=1, shuffle_seed="none"))
    scorer_log = open(tmp_path / "scorer.log", "w")
    scorer = subprocess.Popen(
        [sys.executable, "-m", "launch.scorer", "--scorer.kinds", "reward_fn,reference", "--scorer.reward_fn", str(fn),
         "--scorer.reference", str(tiny_model_dir), "--scorer.buffer_port", str(port), "--scorer.poll_s", "0.2",
         "--scorer.max_new_tokens", "3", "--scorer.overlong_buffer_len", "2"],
        cwd=ROOT, env=subprocess_env(), stderr=scorer_log)
    client = BufferClient("127.0.0.1", port, timeout_s=10)
    try:
        grant = client.lease("test-gen", max_groups=2)
        g0, g1 = grant.groups
        assert (g0.prompt, g1.prompt) == ("12+34=", "1+1=")
        # group 0: the reward function raises on one sample -> the buffer drops the group
        client.push_rollouts([make_rollout(g0.prompt, c, g0.label, g0.group_id, i, grant.lease_id, tok)
                              for i, c in enumerate(["64", "boom"])])
        # group 1: scored normally, after the failure
        client.push_rollouts([make_rollout(g1.prompt, c, g1.label, g1.group_id, i, grant.lease_id, tok)
                              for i, c in enumerate(["2", "3"])])
        batch = client.get_batch(step=0, timeout_s=60)
        log = (tmp_path / "scorer.log").read_text()
        assert len(batch.scored) == 2, log
        by_index = sorted(batch.scored, key=lambda s: s.rollout.sample_index)
        assert {s.rollout.group_id for s in by_index} == {g1.group_id}
        # "2" and "3" are 2 ids each with the end token: 2 - (3 - 2) = 1 over, -min(1 / 2, 1) * 1.0
        assert [s.reward for s in by_index] == [0.5, -0.5]
        assert [s.scores for s in by_index] == [{"reward_fn": 1.0, "overlong": -0.5},
                                                {"reward_fn": 0.0, "overlong": -0.5}]
        assert all(s.ref_logprobs is not None and len(s.ref_logprobs) == len(s.rollout.completion_ids)
                   and np.all(s.ref_logprobs <= 0) for s in by_index)
        m = client.metrics()
        assert m["buffer/failed_groups"] == 1 and m["buffer/accepted_groups"] == 1, m
        assert scorer.poll() is None, "the scorer exited after a failing reward function"
    finally:
        client.close()
        code = stop(scorer)
        stop(buffer)
    assert code == 0, (tmp_path / "scorer.log").read_text()
    assert "reward_fn: reward_fn raised ValueError: boom" in (tmp_path / "scorer.log").read_text()


def test_scorer_config_errors_quote_the_values():
    from common.config import ConfigError, load_section

    with pytest.raises(ConfigError) as e:
        load_section(ScorerConfig, "scorer", None, ["--scorer.kinds", "reward_fn,remote,jury",
                                                    "--scorer.remote_url", "ftp://x",
                                                    "--scorer.reward_fn_timeout_s", "0"])
    msg = str(e.value)
    assert "unknown ['jury']" in msg and "scorer.reward_fn is empty" in msg and "'ftp://x'" in msg
    assert "scorer.reward_fn_timeout_s=0.0 must be > 0" in msg


def test_the_env_component_is_the_episodes_environment_reward():
    from actors.rewards import EnvReward

    played = [make_rollout("p", "c", None, sample_index=i) for i in range(3)]
    for r, x in zip(played, (1.5, 0.0, math.inf)):
        r.env_reward = x
    scores = EnvReward().score(played)
    assert [s.value for s in scores] == [1.5, 0.0, None] and "non-finite" in scores[2].error
    single = EnvReward().score([make_rollout("p", "c", None)])  # a rollout that played no environment
    assert single[0].value is None and "played no environment" in single[0].error
    # an OpenRLHF agent's scores and extra logs (Rollout.env_info) are passed on as a reward file's are
    played[0].env_info = {"filter_score": 0.25, "extra/turns": 2.0}
    s = EnvReward().score(played[:2])
    assert (s[0].filter_score, s[0].extra) == (0.25, {"turns": 2.0}) and s[1].filter_score is None


def test_components_score_a_message_side_by_side(tmp_path):
    """A slow component (a judge, a remote server) holds a message up by its own time, not the sum:
    two stand-in components that each wait for the other (a barrier) both finish."""
    import threading

    from actors.rewards import Score

    (tmp_path / "r.py").write_text("def reward_fn(prompts, completions, labels):\n    return [1.0] * len(prompts)\n")
    scorer = Scorer(ScorerConfig(kinds=["reward_fn"], reward_fn=str(tmp_path / "r.py")).validate())
    barrier = threading.Barrier(2, timeout=20)

    class Waits:
        def __init__(self, name):
            self.name = name

        def score(self, rollouts):
            barrier.wait()  # (in turn, the first would wait for a second that never started)
            return [Score(0.5)] * len(rollouts)

    scorer.parts = [(Waits("a"), 1.0), (Waits("b"), 1.0)]
    try:
        out = scorer.score([make_rollout("p", "c", None)])
    finally:
        scorer.close()
    assert not out[0].failed and out[0].scores == {"a": 0.5, "b": 0.5} and out[0].reward == 1.0
