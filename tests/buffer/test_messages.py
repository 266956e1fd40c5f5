"""The wire protocol: round trips of every message, array views, limits and malformed envelopes."""

import msgpack
import numpy as np
import pytest

from buffer.messages import (
    ID_DTYPE,
    LOGPROB_DTYPE,
    MAX_ITEMS,
    MAX_STR,
    MAX_TOKENS,
    SCHEMA_VERSION,
    Ack,
    Batch,
    BatchRequest,
    Error,
    GroupFailed,
    LeaseGrant,
    LeaseRenew,
    LeaseRequest,
    Limits,
    Metrics,
    MetricsRequest,
    PromptGroup,
    ProtocolError,
    Rollout,
    RolloutsMsg,
    ScoredMsg,
    ScoredRollout,
    SetVersion,
    Wait,
    check_scored,
    decode,
    decode_envelope,
    decode_item,
    encode,
    encode_batch,
    encode_item,
)


def rollout(group_id=3, sample_index=1, lease_id=7, t=5, label="42"):
    return Rollout(
        group_id=group_id, sample_index=sample_index, lease_id=lease_id,
        prompt_ids=np.array([1, 2, 3]), completion_ids=np.arange(10, 10 + t),
        behav_logprobs=-np.linspace(0.1, 0.5, t), versions=np.full(t, 4),
        prompt="2+2=", completion="4", label=label, finish_reason="stop", worker_id="gen-0",
    )


def scored(**kw):
    r = rollout(**kw)
    return ScoredRollout(r, reward=0.5, scores={"correct": 1.0, "len": -0.5},
                         ref_logprobs=-np.linspace(0.2, 0.6, len(r.completion_ids)),
                         metadata={"k": 1, "s": "x", "b": True, "n": None})


def assert_rollout_equal(a: Rollout, b: Rollout):
    for name in ("group_id", "sample_index", "lease_id", "prompt", "completion", "label", "finish_reason",
                 "worker_id"):
        assert getattr(a, name) == getattr(b, name), name
    np.testing.assert_array_equal(a.prompt_ids, b.prompt_ids)
    np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
    np.testing.assert_array_equal(a.versions, b.versions)
    np.testing.assert_allclose(a.behav_logprobs, b.behav_logprobs, rtol=1e-6)  # float32 on the wire


def roundtrip(msg):
    frames = encode(msg)
    assert all(isinstance(f, bytes) for f in frames)
    return decode(frames)


# ---- round trips ------------------------------------------------------------------------------


def test_rollouts_and_scored_round_trip():
    rs = [rollout(sample_index=i, t=3 + i) for i in range(3)]
    back = roundtrip(RolloutsMsg(rs))
    assert isinstance(back, RolloutsMsg) and len(back.rollouts) == 3
    for a, b in zip(rs, back.rollouts):
        assert_rollout_equal(a, b)

    s = scored()
    back = roundtrip(ScoredMsg([s]))
    assert isinstance(back, ScoredMsg)
    b = back.scored[0]
    assert_rollout_equal(s.rollout, b.rollout)
    assert b.reward == 0.5 and b.scores == {"correct": 1.0, "len": -0.5} and not b.failed
    assert b.metadata == {"k": 1, "s": "x", "b": True, "n": None}
    np.testing.assert_allclose(b.ref_logprobs, s.ref_logprobs, rtol=1e-6)


def test_arrays_arrive_as_read_only_views_with_the_wire_dtypes():
    s = scored()
    s.rollout.label = None
    b = roundtrip(ScoredMsg([s])).scored[0]
    r = b.rollout
    assert r.label is None
    for arr, dtype in ((r.prompt_ids, ID_DTYPE), (r.completion_ids, ID_DTYPE), (r.versions, ID_DTYPE),
                       (r.behav_logprobs, LOGPROB_DTYPE), (b.ref_logprobs, LOGPROB_DTYPE)):
        assert arr.dtype == dtype
        assert not arr.flags.writeable  # a view over the received bytes, not a copy
        assert arr.base is not None
    assert r.completion_ids.tolist() == [10, 11, 12, 13, 14]
    assert r.versions.tolist() == [4] * 5
    assert r.min_version == 4
    # -0.1 .. -0.5 as float32
    np.testing.assert_array_equal(r.behav_logprobs, np.float32(-np.linspace(0.1, 0.5, 5)))
    with pytest.raises(ValueError):
        r.completion_ids[0] = 1


def test_batch_round_trips_and_encode_batch_forwards_frames_unchanged():
    items = [scored(sample_index=i) for i in range(2)]
    b = roundtrip(Batch(step=5, rank=1, world_size=2, scored=items, stats={"staleness_mean": 0.5}))
    assert (b.step, b.rank, b.world_size, b.stats) == (5, 1, 2, {"staleness_mean": 0.5})
    assert [x.rollout.sample_index for x in b.scored] == [0, 1]

    frames = [encode_item(x) for x in items]
    out = encode_batch(6, 0, 1, frames, {"n": 2})
    assert out[1:] == frames  # the buffer's accepted bytes go out as they came in
    assert decode(out).step == 6


