"""Weight-sync mode `interrupt`: new weights loaded into a batch while it generates.

The live test runs a real buffer (`launch.buffer`), a weight-sync service in this process (mode
`interrupt`) and a generator process (`launch.generator`, vLLM's AsyncLLM), and reads the raw
rollouts from the buffer's relay (no scorer needed). While the generator's second batch runs, a
`WeightSender` publishes version 1 (the seed-1 model's weights); the rollouts must then say, token
by token, which weights sampled what, and the behaviour log-probs must be those weights' numbers.

A request paused mid-completion keeps its KV cache: after the switch, the new weights attend to
keys and values the old weights computed for the earlier tokens. `mixed_reference` rebuilds
exactly that with transformers (the seed-0 model's cache handed to the seed-1 model), and the test
also checks that neither model alone explains the tokens after the switch.

The unit tests drive `generate_batch` with a fake engine and a fake weight-sync client.
"""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from actors.engines.base import Completion, Engine
from actors.generator import generate_batch
from actors.weight_hook import WeightSyncHook
from buffer.client import BufferClient
from launch.ports import free_port_block
from tests.helpers.buffer import start_buffer, started
from tests.helpers.procs import start_role, stop, wait_exit

TOL = 1e-4  # as tests/actors/test_engines.py: vLLM's CPU build and transformers agree to ~5e-7 in fp32
PROMPTS = [{"prompt": p, "label": ""} for p in
           ["12+34=", "hello world", "The quick brown fox", "99+11=", "7*8=", "abc"]]
N_SAMPLES = 8
GROUPS_PER_LEASE = 2  # 3 leases of 16 samples: a warm-up, the one the round lands in, one after
TEMPERATURE = 0.8


@torch.no_grad()
def mixed_reference(m0, m1, prompt: list[int], completion: list[int], switch: int, temperature: float):
    """(T,) log mu of each completion token when tokens [0, switch) were sampled by `m0` and the
    rest by `m1`, the request keeping its KV cache across the switch.

    Completion token j is sampled from the forward pass over position P+j-1, and that pass writes
    the position's keys and values. So `m0` ran positions [0, P+switch-1) (the prompt's prefill
    sampled token 0), and `m1` runs from position P+switch-1 on, attending to `m0`'s cache.
    """
    P, T = len(prompt), len(completion)
    ids = torch.tensor([list(prompt) + list(completion)])  # (1, P+T)
    if switch == 0:  # paused before its prefill: all new weights
        logits = m1(input_ids=ids).logits[0, P - 1 : P + T - 1]  # (T, V)
    elif switch == T:
        logits = m0(input_ids=ids).logits[0, P - 1 : P + T - 1]
    else:
        cut = P + switch - 1
        old = m0(input_ids=ids[:, :cut], use_cache=True)
        new = m1(input_ids=ids[:, cut : P + T - 1], past_key_values=old.past_key_values, use_cache=True)
        logits = torch.cat([old.logits[0, P - 1 : cut], new.logits[0]])  # (switch + T-switch, V)
    lp = F.log_softmax(logits.float() / temperature, dim=-1)
    return lp.gather(-1, torch.tensor(completion)[:, None])[:, 0]


