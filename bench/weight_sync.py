"""Weight-sync benchmark: how close a Conveyor round comes to a raw broadcast, over gloo on this machine.

    .venv/bin/python bench/weight_sync.py [--layers 8 --hidden 1024 --intermediate 2816] [--reps 3]
                                          [--bucket-mb 256] [--no-vllm]
    .venv/bin/python bench/weight_sync.py --quick     # a ~3M-parameter model, 3 reps, no vLLM (~1 min)

A Llama of ~100M parameters (fp32, random weights, built on the fly) travels from this process
(learner rank 0's role) to one receiver process, three ways:
  (a) raw:        one broadcast of a single flat tensor of the same bytes (group built beforehand)
  (b) bucketed:   a Conveyor round through the real service, WeightSender and receiver code
                  (`broadcast_s`: roster, group setup, every bucket, the receiver's report;
                  `round_s`: all of publish, packing and the control plane included)
  (c) per_tensor: one broadcast per tensor (group built beforehand)
(a) and (c) end with a 1-byte broadcast back from the receiver, so each time covers arrival.
Then (d) two rounds into a live vLLM engine (CPU build) for the same model: `vllm_load_s` is the
worker's `reload_weights` time (second round; the first also allocates the worker's receive
buffers: `vllm_first_*`). Medians over --reps. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _pg(port: int, rank: int, is_master: bool):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, None, is_master, timeout=timedelta(seconds=300), wait_for_workers=False)
    return store, dist.ProcessGroupGloo(dist.PrefixStore("raw", store), rank, 2, timedelta(seconds=300))


def _specs(model_dir: str) -> list[tuple[str, list[int]]]:
    from safetensors import safe_open

    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        return [(k, list(f.get_slice(k).get_shape())) for k in f.keys()]


# ---------------------------------------------------------------------------------------------
# the receiver process


def receiver(a) -> None:
    import torch

    from weight_sync.client import GeneratorSyncClient
    from weight_sync.receiver import receive_named_tensors

    specs = _specs(a.model)
    total = sum(4 * int(torch.Size(s).numel()) for _, s in specs)
    store, pg = _pg(a.store_port, 1, False)
    fence = torch.zeros(1, dtype=torch.uint8)
    flat = torch.empty(total, dtype=torch.uint8)
    tensors = [torch.empty(s, dtype=torch.float32) for _, s in specs]
    ws = GeneratorSyncClient("127.0.0.1", a.port, "bench-receiver", timeout_s=60)
    ws.register("bench")
    buffers: list = []  # kept between rounds, as the vLLM worker extension does on CPU
    for _ in range(a.reps):  # interleaved with the sender: load on this shared machine hits all three alike
        pg.broadcast(flat, 0).wait()  # (a)
        pg.broadcast(fence, 1).wait()
        for t in tensors:  # (c)
            pg.broadcast(t, 0).wait()
        pg.broadcast(fence, 1).wait()
        info = None  # (b)
        while info is None:
            info = ws.poll()
            if info is None:
                time.sleep(0.005)
        named, stats = receive_named_tensors(info, buffers=buffers)
        ws.done(info.version, load_s=0.0)
    ws.unregister()


def vllm_generator(a) -> None:
    from actors.vllm_engine import VLLMEngine
    from weight_sync.client import GeneratorSyncClient

    engine = VLLMEngine(a.model, dtype="float32", max_model_len=256)
    ws = GeneratorSyncClient("127.0.0.1", a.port, "bench-vllm", timeout_s=60)
    ws.register("vllm")
    print("VLLM_READY", flush=True)
    for _ in range(2):  # the first round allocates the worker's receive buffers, the second reuses them
        info = None
        while info is None:
            info = ws.poll()
            if info is None:
                time.sleep(0.005)
        t0 = time.monotonic()
        stats = engine.receive_weights(info)  # the first worker's stats; the engine is now at info.version
        assert engine.version == info.version
        ws.done(info.version, load_s=stats["load_s"])
        print("VLLM_STATS " + json.dumps({**stats, "rpc_s": time.monotonic() - t0}), flush=True)
    engine.close()


# ---------------------------------------------------------------------------------------------
# the sender (this process)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--bucket-mb", type=float, default=256.0)
    p.add_argument("--no-vllm", action="store_true")
    p.add_argument("--quick", action="store_true", help="a small model, 3 reps, no vLLM: a smoke run")
    p.add_argument("--role", default="sender", choices=["sender", "receiver", "vllm"])
    p.add_argument("--model", default="")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--store-port", type=int, default=0)
    a = p.parse_args()
    if a.quick:
        a.layers, a.hidden, a.intermediate, a.reps, a.no_vllm = 2, 256, 512, 3, True
    if a.role == "receiver":
        return receiver(a)
    if a.role == "vllm":
        return vllm_generator(a)

    import torch
    from safetensors.torch import load_file

    from demo.tiny_model import build_tiny_model
    from weight_sync.config import WeightSyncConfig
    from weight_sync.sender import WeightSender
    from weight_sync.service import WeightSyncService

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import free_port_block, subprocess_env

    tmp = tempfile.mkdtemp(prefix="conveyor_bench_ws_")
    t0 = time.monotonic()
    model_dir = str(build_tiny_model(Path(tmp) / "model", num_layers=a.layers, hidden_size=a.hidden,
                                     intermediate_size=a.intermediate, seed=0))
    sd = load_file(os.path.join(model_dir, "model.safetensors"))
    named = list(sd.items())
    n_params = sum(t.numel() for _, t in named)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    print(f"model: {n_params / 1e6:.1f}M params, {len(named)} tensors, {nbytes / 2**20:.0f} MiB fp32 "
          f"(built in {time.monotonic() - t0:.1f}s)", flush=True)

    port, store_port = free_port_block(1), free_port_block(1)
    svc = WeightSyncService(WeightSyncConfig(port=port))
    svc.start()
    env = subprocess_env()
    rx = subprocess.Popen([sys.executable, __file__, "--role", "receiver", "--model", model_dir, "--port", str(port),
                           "--store-port", str(store_port), "--reps", str(a.reps)], env=env)
    store, pg = _pg(store_port, 0, True)
    fence = torch.zeros(1, dtype=torch.uint8)

    # real bytes: an untouched `empty` would send the kernel's shared zero page, hot in cache
    flat = torch.cat([x.reshape(-1).view(torch.uint8) for _, x in named])
    sender = WeightSender("127.0.0.1", port, timeout_s=120, join_timeout_s=60, bucket_mb=a.bucket_mb,
                          serve_in_background=False)
    while "bench-receiver" not in svc.state.generators:
        time.sleep(0.01)
    raw, per_tensor, rounds = [], [], []
    for v in range(1, a.reps + 1):
        t = time.monotonic()  # (a) raw: one flat tensor of the same bytes
        pg.broadcast(flat, 0).wait()
        pg.broadcast(fence, 1).wait()
        raw.append(time.monotonic() - t)
        t = time.monotonic()  # (c) one broadcast per tensor
        for _, x in named:
            pg.broadcast(x, 0).wait()
        pg.broadcast(fence, 1).wait()
        per_tensor.append(time.monotonic() - t)
        stats = sender.publish(v, named)  # (b) a Conveyor round
        assert stats["ok"] == ["bench-receiver"], stats
        while True:  # until the receiver's done (after the last it unregisters)
            g = svc.state.generators.get("bench-receiver")
            if g is None or g.version >= v:
                break
            time.sleep(0.005)
        rounds.append(stats)
    rx.wait(60)
    del pg, flat
    bucketed = [s["broadcast_s"] for s in rounds]
    print(f"(a) raw flat broadcast: {[round(x, 3) for x in raw]} s", flush=True)
    print(f"(c) per-tensor broadcasts ({len(named)}): {[round(x, 3) for x in per_tensor]} s", flush=True)
    def col(key):
        return [round(s[key], 3) for s in rounds]

    print(f"(b) bucketed rounds ({rounds[0]['buckets']} buckets of <= {a.bucket_mb:g} MiB): "
          f"broadcast {col('broadcast_s')} s "
          f"= group setup {col('setup_s')} + transfer {col('transfer_s')} + confirm {col('confirm_s')} s; "
          f"publish total {col('total_s')} s (pack {col('pack_s')} s)", flush=True)

    result = {
        "params_m": round(n_params / 1e6, 1), "bytes": nbytes, "tensors": len(named), "reps": a.reps,
        "bucket_mb": a.bucket_mb, "buckets": rounds[0]["buckets"],
        "raw_s": statistics.median(raw),
        "bucketed_broadcast_s": statistics.median(bucketed),
        "bucketed_round_s": statistics.median(s["total_s"] for s in rounds),
        "bucketed_pack_s": statistics.median(s["pack_s"] for s in rounds),
        "bucketed_setup_s": statistics.median(s["setup_s"] for s in rounds),
        "bucketed_transfer_s": statistics.median(s["transfer_s"] for s in rounds),
        "per_tensor_s": statistics.median(per_tensor),
    }
    result["ratio_bucketed_vs_raw"] = result["bucketed_broadcast_s"] / result["raw_s"]
    result["ratio_round_vs_raw"] = result["bucketed_round_s"] / result["raw_s"]
    result["ratio_per_tensor_vs_raw"] = result["per_tensor_s"] / result["raw_s"]
    result["gbit_s_raw"] = nbytes * 8 / result["raw_s"] / 1e9

    # (d) the same round into a live vLLM engine
    if not a.no_vllm:
        t = time.monotonic()
        gen = subprocess.Popen([sys.executable, __file__, "--role", "vllm", "--model", model_dir, "--port", str(port)],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        for line in gen.stdout:
            if line.startswith("VLLM_READY"):
                break
        result["vllm_engine_start_s"] = time.monotonic() - t
        rounds_v, vstats = [], []
        for v in (a.reps + 1, a.reps + 2):
            rounds_v.append(sender.publish(v, named))
            for line in gen.stdout:
                if line.startswith("VLLM_STATS "):
                    vstats.append(json.loads(line[len("VLLM_STATS "):]))
                    break
        gen.wait(120)
        if all(r["ok"] == ["bench-vllm"] for r in rounds_v) and len(vstats) == 2:
            for i, (r, w) in enumerate(zip(rounds_v, vstats)):
                print(f"(d) vLLM round {i + 1}: broadcast {r['broadcast_s']:.3f} s, "
                      f"reload_weights {w['load_s']:.3f} s, collective_rpc total {w['rpc_s']:.3f} s", flush=True)
            result.update(vllm_round_broadcast_s=rounds_v[1]["broadcast_s"], vllm_load_s=vstats[1]["load_s"],
                          vllm_receive_weights_s=vstats[1]["rpc_s"],
                          vllm_first_round_broadcast_s=rounds_v[0]["broadcast_s"],
                          vllm_first_load_s=vstats[0]["load_s"])
        else:
            result["vllm_error"] = f"rounds {rounds_v}, worker {vstats}"
    sender.close()
    svc.stop()
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