@pytest.mark.parametrize("msg", [
    LeaseRequest("gen-1", max_groups=4, version=2),
    LeaseRenew(9),
    GroupFailed(9, 12, "prompt too long"),
    Wait("admission", retry_after_s=0.25, done=False),
    Wait("exhausted", retry_after_s=0.1, done=True),
    BatchRequest(step=3, rank=1, world_size=4),
    SetVersion(11),
    MetricsRequest(),
    Metrics({"buffer/version": 3.0, "buffer/late": 2.0}),
    Ack(accepted=3, rejected=1, info="ok"),
    Error("bad thing", field="batch_request.rank"),
], ids=lambda m: type(m).__name__)
def test_control_messages_round_trip(msg):
    frames = encode(msg)
    assert len(frames) == 1
    assert roundtrip(msg) == msg


def test_lease_grant_round_trips():
    g = LeaseGrant(lease_id=4, groups=[PromptGroup(0, "a", None, 7), PromptGroup(1, "b", "x", 2)],
                   n_samples=8, ttl_s=30.0, version=3)
    assert roundtrip(g) == g


def test_encode_refuses_non_messages():
    with pytest.raises(TypeError):
        encode({"type": "ack"})


# ---- limits -----------------------------------------------------------------------------------


def test_oversized_frame_message_and_frame_count_are_refused():
    frames = encode(ScoredMsg([scored(t=100), scored(t=100)]))
    size = len(frames[1])
    with pytest.raises(ProtocolError) as e:
        decode(frames, Limits(max_frame_bytes=size - 1))
    assert e.value.field == "frame[1]"
    with pytest.raises(ProtocolError) as e:
        decode(frames, Limits(max_message_bytes=2 * size))
    assert e.value.field == "message"
    with pytest.raises(ProtocolError) as e:
        decode(frames, Limits(max_frames=2))
    assert e.value.field == "message"
    assert len(decode(frames).scored) == 2  # within the default limits


def test_oversized_array_string_and_map_are_refused_naming_the_field():
    # the limits on one field are declared on its type: MAX_TOKENS values, MAX_STR characters, MAX_ITEMS entries
    s = scored(t=MAX_TOKENS + 1)
    s.ref_logprobs = None
    with pytest.raises(ProtocolError) as e:
        decode(encode(ScoredMsg([s])))
    assert e.value.field == "scored[0].rollout.completion_ids"  # (prompt_ids is 3 tokens)
    assert len(decode(encode(ScoredMsg([scored(t=MAX_TOKENS)]))).scored[0].rollout.completion_ids) == MAX_TOKENS
    s = scored()
    s.rollout.prompt = "x" * (MAX_STR + 1)
    with pytest.raises(ProtocolError) as e:
        decode(encode(ScoredMsg([s])))
    assert e.value.field == "scored[0].rollout.prompt"
    with pytest.raises(ProtocolError) as e:
        decode(encode(Metrics({f"m{i}": 1.0 for i in range(MAX_ITEMS + 1)})))
    assert e.value.field == "metrics.values"
    assert len(decode(encode(Metrics({f"m{i}": 1.0 for i in range(MAX_ITEMS)}))).values) == MAX_ITEMS


# ---- malformed envelopes and items ------------------------------------------------------------


def env(**kw):
    return msgpack.packb({"v": SCHEMA_VERSION, **kw}, use_bin_type=True)


def test_wrong_schema_version_is_refused():
    frames = encode(SetVersion(1))
    d = msgpack.unpackb(frames[0])
    d["v"] = SCHEMA_VERSION + 1
    with pytest.raises(ProtocolError) as e:
        decode([msgpack.packb(d)])
    assert e.value.field == "envelope.v"


@pytest.mark.parametrize("frames,field", [
    ([], "message"),
    ([b"\xc1"], "envelope"),  # 0xc1 is never valid msgpack
    ([msgpack.packb([1, 2])], "envelope"),
    ([env(type="nonsense")], "envelope.type"),
    ([env(type=["a"])], "envelope.type"),  # an unhashable type used to escape as TypeError
    ([env(type="set_version")], "set_version.version"),
    ([env(type="set_version", version="3")], "set_version.version"),
    ([env(type="set_version", version=True)], "set_version.version"),
    ([env(type="set_version", version=-1)], "set_version.version"),
    ([env(type="set_version", version=1), b"extra"], "message"),
    ([env(type="scored", n=2), b"x"], "scored.n"),
    ([env(type="metrics", values={"a": None})], "metrics.values[...]"),  # used to escape as TypeError
    ([env(type="batch_request", step=0, rank=1 << 17, world_size=1)], "batch_request.rank"),
    ([env(type="lease_request", worker_id="w", max_groups=0, version=0)], "lease_request.max_groups"),
])
def test_malformed_envelopes_name_the_field(frames, field):
    with pytest.raises(ProtocolError) as e:
        decode(frames)
    assert e.value.field == field


