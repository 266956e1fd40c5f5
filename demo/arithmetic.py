"""The demo's checkable task: two-digit addition, answer digits written least significant first.

`12+39=` -> `15` (51 reversed). Reversed digits let a tiny model learn carrying left to right; with
the digits in normal order the same model stays under 20% for minutes (DESIGN.md). A warm start by
supervised fine-tuning brings the policy to partial accuracy, so reinforcement learning has room
to show a gain, and the reward is exact: the completion equals the label or it does not.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Iterable


def make_problems(n: int, seed: int, exclude: set[str] | None = None) -> list[dict]:
    """`n` distinct problems `{"prompt": "a+b=", "label": reversed(a+b)}`, none of them in `exclude`."""
    rng = random.Random(seed)
    exclude = exclude or set()
    out, seen = [], set(exclude)
    if n > 90 * 90 - len(exclude):
        raise ValueError(f"only {90 * 90 - len(exclude)} distinct problems are left, asked for {n}")
    while len(out) < n:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        prompt = f"{a}+{b}="
        if prompt in seen:
            continue
        seen.add(prompt)
        out.append({"prompt": prompt, "label": str(a + b)[::-1]})
    return out


def write_jsonl(rows: Iterable[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def answer_of(completion: str) -> str:
    """The answer part of a completion: up to the first newline or end-of-text."""
    return completion.split("\n", 1)[0].split("</s>", 1)[0].strip()


def reward_fn(prompts: list[str], completions: list[str], labels: list[str | None]) -> list[float]:
    """1.0 when the answer equals the label, else 0.0 (batched, as scorers call it)."""
    return [float(label is not None and answer_of(c) == label) for c, label in zip(completions, labels)]


def warm_start(model_dir: str | Path, out_dir: str | Path, problems: list[dict], steps: int, *,
               batch_size: int = 128, lr: float = 1e-3, seed: int = 0, log_every: int = 50) -> Path:
    """Supervised fine-tuning on `prompt + label + "\\n"` (loss on the answer only); saves an HF folder."""
    examples = [[(p["prompt"], False), (p["label"] + "\n", True)] for p in problems]
    return warm_start_segments(model_dir, out_dir, examples, steps, batch_size=batch_size, lr=lr, seed=seed,
                               log_every=log_every)


def encode_segments(tok, segments: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of one example: each segment's ids, 1 where the segment is trained."""
    ids, mask = [], []
    for i, (text, trained) in enumerate(segments):
        seg = tok(text, add_special_tokens=i == 0)["input_ids"]  # <s> first, as the generator encodes it
        ids += seg
        mask += [int(trained)] * len(seg)
    return ids, mask


def warm_start_segments(model_dir: str | Path, out_dir: str | Path, examples: list[list[tuple[str, bool]]],
                        steps: int, *, batch_size: int = 128, lr: float = 1e-3, seed: int = 0,
                        log_every: int = 50) -> Path:
    """Supervised fine-tuning on texts made of segments `(text, trained)`, the loss on the trained
    segments' tokens only (a multi-turn episode: the policy's turns trained, the environment's not);
    saves an HF folder. The first segment is encoded as a prompt is (with <s>), the others without
    special tokens, as a generator appends turns and observations.

    Plain PyTorch on purpose: it is a few seconds of set-up for the demo, not the SFT trainer.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    seqs, masks = zip(*(encode_segments(tok, segments) for segments in examples))
    L = max(map(len, seqs))
    ids = torch.full((len(seqs), L), tok.pad_token_id, dtype=torch.long)  # (N, L)
    loss_mask = torch.zeros((len(seqs), L), dtype=torch.float32)  # (N, L)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, : len(s)] = torch.tensor(s)
        loss_mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        idx = torch.randint(0, len(seqs), (batch_size,), generator=g)
        x, m = ids[idx], loss_mask[idx]
        logits = model(input_ids=x).logits[:, :-1]  # (B, L-1, V)
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")  # (B, L-1)
        loss = (nll * m[:, 1:]).sum() / m[:, 1:].sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if log_every and (step + 1) % log_every == 0:
            print(f"warm start step {step + 1}/{steps} loss {loss.item():.4f}", flush=True)
    model.eval()
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return out_dir


def greedy_answers(model_or_dir, problems: list[dict], max_new_tokens: int = 5) -> list[str]:
    """The greedy answer (transformers) to each of `problems`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = model_or_dir
    if not hasattr(model, "generate"):
        model = AutoModelForCausalLM.from_pretrained(model_or_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(getattr(model, "name_or_path", model_or_dir))
    # every prompt "ab+cd=" has the same length, so the batch needs no padding
    prompts = torch.tensor([tok(p["prompt"])["input_ids"] for p in problems])
    with torch.no_grad():
        out = model.generate(prompts, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return [answer_of(t) for t in tok.batch_decode(out[:, prompts.shape[1]:], skip_special_tokens=True)]


def greedy_accuracy(model_or_dir, problems: list[dict], max_new_tokens: int = 5) -> float:
    """Fraction of `problems` whose greedy answer (transformers) equals the label."""
    answers = greedy_answers(model_or_dir, problems, max_new_tokens)
    return sum(a == p["label"] for a, p in zip(answers, problems)) / max(1, len(problems))


def warm_demo(out: str | Path, warm_steps: int = 375) -> dict:
    """What a run of the demo on a cluster starts from, as launch.demo builds it: 3,000 training
    prompts in `out/train.jsonl`, a tiny model warm-started on them in `out/warm`, and the
    tokenizer's newline (the answers' stop token): {"model", "prompts", "newline"}."""
    from demo.tiny_model import build_tiny_model, build_tokenizer

    out = Path(out)
    train = make_problems(3000, seed=0)
    prompts = write_jsonl(train, out / "train.jsonl")
    warm = warm_start(build_tiny_model(out / "base", seed=0), out / "warm", train, warm_steps, seed=0, log_every=0)
    return {"model": str(warm), "prompts": str(prompts), "newline": build_tokenizer().convert_tokens_to_ids("\n")}


def bench_setup(out: str | Path, warm_steps: int) -> tuple[list[dict], Path, Path, float]:
    """The demo's split (200 held-out problems, 3,000 training prompts in `out/train.jsonl`) and a
    tiny model warm-started on it in `out/warm`: (held-out rows, prompts file, warm model folder,
    its held-out greedy accuracy). What the benchmarks that compare two demo runs start from."""
    from demo.tiny_model import build_tiny_model

    out = Path(out)
    heldout = make_problems(200, seed=10_000)
    train = make_problems(3000, seed=0, exclude={q["prompt"] for q in heldout})
    prompts = write_jsonl(train, out / "train.jsonl")
    warm = warm_start(build_tiny_model(out / "base", seed=0), out / "warm", train, warm_steps, seed=0, log_every=0)
    return heldout, prompts, warm, greedy_accuracy(str(warm), heldout)
