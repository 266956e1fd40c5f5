"""learner.offline.datasets: formats, keys, chat templates, response masks, truncation, bad rows."""

from __future__ import annotations

import pytest

from demo.tiny_model import build_tokenizer
from learner.offline.config import DPOConfig, RMConfig, SFTConfig
from learner.offline.datasets import DatasetError, load_examples, load_splits
from tests.helpers.offline import BOS, EOS, V, ids, write

# A small ChatML-like template: every message is "<s>" role ":" content "\n", the generation prompt
# is "<s>assistant:". (The tiny tokenizer has one token per character.)
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}:{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% endif %}")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def sft_cfg(**kw) -> SFTConfig:
    return SFTConfig(model_path="m", dataset="d", save_path="s", **kw)


def test_prompt_response_rows_train_on_the_response_and_eos(tmp_path, tok):
    path = write(tmp_path / "a.jsonl", [{"prompt": "12+39=", "response": "15\n"}, {"q": "1+1=", "a": "2"}])
    [enc], stats = load_examples(path, tok, sft_cfg(on_bad_row="skip"), "sft")
    # <s> 1 2 + 3 9 = | 1 5 \n </s>: the prompt (with the bos the tokenizer adds) is not trained on
    assert enc.ids == [BOS] + ids("12+39=") + ids("15\n") + [EOS]
    assert enc.target == [0] * 7 + [1] * 4
    assert (stats.rows, stats.used, stats.bad) == (2, 1, 1)
    # other column names, and no eos
    [enc], _ = load_examples(path, tok, sft_cfg(prompt_key="q", response_key="a", add_eos=False,
                                                on_bad_row="skip"), "sft")
    assert enc.ids == [BOS] + ids("1+1=2") and enc.target == [0] * 5 + [1]


def test_messages_without_a_template_concatenate_and_train_every_assistant_turn(tmp_path, tok):
    msgs = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "c"},
            {"role": "user", "content": "d"}, {"role": "assistant", "content": "e"}]
    path = write(tmp_path / "m.jsonl", [{"messages": msgs}])
    [enc], _ = load_examples(path, tok, sft_cfg(add_eos=False), "sft")
    assert enc.ids == [BOS] + ids("abcde")
    assert enc.target == [0, 0, 0, 1, 0, 1]


def test_chat_template_renders_turns_and_masks_the_assistant_parts(tmp_path, tok):
    tok.chat_template = TEMPLATE
    try:
        msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "x"}, {"role": "assistant", "content": "z"}]
        path = write(tmp_path / "c.jsonl", [{"messages": msgs}, {"prompt": "1+1=", "response": "2"}])
        conv, single = load_examples(path, tok, sft_cfg(), "sft")[0]
        # rendered: <s>user:hi\n <s>assistant: | yo\n | <s>user:x\n <s>assistant: | z\n
        # trained: the assistant contents with the template's end of turn ("\n"); no eos added
        want_ids = [BOS] + ids("user:hi\n") + [BOS] + ids("assistant:") + ids("yo\n") + [BOS] + ids("user:x\n") \
            + [BOS] + ids("assistant:") + ids("z\n")
        want_target = [0] * 20 + [1] * 3 + [0] * 19 + [1] * 2
        assert conv.ids == want_ids and conv.target == want_target
        assert single.ids == [BOS] + ids("user:1+1=\n") + [BOS] + ids("assistant:") + ids("2\n")
        assert single.target == [0] * 22 + [1, 1]
        # use_chat_template: false falls back to plain concatenation
        [_, plain], _ = load_examples(path, tok, sft_cfg(use_chat_template=False, add_eos=False), "sft")
        assert plain.ids == [BOS] + ids("1+1=2")
    finally:
        tok.chat_template = None


def test_truncation_is_counted_and_rows_without_response_left_are_dropped(tmp_path, tok):
    rows = [{"prompt": "1+1=", "response": "2"},            # 5 + 1 eos + 1 = 7 tokens: fits
            {"prompt": "12+34=", "response": "64"},         # 7 + 2 + 1 = 10: cut to 8, keeps "6"
            {"prompt": "123456789", "response": "x"}]       # prompt alone is 10 tokens: dropped
    path = write(tmp_path / "t.jsonl", rows)
    data, stats = load_examples(path, tok, sft_cfg(max_len=8), "sft")
    assert [len(e) for e in data] == [7, 8]
    assert data[1].ids == [BOS] + ids("12+34=6") and data[1].target[-1] == 1
    assert (stats.truncated, stats.too_long, stats.used) == (2, 1, 2)
    # the reward model keeps the tail instead (the scorer does the same)
    pairs = write(tmp_path / "p.jsonl", [{"prompt": "12+34=", "chosen": "64", "rejected": "99"}])
    [pair], stats = load_examples(pairs, tok, RMConfig(model_path="m", dataset="d", save_path="s", max_len=5),
                                  "pairs", keep="tail")
    assert pair.chosen.ids == ids("34=64") and pair.rejected.ids == ids("34=99") and stats.truncated == 1


@pytest.mark.parametrize("line, why", [
    ('{"prompt": "1+1=", "response": "2"', "not valid JSON"),
    ('{"prompt": "1+1="}', "missing key 'response'"),
    ('{"prompt": "1+1=", "response": 2}', "'response' must be a non-empty string"),
    ('{"prompt": "1+1=", "response": ""}', "'response' must be a non-empty string"),
    ('["1+1=", "2"]', "neither"),
    ('{"messages": [{"role": "user"}]}', "'messages'[0] must be"),
])
def test_a_bad_row_names_its_file_and_line(tmp_path, tok, line, why):
    path = write(tmp_path / "bad.jsonl", [{"prompt": "1+1=", "response": "2"}, "", line])
    with pytest.raises(DatasetError) as e:
        load_examples(path, tok, sft_cfg(), "sft")
    assert f"{path}:3: " in str(e.value) and why in str(e.value) and "on_bad_row" in str(e.value)


