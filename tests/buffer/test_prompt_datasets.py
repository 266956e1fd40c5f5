"""RL prompt datasets as they come: formats, columns, chat prompts, templates, mixing, bad rows.

Unit tests of `buffer.prompts.load_prompts` and `common.datasets` (the readers the offline trainers
share), of the generator's `encode_prompt` against the offline loader's encoding, of the run
config's check of `buffer.prompts`; and one whole run through `launch.local` whose prompts are the
demo's arithmetic problems as chat messages in a Parquet file and a `save_to_disk` folder, with
custom columns, mixed by probabilities and rendered by a chat template.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from buffer.prompts import PromptsError, load_prompts, mix_order, prompts_from_config
from common.datasets import DatasetError, hub_splits, iter_rows
from tests.helpers.buffer import start_buffer
from tests.helpers.datasets import write_jsonl, write_parquet
from tests.helpers.procs import ROOT, subprocess_env

# Every message is "<s>" role ":" content "\n"; the generation prompt is "<s>assistant:" (the tiny
# tokenizer has one token per character, so the ids are easy to write down).
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}:{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% endif %}")
SYSTEM = "Add. Write the digits of the sum in reverse."


def chat_rows(problems: list[dict]) -> list[dict]:
    """The demo's problems as an OpenRLHF-style chat dataset: `question` holds messages, `answer` the label."""
    return [{"question": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": p["prompt"]}],
             "answer": p["label"]} for p in problems]


# ------------------------------------------------------------------------------------------------
# formats and columns


def test_the_old_call_reads_a_jsonl_of_prompt_and_label(tmp_path):
    p = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1=", "label": "2"}, "", {"prompt": "2+2=", "label": 4},
                                           {"prompt": "3+3="}])
    rows = load_prompts(str(p))
    assert [(r.text, r.label, r.index, r.messages) for r in rows] == [
        ("1+1=", "2", 0, None), ("2+2=", "4", 1, None), ("3+3=", None, 2, None)]


def test_parquet_save_to_disk_and_hub_folders_give_the_same_prompts_by_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    train = [{"q": "1+1=", "a": 2}, {"q": "2+3=", "a": 5}]
    test = [{"q": "4+4=", "a": 8}]
    want = {"train": [("1+1=", "2"), ("2+3=", "5")], "test": [("4+4=", "8")]}
    write_parquet(tmp_path / "file.parquet", train)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train),
                          "test": datasets.Dataset.from_list(test)}).save_to_disk(str(tmp_path / "saved"))
    write_parquet(tmp_path / "hub" / "data" / "train-00000-of-00001.parquet", train)
    write_parquet(tmp_path / "hub" / "data" / "test-00000-of-00001.parquet", test)
    write_jsonl(tmp_path / "named" / "train.jsonl", train)
    (tmp_path / "named" / "dev.json").write_text(json.dumps(test))  # a JSON array, split "validation"
    (tmp_path / "named" / "README.md").write_text("# not data\n")

    def read(path, split="train"):
        return [(r.text, r.label) for r in load_prompts(str(path), split=split, input_key="q", label_key="a")]

    assert read(tmp_path / "file.parquet") == read(tmp_path / "saved") == read(tmp_path / "hub") == want["train"]
    assert read(tmp_path / "named") == want["train"]
    assert read(tmp_path / "saved", "test") == read(tmp_path / "hub", "test") == want["test"]
    assert read(tmp_path / "named", "validation") == read(tmp_path / "named", "dev") == want["test"]
    for folder, has in (("saved", "['test', 'train']"), ("hub", "['test', 'train']"),
                        ("named", "['train', 'validation']")):
        with pytest.raises(PromptsError, match=f"no split 'other' .*{has}"):
            read(tmp_path / folder, "other")


