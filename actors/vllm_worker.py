"""Weight rounds inside vLLM: the worker extension, and the load an `AsyncLLM` runs around it.

The engine is created with

    LLM(model_dir, ..., worker_extension_cls="actors.vllm_worker.WorkerExtension")

(or `AsyncEngineArgs(..., worker_extension_cls=...)` for `AsyncLLM`), which mixes
`WorkerExtension` into every vLLM worker. A round then runs as

    llm.collective_rpc("receive_weights", args=(to_builtins(round_info),))

Only the round (a plain map) crosses `collective_rpc`: the tensors come over the round's own
process group (collective_rpc's serialisation mangles tensors), straight into the worker.
`actors.vllm_engine` makes that call and stamps the engine with the round's version.

Modes (`RoundInfo.mode`, chosen in the service's config):
- `finish`: the generator polls between batches, so nothing is running when it loads.
- `interrupt`: a generator on `AsyncLLM` loads while requests are in flight:
  `await apply_round_async(engine, info)` pauses the scheduler with
  `pause_generation(mode="keep", clear_cache=False)` (running requests are frozen, their KV cache
  kept), loads through `collective_rpc`, relabels vLLM's weight version if asked, then
  `resume_generation()`. The frozen requests finish on the new weights: their tokens before the
  pause came from the old version, the rest from the new one, and vLLM reports the label per
  generated span (see `actors.vllm_engine.AsyncVLLMEngine`).
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
        from weight_sync.messages import round_info as checked
        from weight_sync.receiver import receive_named_tensors

        info = checked(round_info)  # a plain map across collective_rpc: checked again here
        local_rank = int(getattr(self, "rank", 0) or 0)  # tensor-parallel workers hold consecutive ranks
        device = getattr(self, "device", "cpu")
        if info.backend == "gloo":
            device = "cpu"  # gloo moves host tensors; loading copies them to the model's device
        # host buffers are kept between rounds (one model copy of RAM; fresh pages cost as much as
        # the transfer); device memory is not, so the KV cache keeps it
        buffers = None
        if str(device) == "cpu":
            buffers = self.__dict__.setdefault("_weight_sync_buffers", [])
        named, stats = receive_named_tensors(info, local_rank, device, buffers)
        t0 = time.monotonic()
        # reload_weights, not model.load_weights: the latter fails on the CPU build once the
        # weights have been repacked into kernel layout
        self.reload_weights(weights_iterator=iter(named))
        stats.update(load_s=time.monotonic() - t0, version=info.version, local_rank=local_rank)
        return stats


def rpc_timeout(info) -> float:
    """How long `collective_rpc` may take for a round: the round's own bound, and a margin to load."""
    return float(info.timeout_s) + 60.0


async def apply_round_async(engine, info, mode: str | None = None, label: str | None = None) -> dict:
    """Load a round (a `RoundInfo`) into an `AsyncLLM`; in `interrupt` mode, around in-flight requests.

    `label`: vLLM's weight-version label to set while the scheduler is paused, so that no step
    straddles the change. Returns the first worker's stats plus `pause_s` (time spent pausing).
    """
    from weight_sync.messages import to_builtins

    interrupt = (mode or info.mode) == "interrupt"
    t0 = time.monotonic()
    if interrupt:
        await engine.pause_generation(mode="keep", clear_cache=False)  # running requests keep their KV cache
    pause_s = time.monotonic() - t0
    try:
        results = await engine.collective_rpc("receive_weights", timeout=rpc_timeout(info), args=(to_builtins(info),))
        if label is not None:
            # while paused: every step from now on is computed by, and labelled with, the new weights
            await engine.update_weight_version(label)
    finally:
        if interrupt:
            await engine.resume_generation()
    return {**results[0], "pause_s": pause_s}
