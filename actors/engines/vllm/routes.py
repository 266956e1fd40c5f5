"""The experts a mixture-of-experts engine routed each token to, recorded for routing replay.

vLLM 0.32 has its own capture (`enable_return_routed_experts`), but it needs Model Runner V2, which
needs Triton: the CPU build refuses it (`vllm/config/vllm.py`: "AuxOutput Connector requires Model
Runner V2", then "Model Runner V2 requires Triton"). So the worker extension records the routes
itself, from the same hook vLLM's capture uses: every MoE layer's router calls its `capture_fn`
with the step's top-k expert ids, before any expert-parallel remapping
(`vllm/model_executor/layers/fused_moe/router/base_router.py`, `BaseRouter.select_experts`).
Each step's rows are laid out request by request in the input batch's order, `query_start_loc`
apart (`GPUModelRunner._prepare_inputs`, which the CPU runner inherits); `_model_forward` gets their
token ids and positions. So every request's rows are known by position, and a finished sequence is
found again by its tokens: `take(sequences)` returns, for each prompt + completion, the (T-1,
layers, k) experts of its first T-1 tokens (the last sampled token is never fed to the model).

Prefix caching is switched off for an engine that records routes: a cached prefix is not
recomputed, so its rows would never reach a router.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from functools import partial

import numpy as np

log = logging.getLogger(__name__)

# Requests kept when nobody takes them (an engine whose generator crashed mid-batch): oldest go first.
MAX_REQUESTS = 16384


class RouteRecorder:
    """Records the routes of every forward of one vLLM worker's model runner."""

    def __init__(self, runner, max_requests: int = MAX_REQUESTS):
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        missing = [a for a in ("_model_forward", "input_batch", "query_start_loc") if not hasattr(runner, a)]
        if missing:
            raise RuntimeError(f"routing replay records routes from vLLM's V1 model runner, but this one "
                               f"({type(runner).__name__}) has no {missing}: set VLLM_USE_V2_MODEL_RUNNER=0")
        self.runner = runner
        self.max_requests = max_requests
        self.step: dict[int, object] = {}  # layer -> this forward's (rows, k) expert ids
        # req id -> [(positions, tokens, routes (rows, layers, k))]; finished ones stay until taken
        self.requests: OrderedDict[str, list] = OrderedDict()
        layers = []
        for module in runner.get_model().modules():
            if isinstance(module, MoERunner):
                if not isinstance(module.router, BaseRouter):
                    name = type(module.router).__name__
                    raise ValueError(f"routing replay: vLLM's router {name} has no capture hook")
                module.router.set_capture_fn(partial(self._capture, module.layer_id))
                layers.append(module.layer_id)
        if not layers:
            raise ValueError("routing replay needs a mixture-of-experts model: this one has no MoE layer")
        self.layers = sorted(layers)
        self._forward = runner._model_forward
        runner._model_forward = self._model_forward

    def _capture(self, layer: int, topk_ids) -> None:
        self.step[layer] = topk_ids

    def _model_forward(self, input_ids=None, positions=None, *args, **kwargs):
        self.step = {}
        out = self._forward(input_ids, positions, *args, **kwargs)
        if self.step and positions is not None and input_ids is not None:
            self._keep(input_ids, positions)
        return out

    def _keep(self, input_ids, positions) -> None:
        import torch

        missing = [layer for layer in self.layers if layer not in self.step]
        if missing:
            raise RuntimeError(f"routing replay: MoE layers {missing} routed no tokens in this step")
        rows = min(int(self.step[self.layers[0]].shape[0]), int(positions.shape[0]))
        # one device-to-host copy per step: (rows, layers, k)
        routes = torch.stack([self.step[layer][:rows] for layer in self.layers], dim=1).to("cpu", torch.int16).numpy()
        pos = positions[:rows].to("cpu").numpy()
        tok = input_ids[:rows].to("cpu").numpy()
        batch = self.runner.input_batch
        starts = self.runner.query_start_loc.np[: batch.num_reqs + 1]
        for i, req in enumerate(batch.req_ids[: batch.num_reqs]):
            a, b = int(starts[i]), min(int(starts[i + 1]), rows)
            if b > a:
                self.requests.setdefault(req, []).append((pos[a:b].copy(), tok[a:b].copy(), routes[a:b].copy()))
                self.requests.move_to_end(req)
        while len(self.requests) > self.max_requests:
            self.requests.popitem(last=False)

    def take(self, sequences: list[list[int]]) -> list[tuple[bytes, list[int]] | None]:
        """For each token sequence (prompt + completion), its routes as (uint8/uint16 bytes, shape
        (T-1, layers, k)), or None when this worker saw no request with those tokens. Requests
        matched are forgotten."""
        index: dict[bytes, list[str]] = {}
        whole: dict[str, np.ndarray] = {}
        for req, chunks in self.requests.items():
            pos = np.concatenate([c[0] for c in chunks])
            # a position seen twice (a preempted request recomputed): its last computation counts
            last = len(pos) - 1 - np.unique(pos[::-1], return_index=True)[1]
            pos = pos[last]
            if len(pos) == 0 or pos[0] != 0 or pos[-1] != len(pos) - 1:
                continue  # not every position seen: no routes
            tok = np.concatenate([c[1] for c in chunks])[last].astype(np.int64)
            whole[req] = np.concatenate([c[2] for c in chunks])[last]
            index.setdefault(tok.tobytes(), []).append(req)
        out: list[tuple[bytes, list[int]] | None] = []
        given: dict[bytes, np.ndarray] = {}
        for seq in sequences:
            key = np.asarray(seq[:-1], dtype=np.int64).tobytes()
            reqs = index.get(key)
            if reqs:  # n samples with equal tokens: one request each while there are
                req = reqs.pop(0)
                given[key] = whole[req]
                self.requests.pop(req, None)
            routes = given.get(key)
            if routes is None:
                out.append(None)
                continue
            dtype = np.uint8 if routes.max(initial=0) < 256 else np.uint16
            out.append((routes.astype(dtype).tobytes(), list(routes.shape)))
        return out
