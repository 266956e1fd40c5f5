"""OpenRLHF's offline command lines (`train_sft`, `train_dpo`, `train_rm`) on launch.sft, launch.dpo, launch.rm.

The fixtures list the options of OpenRLHF 0.11.2's three commands (read once from the PyPI wheel's
argparse parsers, so that no test downloads anything). Every one must be mapped, accepted with a
note, or refused with a message naming it and why; values convert with the same meaning; the
earlier underscore names still work; an unknown flag fails naming the closest one. Then the
commands of OpenRLHF's example scripts, with the tiny model and local data put in, each run to the
end as a real process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import ConfigError
from launch.entry import role_config
from launch.openrlhf.offline import DPO_ALIASES, RM_ALIASES, SFT_ALIASES
from learner.metrics import read_metrics
from learner.offline.config import DPOConfig, RMConfig, SFTConfig
from tests.helpers.procs import subprocess_env

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = {"sft": (SFTConfig, SFT_ALIASES), "dpo": (DPOConfig, DPO_ALIASES), "rm": (RMConfig, RM_ALIASES)}
BASE = ["--model.model_name_or_path", "/m", "--data.dataset", "/d.jsonl", "--ckpt.output_dir", "/o"]


def fixture(command: str) -> dict:
    return json.loads((ROOT / "tests" / "fixtures" / f"openrlhf_0.11.2_train_{command}.json").read_text())


def parse(command: str, argv: list[str]):
    cls, aliases = COMMANDS[command]
    return role_config(cls, command, BASE + list(argv), aliases)


SAMPLE = {  # a value OpenRLHF users give where the default is None
    "--model.model_name_or_path": ["/m2"], "--data.dataset": ["/d2.jsonl"], "--data.dataset_probs": ["1.0"],
    "--eval.dataset": ["/e.jsonl"], "--data.output_key": ["response"],
    "--data.prompt_key": ["prompt"], "--ref.model_name_or_path": ["/r"], "--ds.experts_implementation": ["eager"],
    "--ds.grad_accum_dtype": ["fp32"], "--logger.wandb.key": ["k"], "--logger.wandb.org": ["o"],
    "--logger.wandb.group": ["g"], "--logger.tensorboard_dir": ["tb"], "--data.input_template": ["Q: {} A:"],
    "--data.tokenizer_chat_template": ["{% for m in messages %}{{ m['content'] }}{% endfor %}"],
}
OFF_DEFAULT = {"--model.aux_loss_coef": ["0.01"], "--ds.ring_attn_size": ["2"], "--ds.load_in_4bit": []}


def sample(opt: dict) -> list[str]:
    flag = opt["flag"]
    if flag == "--local_rank":
        return ["--local_rank=0"]  # as the deepspeed launcher appends it
    if flag in SAMPLE:
        return [flag, *SAMPLE[flag]]
    if opt["action"] != "store":
        return [flag]  # a switch alone
    d = opt["default"]
    return [flag, *([str(v) for v in d] if isinstance(d, list) else [str(d)])]


@pytest.mark.parametrize("command", ["sft", "dpo", "rm"])
def test_every_0_11_2_flag_is_mapped_accepted_or_refused_by_name(command):
    aliases = COMMANDS[command][1]
    data = fixture(command)
    assert data["count"] == len(data["flags"]) == {"sft": 77, "dpo": 82, "rm": 79}[command]
    names = [o["flag"][2:] for o in data["flags"]]
    assert not [n for n in names if n not in aliases.specs], "flags with no entry"
    refused = [n for n in names if aliases.specs[n].refused]
    assert (len(names) - len(refused)) / len(names) >= 0.95, refused
    for opt in data["flags"]:
        name = opt["flag"][2:]
        if name in refused:
            at_default = [opt["flag"], "false"] if opt["action"] == "store_true" else sample(opt)
            parse(command, at_default)  # at OpenRLHF's default a refused flag changes nothing: accepted
            with pytest.raises(ConfigError) as e:
                parse(command, [opt["flag"], *OFF_DEFAULT[opt["flag"]]])
            assert str(e.value).startswith(f"--{name} ") and aliases.specs[name].why in str(e.value)
            continue
        try:
            parse(command, sample(opt))
        except ConfigError as e:
            pytest.fail(f"{' '.join(sample(opt))}: {e}")


def test_values_convert_with_the_same_meaning():
    cfg = parse("sft", ["--data.dataset", "/a.jsonl,/b.jsonl", "--data.dataset_probs", "0.7,0.3", "--data.input_key",
                        "question", "--data.output_key", "answer", "--data.max_len", "1024", "--train.batch_size",
                        "64", "--train.micro_batch_size", "4", "--adam.lr", "5e-6", "--adam.betas", "0.9", "0.99",
                        "--lr_scheduler", "cosine_with_min_lr", "--max_norm", "0.5", "--ds.param_dtype", "bf16",
                        "--ds.packing_samples", "--ckpt.save_steps", "-1", "--eval.steps", "20",
                        "--model.pretrain_mode_enable", "--data.tokenizer_chat_template", "{{ x }}",
                        "--data.apply_chat_template", "--data.multiturn", "--ds.lora.rank", "8",
                        "--ds.lora.target_modules", "q_proj", "v_proj", "--ckpt.path", "/ck", "--ckpt.load_enable",
                        "--logger.tensorboard_dir", "tb", "--data.max_samples", "1e3"])
    assert (cfg.dataset, cfg.dataset_probs, cfg.prompt_key, cfg.response_key) == ("/a.jsonl,/b.jsonl", [0.7, 0.3],
                                                                                  "question", "answer")
    assert (cfg.max_len, cfg.batch_size, cfg.micro_batch_size, cfg.lr, cfg.adam_betas) == (1024, 64, 4, 5e-6,
                                                                                          [0.9, 0.99])
    assert (cfg.lr_schedule, cfg.max_grad_norm, cfg.dtype, cfg.packing) == ("cosine", 0.5, "bfloat16", True)
    assert (cfg.save_every, cfg.eval_every, cfg.pretrain_mode, cfg.chat_template) == (0, 20, True, "{{ x }}")
    assert (cfg.use_chat_template, cfg.multiturn, cfg.lora_rank, cfg.lora_target_modules) == (True, True, 8,
                                                                                            ["q_proj", "v_proj"])
    assert (cfg.run_dir, cfg.resume, cfg.tensorboard, cfg.max_samples, cfg.save_path) == ("/ck", True, True, 1000, "/o")
    dpo = parse("dpo", ["--model.beta", "0.2", "--model.ipo_enable", "--model.nll_loss_coef", "0.1",
                        "--ref.model_name_or_path", "/ref", "--data.prompt_key", "q", "--data.chosen_key", "c",
                        "--data.rejected_key", "r", "--ds.packing_samples", "--eval.split", "test"])
    assert (dpo.beta, dpo.loss, dpo.nll_coef, dpo.ref_path, dpo.packing) == (0.2, "ipo", 0.1, "/ref", True)
    assert (dpo.prompt_key, dpo.chosen_key, dpo.rejected_key, dpo.eval_split) == ("q", "c", "r", "test")
    rm = parse("rm", ["--model.loss_type", "logexpsigmoid", "--ds.packing_samples", "--model.margin_loss_enable",
                      "false", "--model.compute_fp32_loss_enable", "--ds.value_head_prefix", "score"])
    assert (rm.loss, rm.packing, rm.margin_key) == ("logexpsigmoid", True, "")
    assert parse("rm", ["--model.margin_loss_enable"]).margin_key == "margin"


def test_earlier_underscore_names_still_work():
    cfg = parse("sft", ["--pretrain", "/p", "--dataset", "/x.jsonl", "--input_key", "q", "--output_key", "a",
                        "--micro_train_batch_size", "2", "--train_batch_size", "16", "--learning_rate", "1e-5",
                        "--bf16", "--save_path", "/s", "--save_steps", "-1", "--logging_steps", "3",
                        "--max_epochs", "2", "--packing_samples", "--pretrain_mode", "--dataset_probs", "1.0",
                        "--apply_chat_template", "--tokenizer_chat_template", "T", "--flash_attn", "--zero_stage",
                        "3", "--lr_warmup_ratio", "0.1", "--l2", "0.01", "--gradient_checkpointing"])
    assert (cfg.model_path, cfg.dataset, cfg.prompt_key, cfg.response_key, cfg.micro_batch_size) == (
        "/p", "/x.jsonl", "q", "a", 2)
    assert (cfg.batch_size, cfg.lr, cfg.dtype, cfg.save_path, cfg.save_every, cfg.log_every) == (
        16, 1e-5, "bfloat16", "/s", 0, 3)
    assert (cfg.epochs, cfg.packing, cfg.pretrain_mode, cfg.chat_template, cfg.zero_stage) == (2, True, True, "T", 3)
    assert (cfg.warmup_ratio, cfg.weight_decay, cfg.gradient_checkpointing) == (0.1, 0.01, True)
    dpo = parse("dpo", ["--beta", "0.3", "--ipo", "--ref_pretrain", "/r", "--ref_offload", "--input_key", "q"])
    assert (dpo.beta, dpo.loss, dpo.ref_path, dpo.prompt_key) == (0.3, "ipo", "/r", "q")
    rm = parse("rm", ["--loss", "logexpsigmoid", "--margin_loss", "--compute_fp32_loss", "--value_head_prefix",
                      "score"])
    assert (rm.loss, rm.margin_key) == ("logexpsigmoid", "margin")


def test_refusals_and_unknown_flags_say_what_and_why():
    for command, argv, expect in [
        ("sft", ["--ds.ring_attn_size", "2"], "--ds.ring_attn_size 2: sequence parallelism is built for the RL"),
        ("dpo", ["--load_in_4bit"], "--load_in_4bit true: 4-bit (QLoRA) base weights are not supported"),
        ("rm", ["--model.aux_loss_coef", "0.01"], "--model.aux_loss_coef 0.01: the MoE load-balancing loss"),
        ("sft", ["--ds.param_dtype", "fp16"], "--ds.param_dtype: cannot use 'fp16'"),
        ("dpo", ["--optim", "muon"], "--optim: cannot use 'muon' ('muon': Muon is not supported"),
        ("rm", ["--model.loss_type", "hinge"], "--model.loss_type: cannot use 'hinge'"),
        ("sft", ["--data.datasett", "/x"], "unknown flag --data.datasett (OpenRLHF train_sft has no such option) "
                                           "(did you mean --data.dataset?)"),
        ("dpo", ["--model.betta", "0.1"], "did you mean --model.beta?"),
        ("rm", ["--learning_rat", "1e-6"], "unknown flag --learning_rat (did you mean --learning_rate?)"),
        ("sft", ["--model.beta", "0.1"], "unknown flag --model.beta (OpenRLHF train_sft has no such option)"),
    ]:
        with pytest.raises(ConfigError) as e:
            parse(command, argv)
        assert expect in str(e.value), (argv, str(e.value))


def test_help_lists_the_openrlhf_flags_by_kind():
    out = subprocess.run([sys.executable, "-c", "from launch.rm import main; main(['--help'])"], capture_output=True,
                         text=True, cwd=ROOT, env=subprocess_env(), timeout=60)
    assert out.returncode == 0, out.stderr
    assert "OpenRLHF train_rm flags" in out.stdout and "--model.loss_type [--loss] -> loss" in out.stdout
    assert "Refused (the run stops at parse time" in out.stdout
    assert "--ds.ring_attn_size [--ring_attn_size]" in out.stdout


# ---- the commands of OpenRLHF's example scripts, run to the end -------------------------------------

SFT_SCRIPT = """--data.max_len 4096 --data.dataset Open-Orca/OpenOrca --data.input_key question
    --data.output_key response --data.input_template INPUT_TEMPLATE --train.batch_size 256
    --train.micro_batch_size 2 --data.max_samples 500000 --model.model_name_or_path meta-llama/Meta-Llama-3-8B
    --ckpt.output_dir ./checkpoint/llama3-8b-sft --ckpt.save_steps -1 --logger.logging_steps 1 --eval.steps -1
    --ds.zero_stage 2 --train.max_epochs 1 --ds.packing_samples --ds.param_dtype bf16 --adam.lr 5e-6
    --model.gradient_checkpointing_enable"""
PRETRAIN_SCRIPT = """--data.max_len 4096 --data.dataset DATASETS --data.dataset_probs 0.5,0.5 --data.input_key text
    --train.batch_size 128 --train.micro_batch_size 4 --data.max_samples 500000
    --model.model_name_or_path meta-llama/Meta-Llama-3-8B --ckpt.output_dir ./checkpoint/llama3-8b-pretrain
    --ckpt.save_steps -1 --logger.logging_steps 1 --eval.steps -1 --ds.zero_stage 2 --train.max_epochs 1
    --model.pretrain_mode_enable --ds.packing_samples --ds.param_dtype bf16 --adam.lr 5e-6
    --model.gradient_checkpointing_enable"""
DPO_SCRIPT = """--ckpt.output_dir ./checkpoint/llama3-8b-dpo --ckpt.save_steps -1 --logger.logging_steps 1
    --eval.steps -1 --train.batch_size 256 --train.micro_batch_size 1
    --model.model_name_or_path OpenRLHF/Llama-3-8b-sft-mixture --ds.param_dtype bf16 --train.max_epochs 1
    --data.max_len 8192 --ds.zero_stage 3 --adam.lr 5e-7 --model.beta 0.1
    --data.dataset OpenRLHF/preference_dataset_mixture2_and_safe_pku --data.apply_chat_template
    --data.chosen_key chosen --data.rejected_key rejected --ds.packing_samples --model.gradient_checkpointing_enable"""
RM_SCRIPT = """--ckpt.output_dir ./checkpoint/llama3-8b-rm --ckpt.save_steps -1 --logger.logging_steps 1 --eval.steps -1
    --train.batch_size 256 --train.micro_batch_size 1 --model.model_name_or_path OpenRLHF/Llama-3-8b-sft-mixture
    --ds.param_dtype bf16 --train.max_epochs 1 --data.max_len 8192 --ds.zero_stage 3 --adam.lr 9e-6
    --data.dataset OpenRLHF/preference_dataset_mixture2_and_safe_pku --data.apply_chat_template
    --data.chosen_key chosen --data.rejected_key rejected --ds.packing_samples --model.gradient_checkpointing_enable
    --model.loss_type logexpsigmoid"""
# short on the tiny model: 8 examples, batches of 4 (two steps), one thread, no tensorboard
SHRINK = ["--train.batch_size", "4", "--train.micro_batch_size", "2", "--data.max_samples", "8", "--data.max_len",
          "64", "--num_threads", "1", "--tensorboard", "false"]
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}:{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% endif %}")


@pytest.fixture(scope="module")
def example_data(tmp_path_factory):
    from demo.arithmetic import make_problems

    d = tmp_path_factory.mktemp("openrlhf_offline")
    rows = make_problems(8, seed=5)

    def conv(p, answer):
        return [{"role": "user", "content": p["prompt"]}, {"role": "assistant", "content": answer}]

    files = {
        "sft": [{"question": r["prompt"], "response": r["label"]} for r in rows],
        "pairs": [{"chosen": conv(r, r["label"]), "rejected": conv(r, r["label"][::-1] + "0")} for r in rows],
        "text_a": [{"text": f"{r['prompt']}{r['label']}"} for r in rows],
        "text_b": [{"text": "the cat sat on the mat."}, {"text": "a dog ran."}],
    }
    out = {}
    for name, data in files.items():
        out[name] = d / f"{name}.jsonl"
        out[name].write_text("".join(json.dumps(r) + "\n" for r in data))
    return out


def run_script(command: str, script: str, swap: dict, tmp_path: Path, *more: str) -> dict:
    argv = [swap.get(a, a) for a in script.split()]
    out_dir = tmp_path / "out"
    argv = [str(out_dir) if a.startswith("./checkpoint/") else a for a in argv] + SHRINK + list(more)
    proc = subprocess.run([sys.executable, "-m", f"launch.{command}", *argv], capture_output=True, text=True, cwd=ROOT,
                          env=subprocess_env(), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["steps_run"] == 2 and (out_dir / "model.safetensors").is_file()
    return {"summary": summary, "metrics": read_metrics(out_dir), "dir": out_dir, "stderr": proc.stderr}


@pytest.mark.slow
def test_sft_example_script_runs(tmp_path, tiny_model_dir, example_data):
    swap = {"Open-Orca/OpenOrca": str(example_data["sft"]), "meta-llama/Meta-Llama-3-8B": str(tiny_model_dir),
            "INPUT_TEMPLATE": "User: {}\nAssistant: "}
    run = run_script("sft", SFT_SCRIPT, swap, tmp_path)
    first = [r for r in run["metrics"] if "loss/sft" in r]
    assert len(first) == 2 and all(r["loss/sft"] > 0 for r in first)
    assert run["summary"]["data"][0]["used"] == 8
    assert json.loads((run["dir"] / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.slow
def test_continued_pretraining_of_two_mixed_datasets_runs(tmp_path, tiny_model_dir, example_data):
    swap = {"DATASETS": f"{example_data['text_a']},{example_data['text_b']}",
            "meta-llama/Meta-Llama-3-8B": str(tiny_model_dir)}
    run = run_script("sft", PRETRAIN_SCRIPT, swap, tmp_path)
    stats = run["summary"]["data"]
    assert [s["rows"] for s in stats] == [8, 2]  # both files read, mixed (then cut to max_samples 8)
    assert run["metrics"][0]["data/rows"] == 10
    assert all(r["loss/sft"] > 0 for r in run["metrics"] if "loss/sft" in r)


@pytest.mark.slow
def test_dpo_example_script_runs(tmp_path, tiny_model_dir, example_data):
    swap = {"OpenRLHF/preference_dataset_mixture2_and_safe_pku": str(example_data["pairs"]),
            "OpenRLHF/Llama-3-8b-sft-mixture": str(tiny_model_dir)}
    run = run_script("dpo", DPO_SCRIPT, swap, tmp_path, "--data.tokenizer_chat_template", TEMPLATE)
    steps = [r for r in run["metrics"] if "loss/dpo" in r]
    # the policy starts as the reference: the first step's loss is log 2 up to bf16 rounding
    assert len(steps) == 2 and abs(steps[0]["loss/dpo"] - 0.6931) < 0.05
    tok_cfg = json.loads((run["dir"] / "tokenizer_config.json").read_text())
    assert tok_cfg.get("chat_template") == TEMPLATE or (run["dir"] / "chat_template.jinja").read_text() == TEMPLATE


@pytest.mark.slow
def test_rm_example_script_runs(tmp_path, tiny_model_dir, example_data):
    swap = {"OpenRLHF/preference_dataset_mixture2_and_safe_pku": str(example_data["pairs"]),
            "OpenRLHF/Llama-3-8b-sft-mixture": str(tiny_model_dir)}
    run = run_script("rm", RM_SCRIPT, swap, tmp_path)
    steps = [r for r in run["metrics"] if "loss/rm" in r]
    assert len(steps) == 2 and all(r["loss/rm"] > 0 for r in steps)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(run["dir"])
    assert config.architectures == ["LlamaForSequenceClassification"] and config.num_labels == 1
