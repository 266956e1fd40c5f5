"""The router load-balancing loss of a mixture-of-experts policy (`learner.aux_loss_coef`).

transformers' MoE causal LMs (Mixtral, Qwen2/3-MoE, OLMoE, ...) return `aux_loss`, the router's
load-balancing loss over the forward's tokens, when called with `output_router_logits=True`. The
learner's forwards go through `learner.modeling.next_token_stats`, which knows nothing of it, so
`RouterAuxLoss` hooks the model instead: a pre-hook asks each forward that builds a graph for the
router logits, a hook keeps the aux loss it returns, and `add` puts coef * weight * aux_loss on
the micro-batch's policy loss (OpenRLHF's actor.aux_loss_coef). No-grad forwards (pi_old, the
reference) are left as they are.
"""

from __future__ import annotations

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
