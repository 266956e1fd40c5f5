"""Routes of a mixture-of-experts engine, without an engine: the worker's `RouteRecorder` (the chunks
of each step kept per request, and whole sequences found again by their tokens), the engine's
`_attach_routes`, and the generator's `cut` and `route_fields` that put them on a rollout.

A recorder is made with `object.__new__` (its `__init__` hooks a vLLM model runner) and given the
chunks `_keep` records: per request, (positions, token ids, routes (rows, layers, k)) of each step.
"""

from __future__ import annotations

from collections import OrderedDict
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from actors.engines.base import Completion
from actors.engines.vllm.engine import _attach_routes, _sequences
from actors.engines.vllm.routes import RouteRecorder
from actors.generator import cut, route_fields
from buffer.messages import Rollout

LAYERS, K = 2, 2


def recorder(requests=(), max_requests=16, layers=None, runner=None) -> RouteRecorder:
    rec = object.__new__(RouteRecorder)
    rec.requests = OrderedDict(requests)
    rec.max_requests = max_requests
    rec.layers, rec.runner, rec.step = layers, runner, {}
    return rec


def experts(rows, seed=0, high=8):
    """(rows, layers, k) expert ids as `_keep` records them (int16)."""
    return np.random.default_rng(seed).integers(0, high, (rows, LAYERS, K)).astype(np.int16)


def chunk(tokens, routes, start, stop):
    """The rows of positions start..stop-1 of one request, as one step records them."""
    return np.arange(start, stop), np.asarray(tokens[start:stop], np.int32), routes[start:stop].copy()


def unpack(got):
    data, shape = got
    return np.frombuffer(data, np.uint8 if len(data) == int(np.prod(shape)) else "<u2").reshape(shape)


PROMPT, COMPLETION = [5, 6, 7], [8, 9, 10]
SEQ = PROMPT + COMPLETION  # the model was fed all but its last token: 5 rows


def test_chunks_out_of_order_and_a_recomputed_position_are_joined_by_position():
    routes = experts(5)
    stale = experts(5, seed=1)  # what positions 2..3 were routed to before the request was preempted
    rec = recorder({"r0": [chunk(SEQ, stale, 2, 4), chunk(SEQ, routes, 0, 2), chunk(SEQ, routes, 2, 5)]})
    (got,) = rec.take([SEQ])
    assert got[1] == [5, LAYERS, K] and len(got[0]) == 5 * LAYERS * K  # uint8: one byte an id
    np.testing.assert_array_equal(unpack(got), routes)  # the last computation of 2..3 counts
    assert not rec.requests  # taken, so forgotten


def test_samples_with_the_same_tokens_each_get_a_request():
    a, b = experts(5, seed=2), experts(5, seed=3)
    rec = recorder({"a": [chunk(SEQ, a, 0, 5)], "b": [chunk(SEQ, b, 0, 3), chunk(SEQ, b, 3, 5)]})
    first, second = rec.take([SEQ, SEQ])
    np.testing.assert_array_equal(unpack(first), a)
    np.testing.assert_array_equal(unpack(second), b)
    assert not rec.requests


def test_a_request_not_seen_whole_gives_no_routes_and_is_kept():
    routes = experts(5)
    other = [5, 6, 7, 8, 1, 2]
    no_start = [3, 3, 3, 3, 3, 4]
    rec = recorder({"whole": [chunk(SEQ, routes, 0, 5)],
                    "no_start": [chunk(no_start, routes, 1, 5)],  # position 0 never seen
                    "gap": [chunk(other, routes, 0, 2), chunk(other, routes, 3, 5)]})  # position 2 missing
    got = rec.take([other, no_start, SEQ, [1, 2, 3]])  # [1, 2, 3]: tokens never seen
    assert got[0] is None and got[1] is None and got[3] is None
    np.testing.assert_array_equal(unpack(got[2]), routes)
    assert list(rec.requests) == ["no_start", "gap"]  # only the one matched is forgotten


