"""Weight rounds into real generator processes: a vLLM engine (CPU build) and transformers models.

Generators are `tests/helpers/ws_generator.py` subprocesses; they report each load as a JSON line.
The service runs in a thread of the test process; the sender (learner rank 0's side) too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from launch.ports import free_port_block
from tests.helpers.procs import ROOT, subprocess_env
from tests.helpers.ws_generator import digest
from weight_sync.client import GeneratorSyncClient
from weight_sync.config import WeightSyncConfig
from weight_sync.receiver import receive_into_model
from weight_sync.sender import WeightSender
from weight_sync.service import WeightSyncService

HELPER = str(ROOT / "tests" / "helpers" / "ws_generator.py")


# ---------------------------------------------------------------------------------------------
# helpers


def state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


class Generator:
    """A helper process and the events it wrote."""

    def __init__(self, tmp: Path, port: int, worker_id: str, model: Path, engine: str = "transformers", *flags):
        self.events_path = tmp / f"{worker_id}.jsonl"
        self.log_path = tmp / f"{worker_id}.log"
        self.proc = subprocess.Popen(
            [sys.executable, HELPER, "--port", str(port), "--worker-id", worker_id, "--engine", engine,
             "--model", str(model), "--events", str(self.events_path), *flags],
            env=subprocess_env(), stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)

    def events(self) -> list[dict]:
        if not self.events_path.exists():
            return []
        return [json.loads(line) for line in self.events_path.read_text().splitlines() if line.strip()]

    def wait(self, pred, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for e in self.events():
                if pred(e):
                    return e
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        tail = self.log_path.read_text()[-3000:] if self.log_path.exists() else ""
        raise AssertionError(f"no matching event from {self.events_path.name} within {timeout_s}s "
                             f"(rc={self.proc.poll()}); events={self.events()}\nlog tail:\n{tail}")

    def stop(self) -> None:
        """SIGKILL the helper's process group: a vLLM engine core outlives its parent (it was left
        polling, a core's worth of CPU, after each run of this module)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


def start_service(**kw) -> tuple[WeightSyncService, int]:
    port = free_port_block(1)
    svc = WeightSyncService(WeightSyncConfig(port=port, **kw))
    svc.start()
    return svc, port


def status(port: int) -> dict:
    with GeneratorSyncClient("127.0.0.1", port, "observer") as c:
        return c.status()


@torch.no_grad()
def greedy(model_dir: Path, prompt_ids: list[list[int]], n: int) -> list[list[int]]:
    """Greedy continuation by transformers: argmax over the full sequence each step, fp32."""
    from learner.modeling import load_causal_lm

    model = load_causal_lm(str(model_dir))
    out = []
    for ids in prompt_ids:
        seq = torch.tensor([ids])
        for _ in range(n):
            nxt = model(input_ids=seq).logits[0, -1].argmax()
            seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
        out.append(seq[0, len(ids):].tolist())
    return out


@pytest.fixture(scope="module")
def seed1_model_dir(tmp_path_factory) -> Path:
    from demo.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model_seed1"), seed=1)


# ---------------------------------------------------------------------------------------------
# vLLM: one engine for the module


@pytest.fixture(scope="module")
def vllm_generator(tmp_path_factory, tiny_model_dir):
    svc, port = start_service(stale_after_s=600)
    tmp = tmp_path_factory.mktemp("ws_vllm")
    gen = Generator(tmp, port, "vllm0", tiny_model_dir, "vllm")
    sender = WeightSender("127.0.0.1", port, timeout_s=60, join_timeout_s=20, same_host="auto")
    try:
        ready = gen.wait(lambda e: e["kind"] == "ready", 180)
        yield svc, port, gen, sender, ready
    finally:
        gen.stop()
        sender.close()
        svc.stop()


@pytest.mark.slow
def test_vllm_round_matches_transformers_greedy(vllm_generator, tiny_model_dir, seed1_model_dir):
    svc, port, gen, sender, ready = vllm_generator
    prompt_ids, n = ready["prompt_ids"], len(ready["outputs"][0])
    before = greedy(tiny_model_dir, prompt_ids, n)
    want = greedy(seed1_model_dir, prompt_ids, n)
    assert ready["outputs"] == before  # the engine starts from seed 0
    assert want != before  # seed 1 really is a different model
    stats = sender.publish(5, state_dict(seed1_model_dir).items())
    assert stats["ok"] == ["vllm0"] and stats["failed"] == [], stats
    assert stats["bytes"] > 0 and stats["buckets"] == 1 and stats["broadcast_s"] > 0
    ev = gen.wait(lambda e: e["kind"] == "round" and e["version"] == 5, 60)
    assert ev["outputs"] == want, "vLLM after the round differs from transformers with the sent weights"
    assert ev["stats"]["load_s"] > 0 and ev["mode"] == "finish"
    # no reload_weights: this engine runs vLLM's default kernels, which on CPU compute from repacked
    # weights, so the round repacks them (a generator's float32 engine keeps plain weights,
    # generator.cpu_linear auto, and its round is a copy: the e2e run's evaluations check that)
    assert ev["stats"]["load_path"] == ("direct" if torch.cuda.is_available() else "repack")
    assert ev["stats"]["via"] == "shm_in_place"  # one host: loaded straight out of the sender's segment, not broadcast
    st = status(port)
    assert st["generators"]["vllm0"]["version"] == 5 and st["generators"]["vllm0"]["lag"] == 0
    assert st["current_version"] == 5 and st["last_round"]["ok"] == ["vllm0"]