@pytest.mark.parametrize("files, splits", [
    (["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet", "data/test-00000-of-00001.parquet",
      "README.md"], {"train": 2, "test": 1}),
    (["train/a.jsonl", "dev/b.jsonl", "x/test/c.json", ".cache/train.jsonl"], {"train": 1, "validation": 1, "test": 1}),
    (["my_train_set.jsonl", "valid.json", "test-1.parquet", "trainer.jsonl"], {"train": 1, "validation": 1, "test": 1}),
    (["a.jsonl", "b.parquet"], {"train": 2}),
])
def test_hub_folder_splits_are_the_ones_datasets_finds(tmp_path, files, splits):
    for f in files:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("")
    mine = {s: sorted(str(f.relative_to(tmp_path)) for f in fs) for s, fs in hub_splits(tmp_path).items()}
    assert {s: len(fs) for s, fs in mine.items()} == splits
    data_files = pytest.importorskip("datasets.data_files")
    found = data_files.DataFilesDict.from_patterns(data_files.get_data_patterns(str(tmp_path)), base_path=str(tmp_path))
    theirs = {str(s): sorted(str(Path(f).relative_to(tmp_path.resolve())) for f in fs if not f.endswith(".md"))
              for s, fs in found.items()}
    assert mine == theirs


def test_chat_messages_template_and_labels_of_any_column(tmp_path):
    p = write_jsonl(tmp_path / "p.jsonl", [
        {"question": [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+1="}], "answer": 2},
        {"question": "2+2=", "answer": "4", "other": [1, 2]},
        {"question": "3+3="},
    ])
    a, b, c = load_prompts(str(p), input_key="question", label_key="answer", input_template="Q: {}\nA:")
    assert (a.messages, a.text, a.label) == ([("system", "Add."), ("user", "1+1=")], "Add.\n1+1=", "2")
    assert (b.messages, b.text, b.label) == (None, "Q: 2+2=\nA:", "4")  # the template: string prompts only
    assert (c.text, c.label) == ("Q: 3+3=\nA:", None)
    assert [r.label for r in load_prompts(str(p), input_key="question", label_key="")] == [None] * 3
    for template in ("Q: %s", "{} and {}", "{x}: {}"):
        with pytest.raises(PromptsError, match="input_template=.* must hold exactly one `{}`"):
            load_prompts(str(p), input_key="question", input_template=template)
    assert load_prompts(str(p), input_key="question", input_template="{{json}} {}")[1].text == "{json} 2+2="


@pytest.mark.parametrize("line, why", [
    ('{"prompt": "a", "label": "x"', "not valid JSON"),
    ('["a"]', "expected an object"),
    ('{"text": "a"}', "no prompt: 'prompt' is missing or null (the row's keys: ['text'])"),
    ('{"prompt": 7}', "'prompt' must be a string or a non-empty list of messages, got 7"),
    ('{"prompt": []}', "non-empty list"),
    ('{"prompt": [{"role": "user"}]}', "'prompt'[0] must be {'role': str, 'content': str}, got {'role': 'user'}"),
    ('{"prompt": "a", "label": {"x": 1}}', "'label' must be a string or a number"),
])
def test_a_bad_row_names_its_file_and_line(tmp_path, line, why):
    p = write_jsonl(tmp_path / "p.jsonl", ['{"prompt": "ok"}', "", line])
    with pytest.raises(PromptsError) as e:
        load_prompts(str(p))
    assert str(e.value).startswith(f"{p}:3: ") and why in str(e.value), str(e.value)


def test_a_bad_row_of_a_folder_names_the_file_inside_it(tmp_path):
    write_parquet(tmp_path / "hub" / "data" / "train-00000-of-00002.parquet", [{"prompt": "a"}])
    write_parquet(tmp_path / "hub" / "data" / "train-00001-of-00002.parquet", [{"prompt": "b"}, {"prompt": None}])
    with pytest.raises(PromptsError, match=r"hub/data/train-00001-of-00002.parquet: row 1: no prompt"):
        load_prompts(str(tmp_path / "hub"))
    with pytest.raises(PromptsError, match=r"nope.jsonl: no such file or folder"):
        load_prompts(f"{write_jsonl(tmp_path / 'ok.jsonl', [{'prompt': 'a'}])},{tmp_path / 'nope.jsonl'}")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no data files in the folder"):
        list(iter_rows(tmp_path / "empty"))


# ------------------------------------------------------------------------------------------------
# several datasets


def test_mixing_by_probabilities_is_the_order_openrlhf_gets_from_interleave_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}"} for i in range(3)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": f"b{i}"} for i in range(5)])
    for probs, seed in (([0.7, 0.3], 0), ([0.2, 0.8], 42)):
        mixed = [r.text for r in load_prompts(f"{a},{b}", probs=probs, seed=seed)]
        hf = datasets.interleave_datasets(
            [datasets.Dataset.from_list([{"prompt": f"{n}{i}"} for i in range(k)]) for n, k in (("a", 3), ("b", 5))],
            probabilities=probs, seed=seed, stopping_strategy="all_exhausted")
        assert mixed == list(hf["prompt"])
        assert {f"a{i}" for i in range(3)} | {f"b{i}" for i in range(5)} == set(mixed)  # each used whole
        assert mixed == [r.text for r in load_prompts([str(a), str(b)], probs=probs, seed=seed)]  # reproducible
    # shares that do not sum to 1 are normalised: 7:3 is 0.7/0.3
    assert mix_order([3, 5], [7, 3], 0) == mix_order([3, 5], [0.7, 0.3], 0)
    with pytest.raises(PromptsError, match="one share > 0 for each of the 2 datasets"):
        load_prompts(f"{a},{b}", probs=[1.0])


