"""A mixture-of-experts policy in the learner (`learner.moe`), on a tiny Qwen3-MoE (2 layers, 8 experts,
top 2) built on the fly: routing replay (the experts and weights each router hands on, padded and
packed), the refusals, the routers' metrics, frozen routers and the load-balancing loss, each
checked against a computation written out here.

The routers' outputs are read with a forward hook registered after `Routers.attach`'s, so it sees
what the layer after the router sees.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from buffer.messages import Rollout, ScoredRollout
from common.config import ConfigError
from learner.batching import to_train_batch
from learner.modeling import load_causal_lm, next_token_stats
from learner.moe import RouterAuxLoss, Routers, freeze_routers, routers

LAYERS, E, K = 2, 8, 2  # the tiny MoE: MoE layers, experts per layer, experts per token
SHAPES = [(4, 5), (3, 2), (2, 2)]  # (prompt, completion) lengths: padding in two rows, which packed share one


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_dir(tmp_path_factory, request):
    """The tiny MoE of each family (their routers differ: Qwen3-MoE renormalises its top-k if
    `norm_topk_prob`, Mixtral always)."""
    from demo.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_moe"), family=request.param, hidden_size=64,
                            num_layers=LAYERS, num_experts=E, experts_per_token=K)


def _model(folder):
    """A fresh copy (hooks never outlive a test)."""
    return load_causal_lm(str(folder))


class Capture:
    """Every router call's (logits, weights, experts) as the experts receive them."""

    def __init__(self, model):
        self.calls: list[tuple] = []
        self.handles = [r.register_forward_hook(lambda m, a, out: self.calls.append(out)) for r in routers(model)]

    def take(self):
        """(layers, N, E) logits, (layers, N, k) weights and (layers, N, k) experts of the last forward."""
        last, self.calls = self.calls[-LAYERS:], []
        return tuple(torch.stack([c[i] for c in last]) for i in range(3))


def _rows(seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(4, 70, p).astype(np.int32), rng.integers(4, 70, t).astype(np.int32)) for p, t in SHAPES]


def _batch(routes=None, seed=0):
    """A TrainBatch of SHAPES' rows; `routes[i]`: row i's (P+T-1, layers, k) experts, carried by its rollout."""
    scored = []
    for i, (p, c) in enumerate(_rows(seed)):
        fields = {}
        if routes is not None and routes[i] is not None:
            fields = dict(routes=np.asarray(routes[i], np.uint8).tobytes(), route_layers=LAYERS, route_k=K)
        r = Rollout(group_id=1, sample_index=i, lease_id=0, prompt_ids=p, completion_ids=c,
                    behav_logprobs=np.full(len(c), -1.0, np.float32), versions=np.zeros(len(c), np.int32),
                    finish_reason="stop", worker_id="gen-0", **fields)
        scored.append(ScoredRollout(rollout=r, reward=1.0))
    return to_train_batch(scored)


def _random_routes(seed=1):
    """Distinct random experts for every token but the last of each row."""
    rng = np.random.default_rng(seed)
    return [np.stack([rng.permutation(E)[:K] for _ in range((p + t - 1) * LAYERS)]).reshape(p + t - 1, LAYERS, K)
            for p, t in SHAPES]


def _own_routes(folder):
    """The experts the model's routers choose by themselves on `_batch()`, as rollouts carry them."""
    model = _model(folder)
    cap = Capture(model)
    tb = _batch()
    with torch.no_grad():
        next_token_stats(model, tb.input_ids, tb.attention_mask)
    chosen = cap.take()[2].permute(1, 0, 2).reshape(*tb.input_ids.shape, LAYERS, K)  # (B, L, layers, k)
    return [chosen[i, : p + t - 1].numpy() for i, (p, t) in enumerate(SHAPES)]


def _completion_loss(logprobs, tb):
    return -(logprobs * tb.completion_mask).sum() / tb.completion_mask.sum()


# ------------------------------------------------------------------------------------------------
# routing replay


