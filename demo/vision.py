"""The vision demo's checkable task: how many red squares are in the picture?

A 56x56 picture is a 2x2 grid of 28x28 cells (one placeholder token each for demo.tiny_vlm's
model); each cell holds, or not, a red square of random size and place inside it, on a white
ground, with a little noise everywhere. The prompt is "<image>How many red squares?" and the label
the count, 0-4. Random sizes, places and noise make every picture new, so the held-out pictures
test counting, not memory. A warm start by supervised fine-tuning gives the policy partial
accuracy; reinforcement learning then has room to show a gain, and the reward is exact.
"""

from __future__ import annotations

import base64
import io
import json
import random
from pathlib import Path

PROMPT = "<image>How many red squares?"
SIDE, CELL = 56, 28


def make_picture(rng: random.Random, cells: list[bool]) -> bytes:
    """A PNG of the 2x2 grid with a red square in each cell marked True."""
    import numpy as np
    from PIL import Image

    px = np.full((SIDE, SIDE, 3), 255, dtype=np.int16)
    for k, on in enumerate(cells):
        if not on:
            continue
        size = rng.randint(10, 22)
        top = (k // 2) * CELL + rng.randint(0, CELL - size)
        left = (k % 2) * CELL + rng.randint(0, CELL - size)
        px[top:top + size, left:left + size] = (rng.randint(190, 255), rng.randint(0, 50), rng.randint(0, 50))
    noise = np.random.default_rng(rng.randrange(1 << 30)).integers(-12, 13, px.shape)
    out = io.BytesIO()
    Image.fromarray(np.clip(px + noise, 0, 255).astype("uint8")).save(out, format="PNG")
    return out.getvalue()


def make_rows(n: int, seed: int) -> list[dict]:
    """`n` rows {"prompt", "images": [base64 PNG], "label": count}; counts spread evenly over 0-4."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        count = i % 5
        cells = [True] * count + [False] * (4 - count)
        rng.shuffle(cells)
        rows.append({"prompt": PROMPT, "images": [base64.b64encode(make_picture(rng, cells)).decode()],
                     "label": str(count)})
    rng.shuffle(rows)
    return rows


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(rows: list[dict], path: str | Path) -> Path:
    """The rows as Parquet, each image a {"bytes", "path"} struct (how `datasets.Image` stores one)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({
        "prompt": [r["prompt"] for r in rows], "label": [r["label"] for r in rows],
        "images": [[{"bytes": base64.b64decode(b), "path": None} for b in r["images"]] for r in rows]})
    pq.write_table(table, path)
    return path


def answer_of(completion: str) -> str:
    return completion.split("\n", 1)[0].split("</s>", 1)[0].strip()


def reward_fn(prompts: list[str], completions: list[str], labels: list[str | None]) -> list[float]:
    """1.0 when the answer equals the count, else 0.0."""
    return [float(label is not None and answer_of(c) == label) for c, label in zip(completions, labels)]


def _encode(processor, rows: list[dict], answers: bool):
    """The rows through the model's processor (chat template, images), with the answer appended when
    `answers`: (batch, the prompt length of each row)."""
    from common.images import pil_image, text_to_parts

    texts, images, prompt_lens = [], [], []
    for r in rows:
        chat = [{"role": "user", "content": text_to_parts(r["prompt"])}]
        prompt = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        texts.append(prompt + (r["label"] + "\n" if answers else ""))
        images.append([pil_image(base64.b64decode(b)) for b in r["images"]])
        # the template's text as it is, no <s> added: the ids a generator renders (actors.prompts)
        prompt_lens.append(len(processor(text=[prompt], images=images[-1], add_special_tokens=False)["input_ids"][0]))
    processor.tokenizer.padding_side = "left" if not answers else "right"
    return processor(text=texts, images=images, return_tensors="pt", padding=True, add_special_tokens=False), \
        prompt_lens


def warm_start(model_dir: str | Path, out_dir: str | Path, rows: list[dict], steps: int, *, batch_size: int = 32,
               lr: float = 1e-3, seed: int = 0, log_every: int = 50) -> Path:
    """Supervised fine-tuning on the rows' answers (loss on the answer and its newline only); saves
    the model and its processor as an HF folder."""
    import shutil

    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    torch.manual_seed(seed)
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    g = random.Random(seed)
    for step in range(steps):
        batch, prompt_lens = _encode(processor, g.sample(rows, min(batch_size, len(rows))), answers=True)
        ids = batch["input_ids"]  # (B, L) right-padded
        labels = torch.full_like(ids, -100)
        for b, n in enumerate(prompt_lens):
            labels[b, n:] = torch.where(batch["attention_mask"][b, n:] > 0, ids[b, n:], -100)
        loss = model(**batch, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if log_every and (step + 1) % log_every == 0:
            print(f"warm start step {step + 1}/{steps} loss {loss.item():.4f}", flush=True)
    model.eval()
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    processor.save_pretrained(out_dir)
    for name in ("conveyor_tiny.json",):
        if (Path(model_dir) / name).is_file():
            shutil.copy2(Path(model_dir) / name, out_dir / name)
    return out_dir


def greedy_answers(model_dir: str | Path, rows: list[dict], batch_size: int = 50) -> list[str]:
    """The greedy answer (transformers) to each row."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for i in range(0, len(rows), batch_size):
        batch, _ = _encode(processor, rows[i:i + batch_size], answers=False)
        with torch.no_grad():
            gen = model.generate(**batch, max_new_tokens=3, do_sample=False)
        texts = processor.tokenizer.batch_decode(gen[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
        out += [answer_of(t) for t in texts]
    return out


def greedy_accuracy(model_dir: str | Path, rows: list[dict]) -> float:
    answers = greedy_answers(model_dir, rows)
    return sum(a == r["label"] for a, r in zip(answers, rows)) / max(1, len(rows))