def test_an_expert_id_from_256_on_comes_as_uint16():
    routes = experts(5, high=300)
    routes[0, 0, 0] = 299
    rec = recorder({"r": [chunk(SEQ, routes, 0, 5)]})
    (got,) = rec.take([SEQ])
    assert len(got[0]) == 2 * 5 * LAYERS * K
    np.testing.assert_array_equal(np.frombuffer(got[0], "<u2").reshape(got[1]), routes)


def test_keep_lays_a_steps_rows_out_by_request_and_drops_the_oldest():
    # one step of two requests: "x" prefills positions 0..2, "y" decodes position 4; rows past the
    # last request (a padded batch) are left out
    batch = SimpleNamespace(req_ids=["x", "y", "gone"], num_reqs=2)
    runner = SimpleNamespace(input_batch=batch, query_start_loc=SimpleNamespace(np=np.array([0, 3, 4, 4])))
    rec = recorder({"old": [chunk(SEQ, experts(5), 0, 5)]}, max_requests=2, layers=[3, 7], runner=runner)
    step = torch.tensor([[1, 2], [3, 4], [5, 6], [7, 0], [9, 9], [9, 9]])  # (rows, k) of layer 3; layer 7: + 10
    rec.step = {3: step, 7: step + 10}
    rec._keep(torch.tensor([5, 6, 7, 40, 0]), torch.tensor([0, 1, 2, 4, 0]))
    assert list(rec.requests) == ["x", "y"]  # (max_requests 2: "old" went first)
    pos, tok, routes = rec.requests["x"][0]
    assert pos.tolist() == [0, 1, 2] and tok.tolist() == [5, 6, 7]
    assert routes.tolist() == [[[1, 2], [11, 12]], [[3, 4], [13, 14]], [[5, 6], [15, 16]]]  # (rows, layers, k)
    pos, tok, routes = rec.requests["y"][0]
    assert pos.tolist() == [4] and tok.tolist() == [40] and routes.tolist() == [[[7, 0], [17, 10]]]
    rec.step = {3: step}
    with pytest.raises(RuntimeError, match=r"MoE layers \[7\] routed no tokens"):
        rec._keep(torch.tensor([5]), torch.tensor([0]))


# ------------------------------------------------------------------------------------------------
# the engine and the generator


def completion(token_ids, routes=None):
    return Completion(list(token_ids), [-0.5] * len(token_ids), "stop", "", routes=routes)


def test_attach_routes_gives_each_completion_its_own_by_their_sequences():
    prompts = [PROMPT, [1, 2]]
    out = [[completion(COMPLETION)], [completion([4, 4]), completion([3])]]
    seqs = _sequences(prompts, out)
    assert seqs == [SEQ, [1, 2, 4, 4], [1, 2, 3]]
    small, large = experts(5), experts(3, high=1000)
    rec = recorder({"a": [chunk(SEQ, small, 0, 5)], "c": [chunk(seqs[1], large, 0, 3)]})
    _attach_routes(out, rec.take(seqs))
    a, b, c = out[0][0], out[1][0], out[1][1]
    assert a.routes.dtype == np.uint8 and b.routes.dtype == np.dtype("<u2") and c.routes is None
    np.testing.assert_array_equal(a.routes, small)
    np.testing.assert_array_equal(b.routes, large)


class Chars:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(96 + i) for i in ids)


def test_cut_trims_routes_to_the_tokens_the_rollout_keeps():
    prompt, tokens = [1, 2, 3], [4, 5, 6, 7, 8, 9]
    routes = experts(len(prompt) + len(tokens) - 1).astype(np.uint8)  # (8, layers, k)
    c = cut(completion(tokens, routes), 4, Chars(), len(prompt))
    assert c.token_ids == [4, 5, 6, 7] and c.finish_reason == "length" and c.text == "defg"
    np.testing.assert_array_equal(c.routes, routes[:3 + 4 - 1])  # every kept token but the last
    whole = completion(tokens, routes)
    assert cut(whole, 6, Chars(), len(prompt)) is whole  # within its budget: as it was
    assert cut(completion(tokens), 4, Chars(), len(prompt)).routes is None

    # the rollout takes them: route_fields' bytes fit its prompt + completion
    r = Rollout(group_id=0, sample_index=0, lease_id=0, prompt_ids=prompt, completion_ids=c.token_ids,
                behav_logprobs=c.logprobs, versions=[0] * 4, **route_fields(c.routes))
    assert (r.route_layers, r.route_k, r.route_width) == (LAYERS, K, 1)
    np.testing.assert_array_equal(r.route_array(), routes[:6])