def test_replay_routes_every_known_token_to_the_given_experts_and_the_rest_by_the_router(moe_dir):
    routes = _random_routes()
    tb = _batch(routes)
    # the layout TrainBatch gives routes: every token but each row's last, -1 after
    assert tb.routes.shape == (3, 9, LAYERS, K) and tb.routes.dtype == torch.int16
    assert (tb.routes[1, 4:] == -1).all() and (tb.routes[1, :4] >= 0).all()
    tb.routes[0, 2] = -1  # and one token in the middle the engine did not record
    model = _model(moe_dir)
    Routers.attach(model, "rollout")
    cap = Capture(model)
    with torch.no_grad():
        next_token_stats(model, tb.input_ids, tb.attention_mask, routes=tb.routes)
    logits, _, chosen = cap.take()
    given = tb.routes.reshape(-1, LAYERS, K).permute(1, 0, 2).long()  # (layers, N, k)
    known = (given >= 0).all(-1)
    own = logits.softmax(-1).topk(K, dim=-1).indices
    assert known.sum() == LAYERS * (sum(p + t - 1 for p, t in SHAPES) - 1)
    assert torch.equal(chosen[known], given[known])
    assert torch.equal(chosen[~known], own[~known])
    assert (given[known] != own[known]).any()  # (the given experts are not the router's choice)

    # off: the routers choose, and the forward is the plain one
    plain = _model(moe_dir)
    off = _model(moe_dir)
    Routers.attach(off, "off")
    cap = Capture(off)
    with torch.no_grad():
        lp_off, _ = next_token_stats(off, tb.input_ids, tb.attention_mask, routes=tb.routes)
        lp_plain, _ = next_token_stats(plain, tb.input_ids, tb.attention_mask)
    logits, _, chosen = cap.take()
    assert torch.equal(chosen, logits.softmax(-1).topk(K, dim=-1).indices)
    assert torch.equal(lp_off, lp_plain)


def test_replayed_weights_and_expert_outputs_by_hand_and_the_router_gets_a_gradient(moe_dir):
    tb = _batch(_random_routes())
    model = _model(moe_dir)
    Routers.attach(model, "rollout")
    cap = Capture(model)
    block = model.model.layers[1].mlp
    seen = {}
    block.register_forward_hook(lambda m, args, out: seen.update(x=args[0], y=out))
    logprobs, _ = next_token_stats(model, tb.input_ids, tb.attention_mask, routes=tb.routes)
    logits, weights, chosen = cap.take()
    # renormalised top-k softmax of the chosen experts = a softmax over their logits alone:
    # w_j = exp(l_j) / sum_{j' chosen} exp(l_j')
    at = logits.double().gather(-1, chosen)
    assert torch.allclose(weights.double(), torch.softmax(at, dim=-1), atol=1e-6, rtol=0)

    # layer 1's MoE block: y = sum_j w_j * down_j(silu(gate_j x) * up_j x) over the replayed experts
    x = seen["x"].reshape(-1, 64).detach().double()
    ex = block.experts
    y = torch.zeros_like(x)
    for n in range(len(x)):
        for j in range(K):
            e = int(chosen[1, n, j])
            gate, up = (ex.gate_up_proj[e].double() @ x[n]).chunk(2)
            y[n] += weights[1, n, j].double() * (ex.down_proj[e].double() @ (F.silu(gate) * up))
    assert torch.allclose(seen["y"].reshape(-1, 64).double(), y, atol=1e-6, rtol=0)

    _completion_loss(logprobs, tb).backward()
    for layer in model.model.layers:
        grad = layer.mlp.gate.weight.grad
        assert grad is not None and grad.abs().max() > 0


