"""A stand-in generator for the weight-sync tests: owns an engine and a GeneratorSyncClient.

    python tests/helpers/ws_generator.py --port P --worker-id g0 --engine transformers \
        --model DIR --events FILE [--wait-current] [--die-mid-round]

It registers, optionally catches up first (`wait_current`, as a generator does before its first
lease), then polls for rounds; after each load it appends one JSON line to FILE:
  {"kind": "ready"}                                   engine up, registered
  {"kind": "round", "version", "catch_up", "digest", "outputs", "stats", ...}
  {"kind": "missed", "error"}                         a round went on without it
`digest` is a hash of every parameter's bytes (sorted by name), `outputs` the greedy continuations
of the fixed prompts (vLLM engine only). `--die-mid-round` exits hard after the first bucket of
the first round, like a generator killed while receiving.

The vLLM engine is an `AsyncLLM`, so the same process exercises both modes: `finish` (load while
idle) and `interrupt` (a long request is in flight when the round arrives; it must finish).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

PROMPTS = ["12+34=", "hello world", "7*8="]
MAX_TOKENS = 12
LONG_TOKENS = 200


def digest(named) -> str:
    h = hashlib.sha1()
    for name, t in sorted(named, key=lambda x: x[0]):
        h.update(name.encode())
        h.update(t.detach().contiguous().cpu().view(-1).view(__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


class Events:
    def __init__(self, path: str):
        self.path = path

    def emit(self, **event) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(event) + "\n")


def die_after_first_bucket() -> None:
    """Make the first bucket of the first round the last thing this process does."""
    import weight_sync.round as R

    orig = R.make_group

    class Dying:
        def __init__(self, pg):
            self.pg = pg

        def broadcast(self, t, root):
            self.pg.broadcast(t, root).wait()
            os._exit(17)

    R.make_group = lambda *a, **k: Dying(orig(*a, **k))


def run_transformers(a, ws, ev: Events) -> None:
    from learner.modeling import load_causal_lm
    from weight_sync.receiver import RoundMissed, receive_into_model

    model = load_causal_lm(a.model)
    ws.register("transformers")
    ev.emit(kind="ready", digest=digest(model.state_dict().items()))

    def apply(info):
        try:
            stats = receive_into_model(model, info)
        except RoundMissed as e:
            ev.emit(kind="missed", error=str(e))
            return
        ws.done(info.version, load_s=stats["load_s"])
        ev.emit(kind="round", version=info.version, catch_up=info.catch_up, backend=info.backend,
                digest=digest(model.state_dict().items()), stats=stats)

    if a.wait_current:
        info = ws.wait_current(timeout_s=60)
        if info:
            apply(info)
        ev.emit(kind="current", version=ws.version)
    deadline = time.monotonic() + a.max_seconds
    while time.monotonic() < deadline:
        info = ws.poll()
        if info:
            apply(info)
        else:
            time.sleep(0.05)  # "a batch"


async def run_vllm(a, ws, ev: Events) -> None:
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from actors.engines.vllm.worker import CPU_LINEAR_ENV, apply_round_async

    # vLLM's own kernels (on CPU: repacked for oneDNN), whatever an engine of the parent process chose
    os.environ[CPU_LINEAR_ENV] = "packed"
    tok = AutoTokenizer.from_pretrained(a.model)
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=a.model, dtype="float32", max_model_len=256, max_num_seqs=8, enforce_eager=True,
        worker_extension_cls="actors.engines.vllm.worker.WorkerExtension", disable_log_stats=True))
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    n_req = 0

    async def generate(ids, params) -> list[int]:
        nonlocal n_req
        n_req += 1
        out = None
        async for out in engine.generate({"prompt_token_ids": ids}, params, request_id=f"r{n_req}"):
            pass
        return list(out.outputs[0].token_ids), out.outputs[0].finish_reason

    async def outputs():
        return [(await generate(ids, greedy))[0] for ids in prompt_ids]

    ws.register("vllm")
    ev.emit(kind="ready", prompt_ids=prompt_ids, outputs=await outputs())
    deadline = time.monotonic() + a.max_seconds
    while time.monotonic() < deadline:
        info = ws.poll()
        if not info:
            await asyncio.sleep(0.05)
            continue
        extra = {}
        try:
            if info.mode == "interrupt":
                # a long request in flight when the round arrives
                n_seen = 0
                long_params = SamplingParams(temperature=0.0, max_tokens=LONG_TOKENS, ignore_eos=True)
                n_req += 1
                stream = engine.generate({"prompt_token_ids": prompt_ids[0]}, long_params, request_id=f"r{n_req}")
                first = await stream.__anext__()
                n_seen = len(first.outputs[0].token_ids)
                while n_seen < 5:
                    out = await stream.__anext__()
                    n_seen = len(out.outputs[0].token_ids)
                stats = await apply_round_async(engine, info)
                last = None
                async for last in stream:
                    pass
                extra = {"long_tokens": len(last.outputs[0].token_ids) if last else n_seen,
                         "long_finish": last.outputs[0].finish_reason if last else "", "tokens_before_load": n_seen}
            else:
                stats = await apply_round_async(engine, info)
        except Exception as e:  # RoundMissed, wrapped by collective_rpc: the engine must keep serving
            ev.emit(kind="missed", version=info.version, error=f"{type(e).__name__}: {e}")
            continue
        ws.done(info.version, load_s=stats["load_s"])
        ev.emit(kind="round", version=info.version, catch_up=info.catch_up, mode=info.mode,
                outputs=await outputs(), stats=stats, **extra)
    engine.shutdown()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--engine", choices=["transformers", "vllm"], default="transformers")
    p.add_argument("--model", required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--wait-current", action="store_true")
    p.add_argument("--die-mid-round", action="store_true")
    p.add_argument("--max-seconds", type=float, default=240)
    a = p.parse_args()
    from weight_sync.client import GeneratorSyncClient

    if a.die_mid_round:
        die_after_first_bucket()
    ev = Events(a.events)
    ws = GeneratorSyncClient(a.host, a.port, a.worker_id)
    if a.engine == "transformers":
        run_transformers(a, ws, ev)
    else:
        asyncio.run(run_vllm(a, ws, ev))


if __name__ == "__main__":
    main()
