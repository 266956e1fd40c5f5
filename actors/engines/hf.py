"""The transformers backend: a Hugging Face causal LM sampled by hand over its KV cache. Slow, but
easy to step through, and a second opinion on vLLM's numbers (the same processed log-probs, see
`actors.engines.base.process_logits`). torch and transformers are imported inside. A LoRA adapter round
is merged into the weights (base + scale * B @ A). Text prompts only: a prompt with images is refused
(ValueError), the vLLM engines take them.
"""

from __future__ import annotations

from typing import Sequence

from actors.engines.base import Completion, Engine, Sampling, process_logits
from weight_sync.messages import RoundInfo, round_info


def _stop_string_end(text: str, stops) -> tuple[str, int] | None:
    """(the stop string, where the text ends with it) for the first one `text` holds, else None."""
    found = [(text.find(s) + len(s), s) for s in stops if s and s in text]
    if not found:
        return None
    end, stop = min(found)
    return stop, end


def _stop_ids(tokenizer, model_path: str, extra: Sequence[int]) -> set[int]:
    """eos ids of the tokenizer and of generation_config.json, plus `extra`."""
    ids = set(int(t) for t in extra)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    except OSError:  # no generation_config.json
        pass
    return ids


class TransformersEngine(Engine):
    """A Hugging Face causal LM sampled by hand: all n*len(prompts) sequences in one left-padded
    batch, one forward per new token over the KV cache."""

    def __init__(self, model: str, *, tokenizer: str = "", dtype: str = "float32", seed: int = 0,
                 device: str = "cpu"):
        import torch
        from transformers import AutoTokenizer

        from learner.modeling import load_causal_lm

        self.model_path = model
        self.model = load_causal_lm(model, dtype=dtype, device=device)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or model)
        self.device = torch.device(device)
        self.rng = torch.Generator(device="cpu").manual_seed(seed)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else 0
        self.eos_ids = _stop_ids(self.tokenizer, model, [])
        self.version = 0
        self._lora_base: dict = {}  # the base weights LoRA adapter rounds are merged into

    def generate(self, prompt_ids: list[list[int]], n: int, sampling: Sampling,
                 images: list[list[bytes] | None] | None = None) -> list[list[Completion]]:
        import torch

        with_images = [i for i, imgs in enumerate(images or ()) if imgs]
        if with_images:
            # The hand-written loop gives each token 1-D positions; a vision-language model's image
            # tokens need its M-RoPE positions and its pixels: use generator.engine=vllm for them.
            raise ValueError(f"the transformers engine samples text prompts only: prompt(s) {with_images} of the "
                             f"batch have images (generator.engine=vllm takes them)")
        if not prompt_ids:
            return []
        seqs = [list(map(int, p)) for p in prompt_ids for _ in range(n)]
        rng = self.rng if sampling.seed is None else torch.Generator(device="cpu").manual_seed(sampling.seed)
        stop = self.eos_ids | set(int(t) for t in sampling.stop_token_ids)
        tokens, logprobs, reasons, texts = self._sample(seqs, sampling, stop, rng)
        out: list[list[Completion]] = []
        for i in range(len(prompt_ids)):
            group = []
            for b in range(i * n, (i + 1) * n):
                text, at = texts[b], _stop_string_end(texts[b], sampling.stop)
                last = tokens[b][-1] if tokens[b] else None
                why = at[0] if at else last if reasons[b] == "stop" and last not in self.eos_ids else None
                group.append(Completion(tokens[b], logprobs[b], reasons[b], text if at is None else text[:at[1]],
                                        stop_reason=why))
            out.append(group)
        return out

    def _sample(self, seqs, sampling, stop, rng):
        import torch
        import torch.nn.functional as F

        with torch.no_grad():
            B = len(seqs)
            P = max(len(s) for s in seqs)
            ids = torch.full((B, P), self.pad_id, dtype=torch.long)  # (B, P) left-padded
            attn = torch.zeros((B, P), dtype=torch.long)
            for b, s in enumerate(seqs):
                ids[b, P - len(s):] = torch.tensor(s)
                attn[b, P - len(s):] = 1
            # Positions count real tokens only, so a left-padded prompt sees the positions it would alone.
            pos = (attn.cumsum(-1) - 1).clamp_min(0)  # (B, P)
            dev = self.device
            out = self.model(input_ids=ids.to(dev), attention_mask=attn.to(dev), position_ids=pos.to(dev),
                             use_cache=True)
            tokens: list[list[int]] = [[] for _ in range(B)]
            logprobs: list[list[float]] = [[] for _ in range(B)]
            reasons = ["length"] * B
            alive = torch.ones(B, dtype=torch.bool)
            stop_t = torch.tensor(sorted(stop), dtype=torch.long)
            for _ in range(sampling.max_tokens):
                logits = process_logits(out.logits[:, -1].cpu(), sampling.temperature, sampling.top_k,
                                        sampling.top_p)  # (B, V)
                lp = F.log_softmax(logits, dim=-1)  # (B, V)
                if sampling.temperature <= 0:
                    nxt = logits.argmax(dim=-1)  # (B,)
                else:
                    nxt = torch.multinomial(lp.exp(), 1, generator=rng).squeeze(-1)  # (B,)
                picked = lp.gather(-1, nxt.unsqueeze(-1)).squeeze(-1)  # (B,)
                for b in alive.nonzero().flatten().tolist():
                    tokens[b].append(int(nxt[b]))
                    logprobs[b].append(float(picked[b]))
                ended = alive & torch.isin(nxt, stop_t)
                if sampling.stop:  # (as vLLM: the text so far, specials skipped, holds a stop string)
                    for b in (alive & ~ended).nonzero().flatten().tolist():
                        ended[b] = _stop_string_end(self.tokenizer.decode(tokens[b], skip_special_tokens=True),
                                                    sampling.stop) is not None
                for b in ended.nonzero().flatten().tolist():
                    reasons[b] = "stop"
                alive &= ~ended
                if not alive.any():
                    break
                # Finished rows keep stepping (their tokens are ignored): the batch stays rectangular.
                attn = torch.cat([attn, torch.ones((B, 1), dtype=torch.long)], dim=1)  # (B, P+t+1)
                pos = pos[:, -1:] + 1  # (B, 1)
                out = self.model(input_ids=nxt.unsqueeze(-1).to(dev), attention_mask=attn.to(dev),
                                 position_ids=pos.to(dev), past_key_values=out.past_key_values, use_cache=True)
            return tokens, logprobs, reasons, [self.tokenizer.decode(t, skip_special_tokens=True) for t in tokens]

    def receive_weights(self, info: RoundInfo) -> dict:
        from weight_sync.receiver import receive_into_model

        info = round_info(info)
        stats = receive_into_model(self.model, info, base=self._lora_base)
        self.version = info.version
        return stats

    def close(self) -> None:
        self.model = None