def test_route_fields_of_uint16_routes_and_of_none():
    routes = experts(4, high=300).astype("<u2")
    assert route_fields(None) == {}
    f = route_fields(routes)
    assert f == {"routes": routes.tobytes(), "route_layers": LAYERS, "route_k": K, "route_width": 2}
    r = Rollout(group_id=0, sample_index=0, lease_id=0, prompt_ids=[1, 2], completion_ids=[3, 4, 5],
                behav_logprobs=[-1.0] * 3, versions=[0] * 3, **f)
    np.testing.assert_array_equal(r.route_array(), routes)


# ------------------------------------------------------------------------------------------------
# a real engine: the routes it records are the experts its routers chose, and the learner replays them


@pytest.mark.slow
def test_the_learners_replayed_routers_choose_the_experts_the_engine_recorded(tmp_path):
    """vLLM (CPU build) samples from the tiny Qwen3-MoE and records every token's experts; the
    learner's model, its routers moved away from the engine's (a later policy), replays them: every
    router's output experts are the engine's for every token the routes cover. Without replay the
    moved routers choose otherwise for some tokens, and the unmoved model's own choice is the
    engine's (the recorder takes the right rows for the right request)."""
    from actors.engines import VLLMEngine
    from actors.engines.base import Sampling
    from buffer.messages import ScoredRollout
    from demo.tiny_model import build_tiny_model
    from learner.batching import to_train_batch
    from learner.modeling import load_causal_lm, next_token_stats
    from learner.moe import Routers, routers

    folder = build_tiny_model(tmp_path / "moe", family="qwen3_moe", seed=3)
    engine = VLLMEngine(str(folder), dtype="float32", seed=0, max_model_len=256, record_routes=True)
    try:
        prompts = [engine.tokenizer(p)["input_ids"] for p in ("12+34=", "7*8=", "hello there, how are you")]
        groups = engine.generate(prompts, 3, Sampling(temperature=1.0, max_tokens=12))
    finally:
        engine.close()
    scored = []
    for g, (ids, comps) in enumerate(zip(prompts, groups)):
        for j, c in enumerate(comps):
            assert c.routes is not None and c.routes.shape == (len(ids) + len(c.token_ids) - 1, LAYERS, K)
            scored.append(ScoredRollout(Rollout(group_id=g, sample_index=j, lease_id=0, prompt_ids=ids,
                                                completion_ids=c.token_ids, behav_logprobs=c.logprobs,
                                                versions=[0] * len(c.token_ids), **route_fields(c.routes))))
    tb = to_train_batch(scored)
    given = tb.routes.reshape(-1, LAYERS, K).permute(1, 0, 2).long()  # (layers, N, k)
    known = (given >= 0).all(-1)

    def chosen(model, replay):
        Routers.attach(model, replay)
        out = []
        handles = [r.register_forward_hook(lambda m, a, o: out.append(o[2])) for r in routers(model)]
        with torch.no_grad():
            next_token_stats(model, tb.input_ids, tb.attention_mask, routes=tb.routes)
        for h in handles:
            h.remove()
        return torch.stack(out).sort(-1).values  # (layers, N, k), as sets

    same = given.sort(-1).values
    own = chosen(load_causal_lm(str(folder)), "off")
    agree = (own == same).all(-1)[known].float().mean().item()
    assert agree >= 0.99, f"the learner's own routers agree with the engine on {agree:.3f} of tokens x layers"
    moved = load_causal_lm(str(folder))
    with torch.no_grad():
        for r in routers(moved):
            r.weight.add_(torch.randn_like(r.weight) * r.weight.std())
    assert not (chosen(moved, "off") == same).all(-1)[known].all()
    assert torch.equal(chosen(moved, "rollout")[known], same[known])
