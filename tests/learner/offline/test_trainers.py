"""The offline trainers on the tiny model, in-process (a world of one), and their command lines.

SFT memorises a few answers; DPO and the reward model learn right-over-wrong preferences of the
arithmetic task (demo/arithmetic.py) and generalise them to held-out problems.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from demo.arithmetic import make_problems, warm_start, write_jsonl
from launch.ports import free_port_block
from learner.metrics import read_metrics
from learner.offline.config import DPOConfig, RMConfig, SFTConfig
from tests.helpers.procs import ROOT, subprocess_env


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # the tiny model on a shared 2-core machine: one thread is several times faster than two fighting
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def common(tmp_path, model, name: str, **kw) -> dict:
    return dict(model_path=str(model), save_path=str(tmp_path / name), zero_stage=0, tensorboard=False,
                num_threads=1, warmup_ratio=0.0, adam_betas=[0.9, 0.999], **kw)


def wrong_answer(label: str, rng: random.Random) -> str:
    while True:
        w = str(rng.randint(10, 198))[::-1]
        if w != label:
            return w


def arithmetic_pairs(n: int, seed: int, exclude: set[str] | None = None) -> list[dict]:
    """Right answer (chosen) over a wrong number (rejected), both ending in "\\n" as the policy writes them."""
    rng = random.Random(seed)
    return [{"prompt": p["prompt"], "chosen": p["label"] + "\n", "rejected": wrong_answer(p["label"], rng) + "\n"}
            for p in make_problems(n, seed, exclude)]


@pytest.fixture(scope="module")
def arithmetic_data(tmp_path_factory, tiny_model_dir):
    """A briefly warm-started policy (a few % greedy accuracy) and train / held-out preference pairs."""
    d = tmp_path_factory.mktemp("arith")
    held = arithmetic_pairs(200, seed=10_000)
    train = arithmetic_pairs(1280, seed=0, exclude={p["prompt"] for p in held})
    warm = warm_start(tiny_model_dir, d / "warm", make_problems(3000, seed=1), steps=300, batch_size=128, log_every=0)
    return {"model": warm, "train": write_jsonl(train, d / "train.jsonl"), "eval": write_jsonl(held, d / "eval.jsonl")}


# ------------------------------------------------------------------------------------------------


def test_packed_rows_give_the_same_logprobs_as_separate_ones(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from learner.modeling import token_logprobs
    from learner.offline.datasets import Encoded
    from learner.offline.loop import pack_batch, pad_batch

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    a = Encoded([1, 10, 11, 12, 13, 14], [0, 0, 0, 1, 1, 1])
    b = Encoded([1, 20, 21, 22], [0, 0, 1, 1])
    with torch.no_grad():
        ids, pos, target = pack_batch([a, b], "cpu")
        packed = token_logprobs(model, ids, position_ids=pos)[0]  # (9,)
        ids, attn, _ = pad_batch([a, b], 0, "cpu")
        padded = token_logprobs(model, ids, attention_mask=attn)  # (2, 5)
    # packed position t predicts token t + 1: a's tokens at 0..4, b's at 6..8 (5 predicts b's <s>)
    torch.testing.assert_close(packed[:5], padded[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[6:9], padded[1, :3], atol=1e-5, rtol=0)
    assert target[0].nonzero().flatten().tolist() == [2, 3, 4, 7, 8]


def test_reward_model_from_a_causal_lm_keeps_its_backbone(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from learner.offline.rm import load_reward_model

    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    rm = load_reward_model(str(tiny_model_dir), pad_token_id=0)
    assert type(rm).__name__ == "LlamaForSequenceClassification" and rm.config.num_labels == 1
    assert rm.config.pad_token_id == 0 and rm.config.architectures == ["LlamaForSequenceClassification"]
    lm_state = lm.model.state_dict()
    for name, tensor in rm.model.state_dict().items():
        assert torch.equal(tensor, lm_state[name]), name
    assert rm.score.weight.shape == (1, lm.config.hidden_size)


MEMORY = {"best fruit?": "mango", "cat name?": "tom", "sky color?": "blue", "lucky number?": "42",
          "capital of france?": "paris", "big animal?": "whale", "hot drink?": "tea", "day after monday?": "tuesday"}


@pytest.mark.parametrize("packing", [True, False])
def test_sft_drives_the_loss_down_and_reproduces_a_memorised_answer(tmp_path, tiny_model_dir, packing):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from learner.offline import sft

    rows = [{"prompt": q + " ", "response": a + "\n"} for q, a in MEMORY.items()]
    data = write_jsonl(rows, tmp_path / "memory.jsonl")
    # batch 8 in micro-batches of 4: DeepSpeed accumulates two micro-batches per step
    cfg = SFTConfig(**common(tmp_path, tiny_model_dir, "sft", dataset=str(data), eval_dataset=str(data), epochs=60,
                             batch_size=8, micro_batch_size=4, lr=3e-3, lr_schedule="constant", packing=packing,
                             log_every=5))
    out = sft.train(cfg)
    assert out["steps_run"] == 60
    losses = [r["loss/sft"] for r in read_metrics(tmp_path / "sft") if "loss/sft" in r]
    assert losses[0] > 2.0 and losses[-1] < 0.1 * losses[0], losses
    assert out["eval_start"]["eval/loss"] > 2.0 and out["eval_end"]["eval/loss"] < 0.2
    # the saved folder is a plain HF model; greedy decoding gives back what it memorised
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "sft").eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "sft")
    right = 0
    for q, a in MEMORY.items():
        ids = torch.tensor([tok(q + " ")["input_ids"]])
        gen = model.generate(ids, max_new_tokens=len(a) + 1, do_sample=False, pad_token_id=tok.pad_token_id)
        right += tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True) == a + "\n"
    assert right >= 6, f"{right}/8 memorised answers reproduced"


def test_sft_with_lora_trains_an_adapter_that_peft_loads(tmp_path, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from learner.modeling import token_logprobs
    from learner.offline import sft

    rows = [{"prompt": q + " ", "response": a + "\n"} for q, a in MEMORY.items()]
    data = write_jsonl(rows, tmp_path / "memory.jsonl")
    cfg = SFTConfig(**common(tmp_path, tiny_model_dir, "sft", dataset=str(data), epochs=10, batch_size=8,
                             micro_batch_size=8, lr=1e-2, lora_rank=8, lora_alpha=16, save_every=5))
    out = sft.train(cfg)
    losses = [r["loss/sft"] for r in read_metrics(tmp_path / "sft") if "loss/sft" in r]
    assert out["steps_run"] == 10 and losses[-1] < 0.7 * losses[0], losses
    ids = torch.tensor([[1, 5, 9, 12, 7, 3, 20]])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "sft").eval()  # save_path: the merged model
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)),
                                      str(tmp_path / "sft" / "adapter")).eval()  # ... and the adapter
    with torch.no_grad():
        assert torch.allclose(token_logprobs(merged, ids), token_logprobs(tuned, ids), atol=1e-5)
    # checkpoints hold the adapter (no merged copy unless lora_save_merged)
    ckpt = tmp_path / "sft" / "checkpoints" / "step_5"
    assert (ckpt / "adapter" / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()


def test_dpo_raises_heldout_preference_accuracy(tmp_path, arithmetic_data):
    from learner.offline import dpo

    cfg = DPOConfig(**common(tmp_path, arithmetic_data["model"], "dpo", dataset=str(arithmetic_data["train"]),
                             eval_dataset=str(arithmetic_data["eval"]), epochs=2, batch_size=32, micro_batch_size=32,
                             lr=1e-3, beta=0.1, log_every=10))
    out = dpo.train(cfg)
    # policy = reference at the start: every implicit reward is 0, the loss log 2, no pair is won
    assert out["eval_start"]["eval/loss"] == pytest.approx(0.693147, abs=1e-5)
    assert out["eval_start"]["eval/accuracy"] == 0.0
    end = out["eval_end"]
    assert end["eval/accuracy"] > 0.8, end
    assert end["eval/rewards_chosen"] > end["eval/rewards_rejected"] and end["eval/margin"] > 0
    logged = read_metrics(tmp_path / "dpo")
    assert logged[0]["data/rows"] == 1280 and logged[0]["data_eval/used"] == 200 and logged[0]["data/bad_rows"] == 0
    train_rows = [r for r in logged if "loss/dpo" in r]
    assert len(train_rows) == 8  # every log_every = 10 of the 80 steps
    assert {"rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy"} <= set(train_rows[0])


def test_ipo_on_the_fly_reference_starts_at_the_hand_worked_loss(tmp_path, arithmetic_data):
    from learner.offline import dpo

    # h = 0 at the start, so IPO's loss is (0 - 1 / (2 * 0.5))^2 = 1; the NLL term is logged apart
    cfg = DPOConfig(**common(tmp_path, arithmetic_data["model"], "ipo", dataset=str(arithmetic_data["eval"]),
                             eval_dataset=str(arithmetic_data["eval"]), max_samples=64, batch_size=32,
                             micro_batch_size=16, lr=1e-4, beta=0.5, loss="ipo", nll_coef=0.5,
                             ref_mode="on_the_fly"))
    out = dpo.train(cfg)
    assert out["eval_start"]["eval/loss"] == pytest.approx(1.0, abs=1e-6)
    assert out["eval_start"]["eval/margin"] == 0.0 and out["eval_start"]["eval/nll"] > 0
    assert out["steps_run"] == 2 and out["eval_end"]["eval/margin"] != 0.0
    assert out["train_last"]["loss/total"] == pytest.approx(
        out["train_last"]["loss/dpo"] + 0.5 * out["train_last"]["loss/nll"], rel=1e-5)


def test_reward_model_learns_heldout_pairs_and_the_scorer_loads_it(tmp_path, arithmetic_data):
    from transformers import AutoConfig

    from actors.rewards import RewardModel
    from buffer.messages import Rollout
    from learner.offline import rm

    cfg = RMConfig(**common(tmp_path, arithmetic_data["model"], "rm", dataset=str(arithmetic_data["train"]),
                            eval_dataset=str(arithmetic_data["eval"]), epochs=2, batch_size=32, micro_batch_size=32,
                            lr=3e-4, log_every=10))
    out = rm.train(cfg)
    assert out["eval_end"]["eval/accuracy"] > 0.8, out["eval_end"]
    assert out["eval_end"]["eval/loss"] < out["eval_start"]["eval/loss"]
    config = AutoConfig.from_pretrained(tmp_path / "rm")
    assert config.num_labels == 1 and config.pad_token_id == 0
    assert config.architectures == ["LlamaForSequenceClassification"]

    # the scorer's reward-model kind reads the folder as it is and ranks held-out pairs the same way
    scorer = RewardModel(str(tmp_path / "rm"), batch_size=64)
    pairs = [json.loads(line) for line in arithmetic_data["eval"].read_text().splitlines()]

    def rollout(prompt, completion):
        empty = np.zeros(0, dtype=np.int32)
        return Rollout(group_id=0, sample_index=0, lease_id=0, prompt_ids=empty, completion_ids=empty,
                       behav_logprobs=empty.astype(np.float32), versions=empty, prompt=prompt, completion=completion)

    chosen = scorer.score([rollout(p["prompt"], p["chosen"]) for p in pairs])
    rejected = scorer.score([rollout(p["prompt"], p["rejected"]) for p in pairs])
    won = sum(c.value > r.value for c, r in zip(chosen, rejected)) / len(pairs)
    assert won == pytest.approx(out["eval_end"]["eval/accuracy"], abs=1e-9)


# ------------------------------------------------------------------------------------------------
# command lines


def test_openrlhf_dpo_flags_map_onto_the_config():
    from common.config import ConfigError
    from launch.dpo import DPO_ALIASES
    from launch.entry import role_config

    argv = ["--pretrain", "/m", "--dataset", "/d.jsonl", "--beta", "0.2", "--max_len", "256",
            "--micro_train_batch_size", "2", "--train_batch_size", "16", "--learning_rate", "5e-7", "--bf16",
            "--save_path", "/out", "--save_steps", "-1", "--logging_steps", "3", "--max_epochs", "2", "--ipo",
            "--label_smoothing", "0.1", "--nll_loss_coef", "0.3", "--flash_attn"]
    with pytest.raises(ConfigError, match="label_smoothing=0.1 applies to the sigmoid loss"):
        role_config(DPOConfig, "dpo", list(argv), DPO_ALIASES)
    cfg = role_config(DPOConfig, "dpo", [a for a in argv if a != "--ipo"], DPO_ALIASES)
    assert (cfg.model_path, cfg.dataset, cfg.beta, cfg.max_len) == ("/m", "/d.jsonl", 0.2, 256)
    assert (cfg.micro_batch_size, cfg.batch_size, cfg.lr, cfg.dtype) == (2, 16, 5e-7, "bfloat16")
    assert (cfg.save_path, cfg.save_every, cfg.log_every, cfg.epochs) == ("/out", 0, 3, 2)
    assert (cfg.label_smoothing, cfg.nll_coef, cfg.loss) == (0.1, 0.3, "sigmoid")
    with pytest.raises(ConfigError, match=r"unknown flag --learning_rat \(did you mean --learning_rate\?\)"):
        role_config(DPOConfig, "dpo", ["--learning_rat", "1e-6"], DPO_ALIASES)
    with pytest.raises(ConfigError, match=r"dpo.beta=-1.0 must be > 0"):
        role_config(DPOConfig, "dpo", ["--pretrain", "/m", "--dataset", "/d", "--save_path", "/o", "--dpo.beta", "-1"],
                    DPO_ALIASES)


def test_launch_help_answers_without_heavy_imports():
    for mod in ("launch.sft", "launch.dpo", "launch.rm"):
        out = subprocess.run([sys.executable, "-c", f"import sys; from {mod} import main; main(['--help']); "
                              "print('HEAVY' if 'torch' in sys.modules or 'deepspeed' in sys.modules else 'LIGHT')"],
                             capture_output=True, text=True, cwd=ROOT, env=subprocess_env(), timeout=60)
        assert out.returncode == 0 and out.stdout.strip().endswith("LIGHT"), out.stderr
        assert "max_len = 512" in out.stdout and "--pretrain" in out.stdout


@pytest.mark.slow
def test_launch_sft_runs_from_yaml_and_names_a_bad_row(tmp_path, tiny_model_dir):
    rows = [{"prompt": q + " ", "response": a + "\n"} for q, a in MEMORY.items()]
    good = write_jsonl(rows, tmp_path / "good.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(good.read_text() + '{"prompt": "x"}\n')
    (tmp_path / "sft.yaml").write_text(f"# python -m launch.sft sft.yaml\nsft:\n  model_path: {tiny_model_dir}\n"
                                       f"  num_threads: 1\n  zero_stage: 0\n  tensorboard: false\n")
    base = [sys.executable, "-m", "launch.sft", str(tmp_path / "sft.yaml"), "--train_batch_size", "4",
            "--micro_train_batch_size", "2", "--max_epochs", "1", "--save_path", str(tmp_path / "out")]
    out = subprocess.run(base + ["--dataset", str(bad)], capture_output=True, text=True, cwd=ROOT,
                         env=subprocess_env(), timeout=300)
    assert out.returncode == 2 and f"{bad}:9: missing key 'response'" in out.stderr, out.stderr[-2000:]
    out = subprocess.run(base + ["--dataset", str(bad), "--sft.on_bad_row", "skip"], capture_output=True, text=True,
                         cwd=ROOT, env=subprocess_env(), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    stats = summary["data"][0]
    assert (stats["rows"], stats["used"], stats["bad"]) == (9, 8, 1)
    assert len(stats["bad_examples"]) == 1 and stats["bad_examples"][0].startswith(f"{bad}:9: missing key 'response'")
    assert summary["steps_run"] == 2
    assert (tmp_path / "out" / "model.safetensors").is_file() and (tmp_path / "out" / "tokenizer.json").is_file()


@pytest.mark.slow
def test_two_ranks_zero3_match_one_rank(tmp_path, tiny_model_dir):
    """torchrun, 2 ranks, ZeRO-3, 2 micro-batches per rank per step: the same held-out losses as one rank."""
    from learner.offline import dpo

    rows = [{"prompt": q + " ", "chosen": a, "rejected": a[::-1] + "x"} for q, a in MEMORY.items()]
    data = write_jsonl(rows, tmp_path / "pairs.jsonl")
    held = write_jsonl(rows[:5], tmp_path / "held.jsonl")  # 5 pairs: one rank evaluates a padding row
    args = dict(dataset=str(data), eval_dataset=str(held), batch_size=4, micro_batch_size=1, lr=1e-3, epochs=2,
                beta=0.5)
    one = dpo.train(DPOConfig(**common(tmp_path, tiny_model_dir, "one", **args)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port_block(1)),
           "-m", "launch.dpo", "--pretrain", str(tiny_model_dir), "--dataset", str(data), "--eval_dataset", str(held),
           "--train_batch_size", "4", "--micro_train_batch_size", "1", "--learning_rate", "1e-3", "--max_epochs", "2",
           "--beta", "0.5", "--zero_stage", "3", "--save_path", str(tmp_path / "two"), "--warmup_ratio", "0",
           "--adam_betas", "0.9,0.999", "--num_threads", "1", "--tensorboard", "false"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=subprocess_env(), timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert (two["world_size"], two["zero_stage"]) == (2, 3)  # the engine really was partitioned over two ranks
    # reference log-probs computed on two shards and summed: policy = reference exactly at the start
    assert two["eval_start"]["eval/loss"] == pytest.approx(0.693147, abs=1e-5)
    assert two["eval_start"]["eval/pairs"] == 5 and two["steps_run"] == one["steps_run"] == 4
    for key in ("eval/loss", "eval/margin", "eval/nll"):
        assert two["eval_end"][key] == pytest.approx(one["eval_end"][key], rel=1e-3, abs=1e-4), key
    assert (tmp_path / "two" / "model.safetensors").is_file()
