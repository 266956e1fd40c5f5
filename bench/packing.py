"""Learner throughput with packed RL batches against padded ones: same model, same batch, one run.

    python bench/packing.py [--model tiny|small] [--sequences 64] [--min-len 16] [--max-len 160]
                            [--grad-accum 4] [--repeat 5]

The batch: `--sequences` rollouts in groups of 4, prompt + completion lengths drawn uniformly in
[min-len, max-len] (10x spread by default). The model is built on the fly (demo/tiny_model.py):
`tiny` (2 layers, hidden 128, the tests' model) or `small` (4 layers, hidden 256). One DeepSpeed
policy engine (world of one, the learner's defaults: ZeRO-2, fp32) runs the learner's own
`train_step` on that batch, padded (`learner.packing=false`) and packed (`true`) in turn,
`--repeat` times each after one untimed warm-up of each; the fastest of each is reported (the
machine may be shared), all of them alongside. Tokens are the batch's real tokens (prompt +
completion, no padding), as the learner's `perf/tokens_per_s` counts them.

Also timed, the same way: the reference scorer's `learner.modeling.completion_logprobs` (no grad,
16 sequences per forward) padded and packed; the padding each layout computes (`*_slots`:
positions the forwards run on, for the micro-batches of the first step); and, for those
micro-batches on a plain copy of the model, the forward + backward of the log-probs alone in five
layouts (`layouts`): padded; each micro-batch packed into rows of its longest sequence, of twice
it, or all in one row (attention over the whole micro-batch); and the learner's own: the
mini-batch's rows re-dealt over its micro-batches first (`learner.packing.regroup`).

`measure(...)` returns the result as a dict (bench/recipes.py imports it). Progress goes to
stderr; the last line on stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODELS = {"tiny": dict(num_layers=2, hidden_size=128), "small": dict(num_layers=4, hidden_size=256)}
PROMPT_LEN = 8


def say(msg: str) -> None:
    print(f"[bench/packing] {msg}", file=sys.stderr, flush=True)


def make_batch(sequences: int, min_len: int, max_len: int, seed: int) -> list:
    """Scored rollouts in groups of 4 whose total lengths are uniform in [min_len, max_len]."""
    import numpy as np

    from buffer.messages import Rollout, ScoredRollout

    rng = np.random.default_rng(seed)
    out = []
    for i in range(sequences):
        n = int(rng.integers(max(min_len, PROMPT_LEN + 1), max_len + 1)) - PROMPT_LEN
        r = Rollout(group_id=i // 4, sample_index=i % 4, lease_id=0,
                    prompt_ids=rng.integers(4, 70, size=PROMPT_LEN).astype(np.int32),
                    completion_ids=rng.integers(4, 70, size=n).astype(np.int32),
                    behav_logprobs=np.log(rng.uniform(0.05, 0.9, size=n)).astype(np.float32),
                    versions=np.zeros(n, dtype=np.int32), finish_reason="stop", worker_id="bench")
        out.append(ScoredRollout(rollout=r, reward=float(rng.uniform())))
    return out


def best_rate(tokens: int, seconds: list[float]) -> dict:
    rates = [tokens / s for s in seconds]
    return {"tokens_per_s": round(max(rates), 1), "seconds": round(min(seconds), 4),
            "all_tokens_per_s": [round(r, 1) for r in rates]}


def time_layouts(model_dir: str, tb, micro: list, repeat: int) -> dict:
    """Forward + backward of next-token log-probs over the rows `micro` (index tensors into the
    TrainBatch `tb`, one per micro-batch), per layout: the fastest of `repeat` rounds (after a
    warm-up), as real tokens/s, and the positions computed."""
    from learner.modeling import load_causal_lm, next_token_stats
    from learner.packing import pack_rows, regroup

    model = load_causal_lm(model_dir).train()
    lengths = tb.attention_mask.sum(-1).tolist()
    tokens = int(sum(lengths))
    dealt = [tb.select(idx) for idx in regroup(lengths, micro)]
    as_given = [tb.select(idx) for idx in micro]

    def longest(mb) -> int:
        return int(mb.attention_mask.sum(-1).max())

    layouts = {  # name -> [(micro-batch, its packed rows or None)]
        "padded": [(mb, None) for mb in as_given],
        "rows_of_longest": [(mb, mb.packed_rows()) for mb in as_given],
        "rows_of_2x_longest": [(mb, pack_rows(mb.input_ids, mb.attention_mask, 2 * longest(mb))) for mb in as_given],
        "one_row": [(mb, pack_rows(mb.input_ids, mb.attention_mask, int(mb.attention_mask.sum()))) for mb in as_given],
        "regrouped_rows_of_longest": [(mb, mb.packed_rows(max(lengths))) for mb in dealt],
    }
    out = {}
    for name, batches in layouts.items():
        seconds = []
        for rep in range(repeat + 1):
            t0 = time.perf_counter()
            for mb, packed in batches:
                lp, _ = next_token_stats(model, mb.input_ids, mb.attention_mask, 1.0, packed)
                (lp * mb.completion_mask).sum().backward()
            if rep:
                seconds.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
        slots = sum(mb.input_ids.numel() if packed is None else packed.num_slots for mb, packed in batches)
        out[name] = {"slots": slots, **best_rate(tokens, seconds)}
        say(f"forward + backward, {name}: {out[name]['tokens_per_s']:.0f} tok/s ({slots} positions)")
    return out


def measure(model: str = "tiny", sequences: int = 64, min_len: int = 16, max_len: int = 160, grad_accum: int = 4,
            repeat: int = 5, seed: int = 0) -> dict:
    """Learner tokens/s of `train_step` padded vs packed (and the reference scorer's log-probs) on one
    mixed-length batch; see the module docstring. `ratio`: packed / padded learner tokens/s."""
    import torch

    from demo.tiny_model import build_tiny_model
    from learner.batching import mini_batches, to_train_batch
    from learner.config import LearnerConfig
    from learner.engine import build_policy_engine, process_group
    from learner.modeling import completion_logprobs
    from learner.packing import regroup
    from learner.trainer import shuffle_seed, train_step

    if model not in MODELS:
        raise ValueError(f"model={model!r}: expected one of {list(MODELS)}")
    scored = make_batch(sequences, min_len, max_len, seed)
    prompts = [s.rollout.prompt_ids for s in scored]
    completions = [s.rollout.completion_ids for s in scored]
    with tempfile.TemporaryDirectory(prefix="bench_packing_") as tmp:
        model_dir = str(build_tiny_model(Path(tmp) / model, **MODELS[model], seed=seed))
        cfg = LearnerConfig(model_path=model_dir, run_dir=str(Path(tmp) / "run"), seed=seed, lr=1e-6,
                            gradient_accumulation_steps=grad_accum, tensorboard=False)
        layouts = {"padded": cfg.model_copy(update={"packing": False}),
                   "packed": cfg.model_copy(update={"packing": True})}
        learner_s: dict[str, list[float]] = {k: [] for k in layouts}
        reference_s: dict[str, list[float]] = {k: [] for k in layouts}
        with process_group(cfg) as (_, world, device):
            policy = build_policy_engine(cfg)
            tb0 = to_train_batch(scored)
            tokens = int(tb0.attention_mask.sum())
            micro = mini_batches(tb0.size, 1, grad_accum, shuffle_seed(cfg, 0, 0))[0]  # step 0's, as train_step
            lengths = tb0.attention_mask.sum(-1).tolist()
            slots = {"padded": sum(tb0.select(idx).input_ids.numel() for idx in micro),
                     "packed": sum(tb0.select(idx).packed_rows(max(lengths)).num_slots
                                   for idx in regroup(lengths, micro))}
            for rep in range(repeat + 1):  # rep 0: warm-up, untimed
                for name, c in layouts.items():  # side by side: the machine's load hits both alike
                    tb = to_train_batch(scored).to(device)
                    t0 = time.perf_counter()
                    train_step(c, policy, None, tb, step=rep, world=world)
                    dt = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    completion_logprobs(policy.module, prompts, completions, batch_size=16,
                                        packing=c.packing)
                    dr = time.perf_counter() - t0
                    if rep:
                        learner_s[name].append(dt)
                        reference_s[name].append(dr)
                say(f"{'warm-up' if rep == 0 else f'run {rep}/{repeat}'}: learner "
                    + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in learner_s.items() if rep))
        layouts_fb = time_layouts(model_dir, tb0, micro, repeat)
    learner = {k: best_rate(tokens, v) for k, v in learner_s.items()}
    reference = {k: best_rate(tokens, v) for k, v in reference_s.items()}
    return {
        "bench": "packing", "model": model, **MODELS[model], "torch_threads": torch.get_num_threads(),
        "sequences": sequences, "lengths": [min_len, max_len], "tokens": tokens, "grad_accum": grad_accum,
        "repeat": repeat, "padded_slots": slots["padded"], "packed_slots": slots["packed"],
        "learner": learner, "reference": reference, "layouts": layouts_fb,
        "ratio": round(learner["packed"]["tokens_per_s"] / learner["padded"]["tokens_per_s"], 2),
        "reference_ratio": round(reference["packed"]["tokens_per_s"] / reference["padded"]["tokens_per_s"], 2),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", choices=list(MODELS))
    p.add_argument("--sequences", type=int, default=64, help="rollouts in the batch (groups of 4)")
    p.add_argument("--min-len", type=int, default=16, help="shortest prompt + completion")
    p.add_argument("--max-len", type=int, default=160, help="longest prompt + completion")
    p.add_argument("--grad-accum", type=int, default=4, help="micro-batches per step")
    p.add_argument("--repeat", type=int, default=5, help="timed steps per layout; the fastest is reported")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    out = measure(a.model, a.sequences, a.min_len, a.max_len, a.grad_accum, a.repeat, a.seed)
    say(f"learner: padded {out['learner']['padded']['tokens_per_s']:.0f} tok/s, packed "
        f"{out['learner']['packed']['tokens_per_s']:.0f} tok/s: {out['ratio']}x (slots {out['padded_slots']} -> "
        f"{out['packed_slots']}); reference log-probs: {out['reference_ratio']}x")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