def test_length_mismatches_are_refused():
    s = scored(t=5)
    s.rollout.versions = np.zeros(4)
    with pytest.raises(ProtocolError) as e:
        decode(encode(ScoredMsg([s])))
    assert e.value.field == "scored[0].rollout.versions"

    s = scored(t=5)
    s.ref_logprobs = np.zeros(6)
    with pytest.raises(ProtocolError) as e:
        decode(encode(ScoredMsg([s])))
    assert e.value.field == "scored[0].ref_logprobs"

    w = msgpack.unpackb(encode_item(scored()))
    w["rollout"]["behav_logprobs"] = b"\x00" * 7  # not a whole number of float32
    with pytest.raises(ProtocolError) as e:
        decode_item(msgpack.packb(w, use_bin_type=True), "scored", "item")
    assert e.value.field == "item.rollout.behav_logprobs"


def test_non_finite_reward_is_refused_unless_the_sample_failed():
    s = scored()
    s.reward = float("nan")
    with pytest.raises(ProtocolError) as e:
        decode(encode(ScoredMsg([s])))
    assert e.value.field == "scored[0].reward"
    s.failed, s.error = True, "reward model timed out"
    back = decode(encode(ScoredMsg([s]))).scored[0]
    assert back.failed and np.isnan(back.reward)


def test_decode_envelope_leaves_items_undecoded():
    frames = encode(ScoredMsg([scored(), scored()]))
    frames[2] = b"not msgpack at all \xc1"
    kind, e = decode_envelope(frames)  # the buffer checks the envelope of relayed messages only
    assert kind == "scored" and e.n == 2
    with pytest.raises(ProtocolError) as err:
        decode(frames)
    assert err.value.field == "scored[1]"


def test_a_multi_turn_rollout_carries_its_action_mask():
    """The policy's tokens (1) and an environment's (0) of one episode; absent means all the policy's."""
    r = rollout(t=5)
    r.action_mask = np.array([1, 1, 0, 0, 1], dtype=np.uint8)
    for b in (roundtrip(ScoredMsg([ScoredRollout(r, reward=1.0)])).scored[0].rollout,
              check_scored(encode_item(ScoredRollout(r, reward=1.0))).rollout):
        assert bytes(b.action_mask) == bytes([1, 1, 0, 0, 1])
    assert roundtrip(ScoredMsg([scored()])).scored[0].rollout.action_mask is None
    item = msgpack.unpackb(encode_item(ScoredRollout(r, reward=1.0)))
    item["rollout"]["action_mask"] = bytes([1, 0, 1])  # not one entry per completion token
    for check in (lambda f: decode_item(f, "scored"), check_scored):
        with pytest.raises(ProtocolError, match="action_mask: length 3 != completion length 5"):
            check(msgpack.packb(item))


# ---- a mixture-of-experts rollout's routes ----------------------------------------------------


def routed(width=1, t=5, layers=2, k=2, experts=8):
    """`rollout(t=t)` with the experts of its 3 + t - 1 tokens (every token but the last) per layer."""
    rows = 3 + t - 1
    ids = (np.arange(rows * layers * k) * 37 % experts).reshape(rows, layers, k)
    r = rollout(t=t)
    r.routes = ids.astype(np.uint8 if width == 1 else "<u2").tobytes()
    r.route_layers, r.route_k, r.route_width = layers, k, width
    return r, ids


@pytest.mark.parametrize("width,experts", [(1, 8), (2, 300)])  # uint16 from 256 experts on
def test_routes_round_trip_as_the_same_array(width, experts):
    r, ids = routed(width, experts=experts)
    assert (int(ids.max()) >= 256) == (width == 2)
    frame = encode_item(ScoredRollout(r, reward=1.0))
    for back in (decode_item(encode_item(r), "rollouts"), roundtrip(RolloutsMsg([r])).rollouts[0],
                 decode_item(frame, "scored").rollout, check_scored(frame).rollout):
        got = back.route_array()
        assert got.shape == (7, 2, 2) and got.dtype.itemsize == width
        np.testing.assert_array_equal(got, ids)
        assert (back.route_layers, back.route_k, back.route_width) == (2, 2, width)
    assert rollout().route_array() is None
    assert decode_item(encode_item(rollout()), "rollouts").routes is None


def test_routes_that_do_not_fit_the_rollout_are_refused_naming_routes():
    r, _ = routed()
    item = msgpack.unpackb(encode_item(ScoredRollout(r, reward=1.0)))
    short = dict(item["rollout"], routes=r.routes[:-4])  # one token's routes (2 layers x 2) missing
    no_layers = dict(item["rollout"], route_layers=0)
    for bad, why in ((short, "24 bytes, not the 28 of 7 tokens x 2 layers x 2 experts x 1 bytes"),
                     (no_layers, "route_layers=0 and route_k=2 must be >= 1 with routes")):
        frame = msgpack.packb(dict(item, rollout=bad))
        for check in (lambda f: decode_item(f, "scored"), check_scored):
            with pytest.raises(ProtocolError) as e:
                check(frame)
            assert e.value.field == "item.rollout.routes" and why in e.value.problem
    with pytest.raises(ProtocolError) as e:  # and a rollout built so, before it is sent
        Rollout(**{f: getattr(r, f) for f in r.__struct_fields__ if f != "routes"}, routes=r.routes + b"\0")
    assert e.value.field == "routes"
