"""OpenRLHF's `train_ppo_ray` command lines through the config layer of launch.local and launch.ray.

The fixture lists the 167 options of OpenRLHF 0.11.2's `openrlhf.cli.train_ppo_ray` (read once from
the PyPI wheel's argparse parser, so that no test downloads anything). Every one must be mapped,
accepted with a note, or refused with a message that names it; values convert with the same
meaning; the PPO quick start of OpenRLHF's toolkit page parses to the expected keys. Config parsing
only: no role is started (one `--help` subprocess times the answer).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from common.config import ConfigError
from tests.helpers.cluster import QUICK_START, SHRINK, run_quick_start
from tests.helpers.procs import subprocess_env

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = json.loads((ROOT / "tests" / "fixtures" / "openrlhf_0.11.2_train_ppo_ray.json").read_text())

# the PPO quick start of OpenRLHF's toolkit page, as written there (its model names replaced in `quick_start`)
@pytest.fixture
def files(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n')
    other = tmp_path / "q.jsonl"
    other.write_text('{"question": "2+2=", "answer": "4"}\n')
    return {"model": str(model), "prompts": str(prompts), "other": str(other), "dir": tmp_path,
            "base": ["--pretrain", str(model), "--prompt_data", str(prompts), "--scorer.reward_fn", "r.py"]}


def local(argv):
    from launch.run_config import load_run_config

    return load_run_config(None, argv)


def on_ray(argv):
    from launch.cluster.config import load

    return load(None, list(argv))


def quick_start(files, *more):
    swap = {"meta-llama/Llama-3.1-8B": files["model"], "meta-llama/Llama-3.1-8B-RM": files["model"],
            "./checkpoint": str(files["dir"] / "checkpoint")}
    return [swap.get(a, a) for a in QUICK_START] + ["--prompt_data", files["prompts"], *SHRINK, *more]


# ---- every flag of 0.11.2 -----------------------------------------------------------------------

SAMPLE = {  # a value OpenRLHF users give where the default is None (or no value at all)
    "--vllm.num_engines": ["2"], "--rollout.max_new_tokens": ["16"], "--data.label_key": ["answer"],
    "--data.input_template": ["Q: {} A:"], "--reward.remote_url": ["http://127.0.0.1:9/rm"],
    "--critic.model_name_or_path": ["{model}", "--algo.advantage.estimator", "gae"],
    "--actor.model_name_or_path": ["{model}"], "--reward.model_name_or_path": ["{model}"],
    "--data.prompt_dataset": ["{prompts}"], "--eval.dataset": ["{prompts}"], "--data.prompt_probs": ["1.0"],
    "--ckpt.output_dir": ["{dir}/out"], "--ds.experts_implementation": ["eager"], "--ds.grad_accum_dtype": ["fp32"],
    "--actor.dual_clip": ["3"], "--actor.eps_clip_low_high": ["0.2", "0.28"], "--reward.overlong_buffer_len": ["4"],
    "--logger.wandb.key": ["k"], "--logger.wandb.org": ["o"], "--logger.wandb.group": ["g"],
    "--logger.tensorboard_dir": ["tb"], "--actor.entropy_coef": ["0.01"], "--rollout.max_tokens_per_gpu": ["4096"],
    "--rollout.vllm_generate_batch_size": ["8"], "--data.max_samples": ["100"], "--train.enable_ema": ["false"],
    "--train.agent_func_path": ["agent_func.py"],
}
OFF_DEFAULT = {  # a value that changes what is trained, for the refused flags
    "--ds.ring_attn_size": ["2"],
}


def sample(opt: dict, files: dict) -> list[str]:
    flag = opt["flag"]
    if flag in SAMPLE:
        values = SAMPLE[flag]
    elif opt["action"] != "store":
        values = []  # a switch alone
    else:
        d = opt["default"]
        values = [str(v) for v in d] if isinstance(d, list) else [str(d)]
    for key in ("model", "prompts", "dir"):
        values = [v.replace("{%s}" % key, str(files[key])) for v in values]
    return [flag, *values]


def test_every_0_11_2_flag_is_mapped_accepted_or_refused_by_name(files):
    from launch.openrlhf.flags import SAME_KEYS, spec

    flags = FIXTURE["flags"]
    assert FIXTURE["count"] == len(flags) == 167
    names = [o["flag"][2:] for o in flags]
    unknown = [n for n in names if spec(n) is None and n not in SAME_KEYS]
    assert not unknown, unknown
    refused = [n for n in names if n not in SAME_KEYS and spec(n).refused]
    assert len(names) - len(refused) == 166  # of 167: mapped or accepted
    # refused: 4-bit weights (no such kernels on this stack)
    assert refused == ["ds.load_in_4bit"], refused
    for opt in flags:  # each accepted flag with a value OpenRLHF users give: the run config still parses
        name = opt["flag"][2:]
        argv = files["base"] + sample(opt, files)
        if name in refused:
            at_default = [opt["flag"], "false"] if opt["action"] == "store_true" else sample(opt, files)
            local(files["base"] + at_default)  # at OpenRLHF's default a refused flag changes nothing: accepted
            off = [opt["flag"], *OFF_DEFAULT.get(opt["flag"], [])] if opt["action"] == "store_true" or \
                opt["flag"] in OFF_DEFAULT else None
            assert off, name
            with pytest.raises(ConfigError) as e:
                local(files["base"] + off)
            assert f"--{name}" in str(e.value) and spec(name).why in str(e.value)
            continue
        try:
            local(argv)
        except ConfigError as e:
            pytest.fail(f"{' '.join(sample(opt, files))}: {e}")


@pytest.mark.parametrize("release", ["0.11.0", "0.11.1"])
def test_every_flag_of_the_earlier_0_11_releases_is_known(files, release):
    """0.11.0 and 0.11.1 have the flags of 0.11.2 but for the correction's old spelling
    (`is_correction_enable` + `is_correction_type`, which 0.11.2 split into level, mode and gating)."""
    from launch.openrlhf.flags import SAME_KEYS, spec

    earlier = json.loads((ROOT / "tests" / "fixtures" / f"openrlhf_{release}_train_ppo_ray.json").read_text())
    assert earlier["count"] == len(earlier["flags"]) == {"0.11.0": 164, "0.11.1": 165}[release]
    latest = {o["flag"] for o in FIXTURE["flags"]}
    assert {o["flag"] for o in earlier["flags"]} - latest == {"--algo.advantage.is_correction_enable",
                                                               "--algo.advantage.is_correction_type"}
    for opt in earlier["flags"]:
        name = opt["flag"][2:]
        assert spec(name) is not None or name in SAME_KEYS, name
        if opt["flag"] not in latest:
            local(files["base"] + sample(opt, files))  # the old spelling parses at its default


@pytest.mark.parametrize("kind, expect", [
    ("tis", ("clip", 0.5, 5.0)), ("icepop", ("icepop", 0.5, 5.0)), ("seq-mask-tis", ("sequence", 0.5, 5.0)),
])
def test_the_0_11_0_correction_flags_mean_what_0_11_2_names_the_same(files, kind, expect):
    old = local(files["base"] + ["--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_type",
                                 kind, "--algo.advantage.is_correction_threshold", "0.5", "5"]).learner
    level, mode = {"tis": ("token", "clip"), "icepop": ("token", "mask"), "seq-mask-tis": ("seq", "mask")}[kind]
    new = local(files["base"] + ["--algo.advantage.is_correction_level", level, "--algo.advantage.is_correction_mode",
                                 mode, "--algo.advantage.is_correction_threshold", "0.5", "5"]).learner
    assert old.to_dict() == new.to_dict()
    off = local(files["base"] + ["--algo.advantage.is_correction_type", "icepop"]).learner
    assert off.behav_correction == "none"  # the type alone, without the switch: no correction, as in 0.11.0
    with pytest.raises(ConfigError, match="give one spelling"):
        local(files["base"] + ["--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_level",
                               "token"])


def test_data_max_len_is_prompt_plus_completion(files):
    g = local(files["base"] + ["--data.max_len", "512", "--rollout.max_new_tokens", "64"]).generator
    assert (g.max_model_len, g.prompt_max_len, g.max_new_tokens, g.max_len) == (512, 448, 64, 0)
    g = local(files["base"] + ["--data.max_len", "512"]).generator  # each completion gets what its prompt leaves
    assert (g.max_model_len, g.prompt_max_len, g.max_new_tokens, g.max_len) == (512, 511, 511, 512)
    g = local(files["base"] + ["--max_len", "512", "--generate_max_len", "100", "--prompt_max_len", "200"]).generator
    assert (g.max_model_len, g.prompt_max_len) == (512, 200)  # an explicit prompt budget wins
    with pytest.raises(ConfigError, match="--data.max_len 64: no room for a prompt"):
        local(files["base"] + ["--data.max_len", "64", "--rollout.max_new_tokens", "64"])


def test_refusals_name_the_flag_and_why_on_both_launchers(files):
    for argv, expect in [
        (["--ds.ring_attn_size", "2"], "learner.sequence_parallel=2 does not divide run.learner_ranks=1"),
        (["--ring_attn_size", "4", "--actor_num_gpus_per_node", "2"], "sequence_parallel=4 does not divide"),
        (["--load_in_4bit"], "--load_in_4bit true: 4-bit (QLoRA) base weights are not supported"),
        (["--algo.advantage.is_correction_gating", "tv", "--algo.advantage.is_correction_level", "token",
          "--algo.advantage.is_correction_mode", "clip"], "is_correction_mode clip: needs is_correction_level token "
                                                          "and is_correction_gating ratio"),
        (["--algo.advantage.is_correction_gating", "tv", "--algo.advantage.is_correction_level", "token",
          "--algo.advantage.is_correction_threshold", "0.1", "0.2"], "takes an upper bound only"),
        (["--remote_rm_url", "reward.txt"], "--remote_rm_url reward.txt: a reward file (FILE.py"),
    ]:
        for load in (local, on_ray):
            with pytest.raises(ConfigError, match=re.escape(expect)):
                load(files["base"] + argv)
    for value_refused in (["--ds.param_dtype", "fp16"], ["--actor.optim", "muon"], ["--policy_loss_type", "cispo"],
                          ["--advantage_estimator", "vtrace"], ["--vllm_num_engines", "0"]):
        with pytest.raises(ConfigError, match=value_refused[0]):
            local(files["base"] + value_refused)
    with pytest.raises(ConfigError, match="--actor_num_nodes 2: launch.local runs on one machine"):
        local(files["base"] + ["--actor_num_nodes", "2"])


# ---- values convert with the same meaning ---------------------------------------------------------


def test_values_convert_with_the_same_meaning(files):
    run = local(files["base"] + [
        "--rollout.n_samples_per_prompt", "4", "--rollout.batch_size", "8", "--train.batch_size", "16",
        "--train.micro_batch_size", "2", "--algo.advantage.estimator", "reinforce", "--eval.steps", "5",
        "--eval.dataset", files["prompts"], "--eval.temperature", "0", "--ckpt.save_steps", "-1",
        "--actor.eps_clip_low_high", "0.2", "0.28", "--algo.kl.use_loss", "--algo.kl.estimator", "k2",
        "--algo.kl.init_coef", "0.05", "--ds.zero_stage", "3", "--ds.param_dtype", "bf16", "--rollout.temperature",
        "0.7", "--rollout.top_p", "0.9", "--train.seed", "3", "--vllm.num_engines", "2",
        "--train.partial_rollout_enable", "--actor.lr_scheduler", "cosine_with_min_lr", "--actor.lr_warmup_ratio",
        "0.1", "--learner.total_steps", "20", "--actor.adam.betas", "0.9", "0.95", "--actor.adam.lr", "2e-6",
        "--critic.adam.betas", "0.9", "0.95", "--data.max_len", "1024", "--logger.wandb.project", "p"])
    b, l, g = run.buffer, run.learner, run.generator
    # 8 prompts x 4 samples = 32 per step: 2 optimizer steps of 16, each 8 forwards of 2
    assert b.prompts_per_step == 8 and l.num_mini_batches == 2 and l.gradient_accumulation_steps == 8
    assert l.advantage_estimator == "reinforce_pp" and run.eval.every == 5 and run.eval.temperature == 0
    assert l.save_every == 0 and (l.clip_eps_low, l.clip_eps_high) == (0.2, 0.28)
    assert (l.kl_in, l.kl_estimator, l.kl_coef) == ("loss", "k2", 0.05)
    assert l.zero_stage == 3 and l.dtype == "bfloat16" and l.lr == 2e-6 and l.adam_betas == [0.9, 0.95]
    assert g.temperature == l.temperature == 0.7 and g.top_p == 0.9 and l.seed == g.seed == 3
    assert run.run.num_generators == 2 and run.weight_sync.mode == "interrupt" and g.max_model_len == 1024
    assert l.lr_schedule == "cosine" and l.warmup_steps == math.ceil(0.1 * 20 * 2)  # of 40 optimizer steps
    assert l.wandb_project == "p"

    data = local(["--pretrain", files["model"], "--scorer.reward_fn", "r.py",
                  "--prompt_data", f"{files['prompts']},{files['other']}", "--prompt_data_probs", "0.7,0.3",
                  "--input_key", "question", "--label_key", "answer", "--input_template", "Q: {} A:",
                  "--apply_chat_template", "--max_samples", "50", "--eval_dataset", files["other"],
                  "--eval_steps", "2", "--eval_n_samples_per_prompt", "8", "--eval_temperature", "0.3"])
    b = data.buffer
    assert b.prompts == f"{files['prompts']},{files['other']}" and b.prompt_probs == [0.7, 0.3]
    assert (b.input_key, b.label_key, b.input_template, b.max_samples) == ("question", "answer", "Q: {} A:", 50)
    assert data.generator.use_chat_template is True
    assert (data.eval.dataset, data.eval.every, data.eval.n_samples_per_prompt, data.eval.temperature) == \
        (files["other"], 2, 8, 0.3)

    for level, mode, threshold, expect in [
        ("token", "mask", ["0.5", "5"], ("icepop", "token", 0.5, 5.0)),
        ("seq", "mask", ["0.8", "1.25"], ("icepop", "sequence", 0.8, 1.25)),  # zeroed, still in the mean
        ("off", "mask", ["0.5", "5"], ("none",)),
    ]:
        l = local(files["base"] + ["--algo.advantage.is_correction_level", level, "--algo.advantage.is_correction_mode",
                                   mode, "--algo.advantage.is_correction_threshold", *threshold]).learner
        assert (l.behav_correction, l.behav_mask_level, l.behav_low, l.behav_high)[:len(expect)] == expect
    l = local(files["base"] + ["--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_mode",
                               "clip", "--algo.advantage.is_correction_threshold", "3"]).learner
    assert (l.behav_correction, l.behav_tis_low, l.behav_tis_cap) == ("tis", 0.0, 3.0)
    l = local(files["base"] + ["--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_mode",
                               "clip"]).learner  # OpenRLHF's default band, clamped from both sides
    assert (l.behav_correction, l.behav_tis_low, l.behav_tis_cap) == ("tis", 0.5, 5.0)
    l = local(files["base"] + ["--algo.advantage.is_correction_level", "seq", "--algo.advantage.is_correction_gating",
                               "binary_kl", "--algo.advantage.is_correction_threshold", "0", "0.05"]).learner
    assert (l.behav_correction, l.behav_gating, l.behav_mask_level, l.behav_high) == \
        ("icepop", "binary_kl", "sequence", 0.05)
    with pytest.raises(ConfigError, match="--critic.adam.betas"):  # the critic trains with the policy's AdamW
        local(files["base"] + ["--algo.advantage.estimator", "gae", "--critic.adam.betas", "0.9", "0.99"])

    remote = local(["--pretrain", files["model"], "--prompt_data", files["prompts"], "--remote_rm_url", "http://h:1/rm"])
    assert remote.scorer.kinds == ["remote"] and remote.scorer.remote_url == "http://h:1/rm"


def test_the_vision_language_flags_set_the_image_keys(files):
    run = local(files["base"] + ["--data.image_key", "pictures", "--data.max_images_per_prompt", "4",
                                 "--actor.freeze_visual_encoder"])
    assert (run.buffer.image_key, run.buffer.max_images_per_prompt) == ("pictures", 4)
    assert run.learner.freeze_visual_encoder is True
    old = local(files["base"] + ["--image_key", "pictures", "--max_images_per_prompt", "4", "--freeze_visual_encoder"])
    assert old.to_dict() == run.to_dict()  # 0.11's names
    text = local(files["base"] + ["--data.max_images_per_prompt", "0"])  # OpenRLHF's default: text prompts only
    assert text.buffer.max_images_per_prompt == 0 and text.learner.freeze_visual_encoder is False
    with pytest.raises(ConfigError, match="max_images_per_prompt"):
        local(files["base"] + ["--data.max_images_per_prompt", "-1"])


def test_legacy_and_dotted_names_set_the_same_config(files):
    from launch.openrlhf.flags import spec

    quick_start_names = [a[2:] for a in QUICK_START if a.startswith("--")]
    usual = ["prompt_data", "input_key", "label_key", "apply_chat_template", "input_template", "prompt_data_probs",
             "max_samples", "eval_dataset", "eval_steps", "eval_temperature", "eval_n_samples_per_prompt", "save_steps",
             "ckpt_path", "use_wandb", "wandb_project", "use_tensorboard", "normalize_reward",
             "gradient_checkpointing", "flash_attn", "adam_offload"]
    assert [n for n in quick_start_names + usual if spec(n) is None] == []
    pairs = [("--vllm_num_engines", "--vllm.num_engines", "2"),
             ("--n_samples_per_prompt", "--rollout.n_samples_per_prompt", "2"),
             ("--rollout_batch_size", "--rollout.batch_size", "4"), ("--train_batch_size", "--train.batch_size", "4"),
             ("--micro_train_batch_size", "--train.micro_batch_size", "2"), ("--eps_clip", "--actor.eps_clip", "0.3"),
             ("--lambd", "--algo.advantage.lambd", "0.95"),
             ("--advantage_estimator", "--algo.advantage.estimator", "gae"),
             ("--critic_pretrain", "--critic.model_name_or_path", files["model"]),
             ("--l2", "--actor.adam.weight_decay", "0.1"),
             ("--max_norm", "--actor.max_norm", "0.5"), ("--save_steps", "--ckpt.save_steps", "3"),
             ("--input_key", "--data.input_key", "question"), ("--max_len", "--data.max_len", "900"),
             ("--gradient_checkpointing", "--actor.gradient_checkpointing_enable", None),
             ("--load_checkpoint", "--ckpt.load_enable", None), ("--async_train", "--train.async_enable", None)]
    old = local(files["base"] + [a for o, _, v in pairs for a in ([o, v] if v else [o])]).to_dict()
    new = local(files["base"] + [a for _, d, v in pairs for a in ([d, v] if v else [d])]).to_dict()
    assert old == new and old["learner"]["critic_path"] == files["model"] and old["learner"]["gae_lambda"] == 0.95


# ---- the quick start, on both launchers -----------------------------------------------------------


def test_quick_start_parses_through_launch_local_and_launch_ray(files):
    run = local(quick_start(files))
    rcfg, ray_run = on_ray(quick_start(files))
    for r in (run, ray_run):
        assert r.run.learner_ranks == r.run.num_generators == r.run.num_scorers == 1
        assert r.learner.model_path == r.generator.model == r.scorer.reward_model
        assert Path(r.learner.model_path).resolve() == Path(files["model"]).resolve()
        assert r.scorer.kinds == ["reward_model", "reference"]  # the KL needs the reference; no reward_fn
        assert Path(r.run.run_dir).name == "checkpoint" and r.learner.lr == 5e-7 and r.learner.kl_coef == 0.01
        # 8 prompts x 4 samples: 2 optimizer steps of 16 samples, each 4 forwards of 4
        assert (r.buffer.prompts_per_step, r.learner.num_mini_batches,
                r.learner.gradient_accumulation_steps) == (8, 2, 4)
        assert (r.generator.groups_per_lease, r.generator.prompt_max_len, r.generator.max_new_tokens) == (4, 64, 16)
        assert r.learner.ppo_epochs == 1 and r.generator.tensor_parallel_size == 1
    # on Ray the placement flags set process counts; GPUs come from the device plan (next test)
    assert rcfg.learner.num_gpus == rcfg.generator.num_gpus == rcfg.scorer.num_gpus == 0
    assert rcfg.learner.bundle() == {"CPU": 1.0}

    rcfg, big = on_ray(quick_start(files, "--actor_num_nodes", "2", "--actor_num_gpus_per_node", "2",
                                   "--reward_num_gpus_per_node", "3", "--train_batch_size", "32",
                                   "--micro_train_batch_size", "2"))
    assert big.run.learner_ranks == 4 and big.run.num_scorers == 3  # 2 nodes x 2 GPUs; max(ref 1, reward 3)
    assert big.learner.gradient_accumulation_steps == 4  # 32 samples / 4 ranks / micro 2
    with pytest.raises(ConfigError, match="--actor_num_nodes 2: launch.local runs on one machine"):
        local(quick_start(files, "--actor_num_nodes", "2"))


def test_ray_bundles_reserve_the_gpus_only_on_a_gpu_cluster(files):
    from launch.cluster.devices import RayDevices
    from launch.devices.gpus import parse_fake

    rcfg, run = on_ray(quick_start(files, "--vllm_tensor_parallel_size", "2", "--scorer.device", "cuda"))
    gpu = RayDevices.make(run, rcfg, parse_fake("8"))  # the separate layout: each process its planned GPUs
    assert (gpu.actor_bundle("learner"), gpu.actor_bundle("generator"), gpu.actor_bundle("scorer")) == \
        ({"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 2.0}, {"CPU": 1.0, "GPU": 1.0})
    assert gpu.actor_bundle("buffer") == {"CPU": 0.5}
    cpu = RayDevices.make(run, rcfg, parse_fake("0"))  # a CPU cluster: the same command, every process on CPUs
    assert all("GPU" not in cpu.actor_bundle(k) for k in ("learner", "generator", "scorer"))
    rcfg, run = on_ray(quick_start(files, "--ray.generator.num_gpus", "0.5"))  # an explicit reservation wins
    assert RayDevices.make(run, rcfg, parse_fake("8")).actor_bundle("generator") == {"CPU": 1.0, "GPU": 0.5}


@pytest.mark.parametrize("flags, placement", [
    (["--colocate_all_models"], "colocate"), (["--train.colocate_all"], "colocate"),
    (["--colocate_actor_ref"], "colocate_scorers"), (["--train.colocate_actor_ref"], "colocate_scorers"),
    (["--colocate_critic_reward"], "colocate_scorers"), (["--train.colocate_critic_reward"], "colocate_scorers"),
    (["--colocate_actor_ref", "--train.colocate_all"], "colocate"),  # colocate_all wins, in either order
    (["--colocate_all_models", "--train.colocate_critic_reward"], "colocate"),
    (["--train.colocate_all", "false"], "auto"), ([], "auto"),
    (["--colocate_critic_reward", "--run.placement", "separate"], "separate"),  # Conveyor's own key wins
])
def test_colocation_flags_set_run_placement_on_both_launchers(files, flags, placement):
    assert local(files["base"] + flags).run.placement == placement
    assert on_ray(files["base"] + flags)[1].run.placement == placement


def test_sleep_flags_are_accepted_and_say_time_sharing_is_not_done(files):
    from launch.openrlhf.flags import spec

    for name in ("vllm.enable_sleep", "ds.enable_sleep", "vllm_enable_sleep", "deepspeed_enable_sleep"):
        assert not spec(name).targets and not spec(name).refused and "time-sharing" in spec(name).why
    run = local(files["base"] + ["--vllm.enable_sleep", "--deepspeed_enable_sleep", "--colocate_all_models"])
    assert run.run.placement == "colocate"


def test_drop_in_takes_openrlhf_defaults_and_the_users_flags_win(files):
    from launch.train_ppo_ray import with_defaults

    rcfg, run = on_ray(with_defaults(quick_start(files, "--rollout_batch_size", "16", "--train_batch_size", "8",
                                                 "--micro_train_batch_size", "4", "--input_key", "prompt")))
    l = run.learner
    assert run.run.mode == "sync" and l.advantage_estimator == "gae" and l.critic_path == run.scorer.reward_model
    assert (l.kl_in, l.kl_estimator, l.kl_coef, l.behav_correction) == ("reward", "k1", 0.01, "none")
    assert run.buffer.n_samples_per_prompt == 1 and run.buffer.input_key == "prompt"  # the user's flag wins
    assert (run.buffer.prompts_per_step, l.num_mini_batches, l.gradient_accumulation_steps) == (16, 2, 2)
    assert l.dtype == "bfloat16" and l.adam_betas == [0.9, 0.95] and l.lr_schedule == "cosine"
    assert run.generator.use_chat_template is False and l.critic_lr == 9e-6 and l.reward_clip_range == [-10, 10]


# ---- --help -------------------------------------------------------------------------------------


def test_help_lists_the_flags_grouped_with_their_meaning_fast():
    from launch.cluster.config import ray_help
    from launch.ray import __doc__ as ray_doc

    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "launch.local", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    took = time.monotonic() - t0
    assert out.returncode == 0 and took < 3.0, (took, out.stderr[-2000:])
    for text in (out.stdout, ray_help(ray_doc)):
        assert "--algo.advantage.estimator [--advantage_estimator] -> learner.advantage_estimator" in text
        assert "--eval.steps [--eval_steps] -> eval.every" in text
        assert "--ds.ring_attn_size [--ring_attn_size] -> learner.sequence_parallel" in text
        assert "Conveyor's\nown keys win" in text or "own keys win" in text


# ---- the quick start, run: the tiny model as policy and (with a value head) as reward model ----------




@pytest.mark.slow
def test_the_quick_start_trains_through_launch_local(quick_start_files, tmp_path):

    run_dir = tmp_path / "checkpoint"
    # with CurveZMQ on (on loopback it is off unless asked): every role holds the run's keys
    res = subprocess.run([sys.executable, "-m", "launch.local", *run_quick_start(quick_start_files, run_dir),
                          "--run.curve", "on", "--normalize_reward"],
                         cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # 16 prompts, 8 a step, one episode: two steps, then the buffer is done and the run ends
    assert [r["step"] for r in rows] == [0, 1]
    assert all(math.isfinite(r["reward/mean"]) and r["perf/samples"] == 8 * 4 for r in rows)  # Conveyor's n=4
    assert (run_dir / "checkpoints" / "step_2" / "config.json").is_file()
    resolved = (run_dir / "config.yaml").read_text()
    assert quick_start_files["rm"] in resolved and "reward_model" in resolved and "reward_normalize: true" in resolved
    assert yaml.safe_load(resolved)["buffer"]["curve"] == "on" and (run_dir / "keys").stat().st_mode & 0o777 == 0o700
    assert {p.name for p in (run_dir / "keys").glob("*.secret")} >= {"server.secret", "learner.secret",
                                                                       "scorer-0.secret", "gen-0.secret"}


# ---- the knobs that were refused before: each sets the learner key that computes OpenRLHF's meaning ----


def test_the_algorithm_knobs_map_onto_the_learner(files):
    l = local(files["base"] + [
        "--train.enable_ema", "--train.ema_beta", "0.99", "--algo.kl.target", "0.1", "--algo.kl.horizon", "5000",
        "--algo.kl.init_coef", "0.05",
        "--algo.kl.use_loss", "--algo.kl.unbiased_gradient", "--reward.clip_range", "-2", "2",
        "--reward.stop_properly_penalty_coef", "0.0", "--actor.aux_loss_coef", "0.01",
        "--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "4096", "--rollout.max_tokens_per_gpu", "8192",
        "--algo.advantage.estimator", "reinforce_baseline", "--algo.advantage.no_std_norm"]).learner
    assert (l.ema_beta, l.kl_target, l.kl_horizon, l.kl_in, l.kl_unbiased_gradient) == (0.99, 0.1, 5000, "loss", True)
    assert l.reward_clip_range == [-2.0, 2.0] and l.stop_properly_penalty_coef == 0.0 and l.aux_loss_coef == 0.01
    assert (l.max_tokens_per_micro_batch, l.max_tokens_per_forward, l.gradient_accumulation_steps) == (4096, 8192, 1)
    assert l.advantage_estimator == "reinforce_baseline" and l.adv_std_norm is False
    l = local(files["base"] + ["--train.enable_ema", "--advantage_estimator", "group_norm",
                               "--advantage_estimator", "group_norm"]).learner
    assert l.ema_beta == 0.992 and l.advantage_estimator == "group_norm" and l.adv_eps == 1e-9  # OpenRLHF's
    l = local(files["base"] + ["--advantage_estimator", "gae", "--critic_pretrain", files["model"],
                               "--freezing_actor_steps", "2"]).learner
    assert l.critic_warmup_steps == 3  # OpenRLHF trains the actor once global_step > 2: steps 0, 1, 2 frozen
    assert local(files["base"] + ["--critic.freezing_steps", "-1"]).learner.critic_warmup_steps == 0
    assert local(files["base"] + ["--algo.kl.target", "0"]).learner.kl_target is None  # falsy there: fixed
    l = local(files["base"] + ["--actor.policy_loss_type", "gspo"]).learner
    assert (l.policy_loss, l.behav_correction, l.gspo_ratio) == ("gspo", "none", "prox")
    l = local(files["base"] + ["--actor.policy_loss_type", "gspo", "--algo.advantage.is_correction_level", "token"]
              ).learner  # OpenRLHF's GSPO then takes its ratio to the rollout policy, and skips the correction
    assert (l.policy_loss, l.behav_correction, l.gspo_ratio) == ("gspo", "none", "behav")
    assert local(files["base"] + ["--normalize_reward"]).scorer.reward_normalize is True
    # sequence parallelism: 4 actor ranks in groups of 2 train 2 data-parallel shares
    run = local(files["base"] + ["--ds.ring_attn_size", "2", "--ds.ring_attn_head_stride", "1",
                                 "--actor.num_gpus_per_node", "4", "--rollout.batch_size", "2"])
    assert (run.learner.sequence_parallel, run.run.learner_ranks) == (2, 4)


def test_reward_files_and_servers_map_onto_the_scorer(files):
    reward = files["dir"] / "reward_func.py"
    reward.write_text("def reward_func(queries, prompts, labels, **kwargs):\n    return [0.0] * len(queries)\n")
    base = ["--pretrain", files["model"], "--prompt_data", files["prompts"]]
    s = local(base + ["--remote_rm_url", str(reward)]).scorer
    assert s.kinds == ["reward_fn"] and s.reward_fn == str(reward) and s.tokenizer == files["model"]
    s = local(base + ["--reward.remote_url", "http://a:1/get_reward,http://b:2/get_reward"]).scorer
    assert s.kinds == ["remote"] and s.remote_urls == ["http://a:1/get_reward", "http://b:2/get_reward"]
    assert s.remote_protocol == "openrlhf" and s.tokenizer == files["model"]
    s = local(base + ["--remote_rm_url", "http://a:1/get_reward", "--scorer.remote_protocol", "conveyor"]).scorer
    assert s.remote_url == "http://a:1/get_reward" and s.remote_protocol == "conveyor"  # Conveyor's key wins
