"""Packed batches (`learner.packing`): the layout worked out by hand, and packed == padded on the tiny
model in fp32 (log-probs, values, losses and gradients, within 1e-5) for the policy, the critic and
the reference scorer's `completion_logprobs`.

The claim packing rests on, that transformers keeps attention inside each document of a row whose
position ids restart at 0 (no attention mask, no cache), is checked against each sequence's own,
unbatched forward, with the tiny model's attention implementation (sdpa).
"""

from __future__ import annotations

import torch

from learner.batching import to_train_batch
from learner.config import LearnerConfig
from learner.packing import first_fit_decreasing, pack_rows, regroup
from tests.helpers.learner import make_group, step_loss_and_grads

TOL = 1e-5


def test_first_fit_decreasing_by_hand():
    # capacity 5, lengths 5, 2, 3, 2: 5 fills bin 0; 3 opens bin 1 (room 2); the first 2 fits there;
    # the second 2 fits nowhere and opens bin 2
    assert first_fit_decreasing([5, 2, 3, 2], 5) == [[0], [2, 1], [3]]
    assert first_fit_decreasing([6, 1], 4) == [[0], [1]]  # too long for any bin: a bin of its own


def test_pack_rows_layout_and_unpack_by_hand():
    # lengths 4, 2, 3, 1 (right-padded to L = 4), capacity 4: bins [0], [2, 3], [1] (used 4, 4, 2)
    lengths = [4, 2, 3, 1]
    ids = torch.tensor([[11, 12, 13, 14], [21, 22, 0, 0], [31, 32, 33, 0], [41, 0, 0, 0]])
    attn = (torch.arange(4)[None] < torch.tensor(lengths)[:, None]).long()
    rows = pack_rows(ids, attn)
    assert rows.input_ids.tolist() == [[11, 12, 13, 14], [31, 32, 33, 41], [21, 22, 0, 0]]
    # positions restart per sequence; row 2's tail of padding is a document of its own
    assert rows.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 0, 1]]
    assert rows.num_slots == 12 and ids.numel() == 16
    assert torch.equal(rows.unpack(rows.input_ids), ids * attn)
    # next-token frame: a sequence's last position (which in the packed row sits before the next
    # sequence) comes back 0, like padding
    nxt = rows.unpack_next(rows.input_ids[:, :-1].float())  # (4, 3)
    assert nxt.tolist() == [[11, 12, 13], [21, 0, 0], [31, 32, 0], [0, 0, 0]]


def test_regroup_deals_whole_packed_rows_by_hand():
    # lengths 5 1 4 2 3 3 in micro-batches [0 1 2] [3 4 5] (padded: 3 x 5 + 3 x 3 = 24 positions).
    # All six into rows of 5: [0] [2 1] [4 3] [5], filled 5 5 5 3; dealt fullest first to the
    # lighter group: [0] -> A, [2 1] -> B, [4 3] -> A (tie: the first), [5] -> B
    groups = regroup([5, 1, 4, 2, 3, 3], [torch.tensor([0, 1, 2]), torch.tensor([3, 4, 5])])
    assert [g.tolist() for g in groups] == [[0, 3, 4], [1, 2, 5]]
    # A packs into 2 rows of 5 and B (4 3 1) into 2 rows of 4: 18 positions
    # fewer packed rows (2: [0] [1 2 3 4]) than groups (3): left as they were
    three = [torch.tensor([0, 1]), torch.tensor([2, 3]), torch.tensor([4])]
    assert regroup([4, 1, 1, 1, 1], three) is three


def mixed_batch():
    """Two groups of 4 whose completions spread 1..40 tokens, one truncated, with reference log-probs."""
    scored = (make_group(0, 4, [1.0, 0.0, 0.5, 0.2], with_ref=True, truncated=(1,), completion_len=(1, 41))
              + make_group(1, 4, [0.0, 0.3, 1.0, 1.0], with_ref=True, completion_len=(1, 41)))
    return to_train_batch(scored)


def max_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def test_packed_policy_logprobs_losses_and_gradients_equal_padded(tiny_model_dir):
    from learner.modeling import completion_logprobs, load_causal_lm

    model = load_causal_lm(str(tiny_model_dir))
    tb = mixed_batch()
    assert tb.packed_rows().num_slots < 0.75 * tb.input_ids.numel()  # the batch is mostly padding
    m = tb.completion_mask
    runs = {}
    for packing in (False, True):  # every loss term on: PPO, KL in the loss, entropy; a truncated row masked
        cfg = LearnerConfig(model_path="m", packing=packing, kl_coef=0.1, entropy_coef=0.01, overlong_filter=True)
        runs[packing] = step_loss_and_grads(model, cfg, tb)  # one micro-batch: the same rows either way
    (pad, _, pad_loss, pad_parts, pad_grads), (pk, _, pk_loss, pk_parts, pk_grads) = runs[False], runs[True]
    assert float(((pad.prox_logprobs - pk.prox_logprobs) * m).abs().max()) < TOL
    assert float((pad_loss - pk_loss).abs()) < TOL
    for k in ("loss/kl", "policy/entropy", "policy/approx_kl"):
        assert abs(pad_parts[k] - pk_parts[k]) < TOL, k
    assert max_gap(pad_grads, pk_grads) < TOL
    # two micro-batches, whose rows packing deals differently: the mini-batch's loss and gradient stay
    _, _, loss2, _, grads2 = step_loss_and_grads(model, cfg, tb, grad_accum=2)
    assert float((loss2 - pad_loss).abs()) < TOL and max_gap(grads2, pad_grads) < TOL

    # each sequence alone, unbatched and unpadded: what attention kept within the sequence gives
    seqs = [tb.input_ids[b, : int(tb.attention_mask[b].sum())] for b in range(tb.size)]
    prompts = [s[: int(m[b].nonzero()[0]) + 1] for b, s in enumerate(seqs)]  # up to the first predicting position
    completions = [s[len(p):] for p, s in zip(prompts, seqs)]
    alone = completion_logprobs(model, prompts, completions, batch_size=1, packing=False)
    for packing in (False, True):
        got = completion_logprobs(model, prompts, completions, batch_size=8, packing=packing)
        assert max(float((g - a).abs().max()) for g, a in zip(got, alone)) < TOL, packing
        assert [len(g) for g in got] == [len(c) for c in completions]


def test_packed_critic_values_loss_and_gradients_equal_padded(tiny_model_dir):
    from learner.engine import ValueModel
    from learner.losses import value_loss
    from learner.trainer import critic_values

    critic = ValueModel(str(tiny_model_dir))
    torch.nn.init.normal_(critic.value_head.weight, std=0.1)  # the zero head would give the backbone no gradient
    tb = mixed_batch()
    m = tb.completion_mask
    returns = torch.linspace(-1, 1, m.numel()).view(m.shape)  # (B, T)
    out = {}
    for packed in (None, tb.packed_rows()):
        critic.zero_grad()
        values = critic_values(critic, tb, packed)  # (B, T)
        loss, _ = value_loss(values, torch.zeros_like(values), returns, m, clip_eps=10.0)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in critic.named_parameters() if p.grad is not None}
        out[packed is not None] = values.detach() * m, loss.detach(), grads
    assert float((out[False][0] - out[True][0]).abs().max()) < TOL
    assert float((out[False][1] - out[True][1]).abs()) < TOL
    assert max_gap(out[False][2], out[True][2]) < TOL