@torch.no_grad()
def full_reference(model, prompt, completion, temperature: float):
    """(T,) log-probs of the completion under `model` alone (one forward over everything)."""
    ids = torch.tensor([list(prompt) + list(completion)])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    return F.log_softmax(logits.float() / temperature, dim=-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def switch_index(versions: np.ndarray) -> int:
    """Index of the first version-1 token (len(versions) if none)."""
    ones = np.flatnonzero(versions == 1)
    return int(ones[0]) if len(ones) else len(versions)


@pytest.mark.slow
def test_interrupt_mode_loads_weights_into_the_running_batch(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file

    from demo.tiny_model import build_tiny_model
    from learner.modeling import load_causal_lm
    from weight_sync.client import GeneratorSyncClient
    from weight_sync.config import WeightSyncConfig
    from weight_sync.sender import WeightSender
    from weight_sync.service import WeightSyncService

    t_start = time.monotonic()
    seed1_dir = build_tiny_model(tmp_path / "seed1", seed=1)
    ws_port = free_port_block(1)
    svc = WeightSyncService(WeightSyncConfig(port=ws_port, mode="interrupt"))
    svc.start()
    buffer, port = started(start_buffer(tmp_path, rows=PROMPTS, n_samples_per_prompt=N_SAMPLES,
                                        prompts_per_step=len(PROMPTS), shuffle_seed="none", lease_ttl_s=120))
    relay = BufferClient("127.0.0.1", port, timeout_s=10)
    relay.pull_rollouts(timeout_s=0.01)  # connect to the relay before anything is pushed
    # Long completions: the tiny random model emits eos at ~1% of tokens, so the longest of a lease's
    # 16 samples usually runs 300-480 tokens, most of a second on the CPU build. The round is
    # published once the second lease is logged (the first one's batch warms the engine up: its
    # first step is slow); the generator's first poll comes weight_sync_poll_s into the batch, and
    # the service holds the offer until then: the round lands that far in, a few dozen tokens.
    gen, gen_log = start_role(tmp_path, "generator", "generator", port, model=tiny_model_dir, engine="vllm",
                              async_engine="true", worker_id="gen-int", groups_per_lease=GROUPS_PER_LEASE,
                              max_new_tokens=480, temperature=TEMPERATURE, max_model_len=512, prompt_max_len=32,
                              max_batches=3, weight_sync_port=ws_port, weight_sync_poll_s=0.1, log_every_s=1)
    sender = WeightSender("127.0.0.1", ws_port, timeout_s=60, join_timeout_s=20, serve_in_background=False)
    rollouts = []
    expected = len(PROMPTS) * N_SAMPLES
    try:
        deadline = time.monotonic() + 150
        while len(re.findall(r"lease \d+: ", gen_log.read_text())) < 2:  # the second batch is starting
            assert gen.poll() is None and time.monotonic() < deadline, gen_log.read_text()[-3000:]
            time.sleep(0.01)
        relay.set_version(1)  # as the learner does: the buffer first, then the weights
        stats = sender.publish(1, load_file(str(seed1_dir / "model.safetensors")).items())
        assert stats["ok"] == ["gen-int"] and stats["failed"] == [], stats
        while len(rollouts) < expected and time.monotonic() < deadline:
            rollouts += relay.pull_rollouts(timeout_s=1.0)
        assert wait_exit(gen, gen_log, 60) == 0, gen_log.read_text()[-4000:]
        with GeneratorSyncClient("127.0.0.1", ws_port, "observer") as c:
            assert c.status()["generators"]["gen-int"]["version"] == 1
    finally:
        relay.close()
        sender.close()
        stop(gen)
        stop(buffer)
        svc.stop()
    log = gen_log.read_text()
    assert "weights v1 loaded into the running batch" in log, log[-3000:]
    assert len(rollouts) == expected, f"{len(rollouts)} rollouts of {expected}:\n{log[-3000:]}"

    leases = sorted({r.lease_id for r in rollouts})
    assert len(leases) == 3
    before, during, after = ([r for r in rollouts if r.lease_id == lease] for lease in leases)
    for r in rollouts:
        v = r.versions
        assert len(v) == len(r.completion_ids) == len(r.behav_logprobs)
        assert set(np.unique(v)) <= {0, 1} and np.all(np.diff(v) >= 0), v  # [0, ..., 0, 1, ..., 1]
    assert all(np.all(r.versions == 0) for r in before) and all(np.all(r.versions == 1) for r in after)
    counts = [(int((r.versions == 0).sum()), int((r.versions == 1).sum())) for r in during]
    mixed = [r for r in during if 0 < switch_index(r.versions) < len(r.versions)]
    assert mixed, f"the round did not land inside the second batch: (v0, v1) tokens {counts}\n{log[-3000:]}"

    # Behaviour log-probs: each token's from the weights its version names (and the cache it saw).
    m0, m1 = load_causal_lm(str(tiny_model_dir)), load_causal_lm(str(seed1_dir))
    gaps, v0_only, v1_only = [], [], []
    mixed_ids = {id(r) for r in mixed}
    for r in rollouts:
        s = switch_index(r.versions)
        ref = mixed_reference(m0, m1, r.prompt_ids.tolist(), r.completion_ids.tolist(), s, TEMPERATURE)
        gaps.append(float((torch.tensor(r.behav_logprobs) - ref).abs().max()))
        if id(r) in mixed_ids:  # after the switch: neither the old weights nor a fresh pass of the new ones
            behav = torch.tensor(r.behav_logprobs[s:])
            for model, out in ((m0, v0_only), (m1, v1_only)):
                alone = full_reference(model, r.prompt_ids.tolist(), r.completion_ids.tolist(), TEMPERATURE)
                out.append(float((alone[s:] - behav).abs().max()))
    switches = [(switch_index(r.versions), len(r.versions)) for r in mixed]
    print(f"{len(mixed)} mixed rollouts (switch, length) {switches}; largest gap to the reference "
          f"{max(gaps):.3g}; after the switch, gap to v0 alone {min(v0_only):.3g}, to a fresh v1 pass "
          f"{min(v1_only):.3g}; test took {time.monotonic() - t_start:.0f}s; (v0, v1) tokens {counts}")
    assert max(gaps) < TOL, f"behaviour log-probs vs the per-version reference: gaps {gaps}"
    assert min(v0_only) > 100 * TOL  # the tokens after the switch really came from the new weights
    assert min(v1_only) > 10 * TOL  # ... attending to the old weights' cache (kept, not recomputed)


# ---------------------------------------------------------------------------------------------
# generate_batch and the hook, with fakes


class FakeEngine(Engine):
    """A batch that takes 0.2 s on another thread; notes each load and whether a batch was running."""

    loads_mid_batch = True

    def __init__(self):
        self.loaded: list[tuple[int, str, bool]] = []
        self.batch: Future | None = None

    def submit(self, prompt_ids, n, sampling) -> Future:
        self.batch = batch = Future()
        done = [[Completion([5, 6], [-1.0, -2.0], "length", "xy", [0, 1])]]
        threading.Timer(0.2, lambda: batch.set_result(done)).start()
        return batch

    def generate(self, prompt_ids, n, sampling):
        return [[Completion([5], [-1.0], "length", "x")]]

    def receive_weights(self, round_info) -> None:
        running = self.batch is not None and not self.batch.done()
        self.loaded.append((round_info.version, round_info.mode, running))
        self.version = round_info.version  # an engine stamps the version it loaded


class FakeSyncClient:
    """Answers polls from a script; notes the thread of every call and every `done`."""

    def __init__(self, engine: FakeEngine, script: list[dict | None]):
        self.engine, self.script = engine, list(script)
        self.threads: set[int] = set()
        self.dones: list[int] = []

    def poll(self):
        self.threads.add(threading.get_ident())
        return self.script.pop(0) if self.script else None

    def done(self, version, ok=True, load_s=0.0, error=""):
        self.threads.add(threading.get_ident())
        self.dones.append(version)


def Round(version: int, mode: str):
    """The two fields of a round's description that the generator's hook reads."""
    return SimpleNamespace(version=version, mode=mode)


def fake_hook(engine: FakeEngine, script, mode: str = "interrupt") -> WeightSyncHook:
    return WeightSyncHook(FakeSyncClient(engine, script), mode, timeout_s=1.0, poll_s=0.001)  # (no service)


def test_interrupt_round_is_loaded_into_the_running_batch():
    engine = FakeEngine()
    hook = fake_hook(engine, [None, Round(version=3, mode="interrupt")])
    out = generate_batch(engine, [[1, 2]], 1, None, hook)
    assert out[0][0].versions == [0, 1]
    assert engine.loaded == [(3, "interrupt", True)] and hook.ws.dones == [3] and engine.version == 3
    assert hook.ws.threads == {threading.get_ident()}  # the client never left the loop's thread


def test_finish_round_arriving_mid_batch_waits_for_the_batch():
    # the service switched to `finish`: the round is loaded after the batch, then polling stops
    engine = FakeEngine()
    hook = fake_hook(engine, [Round(version=4, mode="finish"), Round(version=5, mode="interrupt")])
    generate_batch(engine, [[1]], 1, None, hook)
    assert engine.loaded == [] and len(hook.ws.script) == 1  # no load, and no poll after the deferred round
    assert hook.deferred == Round(version=4, mode="finish")
    hook.poll(engine)  # between batches
    assert engine.loaded == [(4, "finish", False)] and hook.mode == "finish" and hook.deferred is None
    assert generate_batch(engine, [[1]], 1, None, hook)[0][0].token_ids == [5]  # plain generate now


def test_finish_mode_never_polls_mid_batch():
    engine = FakeEngine()
    hook = fake_hook(engine, [Round(version=1, mode="finish")], mode="finish")
    assert generate_batch(engine, [[1]], 1, None, hook)[0][0].versions is None
    assert hook.ws.script and engine.batch is None  # generate, not submit; the round still waits


def test_async_engine_needs_vllm():
    from actors.config import GeneratorConfig
    from common.config import ConfigError, load_section

    args = ["--generator.model", "/m", "--generator.async_engine", "true"]
    cfg = load_section(GeneratorConfig, "generator", None, args)
    assert cfg.async_engine and cfg.engine == "vllm"
    with pytest.raises(ConfigError, match="async_engine=true needs generator.engine='vllm'"):
        load_section(GeneratorConfig, "generator", None, args + ["--generator.engine", "transformers"])