@pytest.mark.slow
def test_vllm_interrupt_mode_loads_with_requests_in_flight(vllm_generator, tiny_model_dir):
    svc, port, gen, sender, ready = vllm_generator
    svc.state.cfg.mode = "interrupt"  # rounds from now on say: pause, load, resume
    try:
        stats = sender.publish(6, state_dict(tiny_model_dir).items())  # back to seed 0's weights
    finally:
        svc.state.cfg.mode = "finish"
    assert stats["ok"] == ["vllm0"], stats
    ev = gen.wait(lambda e: e["kind"] == "round" and e["version"] == 6, 60)
    assert ev["mode"] == "interrupt"
    # the request that was running when the round arrived was paused, not dropped: it finished
    assert ev["long_finish"] == "length" and ev["long_tokens"] == 200
    assert 5 <= ev["tokens_before_load"] < 200
    # and the engine now generates with the new (seed 0) weights
    assert ev["outputs"] == greedy(tiny_model_dir, ready["prompt_ids"], len(ready["outputs"][0]))
    assert status(port)["generators"]["vllm0"]["version"] == 6


@pytest.mark.slow
def test_vllm_engine_survives_a_round_that_never_runs(vllm_generator, seed1_model_dir):
    """A round whose sender never shows up: receive_weights gives up within the round's timeout,
    the error comes back through collective_rpc, and the engine keeps its weights and serving."""
    from weight_sync import buckets as bk
    from weight_sync.client import ask, channel
    from weight_sync.messages import Ready
    from weight_sync.round import open_store

    svc, port, gen, sender, ready = vllm_generator
    sent = state_dict(seed1_model_dir)
    manifest = bk.plan(bk.specs_of(sent.items())[0], 256 << 20)
    store = open_store("127.0.0.1", 0, 10, is_master=True)  # a rendezvous nobody will drive
    ask(channel("127.0.0.1", port), Ready("ghost-sender", 7, "gloo", manifest, "127.0.0.1", store.port, "", False,
                                         2.0, 1.0))
    ev = gen.wait(lambda e: e["kind"] == "missed" and e["version"] == 7, 30)
    assert "no roster" in ev["error"]
    assert status(port)["generators"]["vllm0"]["version"] < 7
    # the engine still works, and the next real round loads; through the broadcast this time, so
    # that both paths are held to transformers' greedy outputs for the same weights
    with WeightSender("127.0.0.1", port, timeout_s=60, join_timeout_s=20, same_host="broadcast",
                      sender_id="learner-broadcast") as broadcast_only:
        stats = broadcast_only.publish(8, sent.items())
    assert stats["ok"] == ["vllm0"], stats
    ev = gen.wait(lambda e: e["kind"] == "round" and e["version"] == 8, 60)
    assert ev["stats"]["via"] == "broadcast"
    assert ev["stats"]["load_path"] == ("direct" if torch.cuda.is_available() else "repack")
    assert ev["outputs"] == greedy(seed1_model_dir, ready["prompt_ids"], len(ready["outputs"][0]))


# ---------------------------------------------------------------------------------------------
# transformers generator processes


@pytest.mark.slow
def test_two_generators_get_the_round_and_a_late_one_catches_up(tmp_path, tiny_model_dir, seed1_model_dir):
    svc, port = start_service()
    sent = state_dict(seed1_model_dir)
    want = digest(sent.items())
    gens = [Generator(tmp_path, port, f"g{i}", tiny_model_dir) for i in range(2)]
    sender = WeightSender("127.0.0.1", port, timeout_s=30, join_timeout_s=20, bucket_mb=0.25,
                          serve_interval_s=0.1)
    late = None
    try:
        for g in gens:
            assert g.wait(lambda e: e["kind"] == "ready", 90)["digest"] != want
        stats = sender.publish(1, sent.items())
        assert stats["ok"] == ["g0", "g1"] and stats["buckets"] > 1, stats
        for g in gens:
            ev = g.wait(lambda e: e["kind"] == "round", 30)
            assert (ev["version"], ev["catch_up"], ev["digest"]) == (1, False, want)
        # a third generator, started after the publish, gets version 1 before it would lease
        late = Generator(tmp_path, port, "late", tiny_model_dir, "transformers", "--wait-current")
        ev = late.wait(lambda e: e["kind"] == "round", 90)
        assert (ev["version"], ev["catch_up"], ev["digest"]) == (1, True, want)
        assert late.wait(lambda e: e["kind"] == "current", 10)["version"] == 1
        st = status(port)
        assert {w: g["version"] for w, g in st["generators"].items()} == {"g0": 1, "g1": 1, "late": 1}
        assert st["max_lag"] == 0 and st["catch_up_rounds"] == 1
    finally:
        for g in gens + ([late] if late else []):
            g.stop()
        sender.close()
        svc.stop()


