"""A LoRA learner feeding real generators through a real weight round, for `tests/learner/test_lora.py`.

    python tests/helpers/lora_sync_driver.py MODEL_DIR RUN_DIR [--async] [--merged]

One process: the learner (a world of one, ZeRO-2, LoRA rank 8) trains a few steps per version
and publishes only the adapter (`iter_publish_params`, `adapter_spec`) through the weight-sync
service (a thread) to two generators that join the same round: a vLLM engine with LoRA on and a
transformers engine that merges the adapter by hand. After each version it saves a checkpoint
with the merged model and prints one JSON line: the greedy outputs of both engines and of
transformers on the merged checkpoint, and the round's bytes. `--async`: vLLM's `AsyncLLM`
(`AsyncVLLMEngine`) instead of the offline engine; `--merged`: publish the merged full weights
(`iter_full_params`, no adapter) instead of the adapter.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

PROMPTS = ["12+34=", "hello world", "7*8="]


def main(model_dir: str, run_dir: str, use_async: bool = False, merged: bool = False) -> None:
    import torch

    from actors.engines.base import Sampling
    from actors.engines.hf import TransformersEngine
    from actors.engines.vllm.engine import AsyncVLLMEngine, VLLMEngine
    from launch.ports import free_port_block
    from learner.checkpoint import save_checkpoint
    from learner.config import LearnerConfig
    from learner.engine import build_policy_engine, iter_full_params, iter_publish_params, process_group
    from learner.lora import adapter_spec
    from learner.modeling import token_logprobs
    from weight_sync.client import GeneratorSyncClient
    from weight_sync.config import WeightSyncConfig
    from weight_sync.sender import WeightSender
    from weight_sync.service import WeightSyncService

    cfg = LearnerConfig(model_path=model_dir, run_dir=run_dir, lora_rank=8, lora_alpha=16, zero_stage=2,
                        lr=5e-3, dist_backend="gloo", tensorboard=False)
    port = free_port_block(1)
    svc = WeightSyncService(WeightSyncConfig(port=port, stale_after_s=600))
    svc.start()
    greedy = Sampling(temperature=0.0, max_tokens=12)
    with process_group(cfg) as _:
        policy = build_policy_engine(cfg)
        vllm = (AsyncVLLMEngine if use_async else VLLMEngine)(model_dir, max_model_len=128, lora_rank=cfg.lora_rank)
        merging = TransformersEngine(model_dir)
        prompts = [vllm.tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
        engines = {"vllm": vllm, "merging": merging}
        clients = {k: GeneratorSyncClient("127.0.0.1", port, k) for k in engines}
        for k, c in clients.items():
            c.register(k)
        sender = WeightSender("127.0.0.1", port, timeout_s=60, join_timeout_s=30)
        print(json.dumps({"version": 0, "vllm": out(vllm, prompts, greedy)}), flush=True)
        target = torch.randint(3, 30, (2, 16), generator=torch.Generator().manual_seed(0))
        for version in (1, 2):
            for _ in range(3):  # move the adapter: fit a fixed random sequence
                loss = -token_logprobs(policy, target, torch.ones_like(target)).mean()
                policy.backward(loss)
                policy.step()
            result = {}
            params, adapter = ((iter_full_params(policy), None) if merged
                               else (iter_publish_params(policy), adapter_spec(policy)))
            publish = threading.Thread(target=lambda: result.update(sender.publish(version, params, adapter=adapter)))
            publish.start()
            loads = []
            for k, engine in engines.items():  # both join the same round (the sender waits for them)
                info = wait_round(clients[k])
                loads.append(threading.Thread(target=load, args=(engine, clients[k], info)))
                loads[-1].start()
            publish.join()
            for t in loads:
                t.join()
            ckpt = save_checkpoint(run_dir, version, policy, None, model_dir, merged=True)
            reference = TransformersEngine(str(ckpt))
            print(json.dumps({"version": version, "bytes": result.get("bytes"), "ok": result.get("ok"),
                              "versions": {k: e.version for k, e in engines.items()},
                              "vllm": out(vllm, prompts, greedy), "merging": out(merging, prompts, greedy),
                              "merged_checkpoint": out(reference, prompts, greedy)}), flush=True)
        sender.close()
        for c in clients.values():
            c.close()
        vllm.close()
    svc.stop()


def load(engine, client, info) -> None:
    """What a generator does with a round: load it, then tell the service."""
    stats = engine.receive_weights(info)
    client.done(info.version, load_s=stats.get("load_s", 0.0))


def wait_round(client, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = client.poll()
        if info is not None:
            return info
        time.sleep(0.05)
    raise TimeoutError(f"{client.worker_id}: no round within {timeout_s}s")


def out(engine, prompts, sampling) -> list[list[int]]:
    return [c[0].token_ids for c in engine.generate(prompts, 1, sampling)]


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--async" in sys.argv[3:], "--merged" in sys.argv[3:])
