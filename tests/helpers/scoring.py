"""Rollouts as a generator would send them to a scorer (`make_rollout`), and scored ones through the
wire format (`roundtrip`)."""

from __future__ import annotations

import numpy as np

from buffer.messages import ID_DTYPE, LOGPROB_DTYPE, Rollout, ScoredMsg, decode, encode


def make_rollout(prompt: str, completion: str, label: str | None, group_id: int = 0, sample_index: int = 0,
                 lease_id: int = 1, tokenizer=None) -> Rollout:
    """A rollout as a generator would send it; token ids from `tokenizer` (else one id per character)."""
    if tokenizer is not None:
        p_ids = tokenizer.encode(prompt, add_special_tokens=False)
        c_ids = tokenizer.encode(completion, add_special_tokens=False) + [tokenizer.eos_token_id]
    else:
        p_ids, c_ids = [5 + ord(c) % 50 for c in prompt], [5 + ord(c) % 50 for c in completion] + [2]
    t = len(c_ids)
    return Rollout(group_id=group_id, sample_index=sample_index, lease_id=lease_id,
                   prompt_ids=np.asarray(p_ids, ID_DTYPE), completion_ids=np.asarray(c_ids, ID_DTYPE),
                   behav_logprobs=np.full(t, -1.0, LOGPROB_DTYPE), versions=np.zeros(t, ID_DTYPE),
                   prompt=prompt, completion=completion, label=label, finish_reason="stop", worker_id="test")


def roundtrip(scored):
    """Through the wire format: what the buffer would decode."""
    return decode(encode(ScoredMsg(scored))).scored