def test_skip_mode_counts_bad_rows_and_keeps_the_rest(tmp_path, tok):
    rows = [{"prompt": "1+1=", "response": "2"}, "not json", {"prompt": "2+2="}, {"prompt": "3+3=", "response": "6"},
            {"prompt": "x", "response": None}]
    path = write(tmp_path / "mixed.jsonl", rows)
    data, stats = load_examples(path, tok, sft_cfg(on_bad_row="skip"), "sft")
    assert len(data) == 2 and (stats.rows, stats.used, stats.bad) == (5, 2, 3)
    assert stats.bad_examples[0].startswith(f"{path}:2: not valid JSON")
    assert stats.bad_examples[1].startswith(f"{path}:3: missing key 'response'")
    assert stats.as_metrics("data")["data/bad_rows"] == 3
    # a file with nothing usable is an error even when skipping
    only_bad = write(tmp_path / "all_bad.jsonl", ["{", "[]"])
    with pytest.raises(DatasetError, match="no usable rows"):
        load_examples(only_bad, tok, sft_cfg(on_bad_row="skip"), "sft")


def test_pairs_with_strings_conversations_and_margins(tmp_path, tok):
    rows = [
        {"prompt": "1+1=", "chosen": "2", "rejected": "3", "margin": 0.5},
        {"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "good"}],
         "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "bad"}]},
        {"prompt": "1+1=", "chosen": "2", "rejected": "3", "margin": "big"},
        {"prompt": "1+1=", "chosen": "2"},
    ]
    path = write(tmp_path / "pairs.jsonl", rows)
    cfg = RMConfig(model_path="m", dataset="d", save_path="s", on_bad_row="skip")
    (p0, p1), stats = load_examples(path, tok, cfg, "pairs")
    assert p0.chosen.ids == [BOS] + ids("1+1=2") and p0.rejected.ids == [BOS] + ids("1+1=3")  # rm: no eos
    assert p0.chosen.target == [0] * 5 + [1] and p0.margin == 0.5
    assert p1.chosen.ids == [BOS] + ids("qgood") and p1.chosen.target == [0, 0] + [1] * 4 and p1.margin == 0.0
    assert stats.bad == 2
    assert "'margin' must be a number" in stats.bad_examples[0] and "missing key 'rejected'" in stats.bad_examples[1]
    # DPO appends eos to each response by default
    [d0], _ = load_examples(path, tok, DPOConfig(model_path="m", dataset="d", save_path="s", on_bad_row="skip",
                                                  max_samples=1), "pairs", limit=1)
    assert d0.chosen.ids[-1] == EOS and d0.rejected.ids[-2:] == [V["3"], EOS]


def test_held_out_split_by_fraction_or_file(tmp_path, tok):
    rows = [{"prompt": f"{i}+1=", "response": str(i + 1)} for i in range(10, 50)]
    path = write(tmp_path / "all.jsonl", rows)
    cfg = sft_cfg(eval_fraction=0.25, seed=3)
    cfg.dataset = path
    train, held, _ = load_splits(tok, cfg, "sft")
    again, held_again, _ = load_splits(tok, cfg, "sft")
    assert (len(train), len(held)) == (30, 10)
    assert [e.ids for e in held] == [e.ids for e in held_again]  # seeded: every rank holds out the same rows
    assert not {tuple(e.ids) for e in train} & {tuple(e.ids) for e in held}
    cfg = sft_cfg(eval_dataset=write(tmp_path / "ev.jsonl", rows[:3]), max_samples=20)
    cfg.dataset = path
    train, held, stats = load_splits(tok, cfg, "sft")
    assert (len(train), len(held), len(stats)) == (20, 3, 2)


def test_unknown_format_and_missing_file(tmp_path, tok):
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match="unknown format '.csv'"):
        load_examples(tmp_path / "x.csv", tok, sft_cfg(), "sft")
    with pytest.raises(DatasetError, match="no such file"):
        load_examples(tmp_path / "nope.jsonl", tok, sft_cfg(), "sft")


def test_parquet_rows(tmp_path, tok):
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed: Parquet datasets are not readable here")
    import pyarrow.parquet as pq

    table = pa.table({"prompt": ["1+1=", "2+2="], "response": ["2", None]})
    pq.write_table(table, tmp_path / "d.parquet")
    data, stats = load_examples(tmp_path / "d.parquet", tok, sft_cfg(on_bad_row="skip"), "sft")
    assert len(data) == 1 and stats.bad == 1 and stats.bad_examples[0].startswith(f"{tmp_path / 'd.parquet'}: row 1")


def test_save_to_disk_folder(tmp_path, tok):
    datasets = pytest.importorskip("datasets", reason="the `datasets` package is not installed: "
                                                      "save_to_disk folders are not readable here")
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"prompt": ["1+1="], "response": ["2"]}),
                               "test": datasets.Dataset.from_dict({"prompt": ["3+3="], "response": ["6"]})})
    dd.save_to_disk(str(tmp_path / "ds"))
    [enc], _ = load_examples(tmp_path / "ds", tok, sft_cfg(add_eos=False), "sft")
    assert enc.ids == [BOS] + ids("1+1=2")
    cfg = sft_cfg(add_eos=False, dataset_split="test")
    [enc], _ = load_examples(tmp_path / "ds", tok, cfg, "sft")
    assert enc.ids == [BOS] + ids("3+3=6")
    with pytest.raises(DatasetError, match="no split 'dev'"):
        load_examples(tmp_path / "ds", tok, sft_cfg(dataset_split="dev"), "sft")