@pytest.mark.slow
def test_generator_killed_mid_round(tmp_path, tiny_model_dir, seed1_model_dir):
    """'doomed' exits after the first bucket: the others' broadcast fails, they report it and are
    served in a second attempt. (A member that failed must drop its group at once, with the
    collectives queued on it: one that receives through it would otherwise hang until the next
    attempt, after the sender's grace period, and be counted failed; it was, 1 run in 2.)"""
    svc, port = start_service()
    sent = state_dict(seed1_model_dir)
    gens = [Generator(tmp_path, port, "g0", tiny_model_dir), Generator(tmp_path, port, "g1", tiny_model_dir),
            Generator(tmp_path, port, "doomed", tiny_model_dir, "transformers", "--die-mid-round")]
    timeout_s = 30
    # 64 KiB buckets: the 1.4 MB model takes ~20 broadcasts, and "doomed" dies after the first
    sender = WeightSender("127.0.0.1", port, timeout_s=timeout_s, join_timeout_s=20, bucket_mb=1 / 16,
                          serve_in_background=False, same_host="broadcast")
    try:
        for g in gens:
            g.wait(lambda e: e["kind"] == "ready", 90)
        stats = sender.publish(1, sent.items())
        assert sorted(stats["members"]) == ["doomed", "g0", "g1"]
        assert stats["ok"] == ["g0", "g1"] and stats["failed"] == ["doomed"], stats
        assert stats["attempts"] == 2 and stats["buckets"] > 10
        assert stats["total_s"] < timeout_s
        assert gens[2].proc.wait(10) == 17  # it did die mid-round
        for g in gens[:2]:
            ev = g.wait(lambda e: e["kind"] == "round", 30)
            assert ev["version"] == 1 and ev["digest"] == digest(sent.items())
        assert status(port)["generators"]["doomed"]["dead"]
        # the next round works, without the dead member
        sent2 = {k: v * 0.5 for k, v in sent.items()}
        stats2 = sender.publish(2, sent2.items())
        assert sorted(stats2["members"]) == ["g0", "g1"] and stats2["ok"] == ["g0", "g1"] and stats2["attempts"] == 1
        for g in gens[:2]:
            ev = g.wait(lambda e: e["kind"] == "round" and e["version"] == 2, 30)
            assert ev["digest"] == digest(sent2.items())
    finally:
        for g in gens:
            g.stop()
        sender.close()
        svc.stop()


# ---------------------------------------------------------------------------------------------
# disk fallback (no processes: clients and models in this process)


def test_disk_round_and_disk_catch_up(tmp_path, tiny_model_dir, seed1_model_dir):
    from learner.modeling import load_causal_lm

    svc, port = start_service()
    sent = state_dict(seed1_model_dir)
    sender = WeightSender("127.0.0.1", port, timeout_s=10, backend="disk", disk_dir=str(tmp_path / "weights"),
                          disk_keep=1)
    try:
        early = GeneratorSyncClient("127.0.0.1", port, "early")
        early.register("transformers")
        model = load_causal_lm(str(tiny_model_dir))
        stats = sender.publish(3, sent.items())
        assert stats["members"] == ["early"] and stats["path"].endswith("v00000003")
        assert (Path(stats["path"]) / "model.safetensors").exists() and (Path(stats["path"]) / "manifest.json").exists()
        info = early.poll()
        assert info.backend == "disk" and info.version == 3
        receive_into_model(model, info)
        early.done(3)
        assert all(torch.equal(p, sent[n]) for n, p in model.state_dict().items())
        # a newcomer catches up from the folder; the service serves that without the sender
        sender.publish(4, {k: v + 1 for k, v in sent.items()}.items())
        assert not (tmp_path / "weights" / "v00000003").exists()  # disk_keep=1
        late = GeneratorSyncClient("127.0.0.1", port, "late")
        late.register("transformers")
        info = late.wait_current(5)
        assert info.catch_up and info.version == 4
        model2 = load_causal_lm(str(tiny_model_dir))
        receive_into_model(model2, info)
        late.done(4)
        assert all(torch.equal(p, sent[n] + 1) for n, p in model2.state_dict().items())
        st = status(port)
        assert st["generators"]["late"]["version"] == 4 and st["generators"]["early"]["lag"] == 1
    finally:
        sender.close()
        svc.stop()