def test_replaying_the_models_own_routes_changes_nothing(moe_dir):
    tb = _batch(_own_routes(moe_dir))
    model = _model(moe_dir)
    with torch.no_grad():
        plain, _ = next_token_stats(model, tb.input_ids, tb.attention_mask)
    Routers.attach(model, "rollout")
    with torch.no_grad():
        replayed, _ = next_token_stats(model, tb.input_ids, tb.attention_mask, routes=tb.routes)
    assert torch.allclose(replayed, plain, atol=1e-6, rtol=0)


def test_replay_with_gradient_checkpointing_gives_the_same_gradients(moe_dir):
    """learner.gradient_checkpointing recomputes each layer's forward during backward, after
    `routing(...)` has ended: the recomputed routers must still replay the rollout's experts."""
    from torch.utils.checkpoint import CheckpointError

    from learner.engine import load_trainable_lm

    tb = _batch(_random_routes())

    def grads(checkpointing):
        model = load_trainable_lm(str(moe_dir), gradient_checkpointing=checkpointing)
        Routers.attach(model, "rollout")
        logprobs, _ = next_token_stats(model, tb.input_ids, tb.attention_mask, routes=tb.routes)
        failed = ""
        try:
            _completion_loss(logprobs, tb).backward()
        except CheckpointError as e:
            failed = str(e).splitlines()[0]
        assert not failed, ("learner/moe.py `routing`/`Routers._hook`: with gradient checkpointing each layer's "
                            "forward is recomputed in backward, after `routing(...)` has ended (hooks.routes is None), "
                            "so the routers choose their own experts and the recomputation differs: " + failed)
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    plain, checkpointed = grads(False), grads(True)
    assert sorted(plain) == sorted(checkpointed)
    for n in plain:
        assert torch.allclose(checkpointed[n], plain[n], atol=1e-6, rtol=0), \
            f"{n}: the recomputation in backward did not replay the rollout's experts"


