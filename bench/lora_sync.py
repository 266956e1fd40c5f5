"""LoRA weight-sync benchmark: the bytes one round moves with a LoRA policy vs full fine-tuning.

    .venv/bin/python bench/lora_sync.py [--layers 4 --hidden 512] [--rank 8 --alpha 16] [--targets all-linear]
    .venv/bin/python bench/lora_sync.py --quick       # the 2-layer tiny model (~15 s)

The same random Llama (built on the fly) is loaded twice as the learner's policy (a world of one,
ZeRO-2): with LoRA adapters of `--rank` on `--targets`, and for full fine-tuning. Each publishes
one version through the real weight-sync service and `WeightSender` to one receiver (a thread
running the generator side's `receive_named_tensors`); the bytes are what that receiver took
off the wire (the round's buckets). Goal: bytes_lora / bytes_full close to the ratio of trainable
parameters (adapter parameters / model parameters); the two differ only by the buckets'
64-byte alignment. `measure(...)` returns the figures as a dict (for a combined bench); run as a
script, the last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _one_round(policy, port: int, version: int) -> dict:
    """Publish `policy` once to one receiver thread; the round's bytes (as received) and seconds."""
    from learner.engine import iter_publish_params
    from learner.lora import adapter_spec
    from weight_sync.client import GeneratorSyncClient
    from weight_sync.receiver import receive_named_tensors
    from weight_sync.sender import WeightSender

    got: dict = {}

    def receive() -> None:
        with GeneratorSyncClient("127.0.0.1", port, f"bench-{version}") as client:
            client.register("bench")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                info = client.poll()
                if info is not None:
                    named, stats = receive_named_tensors(info)
                    got.update(bytes=sum(t.numel() * t.element_size() for _, t in named), recv_bytes=stats["bytes"],
                               tensors=len(named))
                    client.done(info.version)
                    client.unregister()  # the next round must not wait for this receiver
                    return
                time.sleep(0.01)

    thread = threading.Thread(target=receive)
    thread.start()
    time.sleep(0.3)  # registered before the publish, so the round includes it
    with WeightSender("127.0.0.1", port, timeout_s=120, join_timeout_s=30) as sender:
        stats = sender.publish(version, iter_publish_params(policy), adapter=adapter_spec(policy))
    thread.join()
    if stats.get("error") or stats.get("failed") or not got:
        raise RuntimeError(f"the round of version {version} failed: {stats}")
    return {"wire_bytes": got["recv_bytes"], "tensor_bytes": got["bytes"], "tensors": got["tensors"],
            "round_s": stats["total_s"]}


def measure(layers: int = 4, hidden: int = 512, rank: int = 8, alpha: int = 16,
            targets: tuple[str, ...] = ("all-linear",), model_dir: str | None = None) -> dict:
    """Bytes of one weight round, LoRA vs full, for the same model (built unless `model_dir` is given)."""
    from demo.tiny_model import build_tiny_model
    from launch.ports import free_port_block
    from learner.config import LearnerConfig
    from learner.engine import build_policy_engine, process_group
    from weight_sync.config import WeightSyncConfig
    from weight_sync.service import WeightSyncService

    tmp = tempfile.TemporaryDirectory(prefix="bench-lora-")
    model = model_dir or str(build_tiny_model(Path(tmp.name) / "model", num_layers=layers, hidden_size=hidden))
    port = free_port_block(1)
    svc = WeightSyncService(WeightSyncConfig(port=port, stale_after_s=600))
    svc.start()
    out: dict = {"layers": layers, "hidden": hidden, "rank": rank, "alpha": alpha, "targets": list(targets)}
    try:
        common = dict(model_path=model, run_dir=str(Path(tmp.name) / "run"), dist_backend="gloo", tensorboard=False)
        with process_group(LearnerConfig(**common)):
            full = build_policy_engine(LearnerConfig(**common, lora_rank=0))
            out["total_params"] = sum(p.numel() for p in full.module.parameters())
            out["full"] = _one_round(full, port, 1)
            del full
            lora = build_policy_engine(LearnerConfig(**common, lora_rank=rank, lora_alpha=alpha,
                                                     lora_target_modules=list(targets)))
            out["trainable_params"] = sum(p.numel() for p in lora.module.parameters() if p.requires_grad)
            out["lora"] = _one_round(lora, port, 2)
            del lora
    finally:
        svc.stop()
        tmp.cleanup()
    out["trainable_ratio"] = out["trainable_params"] / out["total_params"]
    out["bytes_ratio"] = out["lora"]["wire_bytes"] / out["full"]["wire_bytes"]
    out["bytes_ratio_over_trainable_ratio"] = out["bytes_ratio"] / out["trainable_ratio"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=int, default=16)
    p.add_argument("--targets", nargs="+", default=["all-linear"])
    p.add_argument("--quick", action="store_true", help="the 2-layer, hidden-128 tiny model")
    a = p.parse_args()
    if a.quick:
        a.layers, a.hidden = 2, 128
    result = measure(a.layers, a.hidden, a.rank, a.alpha, tuple(a.targets))
    for kind in ("full", "lora"):
        r = result[kind]
        print(f"{kind:>4}: {r['wire_bytes']:>12,} bytes in {r['tensors']} tensors, round {r['round_s']:.3f} s")
    print(f"bytes lora/full {result['bytes_ratio']:.5f}; trainable params {result['trainable_params']:,} / "
          f"{result['total_params']:,} = {result['trainable_ratio']:.5f}")
    print(json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