# ---------------------------------------------------------------------------------------------
# the plan load (actors.engines.vllm.load) against vLLM's own load_weights

_DIRECT_COPY_CHECK = (r"""
import json, os, sys, tempfile
import torch
from safetensors.torch import load_file
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.models.llama import LlamaForCausalLM
from actors.engines.vllm.load import apply_plan, load_plan

model_dir = sys.argv[1]
cfg = VllmConfig(model_config=ModelConfig(model=model_dir, dtype="float32"))
with set_current_vllm_config(cfg):
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method="file://" + tempfile.mktemp())
    initialize_model_parallel(1, 1)
    by_load, by_copy = (LlamaForCausalLM(vllm_config=cfg, prefix=p) for p in ("a", "b"))
named = list(load_file(os.path.join(model_dir, "model.safetensors")).items())
by_load.load_weights(iter(named))
plan = load_plan(by_copy, named, staging={})
assert plan is not None and plan.rebind == []  # nothing repacked yet: copies only
apply_plan(plan, named)
a, b = dict(by_load.named_parameters()), dict(by_copy.named_parameters())
out = {"fused": sorted(k for k in a if "qkv_proj" in k or "gate_up_proj" in k),
       "names_equal": sorted(a) == sorted(b), "differ": [k for k in a if not torch.equal(a[k], b[k])]}

# both processed as after a checkpoint load: on the CPU build the linear layers now compute from
# oneDNN's repacked copies and drop their weights; a round of other weights (x0.5), then the
# original ones again, must reach those kernels
for m in (*by_load.modules(), *by_copy.modules()):
    if getattr(m, "quant_method", None) is not None:
        m.quant_method.process_weights_after_loading(m)
staging = {}
layers = {n: m for n, m in by_copy.named_modules() if hasattr(m, "cpu_linear") """
r"""and hasattr(m, "input_size_per_partition")}
ref = dict(by_load.named_modules())
x = {n: torch.randn(3, m.input_size_per_partition) for n, m in layers.items()}
def outputs(model_layers):
    return {n: model_layers[n].cpu_linear(x[n], model_layers[n].weight, None) for n in layers}
want = {n: ref[n].cpu_linear(x[n], ref[n].weight, None) for n in layers}
half = [(n, t * 0.5) for n, t in named]
plan = load_plan(by_copy, half, staging)
apply_plan(plan, half)
got_half = outputs(layers)
ptrs = sorted(t.data_ptr() for t in staging.values())
plan = load_plan(by_copy, named, staging)
apply_plan(plan, named)
got = outputs(layers)
out.update(repacked=len(plan.rebind), layers=len(layers), dropped=sum(m.weight.numel() == 0 for m in layers.values()),
           staging_kept=ptrs == sorted(t.data_ptr() for t in staging.values()),
           half_ok=all(torch.allclose(got_half[n], 0.5 * want[n], atol=1e-5) for n in layers),
           back_ok=all(torch.allclose(got[n], want[n], atol=1e-6) for n in layers))
print(json.dumps(out))
""")


def test_direct_copy_load_equals_load_weights(tiny_model_dir):
    """vLLM's Llama (its own class, one rank): copying the received tensors into the parameters
    through `load_plan` (fused qkv / gate_up rows, the padded vocabulary) gives exactly the
    parameters its `load_weights` gives; and once the CPU build has repacked the linear layers for
    oneDNN (generator.cpu_linear packed), a round repacks each from its new weight. \
(Run in a child: vLLM's parallel state is process-wide.)"""
    out = subprocess.run([sys.executable, "-c", _DIRECT_COPY_CHECK, str(tiny_model_dir)],
                         env={**subprocess_env(), "CONVEYOR_CPU_LINEAR": "packed"},
                         capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["names_equal"] and got["differ"] == []
    assert len(got["fused"]) == 4  # 2 layers x (qkv_proj, gate_up_proj): the fused rows were placed
    if torch.cuda.is_available():
        return  # (the packed kernels below are the CPU build's)
    # the packed CPU kernels: every linear layer repacked from its new weight (staging kept between rounds)
    # 2 x (qkv, o, gate_up, down) dropped their weights; the embedding and the LM head keep theirs
    assert (got["layers"], got["repacked"], got["dropped"]) == (10, 8, 8), got
    assert got["half_ok"] and got["back_ok"] and got["staging_kept"], got