def test_without_probabilities_datasets_follow_each_other_and_max_samples_caps_each_and_the_whole(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}"} for i in range(3)] + ["not json"])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": f"b{i}"} for i in range(5)])
    assert [r.text for r in load_prompts(f"{b},{a}", max_samples=3)] == ["b0", "b1", "b2"]
    # each dataset is read up to max_samples rows (a's bad fourth line is never reached), then the whole
    assert [r.text for r in load_prompts(f"{a},{b}", max_samples=3)] == ["a0", "a1", "a2"]
    with pytest.raises(PromptsError, match=r"a.jsonl:4: not valid JSON"):
        load_prompts(f"{a},{b}")
    rows = load_prompts(f"{a},{b}", max_samples=2, probs=[0.5, 0.5])
    assert len(rows) == 2 and [r.index for r in rows] == [0, 1]


def test_prompts_from_config_reads_the_buffer_keys_and_another_dataset_for_evaluation(tmp_path):
    from buffer.config import BufferConfig

    p = write_jsonl(tmp_path / "p.jsonl", chat_rows([{"prompt": f"1{i}+10=", "label": f"{i}2"} for i in range(4)]))
    e = write_jsonl(tmp_path / "e.jsonl", [{"question": "5+5=", "answer": "01"}] * 3)
    cfg = BufferConfig(prompts=f"{p},{p}", prompt_probs=[0.5, 0.5], input_key="question", label_key="answer",
                       max_samples=3)
    rows = prompts_from_config(cfg)
    assert len(rows) == 3 and rows[0].messages[0] == ("system", SYSTEM) and rows[0].label.endswith("2")
    evals = prompts_from_config(cfg, dataset=str(e), split="train", max_samples=2)
    assert [(r.text, r.label, r.messages) for r in evals] == [("5+5=", "01", None)] * 2


def test_run_config_accepts_folders_and_lists_and_names_a_missing_dataset(tmp_path):
    from common.config import ConfigError
    from launch.run_config import load_run_config

    demo, model = ROOT / "examples" / "demo.yaml", tmp_path / "model"
    model.mkdir()
    p = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1="}])
    (tmp_path / "folder").mkdir()
    run = load_run_config(demo, ["--pretrain", str(model), "--buffer.prompts", f"{p}, {tmp_path / 'folder'}",
                                 "--buffer.prompt_probs", "0.6", "0.4"])
    assert run.buffer.prompt_probs == [0.6, 0.4]
    with pytest.raises(ConfigError, match=r"buffer.prompts: '.*/nope' is neither a file nor a folder"):
        load_run_config(demo, ["--pretrain", str(model), "--buffer.prompts", f"{p},{tmp_path / 'nope'}"])
    with pytest.raises(ConfigError, match=r"prompt_probs=\[1.0\] needs one share per dataset"):
        load_run_config(demo, ["--pretrain", str(model), "--buffer.prompts", f"{p},{p}", "--buffer.prompt_probs", "1"])


