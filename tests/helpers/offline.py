"""What the offline trainers' tests share: the tiny tokenizer's ids by hand, and JSONL files."""

from __future__ import annotations

import json

from demo.tiny_model import vocab

V = vocab()
BOS, EOS = V["<s>"], V["</s>"]


def ids(text: str) -> list[int]:
    """The tiny tokenizer's ids of `text` (one token per character)."""
    return [V[c] for c in text]


def write(path, rows) -> str:
    """A JSONL file of `rows` (a string row is written as it is: a broken line on purpose)."""
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)
