"""A mixture-of-experts policy in the learner: the router load-balancing loss (`learner.aux_loss_coef`),
routing replay (`learner.routing_replay`), frozen routers and the routers' metrics (`Routers`).

transformers' MoE causal LMs (Mixtral, Qwen2/3-MoE, OLMoE, ...) return `aux_loss`, the router's
load-balancing loss over the forward's tokens, when called with `output_router_logits=True`. The
learner's forwards go through `learner.modeling.next_token_stats`, which knows nothing of it, so
`RouterAuxLoss` hooks the model instead: a pre-hook asks each forward that builds a graph for the
router logits, a hook keeps the aux loss it returns, and `add` puts coef * weight * aux_loss on
the micro-batch's policy loss (OpenRLHF's actor.aux_loss_coef). No-grad forwards (pi_old, the
reference) are left as they are.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn

from common.config import ConfigError


def causal_lm(model) -> nn.Module:
    """The transformers model inside a DeepSpeed engine and a peft wrapper."""
    module = getattr(model, "module", model)
    return module.get_base_model() if hasattr(module, "get_base_model") else module


class RouterAuxLoss:
    """Collects the aux loss of every grad-enabled forward of `model`; `add` spends it."""

    def __init__(self, model, coef: float, model_path: str = ""):
        lm = causal_lm(model)
        if not hasattr(lm.config, "output_router_logits"):
            raise ConfigError(
                f"learner.aux_loss_coef={coef} needs a mixture-of-experts model whose forward returns a "
                f"router aux loss (output_router_logits), but model_type {lm.config.model_type!r} "
                f"({model_path or type(lm).__name__}) has no router: set learner.aux_loss_coef=0")
        self.coef = coef
        self.model_type = lm.config.model_type
        self.last: torch.Tensor | None = None
        self.handles = [lm.register_forward_pre_hook(self._ask, with_kwargs=True),
                        lm.register_forward_hook(self._keep)]

    def _ask(self, module, args, kwargs):
        if torch.is_grad_enabled():
            return args, {**kwargs, "output_router_logits": True}
        return None

    def _keep(self, module, args, output):
        if torch.is_grad_enabled():
            self.last = getattr(output, "aux_loss", None)

    def add(self, loss: torch.Tensor, parts: dict[str, float], weight: float) -> torch.Tensor:
        """loss + coef * weight * the aux loss of the last forward with grad (the micro-batch's);
        its value goes into `parts` as `policy/router_aux_loss`."""
        aux, self.last = self.last, None
        if aux is None:
            raise RuntimeError(f"learner.aux_loss_coef={self.coef}: the {self.model_type!r} model's forward "
                               "returned no aux_loss with output_router_logits=True")
        parts["policy/router_aux_loss"] = float(aux.detach())
        return loss + (self.coef * weight) * aux.to(loss.dtype)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


# ------------------------------------------------------------------------------------------------
# routers: routing replay and their metrics


def routers(model) -> list[nn.Module]:
    """The top-k routers of a transformers MoE causal LM, in layer order (Qwen3/Qwen2-MoE, OLMoE,
    Mixtral: modules `*TopKRouter` with `top_k` and a `weight` (experts, hidden)); [] for a dense model."""
    return [m for m in causal_lm(model).modules() if type(m).__name__.endswith("TopKRouter")
            and hasattr(m, "top_k") and hasattr(m, "weight")]


def freeze_routers(model) -> int:
    """`learner.freeze_router`: no gradient for the routers' weights; returns how many were frozen."""
    found = routers(model)
    if not found:
        raise ConfigError(f"learner.freeze_router needs a mixture-of-experts model; "
                          f"{causal_lm(model).config.model_type!r} has no router")
    for m in found:
        m.weight.requires_grad_(False)
    return len(found)


class Routers:
    """Hooks on every router of an MoE policy (`Routers.attach`): each forward inside `routing(...)`
    is given the rollouts' routes to replay and the positions that are tokens; no-grad forwards (pi_old)
    measure the routers: load per expert, router entropy, and the share of tokens whose top-k
    experts differ from the engine's (`metrics`).

    Replay: a router computes its logits as always, but its top-k experts are the given ones where
    the routes know them (every token of a rollout but its last); their weights are the softmax
    probabilities of those experts, renormalised when the router renormalises its top-k
    (`norm_topk_prob`; Mixtral always does). So the chosen experts' outputs are exactly the
    engine's, and the router's weights get the gradient through the chosen experts' weights.
    """

    def __init__(self, model, replay: bool):
        self.lm = causal_lm(model)
        self.list = routers(model)
        self.replay = replay
        first = self.list[0]  # (under ZeRO-3 a weight's own shape is (0,): ds_shape is the whole one)
        shape = getattr(first.weight, "ds_shape", first.weight.shape)
        self.num_experts = int(getattr(first, "num_experts", 0) or shape[0])
        self.top_k = int(self.list[0].top_k)
        self.routes: torch.Tensor | None = None  # (N, layers, k) long of this forward's rows, -1: unknown
        self.valid: torch.Tensor | None = None  # (N,) bool, the rows that are tokens
        self._sums: dict[str, float] = {}
        self.handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(self.list)]

    @classmethod
    def attach(cls, model, replay: str) -> "Routers | None":
        """Hooks for an MoE policy, found by `routing` on the model (None for a dense one, which
        `routing_replay: rollout` refuses)."""
        if not routers(model):
            if replay != "off":
                raise ConfigError(f"learner.routing_replay={replay!r} needs a mixture-of-experts model; "
                                  f"{causal_lm(model).config.model_type!r} has no router")
            return None
        hooks = cls(model, replay != "off")
        hooks.lm._conveyor_routers = hooks
        return hooks

    def check(self, routes: torch.Tensor) -> None:
        """Routes (N, layers, k) that this model cannot replay: ValueError with the reason."""
        layers, k = routes.shape[1:]
        if (layers, k) != (len(self.list), self.top_k):
            raise ValueError(f"the rollouts' routes have {layers} layers x {k} experts per token, but the policy has "
                             f"{len(self.list)} MoE layers routing each token to {self.top_k}: the generators serve "
                             f"another model than the learner trains")
        top = int(routes.max()) if routes.numel() else -1
        if top >= self.num_experts:
            raise ValueError(f"the rollouts' routes name expert {top}, but the policy's layers have "
                             f"{self.num_experts} experts")

    def _hook(self, layer: int):
        def hook(module, args, output):
            logits, scores, chosen = output
            own = chosen
            routes = None if self.routes is None else self.routes[:, layer].to(chosen.device, torch.long)
            if routes is not None and self.replay:
                known = (routes >= 0).all(-1, keepdim=True)  # (N, 1)
                chosen = torch.where(known, routes, chosen)
                probs = torch.softmax(logits.float(), dim=-1).gather(-1, chosen)
                if getattr(module, "norm_topk_prob", True):
                    probs = probs / probs.sum(-1, keepdim=True)
                scores = probs.to(scores.dtype)
            if not torch.is_grad_enabled():
                self._measure(logits, chosen, own, routes)
            return logits, scores, chosen
        return hook

    @torch.no_grad()
    def _measure(self, logits, chosen, own, routes) -> None:
        valid = self.valid if self.valid is not None else torch.ones(len(logits), dtype=torch.bool)
        valid = valid.to(logits.device)
        n = float(valid.sum())
        if not n:
            return
        load = torch.bincount(chosen[valid].reshape(-1), minlength=self.num_experts).float()
        probs = torch.softmax(logits[valid].float(), dim=-1)
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
        s = self._sums
        s["layers"] = s.get("layers", 0.0) + 1
        s["load"] = s.get("load", 0.0) + float(load.max() / load.mean())
        s["entropy"] = s.get("entropy", 0.0) + float(entropy.sum())
        s["tokens"] = s.get("tokens", 0.0) + n
        if routes is not None:
            known = valid & (routes >= 0).all(-1)
            differ = (own[known].sort(-1).values != routes[known].sort(-1).values).any(-1)
            s["differ"] = s.get("differ", 0.0) + float(differ.sum())
            s["compared"] = s.get("compared", 0.0) + float(known.sum())

    def metrics(self) -> dict[str, float]:
        """The measures of the no-grad forwards since the last call (per step: pi_old's), as sums
        over this rank for `reduce_across_ranks`' mean; then reset."""
        s, self._sums = self._sums, {}
        if not s:
            return {}
        out = {"moe/expert_load_max_over_mean": s["load"] / s["layers"],
               "moe/router_entropy": s["entropy"] / s["tokens"]}
        if s.get("compared"):
            # tokens x layers whose top-k set the learner's router would choose differs from the engine's
            out["moe/route_mismatch"] = s["differ"] / s["compared"]
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        if getattr(self.lm, "_conveyor_routers", None) is self:
            del self.lm._conveyor_routers


