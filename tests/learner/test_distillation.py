"""On-policy distillation: a teacher scorer's log-probs of the student's own tokens
(`ScoredRollout.teacher_logprobs`), and the learner's per-token reverse-KL advantage
(`learner.trainer.distill_advantages`), checked against the formula on a hand-made batch."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from actors.config import ScorerConfig, tokenizer_mismatch
from buffer.messages import ScoredRollout
from learner.batching import to_train_batch
from learner.config import LearnerConfig
from learner.trainer import distill_advantages
from tests.helpers.scoring import make_rollout, roundtrip


def test_the_advantage_gains_coef_times_teacher_minus_student_on_sampled_tokens():
    scored = [ScoredRollout(make_rollout("ab", "cde", None), reward=0.0,
                            teacher_logprobs=np.array([-0.5, -1.0, -2.0, -0.1], np.float32)),
              ScoredRollout(make_rollout("ab", "c", None), reward=0.0,
                            teacher_logprobs=np.array([-3.0, -0.2], np.float32))]
    tb = to_train_batch(scored, pad_id=0)
    mask = tb.action_mask
    tb.prox_logprobs = torch.where(mask, torch.full(mask.shape, -1.0), torch.zeros(mask.shape))
    tb.advantages = torch.where(mask, torch.full(mask.shape, 0.25), torch.zeros(mask.shape))
    cfg = LearnerConfig(distill_coef=0.5)
    m = distill_advantages(cfg, tb, mask, step=0)
    # by hand: each sampled token's 0.25 + 0.5 x (teacher - (-1)); nothing off the completion
    want = [[0.25 + 0.5 * (t + 1.0) for t in (-0.5, -1.0, -2.0, -0.1)], [0.25 + 0.5 * (t + 1.0) for t in (-3.0, -0.2)]]
    got = [tb.advantages[b][mask[b]].tolist() for b in range(2)]
    for g, w in zip(got, want):
        assert g == pytest.approx(w)
    assert float(tb.advantages[~mask].abs().sum()) == 0.0
    gaps = [-(t + 1.0) for t in (-0.5, -1.0, -2.0, -0.1, -3.0, -0.2)]  # log pi_old - log teacher
    assert m["distill/reverse_kl"] == pytest.approx(sum(gaps) / 6)
    assert distill_advantages(LearnerConfig(), tb, mask, 0) == {}  # off: nothing added
    # the mean baseline: the term's mean over the sampled tokens taken off first
    before = tb.advantages.clone()
    distill_advantages(LearnerConfig(distill_coef=0.5, distill_baseline="mean"), tb, mask, step=0)
    terms = [t + 1.0 for t in (-0.5, -1.0, -2.0, -0.1, -3.0, -0.2)]
    mean = sum(terms) / len(terms)
    assert (tb.advantages - before)[mask].tolist() == pytest.approx([0.5 * (t - mean) for t in terms])
    tb.teacher_logprobs = None
    with pytest.raises(ValueError, match="distill_coef=0.5 needs teacher_logprobs.*kind `teacher`"):
        distill_advantages(cfg, tb, mask, step=3)


def test_teacher_logprobs_travel_the_wire_and_a_wrong_length_is_refused():
    s = ScoredRollout(make_rollout("ab", "cd", None), reward=1.0, teacher_logprobs=np.array([-1, -2, -3], np.float32))
    back = roundtrip([s])[0]
    assert back.teacher_logprobs.tolist() == [-1.0, -2.0, -3.0]
    from buffer.messages import ProtocolError

    with pytest.raises(ProtocolError, match="teacher_logprobs"):
        ScoredRollout(make_rollout("ab", "cd", None), reward=1.0, teacher_logprobs=np.zeros(2, np.float32))


def test_the_teacher_scorer_gives_the_teachers_logprobs(tiny_model_dir):
    from actors.scorer import Scorer
    from learner.modeling import completion_logprobs, load_causal_lm

    cfg = ScorerConfig(kinds=["teacher"], teacher=str(tiny_model_dir)).validate()
    scorer = Scorer(cfg)
    try:
        rollouts = [make_rollout("1+2=", "3", None), make_rollout("4+4=", "81", None)]
        out = scorer.score(rollouts)
    finally:
        scorer.close()
    model = load_causal_lm(str(tiny_model_dir))
    want = completion_logprobs(model, [r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts])
    for s, w in zip(out, want):
        assert not s.failed and s.reward == 0.0 and s.ref_logprobs is None  # no reward of its own
        assert np.allclose(s.teacher_logprobs, w.numpy(), atol=1e-6)


def test_a_teacher_with_another_tokenizer_is_refused(tiny_model_dir, tmp_path):
    import shutil

    assert tokenizer_mismatch(str(tiny_model_dir), str(tiny_model_dir)) == ""
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: same size, another tokenizer
    (other / "tokenizer.json").write_text(json.dumps(tok))
    assert "vocabularies differ" in tokenizer_mismatch(str(tiny_model_dir), str(other))
    from common.config import ConfigError
    from launch.run_config import load_run_config

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    base = [f"--learner.model_path={tiny_model_dir}", f"--buffer.prompts={prompts}", "--scorer.kinds=teacher"]
    with pytest.raises(ConfigError, match="does not share the policy's tokenizer.*vocabularies differ"):
        load_run_config(None, base + [f"--scorer.teacher={other}", "--learner.distill_coef=1"])
    with pytest.raises(ConfigError, match="needs both a teacher scorer and learner.distill_coef > 0"):
        load_run_config(None, base + [f"--scorer.teacher={tiny_model_dir}"])
    run = load_run_config(None, base + [f"--scorer.teacher={tiny_model_dir}", "--learner.distill_coef=1"])
    assert run.scorer.teacher == str(tiny_model_dir) and run.learner.distill_coef == 1.0