def test_a_live_buffer_leases_chat_prompts_of_mixed_datasets_with_their_labels(tmp_path):
    datasets = pytest.importorskip("datasets")

    problems = [{"prompt": f"{10 + i}+10=", "label": f"{i}2"} for i in range(8)]
    write_parquet(tmp_path / "a.parquet", chat_rows(problems[:4]))
    datasets.Dataset.from_list(chat_rows(problems[4:])).save_to_disk(str(tmp_path / "b"))
    buf = start_buffer(tmp_path, extra=("--buffer.prompt_probs", "0.5", "0.5"), prompts=f"{tmp_path / 'a.parquet'},"
                       f"{tmp_path / 'b'}", input_key="question", label_key="answer", max_samples=6)
    try:
        grant = buf.client().lease("w", max_groups=16)
    finally:
        assert buf.stop() == 0
    want = load_prompts(f"{tmp_path / 'a.parquet'},{tmp_path / 'b'}", probs=[0.5, 0.5], input_key="question",
                        label_key="answer", max_samples=6)
    got = [(g.index, g.prompt, g.label, [(m.role, m.content) for m in g.messages]) for g in grant.groups]
    assert sorted(got) == [(p.index, p.text, p.label, p.messages) for p in want]
    assert len(want) == 6 and {p.label for p in want} <= {p["label"] for p in problems}


# ------------------------------------------------------------------------------------------------
# the generator's rendering


def test_encode_prompt_renders_messages_as_the_template_and_the_offline_loader_do():
    from actors.prompts import encode_prompt
    from buffer.messages import ChatMessage
    from demo.tiny_model import build_tokenizer, vocab
    from learner.offline.datasets import encode_messages

    V = vocab()
    chat = [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+1="}]
    wire = [ChatMessage(m["role"], m["content"]) for m in chat]
    plain = build_tokenizer()
    templated = build_tokenizer()
    templated.chat_template = TEMPLATE

    def offline_prompt(tok, use_chat_template):
        """The prompt part of the offline loader's encoding of the conversation plus one answer."""
        enc = encode_messages(tok, chat + [{"role": "assistant", "content": "2"}], "last", use_chat_template, False)
        return enc.ids[: enc.target.index(1)]

    ids = encode_prompt(templated, "Add.\n1+1=", True, wire)
    assert ids == [V[c] if len(c) == 1 else V["<s>"] for c in
                   ["<s>", *"system:Add.\n", "<s>", *"user:1+1=\n", "<s>", *"assistant:"]]
    assert ids == offline_prompt(templated, True)
    # without a template (or with it off): the contents, the first with bos, as the offline loader does
    assert encode_prompt(plain, "Add.\n1+1=", True, wire) == offline_prompt(plain, False) == \
        [V["<s>"]] + [V[c] for c in "Add.1+1="]
    assert encode_prompt(templated, "x", False, wire) == offline_prompt(templated, False)
    # a string prompt is one user message, as before
    assert encode_prompt(templated, "1+1=", True) == [V["<s>"]] + [V[c] for c in "user:1+1=\n"] + \
        [V["<s>"]] + [V[c] for c in "assistant:"]
    assert encode_prompt(plain, "1+1=", True) == [V["<s>"]] + [V[c] for c in "1+1="]


# ------------------------------------------------------------------------------------------------
# one whole run


def stored_groups(state_dir: Path) -> list:
    """The scored rollouts of the groups the buffer accepted and had not served when the run ended
    (its state log keeps those for a resume)."""
    import msgpack

    from buffer.messages import decode_item
    from buffer.store import LOG_NAME

    with open(state_dir / LOG_NAME, "rb") as f:
        return [[decode_item(bytes(x), "scored") for x in rec[2]]
                for rec in msgpack.Unpacker(f, raw=False, strict_map_key=False) if rec[0] == "group"]


@pytest.mark.slow
def test_chat_prompts_from_parquet_and_save_to_disk_train_with_custom_keys(tiny_model_dir, tmp_path):
    """The demo's arithmetic problems as chat messages (`question`, label `answer`) in a Parquet file
    and a save_to_disk DatasetDict, mixed 50/50, rendered by the policy's chat template, trained by
    the demo's async GRPO: the run completes; every step trained on prompts of the template's length;
    the samples still queued when it stopped carry their row's label, the template's prompt ids and
    the reward the demo's reward function gives their completions."""
    datasets = pytest.importorskip("datasets")
    from transformers import AutoTokenizer

    from demo.arithmetic import make_problems, reward_fn

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(model)
    problems = make_problems(60, seed=1)
    write_parquet(tmp_path / "a.parquet", chat_rows(problems[:20]))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(chat_rows(problems[20:40])),
                          "test": datasets.Dataset.from_list(chat_rows(problems[40:]))}).save_to_disk(
        str(tmp_path / "b"))
    run_dir = tmp_path / "run"
    steps = 3
    proc = subprocess.run(
        [sys.executable, "-m", "launch.local", str(ROOT / "examples" / "demo.yaml"), "--run.run_dir", str(run_dir),
         "--learner.model_path", str(model), "--learner.total_steps", str(steps), "--learner.save_every", "0",
         "--buffer.prompts", f"{tmp_path / 'a.parquet'},{tmp_path / 'b'}", "--buffer.prompt_probs", "0.5", "0.5",
         "--buffer.input_key", "question", "--buffer.label_key", "answer", "--buffer.prompts_per_step", "4",
         "--buffer.n_samples_per_prompt", "4", "--generator.groups_per_lease", "4",
         "--generator.use_chat_template", "true"],
        cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps))

    def chat(p: dict) -> list[dict]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": p["prompt"]}]

    # every problem "ab+cd=" renders to the same length; tokens per sample = prompt + completion
    n_prompt = len(tok.apply_chat_template(chat(problems[0]), add_generation_prompt=True, return_dict=False))
    assert n_prompt == 3 + len(f"system:{SYSTEM}\nuser:12+34=\nassistant:")  # three <s> and one id per character
    for r in rows:
        assert r["perf/tokens"] / r["perf/samples"] - r["perf/completion_len"] == pytest.approx(n_prompt), r
    by_text = {f"{SYSTEM}\n{p['prompt']}": p for p in problems}
    samples = [s for group in stored_groups(run_dir / "buffer_state") for s in group]
    assert samples, "no group was left queued (the generators run a step ahead of the learner)"
    for s in samples:
        r = s.rollout
        p = by_text[r.prompt]
        assert problems.index(p) < 40  # the train split of the folder, never its test split
        assert r.label == p["label"]
        assert list(r.prompt_ids) == tok.apply_chat_template(chat(p), add_generation_prompt=True, return_dict=False)
        assert s.reward == reward_fn([r.prompt], [r.completion], [r.label])[0]