@contextmanager
def routing(model, routes: torch.Tensor | None, attention_mask: torch.Tensor | None, packed=None):
    """Around one forward of `model` on a (B, L) batch (or its `packed` rows): the routers' hooks
    (`Routers`, found on the model) get the batch's routes (B, L, layers, k), -1 where unknown,
    laid out as the forward's rows, and which rows are tokens. A model without hooks: nothing."""
    hooks: Routers | None = getattr(causal_lm(model), "_conveyor_routers", None)
    if hooks is None:
        if routes is not None:
            raise RuntimeError("rollouts carry routes but this model has no router hooks (learner.routing_replay)")
        yield
        return
    if packed is None:
        valid = attention_mask.reshape(-1).bool() if attention_mask is not None else None
        flat = None if routes is None else routes.reshape(-1, *routes.shape[2:])
    else:
        slots = packed.input_ids.numel()
        valid = torch.zeros(slots, dtype=torch.bool, device=packed.input_ids.device)
        valid[packed.packed_index] = True
        flat = None
        if routes is not None:
            flat = routes.new_full((slots, *routes.shape[2:]), -1)
            flat[packed.packed_index] = routes.reshape(-1, *routes.shape[2:])[packed.padded_index]
    if flat is not None:
        hooks.check(flat)
    hooks.routes, hooks.valid = flat, valid
    grad = torch.is_grad_enabled()
    try:
        yield
    finally:
        if not grad:
            hooks.routes = hooks.valid = None
        # else kept until the next forward: gradient checkpointing runs the layers' forwards again
        # in the backward, after this context, and they must route as the first forward did
