"""Weight rounds inside vLLM: the worker extension, and the helpers a generator calls.

The engine is created with

    LLM(model_dir, ..., worker_extension_cls="actors.vllm_worker.WorkerExtension")

(or `AsyncEngineArgs(..., worker_extension_cls=...)` for `AsyncLLM`), which mixes
`WorkerExtension` into every vLLM worker. A round then runs as

    llm.collective_rpc("receive_weights", args=(round_info,))

Only the round_info (a plain map) crosses `collective_rpc`: the tensors come over the round's own
process group (collective_rpc's serialisation mangles tensors), straight into the worker.

Modes (round_info["mode"], chosen in the service's config):
- `finish`: the generator polls between batches, so nothing is running when it loads:
  `apply_round(llm, info)`.
- `interrupt`: a generator on `AsyncLLM` loads while requests are in flight:
  `await apply_round_async(engine, info)` pauses the scheduler with
  `pause_generation(mode="keep", clear_cache=False)` (running requests are frozen, their KV cache
  kept), loads through `collective_rpc`, then `resume_generation()`. The frozen requests finish on
  the new weights: their tokens before the pause came from the old version, the rest from the new
  one, and the generator's per-token versions say so: actors.engines.AsyncVLLMEngine sets vLLM's
  weight-version label while the engine is paused, and vLLM reports it per generated span.
"""

from __future__ import annotations

import time


class WorkerExtension:
    """Mixed into vLLM's worker class; `self` is the worker (it has `reload_weights`, `device`)."""

    def receive_weights(self, round_info: dict) -> dict:
        """Receive a weight round and load it in place; returns stats (version, bytes, seconds).

        Raises `weight_sync.receiver.RoundMissed` (through collective_rpc) when this generator was
        left out of the round; the weights are then untouched.
        """
        from weight_sync.receiver import receive_named_tensors

        local_rank = int(getattr(self, "rank", 0) or 0)  # tensor-parallel workers hold consecutive ranks
        device = getattr(self, "device", "cpu")
        if round_info["backend"] == "gloo":
            device = "cpu"  # gloo moves host tensors; loading copies them to the model's device
        # host buffers are kept between rounds (one model copy of RAM; fresh pages cost as much as
        # the transfer); device memory is not, so the KV cache keeps it
        buffers = None
        if str(device) == "cpu":
            buffers = self.__dict__.setdefault("_weight_sync_buffers", [])
        named, stats = receive_named_tensors(round_info, local_rank, device, buffers)
        t0 = time.monotonic()
        # reload_weights, not model.load_weights: the latter fails on the CPU build once the
        # weights have been repacked into kernel layout
        self.reload_weights(weights_iterator=iter(named))
        stats.update(load_s=time.monotonic() - t0, version=int(round_info["version"]), local_rank=local_rank)
        return stats


def apply_round(llm, round_info: dict) -> dict:
    """Load a round into a (synchronous) `vllm.LLM` between batches; stats of its first worker."""
    timeout = float(round_info["timeout_s"]) + 60.0
    return llm.collective_rpc("receive_weights", timeout=timeout, args=(round_info,))[0]


async def apply_round_async(engine, round_info: dict, mode: str | None = None) -> dict:
    """Load a round into an `AsyncLLM`; in `interrupt` mode, around in-flight requests.

    Returns the first worker's stats plus `pause_s` (time spent pausing the scheduler).
    """
    mode = mode or round_info.get("mode", "finish")
    paused = False
    t0 = time.monotonic()
    if mode == "interrupt":
        await engine.pause_generation(mode="keep", clear_cache=False)
        paused = True
    pause_s = time.monotonic() - t0
    try:
        timeout = float(round_info["timeout_s"]) + 60.0
        results = await engine.collective_rpc("receive_weights", timeout=timeout, args=(round_info,))
    finally:
        if paused:
            await engine.resume_generation()
    stats = dict(results[0])
    stats["pause_s"] = pause_s
    return stats