def test_a_rows_other_columns_travel_with_it_as_json(tmp_path):
    from buffer.prompts import MAX_COLUMNS_BYTES, prompt_group

    rows = [{"prompt": "p0", "label": "1", "tests": ["assert f() == 1"], "meta": {"level": 3}},
            {"prompt": "p1", "label": "2"}]
    p = write_jsonl(tmp_path / "p.jsonl", rows)
    a, b = load_prompts(str(p))
    assert json.loads(a.columns) == {"tests": ["assert f() == 1"], "meta": {"level": 3}} and b.columns == ""
    assert json.loads(prompt_group(a, 7).columns) == json.loads(a.columns)  # what a lease carries
    assert json.loads(load_prompts(str(p), columns=["meta"])[0].columns) == {"meta": {"level": 3}}
    assert load_prompts(str(p), columns=[])[0].columns == ""
    # Parquet: arrays and numpy scalars as JSON lists and numbers
    write_parquet(tmp_path / "p.parquet", [{"prompt": "p", "label": "1", "tests": ["a", "b"], "n": 2}])
    assert json.loads(load_prompts(str(tmp_path / "p.parquet"))[0].columns) == {"tests": ["a", "b"], "n": 2}
    big = write_jsonl(tmp_path / "big.jsonl", [{"prompt": "p", "blob": "x" * (MAX_COLUMNS_BYTES + 1)}])
    with pytest.raises(PromptsError, match=r"big.jsonl:1: its other columns take \d+ bytes.*the largest: 'blob'"):
        load_prompts(str(big))


def test_a_reasoning_gym_spec_is_a_dataset_made_on_the_spot(tmp_path):
    spec = "reasoning_gym:chain_sum?size=3&seed=1"
    rows = load_prompts(spec, input_key="question", label_key="answer")  # (the keys it is read with)
    assert len(rows) == 3 and rows == load_prompts(spec, input_key="question", label_key="answer")  # the same rows
    cols = json.loads(rows[0].columns)
    assert cols["task"] == cols["rg_task"] == "chain_sum" and cols["rg_entry"]["answer"] == rows[0].label
    mixed = load_prompts(f"{write_jsonl(tmp_path / 'p.jsonl', [{'prompt': 'p', 'label': '1'}])},{spec}")
    assert [r.text for r in mixed][0] == "p" and len(mixed) == 4
    with pytest.raises(PromptsError, match="chain_summ"):
        load_prompts("reasoning_gym:chain_summ")
