"""Weight-sync benchmark: how close a Conveyor round comes to a raw broadcast, over gloo on this machine.

    .venv/bin/python bench/weight_sync.py [--layers 8 --hidden 1024 --intermediate 2816] [--reps 3]
                                          [--bucket-mb 256] [--no-vllm]
    .venv/bin/python bench/weight_sync.py --quick     # a ~3M-parameter model, 3 reps, no vLLM (~1 min)

A Llama of ~100M parameters (fp32, random weights, built on the fly) travels from this process
(learner rank 0's role) to one receiver process, each rep in turn:
  (a) raw:        one broadcast of a single flat tensor of the same bytes (group built beforehand)
  (c) per_tensor: one broadcast per tensor (group built beforehand)
  (b) round:      a Conveyor round through the real service, WeightSender and receiver code over
                  the broadcast (`same_host: broadcast`, what a generator on another host gets);
                  `round_s` is all of publish after the gather (control plane, join, group set-up,
                  transfer, reports); `gather_s`, the copy of each tensor into the sender's buckets
                  as the learner hands it over, is reported apart: it is the learner's copy of its
                  weights, which it made before as well
  (e) shm_round:  the same through the shared-memory segment (`same_host: auto`, one host)
(a) and (c) end with a 1-byte broadcast back from the receiver, so each time covers arrival.
Then (d) rounds into a live vLLM engine (CPU build here) for the same model, alternating (b) and
(e) (on a GPU, (e) with the slot on the device: CUDA IPC, `vllm_ipc_*`): `vllm_load_s` is the
worker's load after the bytes arrived (`load_path`: `direct` copies into the engine's parameters,
`repack` gives the CPU build's repacked layers their new weights and repacks them,
`reload_weights` is vLLM's own reload; through the segment, `vllm_shm_load_s` is the whole load
straight out of the slot: no receive step before it), `vllm_publish_to_serving_s` runs from the learner calling
publish to the engine answering a request on the new version (same host: one clock). The first two vLLM rounds warm up
(receive buffers, the segment's pages). Medians over --reps. The last line printed is one JSON
object, with every figure's ratio to raw.
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


def _pg(port: int, rank: int, is_master: bool, backend: str = "gloo"):
    import torch.distributed as dist

    from weight_sync.groups import make_group

    store = dist.TCPStore("127.0.0.1", port, None, is_master, timeout=timedelta(seconds=300), wait_for_workers=False)
    return store, make_group(backend, dist.PrefixStore("raw", store), rank, 2, 300)


def _device(backend: str) -> str:
    """Where the bytes live for `backend`: NCCL moves device memory (one GPU, both ends)."""
    return "cuda" if backend == "nccl" else "cpu"


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
    store, pg = _pg(a.store_port, 1, False, a.backend)
    dev = _device(a.backend)
    fence = torch.zeros(1, dtype=torch.uint8, device=dev)
    flat = torch.empty(total, dtype=torch.uint8, device=dev)
    tensors = [torch.empty(s, dtype=torch.float32, device=dev) for _, s in specs]
    ws = GeneratorSyncClient("127.0.0.1", a.port, "bench-receiver", timeout_s=60)
    ws.register("bench")
    buffers: list = []  # kept between rounds, as the vLLM worker extension does on CPU
    for _ in range(a.reps):  # interleaved with the sender: load on this shared machine hits all three alike
        pg.broadcast(flat, 0).wait()  # (a)
        pg.broadcast(fence, 1).wait()
        for t in tensors:  # (c)
            pg.broadcast(t, 0).wait()
        pg.broadcast(fence, 1).wait()
        for _ in range(2):  # (b) through the broadcast, (e) through shared memory
            info = None
            while info is None:
                info = ws.poll()
                if info is None:
                    time.sleep(0.005)
            named, stats = receive_named_tensors(info, device=dev, buffers=buffers)
            ws.done(info.version, load_s=stats["recv_s"])
            print("RX_STATS " + json.dumps(stats), flush=True)
    ws.unregister()


def vllm_generator(a) -> None:
    from actors.engines.base import Sampling
    from actors.engines.vllm.engine import VLLMEngine
    from weight_sync.client import GeneratorSyncClient

    engine = VLLMEngine(a.model, dtype="float32", max_model_len=256)
    ws = GeneratorSyncClient("127.0.0.1", a.port, "bench-vllm", timeout_s=60)
    ws.register("vllm")
    print("VLLM_READY", flush=True)
    for _ in range(a.vllm_rounds):  # the first round allocates the worker's receive buffers
        info = None
        while info is None:
            info = ws.poll()
            if info is None:
                time.sleep(0.005)
        t0, info_at = time.monotonic(), time.time()
        stats = engine.receive_weights(info)  # the first worker's stats; the engine is now at info.version
        assert engine.version == info.version
        loaded_at = time.time()
        ws.done(info.version, load_s=stats["load_s"])
        # serving: the engine answers a request on the new weights (same host: one clock)
        engine.generate([[1, 2, 3]], 1, Sampling(max_tokens=1, temperature=0.0))
        print("VLLM_STATS " + json.dumps({**stats, "rpc_s": time.monotonic() - t0, "info_at": info_at,
                                          "loaded_at": loaded_at, "serving_at": time.time()}), flush=True)
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
    p.add_argument("--vllm-rounds", type=int, default=8,
                   help="rounds into vLLM, alternating paths; the first two warm up")
    p.add_argument("--fresh-groups", action="store_true",
                   help="build the broadcast group anew every round (as before groups were kept between rounds)")
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"],
                   help="nccl: both ends on GPUs (needs two: NCCL refuses two ranks on one device)")
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
    from launch.ports import free_port_block
    from tests.helpers.procs import subprocess_env
    from weight_sync.config import WeightSyncConfig
    from weight_sync.sender import WeightSender
    from weight_sync.service import WeightSyncService

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
                           "--store-port", str(store_port), "--reps", str(a.reps), "--backend", a.backend],
                          env=env, stdout=subprocess.PIPE, text=True)
    store, pg = _pg(store_port, 0, True, a.backend)
    dev = _device(a.backend)
    named = [(k, x.to(dev)) for k, x in named]
    fence = torch.zeros(1, dtype=torch.uint8, device=dev)

    # real bytes: an untouched `empty` would send the kernel's shared zero page, hot in cache
    flat = torch.cat([x.reshape(-1).view(torch.uint8) for _, x in named])
    # (b) the broadcast path (what a generator on another host gets), (e) the same-host path
    sender = WeightSender("127.0.0.1", port, timeout_s=120, join_timeout_s=60, bucket_mb=a.bucket_mb,
                          serve_in_background=False, same_host="broadcast", sender_id="bench-bcast",
                          backend=a.backend)
    sender_shm = WeightSender("127.0.0.1", port, timeout_s=120, join_timeout_s=60, bucket_mb=a.bucket_mb,
                              serve_in_background=False, same_host="auto", sender_id="bench-shm",
                              backend=a.backend)
    if a.fresh_groups:  # keep none: every round builds its group
        sender._groups.limit = 0
    while "bench-receiver" not in svc.state.generators:
        time.sleep(0.01)

    def publish(s, v: int, who: str) -> dict:
        stats = s.publish(v, named)
        assert stats["ok"] == [who], stats
        stats["round_s"] = stats["total_s"] - stats["gather_s"]  # the gather is the learner's copy
        while True:  # until the member's done (after the last round it unregisters)
            g = svc.state.generators.get(who)
            if g is None or g.version >= v:
                return stats
            time.sleep(0.002)

    raw, per_tensor, rounds, shm_rounds = [], [], [], []
    v = 0
    for _ in range(a.reps):
        t = time.monotonic()  # (a) raw: one flat tensor of the same bytes
        pg.broadcast(flat, 0).wait()
        pg.broadcast(fence, 1).wait()
        raw.append(time.monotonic() - t)
        t = time.monotonic()  # (c) one broadcast per tensor
        for _, x in named:
            pg.broadcast(x, 0).wait()
        pg.broadcast(fence, 1).wait()
        per_tensor.append(time.monotonic() - t)
        v += 1
        rounds.append(publish(sender, v, "bench-receiver"))  # (b)
        v += 1
        t = time.monotonic()
        shm_rounds.append({**publish(sender_shm, v, "bench-receiver"), "until_done_s": time.monotonic() - t})  # (e)
    rx_stats = [json.loads(line[len("RX_STATS "):]) for line in rx.communicate(timeout=60)[0].splitlines()
                if line.startswith("RX_STATS ")]
    del pg, flat
    med = statistics.median

    def col(rs, key):
        return [round(r.get(key, 0.0), 3) for r in rs]

    print(f"(a) raw flat broadcast: {[round(x, 3) for x in raw]} s", flush=True)
    print(f"(c) per-tensor broadcasts ({len(named)}): {[round(x, 3) for x in per_tensor]} s", flush=True)
    print(f"(b) broadcast rounds ({rounds[0]['buckets']} receive buckets of <= {a.bucket_mb:g} MiB): "
          f"join {col(rounds, 'join_s')} s, broadcast {col(rounds, 'broadcast_s')} s = ready {col(rounds, 'ready_s')} "
          f"+ group setup {col(rounds, 'setup_s')} + transfer "
          f"{col(rounds, 'transfer_s')} + confirm {col(rounds, 'confirm_s')} s; whole round (publish) "
          f"{col(rounds, 'round_s')} s, before it the gather into the sender's buckets {col(rounds, 'gather_s')} s",
          flush=True)
    print(f"(e) shared-memory rounds: write {col(shm_rounds, 'shm_s')} s, member's copy "
          f"{[round(r['recv_s'], 3) for r in rx_stats if r.get('via') == 'shm']} s, whole round "
          f"{col(shm_rounds, 'round_s')} s", flush=True)

    result = {
        "params_m": round(n_params / 1e6, 1), "bytes": nbytes, "tensors": len(named), "reps": a.reps,
        "bucket_mb": a.bucket_mb, "buckets": rounds[0]["buckets"],
        "raw_s": med(raw),
        "round_s": med(r["round_s"] for r in rounds),
        "round_broadcast_s": med(r["broadcast_s"] for r in rounds),
        "round_transfer_s": med(r["transfer_s"] for r in rounds),
        "round_control_s": med(r["round_s"] - r["transfer_s"] for r in rounds),  # everything but the bytes
        "round_gather_s": med(r["gather_s"] for r in rounds),
        "round_join_s": med(r["join_s"] for r in rounds),
        "round_setup_s": med(r["setup_s"] for r in rounds),
        "rounds_on_a_kept_group": sum(r.get("groups_reused", 0) for r in rounds),
        "per_tensor_s": med(per_tensor),
        "shm_round_s": med(r["round_s"] for r in shm_rounds),
        "shm_write_s": med(r["shm_s"] for r in shm_rounds),
        "shm_read_s": med(r["recv_s"] for r in rx_stats if r.get("via") == "shm"),
    }
    for key in ("round_s", "round_broadcast_s", "per_tensor_s", "shm_round_s"):
        result[f"ratio_{key[:-2]}_vs_raw"] = result[key] / result["raw_s"]
    result["gbit_s_raw"] = nbytes * 8 / result["raw_s"] / 1e9

    # (d) rounds into a live vLLM engine: load, and publish -> serving on the new version
    if not a.no_vllm:
        same_host = sender_shm
        if torch.cuda.is_available():  # a learner on CUDA: the same-host slot on its device, CUDA IPC
            same_host = WeightSender("127.0.0.1", port, timeout_s=120, join_timeout_s=60, bucket_mb=a.bucket_mb,
                                     serve_in_background=False, same_host="shm", sender_id="bench-ipc",
                                     backend="nccl")
        result.update(vllm_rounds(a, model_dir, port, env, named, [sender, same_host], v, result["raw_s"]))
        same_host.close()
    sender.close()
    sender_shm.close()
    svc.stop()
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))


def vllm_rounds(a, model_dir: str, port: int, env: dict, named: list, senders: list, v: int, raw_s: float) -> dict:
    """Rounds into a vLLM engine in another process, alternating the broadcast and the same-host
    sender; the first two warm up (receive buffers, the segment's pages)."""
    t = time.monotonic()
    gen = subprocess.Popen([sys.executable, __file__, "--role", "vllm", "--model", model_dir, "--port", str(port),
                            "--vllm-rounds", str(a.vllm_rounds)],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in gen.stdout:
        if line.startswith("VLLM_READY"):
            break
    out: dict = {"vllm_engine_start_s": time.monotonic() - t}
    rows = []
    for i in range(a.vllm_rounds):
        v += 1
        t_pub = time.time()
        r = senders[i % 2].publish(v, named)
        for line in gen.stdout:
            if line.startswith("VLLM_STATS "):
                w = json.loads(line[len("VLLM_STATS "):])
                break
        else:
            w = {}
        rows.append((r, w, w.get("serving_at", t_pub) - t_pub))
    gen.wait(120)
    if not all(r["ok"] == ["bench-vllm"] for r, _, _ in rows) or any(not w for _, w, _ in rows):
        return {**out, "vllm_error": f"rounds {[r for r, _, _ in rows]}"}
    for i, (r, w, p2s) in enumerate(rows):
        t_pub = w["serving_at"] - p2s
        print(f"(d) vLLM round {i + 1} via {w.get('via')}: publish -> serving {p2s:.3f} s = gather "
              f"{r.get('gather_s', 0):.3f} + round offered at the generator's poll "
              f"{w['info_at'] - t_pub - r.get('gather_s', 0):.3f}"
              f" + receive {w['recv_s']:.3f} + load ({w.get('load_path')}) {w['load_s']:.3f} + the rest of the engine "
              f"call {w['loaded_at'] - w['info_at'] - w['recv_s'] - w['load_s']:.3f} + first token "
              f"{w['serving_at'] - w['loaded_at']:.3f} s", flush=True)
    # a same-host member on the CPU loads straight out of the slot (shm_in_place); others copy it out (shm)
    for key, vias in (("vllm", ("broadcast",)), ("vllm_shm", ("shm", "shm_in_place")), ("vllm_ipc", ("cuda_ipc",))):
        warm = [(r, w, p2s) for r, w, p2s in rows[2:] if w.get("via") in vias]
        if warm:
            out[f"{key}_load_s"] = statistics.median(w["load_s"] for _, w, _ in warm)
            out[f"{key}_publish_to_serving_s"] = statistics.median(p for _, _, p in warm)
            out[f"ratio_{key}_load_vs_raw"] = out[f"{key}_load_s"] / raw_s
            out[f"ratio_{key}_publish_to_serving_vs_raw"] = out[f"{key}_publish_to_serving_s"] / raw_s
            out[f"{key}_load_path"] = warm[-1][1].get("load_path", "reload_weights")
    return out


if __name__ == "__main__":
    main()
