"""Datasets of the offline trainers: rows from files, tokenized into sequences with a response mask.

Rows come from `common.datasets.iter_rows`: JSONL, JSON, Parquet, `datasets.save_to_disk` folders and
hub dataset folders (`cfg.dataset_split` picks the split). A row is either

  prompt/response   {"prompt": "...", "response": "..."}            (SFT)
  messages          {"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}]}
  pair              {"prompt": ..., "chosen": ..., "rejected": ..., "margin"?: float}  (DPO, RM)

with the column names taken from the config. A prompt may itself be a list of chat messages, and
a chosen/rejected response may be a whole conversation (its last assistant message is the
response). With a chat template, the template renders the conversation; without one, the texts
are concatenated (the prompt encoded as the tokenizer encodes a whole text, with its bos).

Every sequence carries `target`: 1 on the tokens trained on (the response), 0 elsewhere. A bad
row raises `DatasetError` naming its file and line, or is skipped and counted (`on_bad_row`).

Without a chat template in use, `input_template` frames a string prompt (`User: {}\nAssistant: `).
In `pretrain_mode` (SFT) a row is one plain text and every token is a target. Several datasets,
comma-separated, are mixed by `dataset_probs` as the buffer mixes prompt datasets
(`buffer.prompts.mix_order`, OpenRLHF's `interleave_datasets`) or follow one another.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from buffer.prompts import mix_order
from common.datasets import BadRow, DatasetError, chat_messages, iter_rows
from common.wire import short
from learner.offline.config import dataset_names


@dataclass
class Encoded:
    """One tokenized sequence; target[t] = 1 when token t is a response token (loss is taken on it)."""

    ids: list[int]
    target: list[int]

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def num_targets(self) -> int:
        return sum(self.target)


@dataclass
class Pair:
    """A preference pair sharing one prompt; `margin` is the optional Bradley-Terry margin."""

    chosen: Encoded
    rejected: Encoded
    margin: float = 0.0


@dataclass
class DataStats:
    """What loading one file did: rows read, used, skipped as bad, truncated, dropped as too long."""

    path: str = ""
    role: str = "data"
    """`data` (training) or `data_eval` (held out): the prefix of its metrics."""
    rows: int = 0
    used: int = 0
    bad: int = 0
    truncated: int = 0
    too_long: int = 0
    bad_examples: list[str] = field(default_factory=list)

    def as_metrics(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}/rows": self.rows, f"{prefix}/used": self.used, f"{prefix}/bad_rows": self.bad,
                f"{prefix}/truncated": self.truncated, f"{prefix}/dropped_too_long": self.too_long}

    def summary(self) -> str:
        return (f"{self.path}: {self.rows} rows, {self.used} used, {self.bad} bad (skipped), "
                f"{self.truncated} truncated to max_len, {self.too_long} dropped (no response token within max_len)")


# ------------------------------------------------------------------------------------------------
# rows -> chat messages


def _need(row: Any, key: str) -> Any:
    if not isinstance(row, dict):
        raise BadRow(f"a row must be a JSON object, got {short(row)}")
    if key not in row or row[key] is None:
        raise BadRow(f"missing key {key!r} (keys: {sorted(row)})")
    return row[key]


def sft_conversation(row: Any, cfg, input_template: str = "") -> tuple[list[dict], bool]:
    """(messages, all_turns) of an SFT row: a conversation (the `messages_key` column, or a `prompt_key`
    column holding messages and no response column) trains on every assistant message when
    cfg.multiturn, else on the last; a prompt/response row on its response. `input_template` is put
    around a string prompt."""
    conversation = None
    if isinstance(row, dict) and row.get(cfg.messages_key) is not None:
        conversation = cfg.messages_key
    elif isinstance(row, dict) and isinstance(row.get(cfg.prompt_key), list) and row.get(cfg.response_key) is None:
        conversation = cfg.prompt_key
    if conversation is not None:
        msgs = chat_messages(row[conversation], conversation)
        if not any(m["role"] == "assistant" for m in msgs):
            raise BadRow(f"{conversation!r} has no assistant message to train on")
        if not cfg.multiturn:  # the last assistant message is the response, what follows it is dropped
            last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
            return msgs[: last + 1], False
        return msgs, True
    if not isinstance(row, dict) or cfg.prompt_key not in row and cfg.response_key not in row:
        keys = sorted(row) if isinstance(row, dict) else short(row)
        raise BadRow(f"has neither {cfg.prompt_key!r}/{cfg.response_key!r} nor {cfg.messages_key!r} (keys: {keys})")
    prompt = _need(row, cfg.prompt_key)
    response = _need(row, cfg.response_key)
    if not isinstance(response, str) or not response:
        raise BadRow(f"{cfg.response_key!r} must be a non-empty string, got {short(response)}")
    prompt = _templated(prompt, input_template)
    msgs = chat_messages(prompt, cfg.prompt_key) if prompt != "" else []
    return msgs + [{"role": "assistant", "content": response}], False


def pretrain_text(row: Any, cfg) -> str:
    """The text of a continued pre-training row: its `prompt_key` column, a non-empty string."""
    text = _need(row, cfg.prompt_key)
    if not isinstance(text, str) or not text:
        raise BadRow(f"{cfg.prompt_key!r} must be a non-empty string in pretrain_mode, got {short(text)}")
    return text


def _templated(prompt: Any, input_template: str) -> Any:
    return input_template.format(prompt) if input_template and isinstance(prompt, str) else prompt


def pair_conversations(row: Any, cfg, input_template: str = "") -> tuple[list[dict], list[dict], float]:
    """(chosen messages, rejected messages, margin) of a preference row; the last message of each is the
    response. `input_template` is put around a string prompt."""
    chosen, rejected = _need(row, cfg.chosen_key), _need(row, cfg.rejected_key)
    prompt = row.get(cfg.prompt_key, "") if cfg.prompt_key else ""
    prompt = _templated(prompt, input_template) if prompt not in ("", None) else prompt
    base = chat_messages(prompt, cfg.prompt_key) if prompt not in ("", None) else []
    out = []
    for key, value in ((cfg.chosen_key, chosen), (cfg.rejected_key, rejected)):
        if isinstance(value, str):
            if not value:
                raise BadRow(f"{key!r} is an empty string")
            out.append(base + [{"role": "assistant", "content": value}])
        else:
            msgs = chat_messages(value, key)
            if msgs[-1]["role"] != "assistant":
                raise BadRow(f"{key!r} must end with an assistant message, ends with role {msgs[-1]['role']!r}")
            out.append(base + msgs)
    margin = 0.0
    key = getattr(cfg, "margin_key", "")
    if key and row.get(key) is not None:
        m = row[key]
        if isinstance(m, bool) or not isinstance(m, (int, float)):
            raise BadRow(f"{key!r} must be a number, got {short(m)}")
        margin = float(m)
    return out[0], out[1], margin


# ------------------------------------------------------------------------------------------------
# messages -> tokens


def encode_messages(tokenizer, messages: list[dict], train_on: str, use_chat_template: bool,
                    add_eos: bool) -> Encoded:
    """Token ids of a conversation and its target mask.

    train_on: "all" (every assistant message) or "last" (the last message only, for pairs).
    The conversation is encoded piece by piece (each piece the text one more message adds), so every
    token belongs to exactly one message and the mask cannot drift off by a token at a boundary.
    """
    template = use_chat_template and getattr(tokenizer, "chat_template", None)
    ids: list[int] = []
    target: list[int] = []
    rendered = ""
    for i, msg in enumerate(messages):
        trained = msg["role"] == "assistant" and (train_on == "all" or i == len(messages) - 1)
        if template:
            # the prompt part ends with the generation prompt, as the generator renders it
            if msg["role"] == "assistant":
                head = (tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
                        if i else "")
                if not head.startswith(rendered):
                    raise BadRow("the chat template renders an earlier turn differently once later ones follow")
                _extend(tokenizer, head[len(rendered):], 0, ids, target, first=not ids)
                rendered = head
            full = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
            if not full.startswith(rendered):
                raise BadRow("the chat template renders an earlier turn differently once later ones follow")
            _extend(tokenizer, full[len(rendered):], int(trained), ids, target, first=not ids)
            rendered = full
        else:
            _extend(tokenizer, msg["content"], int(trained), ids, target, first=not ids, plain=True)
            if trained and add_eos and tokenizer.eos_token_id is not None:
                ids.append(tokenizer.eos_token_id)
                target.append(1)
    if not any(target):
        raise BadRow("no response tokens (the response encodes to nothing)")
    return Encoded(ids, target)


def encode_text(tokenizer, text: str, add_eos: bool) -> Encoded:
    """A plain text for continued pre-training, encoded as a whole text is (with bos); every token is
    trained on (the first one is never predicted), eos appended when `add_eos`."""
    ids = list(tokenizer(text)["input_ids"])
    if add_eos and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return Encoded(ids, [1] * len(ids))


def _extend(tokenizer, text: str, flag: int, ids: list[int], target: list[int], first: bool,
            plain: bool = False) -> None:
    if not text and not (plain and first):
        return
    # plain text: the first piece is encoded as a whole text is (with bos); a rendered template
    # writes its own special tokens
    new = tokenizer(text, add_special_tokens=plain and first)["input_ids"]
    ids.extend(new)
    if plain and first and flag:
        # a response with no prompt before it: the specials the tokenizer added (bos) are not trained on
        n_text = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        target.extend([0] * (len(new) - n_text) + [flag] * n_text)
    else:
        target.extend([flag] * len(new))


def truncate(enc: Encoded, max_len: int, keep: str = "head") -> tuple[Encoded, bool]:
    """(the sequence cut to max_len, whether it was cut); keep="tail" keeps the last tokens."""
    if len(enc) <= max_len:
        return enc, False
    if keep == "tail":
        return Encoded(enc.ids[-max_len:], enc.target[-max_len:]), True
    return Encoded(enc.ids[:max_len], enc.target[:max_len]), True


# ------------------------------------------------------------------------------------------------
# whole files


def _handle_bad(stats: DataStats, where: str, why: str, on_bad_row: str) -> None:
    if on_bad_row == "error":
        raise DatasetError(f"{where}: {why} (set on_bad_row: skip to leave such rows out)")
    stats.bad += 1
    if len(stats.bad_examples) < 5:
        stats.bad_examples.append(f"{where}: {why}")


def load_examples(path: str | Path, tokenizer, cfg, kind: str, keep: str = "head",
                  limit: int = 0, split: str = "") -> tuple[list, DataStats]:
    """Read and tokenize a whole file. kind="sft" -> [Encoded]; kind="pairs" -> [Pair].

    `keep` says which end of a sequence longer than cfg.max_len survives; `limit` stops after that
    many rows (0: all); `split`: the split to read (empty: cfg.dataset_split).
    """
    stats = DataStats(path=str(path))
    out: list = []
    # the input template frames a string prompt only where no chat template renders the turns
    templated = cfg.use_chat_template and bool(getattr(tokenizer, "chat_template", None))
    input_template = "" if templated else getattr(cfg, "input_template", "")
    for where, row in iter_rows(path, split or getattr(cfg, "dataset_split", "train")):
        if limit and stats.rows >= limit:
            break
        stats.rows += 1
        try:
            if isinstance(row, BadRow):
                raise row
            if kind == "sft":
                if getattr(cfg, "pretrain_mode", False):
                    enc = encode_text(tokenizer, pretrain_text(row, cfg), cfg.add_eos)
                else:
                    msgs, all_turns = sft_conversation(row, cfg, input_template)
                    enc = encode_messages(tokenizer, msgs, "all" if all_turns else "last", cfg.use_chat_template,
                                          cfg.add_eos)
                enc, cut = truncate(enc, cfg.max_len, keep)
                stats.truncated += cut
                if not enc.num_targets:
                    stats.too_long += 1
                    continue
                out.append(enc)
            else:
                chosen_msgs, rejected_msgs, margin = pair_conversations(row, cfg, input_template)
                pair_cut, ok = False, True
                encs = []
                for msgs in (chosen_msgs, rejected_msgs):
                    enc = encode_messages(tokenizer, msgs, "last", cfg.use_chat_template, cfg.add_eos)
                    enc, cut = truncate(enc, cfg.max_len, keep)
                    pair_cut |= cut
                    ok &= enc.num_targets > 0
                    encs.append(enc)
                stats.truncated += pair_cut
                if not ok:
                    stats.too_long += 1
                    continue
                out.append(Pair(encs[0], encs[1], margin))
        except BadRow as e:
            _handle_bad(stats, where, str(e), cfg.on_bad_row)
            continue
        stats.used += 1
    if not out:
        raise DatasetError(f"{path}: no usable rows ({stats.summary()})"
                           + (f"; first bad: {stats.bad_examples[0]}" if stats.bad_examples else ""))
    return out, stats


def load_splits(tokenizer, cfg, kind: str, keep: str = "head") -> tuple[list, list, list[DataStats]]:
    """(train, eval, stats): train from the datasets of cfg.dataset (at most max_samples of each,
    mixed by cfg.dataset_probs or one after the other, at most max_samples in all, as OpenRLHF's
    `blending_datasets`); eval from cfg.eval_dataset, or cfg.eval_fraction of the training examples
    held out (a seeded shuffle, so every rank and every resumed run holds out the same examples);
    stats: one per file read."""
    sources = [load_examples(name, tokenizer, cfg, kind, keep, cfg.max_samples) for name in dataset_names(cfg.dataset)]
    all_stats = [stats for _, stats in sources]
    if cfg.dataset_probs is None:
        train = [x for examples, _ in sources for x in examples]
    else:
        train = [sources[d][0][i] for d, i in mix_order([len(e) for e, _ in sources], cfg.dataset_probs, cfg.seed)]
    if cfg.max_samples:
        train = train[: cfg.max_samples]
    held: list = []
    if cfg.eval_dataset:
        for name in dataset_names(cfg.eval_dataset):
            examples, eval_stats = load_examples(name, tokenizer, cfg, kind, keep, split=cfg.eval_split)
            held += examples
            eval_stats.role = "data_eval"
            all_stats.append(eval_stats)
    elif cfg.eval_fraction > 0:
        order = list(range(len(train)))
        random.Random(cfg.seed).shuffle(order)
        n_eval = max(1, int(round(cfg.eval_fraction * len(train))))
        if n_eval >= len(train):
            raise DatasetError(f"{cfg.dataset}: eval_fraction={cfg.eval_fraction} of {len(train)} examples "
                               "leaves none to train on")
        held_idx = set(order[:n_eval])
        held = [x for i, x in enumerate(train) if i in held_idx]
        train = [x for i, x in enumerate(train) if i not in held_idx]
    return train, held, all_stats


def report(all_stats: list[DataStats], file=sys.stderr) -> None:
    """One line per file, and the first bad rows of each (rank 0 calls this)."""
    for s in all_stats:
        print(f"data: {s.summary()}", file=file, flush=True)
        for line in s.bad_examples:
            print(f"data:   skipped {line}", file=file, flush=True)