def test_replay_on_packed_rows_is_replay_on_the_padded_frame(moe_dir):
    tb = _batch(_random_routes())
    model = _model(moe_dir)
    Routers.attach(model, "rollout")
    cap = Capture(model)
    packed = tb.packed_rows()
    assert packed.input_ids.shape[0] < 3  # two of the three rows share one packed row
    with torch.no_grad():
        padded, _ = next_token_stats(model, tb.input_ids, tb.attention_mask, routes=tb.routes)
        cap.take()
        rows, _ = next_token_stats(model, tb.input_ids, tb.attention_mask, packed=packed, routes=tb.routes)
    _, _, chosen = cap.take()  # (layers, R*C, k)
    given = tb.routes.reshape(-1, LAYERS, K)[packed.padded_index].permute(1, 0, 2).long()  # (layers, N, k)
    known = (given >= 0).all(-1)
    assert torch.equal(chosen[:, packed.packed_index][known], given[known])
    real = tb.attention_mask[:, 1:].bool()  # the positions that predict a token
    assert torch.allclose(rows[real], padded[real], atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------
# refusals


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=80, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


@pytest.mark.parametrize("shape,value,why", [
    ((LAYERS + 1, K), 0, "3 layers x 2 experts per token, but the policy has 2 MoE layers"),
    ((LAYERS, K + 1), 0, "2 layers x 3 experts per token, but the policy has 2 MoE layers routing each token to 2"),
    ((LAYERS, K), E, "name expert 8, but the policy's layers have 8 experts"),
])
def test_routes_the_policy_cannot_replay_are_refused(moe_dir, shape, value, why):
    tb = _batch()
    model = _model(moe_dir)
    Routers.attach(model, "rollout")
    routes = torch.full((*tb.input_ids.shape, *shape), value, dtype=torch.int16)
    with pytest.raises(ValueError, match=why):
        next_token_stats(model, tb.input_ids, tb.attention_mask, routes=routes)


def test_routes_on_a_model_without_hooks_and_replay_on_a_dense_model_are_refused(moe_dir):
    tb = _batch(_random_routes())
    with pytest.raises(RuntimeError, match="no router hooks"):
        next_token_stats(_model(moe_dir), tb.input_ids, tb.attention_mask, routes=tb.routes)
    dense = _tiny_llama()
    with pytest.raises(ConfigError, match="routing_replay='rollout' needs a mixture-of-experts model; 'llama'"):
        Routers.attach(dense, "rollout")
    assert Routers.attach(dense, "off") is None


def test_a_batch_where_only_some_rollouts_carry_routes_is_refused():
    routes = _random_routes()
    routes[1] = None
    with pytest.raises(ValueError, match="2 of 3 rollouts carry routes, not group 1 sample 1 "):
        _batch(routes)
    assert _batch().routes is None


# ------------------------------------------------------------------------------------------------
# metrics


def test_router_metrics_of_no_grad_forwards_by_hand(moe_dir):
    tb = _batch(_random_routes())
    model = _model(moe_dir)
    hooks = Routers.attach(model, "rollout")
    cap = Capture(model)
    with torch.no_grad():
        next_token_stats(model, tb.input_ids, tb.attention_mask, routes=tb.routes)
    logits, _, chosen = cap.take()
    got = hooks.metrics()
    # by hand, over the tokens (attention mask) of each layer: max/mean of the experts' load, averaged
    # over layers; the routers' entropy per token; the share of known tokens whose own top-k set differs
    valid = tb.attention_mask.reshape(-1).bool()
    given = tb.routes.reshape(-1, LAYERS, K).permute(1, 0, 2).long()
    load = [torch.bincount(chosen[i][valid].reshape(-1), minlength=E).double() for i in range(LAYERS)]
    p = logits[:, valid].double().softmax(-1)
    own = logits.topk(K, dim=-1).indices.sort(-1).values
    known = valid & (given >= 0).all(-1)  # (layers, N)
    differ = (own != given.sort(-1).values).any(-1)[known]
    want = {"moe/expert_load_max_over_mean": sum(float(x.max() / x.mean()) for x in load) / LAYERS,
            "moe/router_entropy": float(-(p * p.log()).sum(-1).mean()),
            "moe/route_mismatch": float(differ.double().mean())}
    assert got == pytest.approx(want, rel=1e-6)
    assert got["moe/expert_load_max_over_mean"] >= 1
    assert 0 < got["moe/router_entropy"] <= math.log(E)
    assert 0 < got["moe/route_mismatch"] <= 1  # random experts: most tokens differ
    assert hooks.metrics() == {}  # reset by the call

    # a forward with grad (the trained policy's) is not measured; one without routes has no mismatch
    next_token_stats(model, tb.input_ids, tb.attention_mask, routes=tb.routes)
    assert hooks.metrics() == {}
    with torch.no_grad():
        next_token_stats(model, tb.input_ids, tb.attention_mask)
    assert sorted(hooks.metrics()) == ["moe/expert_load_max_over_mean", "moe/router_entropy"]


def test_route_mismatch_is_zero_for_the_models_own_routes(moe_dir):
    tb = _batch(_own_routes(moe_dir))
    model = _model(moe_dir)
    hooks = Routers.attach(model, "rollout")
    with torch.no_grad():
        next_token_stats(model, tb.input_ids, tb.attention_mask, routes=tb.routes)
    assert hooks.metrics()["moe/route_mismatch"] == 0.0


# ------------------------------------------------------------------------------------------------
# frozen routers


def test_frozen_routers_keep_their_weights_while_the_experts_train(moe_dir):
    tb = _batch()
    model = _model(moe_dir)
    assert freeze_routers(model) == LAYERS
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    logprobs, _ = next_token_stats(model, tb.input_ids, tb.attention_mask)
    _completion_loss(logprobs, tb).backward()
    opt.step()
    after = dict(model.named_parameters())
    gates = [n for n in before if n.endswith("mlp.gate.weight")]
    experts = [n for n in before if ".mlp.experts." in n]
    assert len(gates) == LAYERS and experts
    for n in gates:
        assert not after[n].requires_grad and torch.equal(after[n], before[n]), n
    for n in experts:
        assert not torch.equal(after[n], before[n]), n
    with pytest.raises(ConfigError, match="learner.freeze_router needs a mixture-of-experts model; 'llama'"):
        freeze_routers(_tiny_llama())


# ------------------------------------------------------------------------------------------------
# the load-balancing loss


def _switch_aux_loss(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's load-balancing loss as transformers pools it over layers (Qwen3-MoE's
    `load_balancing_loss_func`): over the tokens (mask 1) of every layer,
    f_i = (top-k assignments to expert i) / (layers * tokens)   (sum_i f_i = k),
    P_i = (sum of router probabilities of expert i) / (layers * tokens),
    loss = E * sum_i f_i * P_i   (a router that spreads evenly: E * k * (1/E) = k).
    logits (layers, N, E), mask (N,)."""
    probs = logits.float().softmax(-1)  # (layers, N, E)
    top = torch.zeros_like(probs).scatter(-1, probs.topk(K, dim=-1).indices, 1.0)  # (layers, N, E) 0/1
    m = mask.float()[None, :, None]
    rows = logits.shape[0] * mask.float().sum()
    f = (top * m).sum((0, 1)) / rows
    p = (probs * m).sum((0, 1)) / rows
    return E * (f * p).sum()


def test_router_aux_loss_is_the_switch_formula_and_its_gradient_is_added_at_coef(moe_dir):
    tb = _batch()
    coef = 0.3
    model = _model(moe_dir)
    params = list(model.parameters())

    logprobs, _ = next_token_stats(model, tb.input_ids, tb.attention_mask)
    g0 = torch.autograd.grad(_completion_loss(logprobs, tb), params, allow_unused=True)

    aux = RouterAuxLoss(model, coef)
    cap = Capture(model)
    logprobs, _ = next_token_stats(model, tb.input_ids, tb.attention_mask)
    parts = {}
    loss = aux.add(_completion_loss(logprobs, tb), parts, 1.0)
    logits = torch.stack([c[0] for c in cap.calls])  # (layers, N, E), in the graph
    hand = _switch_aux_loss(logits, tb.attention_mask.reshape(-1))
    value = float(hand.detach())
    assert parts["policy/router_aux_loss"] == pytest.approx(value, rel=1e-6)
    # the padding is left out: counted in, the value would differ
    assert float(_switch_aux_loss(logits, torch.ones(logits.shape[1])).detach()) != pytest.approx(value, rel=1e-6)
    assert 1.0 < value < 2 * K  # about k = 2 for a near-even router

    g1 = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    gh = torch.autograd.grad(hand, params, allow_unused=True)
    for (name, p), a, b, h in zip(model.named_parameters(), g0, g1, gh):
        a = torch.zeros_like(p) if a is None else a
        b = torch.zeros_like(p) if b is None else b
        h = torch.zeros_like(p) if h is None else h
        assert torch.allclose(b - a, coef * h, atol=1e-5, rtol=0), name
        if name.endswith("mlp.gate.weight"):  # (the check means something: the routers' share is far above 1e-5)
            assert (coef * h).abs().max() > 1e-3, name
    aux.close()


def test_weight_rounds_carry_the_checkpoints_names_and_layout(moe_dir):
    """transformers 5 holds a mixture of experts' per-expert weights fused (and Mixtral's
    `block_sparse_moe` renamed `mlp`); a round converts each parameter back on its own, and the
    union is the checkpoint the engines load, key for key and value for value."""
    from safetensors.torch import load_file

    from learner.engine import in_checkpoint_layout

    model = _model(moe_dir)
    sent = dict(in_checkpoint_layout(model, ((n, p.detach()) for n, p in model.named_parameters())))
    saved = load_file(str(moe_dir / "model.safetensors"))
    assert sorted(sent) == sorted(saved)
    assert all(torch.equal(sent[k], saved[k]) for k in saved)
    assert not any(k.endswith("gate_up_proj") for k in sent)  # (per expert, as on disk)
