"""OpenRLHF's `train_ppo_ray` command line, flag by flag: what each one means here.

Every option of OpenRLHF 0.11.2's `openrlhf.cli.train_ppo_ray` (the dotted names, `--actor.num_nodes`,
`--algo.advantage.estimator`, ...) and the underscore names of 0.11 (`--ref_num_nodes`,
`--prompt_data`, `--advantage_estimator`, ...) is one of three kinds:

- mapped (`to`): it sets Conveyor keys with the same meaning, its value converted (OpenRLHF counts
  samples where the buffer counts prompt groups, names estimators and schedules differently,
  says -1 for "off");
- accepted (`note`): it has no effect here and leaving it out changes nothing the run learns
  (a CUDA-only speed-up, a logging cadence); a note says so.
  Two are accepted with a check: `only` at one value (`--actor.num_nodes 1` on launch.local; more
  nodes are launch.ray's), and `shared` when it agrees with the policy's key (the critic trains
  with the policy's AdamW settings);
- refused (`refuse`): it would change what is trained and Conveyor has no counterpart; the run
  stops at parse time with one line naming the flag and why. Given at OpenRLHF's default value,
  such a flag changes nothing and is accepted.

`ALIASES` is the table as `launch.run_config` reads it (an `Alias` per name). Flags whose meaning
needs another flag's value (`--actor.eps_clip_low_high` into two keys, the `is_correction_*`
family, a warm-up ratio of the run's optimizer steps, a remote reward URL that adds a scorer kind)
and the refusals land in `Run.extra` and are resolved by `launch.openrlhf.resolve.resolve`, which
`run_config.finish` calls. The placement flags set process counts here (learner ranks, generators) and are read again
by `launch.ray` for the resources (launch/cluster/config.py `ray_placement`); the colocation flags set
`run.placement` (resolved together: `--train.colocate_all` wins over the two partial ones). \
Where a name is both a Conveyor key and an
OpenRLHF flag (`--eval.dataset`, `--eval.split`, `--eval.temperature`, `--eval.n_samples_per_prompt`)
it is Conveyor's key, which means the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from common.config import Alias, parse_bool

UNSET = object()  # no value: a refusal with no harmless value, a flag with no `only` check


@dataclass(frozen=True)
class Spec:
    """One OpenRLHF option: `targets` (Conveyor keys; `extra.X` for `resolve`), how its value reads,
    and for help the meaning (`why`); `refused`: the reason it stops a run (unless at `default`)."""

    targets: tuple[str, ...] = ()
    convert: Callable[[str], Any] = str
    why: str = ""
    refused: bool = False
    default: Any = UNSET
    only: Any = UNSET  # accepted at this value only (a check, not a refusal): `why` says where else it works
    shares: str = ""  # a critic setting the policy's learner key holds for both: accepted when they agree


def to(*targets: str, convert: Callable[[str], Any] = str, why: str = "") -> Spec:
    return Spec(tuple(targets), convert, why)


def note(why: str) -> Spec:
    return Spec((), str, why)


def refuse(why: str, default: Any = UNSET) -> Spec:
    return Spec((), str, why, refused=True, default=default)


def only(value: Any, why: str) -> Spec:
    return Spec((), str, why, only=value)


def shared(key: str, convert: Callable[[str], Any] = str) -> Spec:
    return Spec((), convert, f"the critic shares the policy's {key}: accepted when they agree", shares=key)


# ---- value conversions ---------------------------------------------------------------------------


def off_if_negative(v: str) -> int:
    """OpenRLHF's -1 ("never") as Conveyor's 0."""
    return max(0, int(float(v)))


def whole(v: str) -> int:
    return int(float(v))  # `1e8`, `16.0`


def floats(v: str) -> list[float]:
    return [float(x) for x in str(v).split(",") if x.strip()]


def none_as_zero(v: str) -> float:
    return 0.0 if str(v).lower() in ("none", "null") else float(v)


def choose(names: dict[str, Any], why: str) -> Callable[[str], Any]:
    """A value read through `names` (OpenRLHF's name -> Conveyor's); any other is refused with `why`."""
    def read(v: str) -> Any:
        if v not in names:
            raise ValueError(f"{v!r}: {why}")
        return names[v]
    return read


def switch(on: str, off: str) -> Callable[[str], str]:
    """An OpenRLHF on/off flag as the Conveyor value it picks."""
    return lambda v: on if parse_bool(v) else off


def engines(v: str) -> int:
    if int(v) < 1:
        raise ValueError("0 engines (generation by the training model) is not supported: give 1 or more")
    return int(v)


estimator = choose({"group_norm": "group_norm", "grpo": "grpo", "dr_grpo": "dr_grpo", "rloo": "rloo", "gae": "gae",
                    "reinforce": "reinforce_pp", "reinforce_baseline": "reinforce_baseline",
                    "reinforce_pp": "reinforce_pp", "flash_reinforce": "flash_reinforce"},
                   "not one of gae, reinforce, rloo, reinforce_baseline, group_norm, dr_grpo, flash_reinforce")
param_dtype = choose({"bf16": "bfloat16", "fp32": "float32"}, "fp16 training is not supported (bf16)")
schedule = choose({"cosine_with_min_lr": "cosine", "cosine": "cosine", "linear": "linear", "constant": "constant",
                   "constant_with_warmup": "constant"}, "not one of cosine_with_min_lr, linear, constant")
sync_backend = choose({"nccl": "auto", "gloo": "gloo"}, "nccl (NCCL on CUDA, gloo on CPU) or gloo")
bf16 = switch("bfloat16", "float32")


# ---- the table: OpenRLHF 0.11.2's dotted options --------------------------------------------------

LOCAL_ONE_NODE = "launch.local runs on one machine; several nodes: launch.ray or launch.train_ppo_ray"
PLACED = ("placement: launch.ray starts max(ref, reward) nodes x GPUs scorers (each serves both models); "
          "launch.local runs run.num_scorers")
SLEEP = ("time-sharing of a colocated GPU (the engines sleep while the learner trains, the learner's state "
         "leaves the GPU while they generate) is not done yet: colocated roles share each GPU's memory at once "
         "(run.placement colocate gives each its share); accepted, no effect")
SPEED = "speed or memory only"

TABLE: dict[str, Spec] = {
    # placement (Ray and vLLM)
    "ref.num_nodes": only(1, LOCAL_ONE_NODE),
    "ref.num_gpus_per_node": note(PLACED),
    "reward.num_nodes": only(1, LOCAL_ONE_NODE),
    "reward.num_gpus_per_node": note(PLACED),
    "actor.num_nodes": only(1, LOCAL_ONE_NODE),
    "actor.num_gpus_per_node": to("run.learner_ranks", convert=int,
                                  why="a rank per GPU, x actor.num_nodes on launch.ray; without GPUs a rank "
                                      "runs on CPUs"),
    "critic.num_nodes": only(1, LOCAL_ONE_NODE),
    "critic.num_gpus_per_node": note("the critic trains inside the learner ranks (learner.critic_path)"),
    "train.colocate_actor_ref": to("extra.colocate_actor_ref", convert=parse_bool,
                                   why="run.placement colocate_scorers (the reference scorers on the learner's GPUs), "
                                       "unless --train.colocate_all"),
    "train.colocate_critic_reward": to("extra.colocate_critic_reward", convert=parse_bool,
                                       why="run.placement colocate_scorers (the critic trains in the learner ranks; "
                                           "the reward scorers on their GPUs), unless --train.colocate_all"),
    "train.colocate_all": to("extra.colocate_all", convert=parse_bool,
                             why="run.placement colocate (engines and scorers on the learner's GPUs, each with a "
                                 "memory share)"),
    "vllm.num_engines": to("run.num_generators", convert=engines, why="one generator process per engine"),
    "vllm.tensor_parallel_size": to("generator.tensor_parallel_size", convert=int),
    "vllm.sync_backend": to("weight_sync.backend", convert=sync_backend, why="nccl: auto (NCCL on CUDA, gloo on CPU)"),
    "vllm.sync_with_ray": note("weights go over a torch.distributed group (weight_sync.backend)"),
    "vllm.enable_prefix_caching": note(SPEED),
    "vllm.enforce_eager": note(SPEED),
    "vllm.enable_sleep": note(SLEEP),
    "vllm.gpu_memory_utilization": to("generator.gpu_memory_utilization", convert=float,
                                      why="on a CPU build: of host memory, for the KV cache"),
    # behaviour -> proximal importance-sampling correction (resolved together)
    "algo.advantage.is_correction_level": to("extra.is_correction_level",
                                             why="off: none; token + mask: icepop; seq + mask: mask by "
                                                 "sequence; token + clip (HIGH only): tis"),
    "algo.advantage.is_correction_mode": to("extra.is_correction_mode", why="with is_correction_level"),
    "algo.advantage.is_correction_gating": to("extra.is_correction_gating", why="ratio only"),
    "algo.advantage.is_correction_threshold": to("extra.is_correction_threshold", convert=floats,
                                                 why="learner.behav_low, behav_high (or tis cap)"),
    # 0.11.0 and 0.11.1 spell the same correction as a switch and a type (0.11.2 renamed them)
    "algo.advantage.is_correction_enable": to("extra.is_correction_enable", convert=parse_bool,
                                              why="0.11.0/0.11.1: the correction on, of is_correction_type"),
    "algo.advantage.is_correction_type": to("extra.is_correction_type",
                                            why="0.11.0/0.11.1: tis (token level, clip), icepop (token level, mask), "
                                                "seq-mask-tis (sequence level, mask)"),
    # asynchronous training
    "train.async_enable": to("run.mode", convert=switch("async", "sync"), why="true: async, false: sync"),
    "train.async_queue_size": to("buffer.max_staleness", convert=int,
                                 why="batches the generators may run ahead = versions a sample may lag"),
    "train.partial_rollout_enable": to("weight_sync.mode", convert=switch("interrupt", "finish"),
                                       why="true: interrupt (weights load into running batches)"),
    # evaluation, checkpoints, logging
    "eval.steps": to("eval.every", convert=off_if_negative, why="-1: 0 (off)"),
    "ckpt.save_steps": to("learner.save_every", convert=off_if_negative, why="-1: 0 (only at the end)"),
    "logger.logging_steps": note("metrics are logged every learner step"),
    "ckpt.path": note("checkpoints go to run.run_dir/checkpoints"),
    "ckpt.save_hf": note("checkpoints hold the model as a Hugging Face folder already"),
    "ckpt.disable_ds": note("checkpoints keep the optimizer state for learner.resume"),
    "ckpt.max_num": to("learner.keep_checkpoints", convert=int),
    "ckpt.max_mem": note("no size cap: learner.keep_checkpoints bounds them"),
    "ckpt.load_enable": to("learner.resume", convert=parse_bool),
    "ckpt.best_metric_key": note("no best-checkpoint copy; eval/* metrics are logged every eval.every steps"),
    "ds.use_universal_ckpt": note("checkpoints resume with the same number of ranks"),
    "local_rank": note("ranks come from the environment"),
    # DeepSpeed and the model
    "ds.zero_stage": to("learner.zero_stage", convert=int),
    "actor.gradient_checkpointing_enable": to("learner.gradient_checkpointing", convert=parse_bool),
    "ds.deepcompile": note(SPEED),
    "ds.param_dtype": to("learner.dtype", convert=param_dtype, why="bf16: bfloat16 (fp16 refused)"),
    "train.enable_ema": to("extra.enable_ema", convert=parse_bool,
                           why="learner.ema_beta (the checkpoints' HF model is the EMA, as OpenRLHF saves it)"),
    "train.ema_beta": to("extra.ema_beta", convert=float, why="learner.ema_beta, with --train.enable_ema"),
    "ds.zpg": note(SPEED),
    "ds.adam_offload": note(SPEED),
    "ds.attn_implementation": note("attention is PyTorch's (sdpa/eager); the values match up to rounding"),
    "ds.experts_implementation": note(SPEED),
    "ds.use_liger_kernel": note(SPEED),
    "ds.grad_accum_dtype": note(SPEED),
    "ds.overlap_comm": note(SPEED),
    "actor.gradient_checkpointing_reentrant": note(SPEED),
    "data.disable_fast_tokenizer": note("the tokenizer folder decides"),
    "data.dataloader_num_workers": note("the buffer service reads the prompts"),
    "ds.enable_sleep": note(SLEEP),
    "ds.tensor_parallel_size": note("a memory layout: learner ranks are data-parallel ZeRO (ZeRO-3 partitions "
                                    "the parameters); the gradient is the same"),
    "ds.packing_samples": to("learner.packing", convert=parse_bool),
    "train.dynamic_batch_enable": to("extra.dynamic_batch", convert=parse_bool,
                                     why="micro-batches cut by tokens (learner.max_tokens_per_micro_batch), the "
                                         "same gradient"),
    "rollout.max_tokens_per_gpu": to("extra.rollout_max_tokens", convert=int,
                                     why="learner.max_tokens_per_forward, with --train.dynamic_batch_enable"),
    "train.max_tokens_per_gpu": to("extra.train_max_tokens", convert=int,
                                   why="learner.max_tokens_per_micro_batch, with --train.dynamic_batch_enable"),
    "ds.load_in_4bit": refuse("4-bit (QLoRA) base weights are not supported", False),
    "ds.lora.rank": to("learner.lora_rank", convert=int),
    "ds.lora.alpha": to("learner.lora_alpha", convert=int),
    "ds.lora.target_modules": to("learner.lora_target_modules"),
    "ds.lora.dropout": to("learner.lora_dropout", convert=float),
    # PPO sizes (OpenRLHF counts samples; resolved against n_samples_per_prompt and the ranks)
    "ckpt.output_dir": to("run.run_dir"),
    "train.num_episodes": to("buffer.max_epochs", convert=int, why="passes over the prompts"),
    "rollout.batch_size": to("buffer.prompts_per_step", "extra.rollout_batch_size", why="prompts per learner step"),
    "rollout.vllm_generate_batch_size": note("generation batching only (generator.groups_per_lease)"),
    "rollout.micro_batch_size": to("generator.groups_per_lease", convert=int),
    "train.max_epochs": to("learner.ppo_epochs", convert=int),
    "data.max_len": to("extra.max_len", convert=int,
                       why="generator.max_model_len, prompt + completion: generator.prompt_max_len is max_len - "
                           "max_new_tokens (longer prompts keep their last tokens, as OpenRLHF truncates them)"),
    "rollout.max_new_tokens": to("generator.max_new_tokens", convert=int),
    "data.max_samples": to("buffer.max_samples", convert=whole),
    "actor.eps_clip": to("learner.clip_eps_low", "learner.clip_eps_high", convert=float),
    "actor.eps_clip_low_high": to("extra.eps_clip_low_high", convert=floats,
                                  why="learner.clip_eps_low, learner.clip_eps_high"),
    "actor.dual_clip": to("learner.dual_clip_c"),
    "critic.value_clip": to("learner.value_clip_eps", convert=float),
    "algo.advantage.lambd": to("learner.gae_lambda", convert=float),
    "algo.advantage.gamma": to("learner.gamma", convert=float),
    "train.micro_batch_size": to("extra.micro_train_batch_size", convert=int,
                                 why="samples per forward: learner.gradient_accumulation_steps"),
    "train.batch_size": to("extra.train_batch_size", convert=int,
                           why="samples per optimizer step: learner.num_mini_batches"),
    "reward.normalize_enable": to("scorer.reward_normalize", convert=parse_bool,
                                  why="the reward model's score as (raw - mean) / std, the statistics its "
                                      "config.json holds"),
    "rollout.top_p": to("generator.top_p", convert=float),
    "rollout.temperature": to("generator.temperature", "learner.temperature", convert=float),
    "train.seed": to("learner.seed", "generator.seed", convert=int),
    "train.full_determinism_enable": note("runs are seeded (learner.seed, generator.seed)"),
    "critic.freezing_steps": to("learner.critic_warmup_steps", convert=lambda v: max(0, int(v) + 1),
                                why="N: the policy is frozen for the first N + 1 steps (steps 0..N, as OpenRLHF "
                                    "trains it once global_step > N); -1: 0"),
    "rollout.n_samples_per_prompt": to("buffer.n_samples_per_prompt", convert=int),
    "critic.save_value_network": note("the critic is saved with the learner's checkpoints"),
    "algo.kl.target": to("learner.kl_target", convert=lambda v: None if str(v).lower() in ("none", "null") or
                         not float(v) else float(v),
                         why="the adaptive KL controller (kl_coef its starting value); 0 or None: a fixed kl_coef"),
    "algo.kl.horizon": to("learner.kl_horizon", convert=whole),
    "algo.kl.init_coef": to("learner.kl_coef", convert=float),
    "actor.policy_loss_type": to("extra.policy_loss_type", convert=choose({"ppo": "ppo", "gspo": "gspo"},
                                                                          "ppo or gspo"),
                                 why="learner.policy_loss (gspo: the vLLM correction is not applied, as there)"),
    "actor.loss_agg_mode": to("learner.loss_agg"),
    "algo.kl.estimator": to("learner.kl_estimator"),
    "algo.kl.unbiased_gradient": to("learner.kl_unbiased_gradient", convert=parse_bool),
    "actor.aux_loss_coef": to("learner.aux_loss_coef", convert=float,
                              why="a model without a router is refused at start"),
    "actor.entropy_coef": to("learner.entropy_coef", convert=none_as_zero),
    "reward.clip_range": to("learner.reward_clip_range", convert=floats, why="LOW HIGH, after the baseline"),
    "algo.advantage.estimator": to("learner.advantage_estimator", "extra.estimator", convert=estimator,
                                   why="each name computes what OpenRLHF's does (reinforce: reinforce_pp)"),
    "algo.kl.use_loss": to("learner.kl_in", convert=switch("loss", "reward"), why="true: loss, false: reward"),
    "algo.advantage.no_std_norm": to("learner.adv_std_norm", convert=lambda v: not parse_bool(v),
                                     why="true: adv_std_norm false (the mean is subtracted, no division)"),
    "reward.overlong_buffer_len": to("scorer.overlong_buffer_len", convert=whole),
    "reward.overlong_penalty_factor": to("scorer.overlong_penalty_factor", convert=float),
    "reward.stop_properly_penalty_coef": to("learner.stop_properly_penalty_coef", convert=lambda v: None if
                                            str(v).lower() in ("none", "null") else float(v)),
    "ds.ring_attn_size": to("learner.sequence_parallel", convert=int,
                            why="sequence parallelism as DeepSpeed-Ulysses (an all-to-all per attention layer), "
                                "not ring attention: the same split of each sequence over that many ranks"),
    "ds.ring_attn_head_stride": note("ring attention's head stride: a Ulysses split has none"),
    "actor.model_name_or_path": to("learner.model_path", "generator.model"),
    "reward.model_name_or_path": to("scorer.reward_model", "extra.reward_model", why="one reward model"),
    "reward.remote_url": to("extra.remote_url", why="a reward file (reward_func): scorer.reward_fn; http(s) URLs, "
                                                     "comma-separated: scorer.remote_url in OpenRLHF's protocol"),
    "critic.model_name_or_path": to("learner.critic_path"),
    "ds.value_head_prefix": note("the value head is saved under Conveyor's own name"),
    "ref.offload": note(SPEED),
    "reward.offload": note(SPEED),
    "train.agent_func_path": to("generator.env", why="the agent file runs unchanged: an AgentExecutor with its "
                                                       "own execute(), or an AgentInstance played turn by turn"),
    # data and evaluation
    "data.prompt_dataset": to("buffer.prompts"),
    "data.prompt_probs": to("buffer.prompt_probs"),
    "data.prompt_split": to("buffer.prompt_split"),
    "data.input_key": to("buffer.input_key"),
    "data.label_key": to("buffer.label_key"),
    "data.input_template": to("buffer.input_template"),
    "data.apply_chat_template": to("generator.use_chat_template", convert=parse_bool),
    "data.image_key": to("buffer.image_key"),
    "data.max_images_per_prompt": to("buffer.max_images_per_prompt", convert=int,
                                     why="0: text prompts only, as there"),
    "actor.freeze_visual_encoder": to("learner.freeze_visual_encoder", convert=parse_bool),
    # loggers
    "logger.wandb.key": note("log in with `wandb login` or WANDB_API_KEY"),
    "logger.wandb.org": note("wandb's default entity is used"),
    "logger.wandb.group": note("runs are not grouped"),
    "logger.wandb.project": to("learner.wandb_project"),
    "logger.wandb.run_name": note("the run is named after run.run_dir"),
    "logger.tensorboard_dir": to("learner.tensorboard", convert=lambda v: True,
                                 why="events go under run.run_dir"),
    "algo.dynamic_filtering_enable": to("buffer.dynamic_filtering", convert=parse_bool),
    "algo.dynamic_filtering_range": to("buffer.dynamic_filtering_range"),
    "use_ms": note("models are local folders"),
}

# the optimizer loop `for prefix in ("actor", "critic")`
for _p, _lr in (("actor", "learner.lr"), ("critic", "learner.critic_lr")):
    TABLE[f"{_p}.optim"] = to(f"extra.{_p}_optim", convert=choose({"adam": "adam"}, "Muon is not supported (AdamW)"),
                              why="adam only")
    for _k in ("muon.lr", "muon.momentum", "muon.ns_steps", "muon.nesterov", "muon.no_nesterov"):
        TABLE[f"{_p}.{_k}"] = note(f"used with --{_p}.optim muon only")
    TABLE[f"{_p}.adam.lr"] = to(_lr, convert=float)
    if _p == "actor":
        TABLE.update({"actor.adam.betas": to("learner.adam_betas"), "actor.adam.eps": to("learner.adam_eps"),
                      "actor.adam.weight_decay": to("learner.weight_decay", convert=float),
                      "actor.lr_scheduler": to("learner.lr_schedule", convert=schedule,
                                               why="cosine_with_min_lr: cosine"),
                      "actor.lr_warmup_ratio": to("extra.lr_warmup_ratio", convert=float,
                                                  why="learner.warmup_steps = ratio x the run's optimizer steps"),
                      "actor.min_lr_ratio": to("learner.min_lr_ratio", convert=float),
                      "actor.max_norm": to("learner.max_grad_norm", convert=float)})
    else:
        TABLE.update({"critic.adam.betas": shared("adam_betas", floats), "critic.adam.eps": shared("adam_eps", float),
                      "critic.adam.weight_decay": shared("weight_decay", float),
                      "critic.lr_scheduler": shared("lr_schedule", schedule),
                      "critic.lr_warmup_ratio": shared("warmup_steps", float),
                      "critic.min_lr_ratio": shared("min_lr_ratio", float),
                      "critic.max_norm": shared("max_grad_norm", float)})

SAME_KEYS = ("eval.dataset", "eval.split", "eval.temperature", "eval.n_samples_per_prompt")
"""OpenRLHF options that are Conveyor keys of the same name and meaning (section `eval:`)."""

# ---- OpenRLHF 0.11's underscore names ------------------------------------------------------------

TAIL = (
    "train.colocate_actor_ref", "train.colocate_critic_reward", "vllm.enable_prefix_caching",
    "vllm.enforce_eager", "ckpt.save_steps", "logger.logging_steps", "ds.zero_stage", "train.enable_ema",
    "train.ema_beta", "ds.zpg", "ds.adam_offload", "ds.use_liger_kernel", "ds.grad_accum_dtype",
    "ds.overlap_comm", "data.disable_fast_tokenizer", "ds.packing_samples", "ds.load_in_4bit",
    "ds.lora.target_modules", "train.num_episodes", "rollout.vllm_generate_batch_size", "train.max_epochs",
    "data.max_len", "data.max_samples", "actor.eps_clip", "actor.eps_clip_low_high", "actor.dual_clip",
    "critic.value_clip", "algo.advantage.lambd", "algo.advantage.gamma", "rollout.top_p", "rollout.temperature",
    "train.seed", "rollout.n_samples_per_prompt", "critic.save_value_network", "actor.policy_loss_type",
    "actor.aux_loss_coef", "reward.overlong_buffer_len", "reward.overlong_penalty_factor",
    "reward.stop_properly_penalty_coef", "ds.ring_attn_size", "ds.value_head_prefix", "train.agent_func_path",
    "data.prompt_split", "data.input_key", "data.label_key", "data.input_template", "data.apply_chat_template",
    "data.image_key", "data.max_images_per_prompt", "actor.freeze_visual_encoder", "actor.lr_scheduler",
    "actor.lr_warmup_ratio", "actor.max_norm",
)
"""0.11 names that are the dotted name's last part (`--zero_stage` is `--ds.zero_stage`)."""
JOINED = (
    "ref.num_nodes", "ref.num_gpus_per_node", "reward.num_nodes", "reward.num_gpus_per_node", "actor.num_nodes",
    "actor.num_gpus_per_node", "critic.num_nodes", "critic.num_gpus_per_node", "vllm.num_engines",
    "vllm.tensor_parallel_size", "vllm.sync_backend", "vllm.sync_with_ray", "vllm.enable_sleep",
    "vllm.gpu_memory_utilization", "eval.steps", "ckpt.path", "ds.tensor_parallel_size",
    "rollout.max_tokens_per_gpu", "train.max_tokens_per_gpu", "rollout.batch_size", "train.batch_size",
    "reward.clip_range", "eval.dataset", "eval.split", "eval.temperature", "eval.n_samples_per_prompt", "use_ms",
)
"""0.11 names that are the dotted name with `_` for `.` (`--ref_num_nodes` is `--ref.num_nodes`)."""
LEGACY: dict[str, str] = {
    **{d.split(".")[-1]: d for d in TAIL}, **{d.replace(".", "_"): d for d in JOINED},
    "colocate_all_models": "train.colocate_all", "async_train": "train.async_enable",
    "partial_rollout": "train.partial_rollout_enable", "save_hf_ckpt": "ckpt.save_hf",
    "disable_ds_ckpt": "ckpt.disable_ds", "max_ckpt_num": "ckpt.max_num", "max_ckpt_mem": "ckpt.max_mem",
    "load_checkpoint": "ckpt.load_enable", "use_ds_universal_ckpt": "ds.use_universal_ckpt",
    "gradient_checkpointing": "actor.gradient_checkpointing_enable",
    "gradient_checkpointing_use_reentrant": "actor.gradient_checkpointing_reentrant",
    "deepspeed_enable_sleep": "ds.enable_sleep", "use_dynamic_batch": "train.dynamic_batch_enable",
    "lora_rank": "ds.lora.rank", "lora_alpha": "ds.lora.alpha", "lora_dropout": "ds.lora.dropout",
    "save_path": "ckpt.output_dir", "micro_rollout_batch_size": "rollout.micro_batch_size",
    "micro_train_batch_size": "train.micro_batch_size", "normalize_reward": "reward.normalize_enable",
    "full_determinism": "train.full_determinism_enable", "freezing_actor_steps": "critic.freezing_steps",
    "kl_target": "algo.kl.target", "kl_horizon": "algo.kl.horizon", "init_kl_coef": "algo.kl.init_coef",
    "kl_estimator": "algo.kl.estimator", "entropy_loss_coef": "actor.entropy_coef",
    "advantage_estimator": "algo.advantage.estimator", "use_kl_loss": "algo.kl.use_loss",
    "no_advantage_std_norm": "algo.advantage.no_std_norm", "ring_head_stride": "ds.ring_attn_head_stride",
    "pretrain": "actor.model_name_or_path", "reward_pretrain": "reward.model_name_or_path",
    "remote_rm_url": "reward.remote_url", "critic_pretrain": "critic.model_name_or_path",
    "prompt_data": "data.prompt_dataset", "prompt_data_probs": "data.prompt_probs",
    "wandb_org": "logger.wandb.org", "wandb_group": "logger.wandb.group",
    "wandb_project": "logger.wandb.project", "wandb_run_name": "logger.wandb.run_name",
    "dynamic_filtering": "algo.dynamic_filtering_enable",
    "dynamic_filtering_reward_range": "algo.dynamic_filtering_range", "actor_learning_rate": "actor.adam.lr",
    "critic_learning_rate": "critic.adam.lr", "learning_rate": "actor.adam.lr",
    "adam_betas": "actor.adam.betas", "l2": "actor.adam.weight_decay",
}
"""Every 0.11 underscore name -> its 0.11.2 dotted name."""

LEGACY_ONLY: dict[str, Spec] = {
    "prompt_max_len": to("generator.prompt_max_len", convert=int),
    "generate_max_len": to("generator.max_new_tokens", convert=int),
    "bf16": to("learner.dtype", convert=bf16),
    "flash_attn": note("attention is PyTorch's (sdpa/eager); the values match up to rounding"),
    "ref_reward_offload": note(SPEED),
    "use_wandb": to("extra.use_wandb", why="wandb on (project learner.wandb_project, else openrlhf_train_ppo)"),
    "use_tensorboard": to("learner.tensorboard", convert=lambda v: True, why="events go under run.run_dir"),
}


def spec(name: str) -> Spec | None:
    """The Spec of an OpenRLHF flag as typed (dotted or underscore), or None."""
    if name in LEGACY_ONLY:
        return LEGACY_ONLY[name]
    dotted = LEGACY.get(name, name)
    if dotted in SAME_KEYS:
        return to(dotted)
    return TABLE.get(dotted)


def names() -> list[str]:
    """Every OpenRLHF name this table knows (dotted ones first)."""
    return [*TABLE, *LEGACY, *LEGACY_ONLY]


def alias(name: str, s: Spec) -> Alias:
    if s.refused or s.only is not UNSET:
        return Alias((f"extra.refused:{name}",))
    if s.shares:
        return Alias((f"extra.shared:{name}",), s.convert)
    if not s.targets:
        return Alias((), str, s.why)
    return Alias(s.targets, s.convert)


class FlagTable(dict):
    """`{flag: Alias}` for `apply_flags`, which also writes the grouped `--help` section."""

    def describe(self) -> list[str]:
        return describe()


ALIASES = FlagTable({n: alias(n, spec(n)) for n in names()})


def describe() -> list[str]:
    """The `--help` section: every flag grouped by kind and by OpenRLHF section, its 0.11 name in
    brackets, with its Conveyor meaning (mapped), why it does nothing (accepted) or why not (refused)."""
    old: dict[str, list[str]] = {}
    for legacy, dotted in LEGACY.items():
        if legacy != dotted:
            old.setdefault(dotted, []).append(legacy)
    rows: dict[str, list[str]] = {"mapped": [], "accepted": [], "refused": []}
    for name, s in [*TABLE.items(), *LEGACY_ONLY.items()]:
        flag = f"--{name}" + "".join(f" [--{o}]" for o in old.get(name, []))
        if s.only is not UNSET or s.shares:
            rows["accepted"].append(f"  {flag}: " + (f"accepted at {s.only!r}; " if s.shares == "" else "") + s.why)
        elif s.refused:
            at = "" if s.default is UNSET else f" (accepted at its default {s.default!r})"
            rows["refused"].append(f"  {flag}: {s.why}{at}")
        elif not s.targets:
            rows["accepted"].append(f"  {flag}: {s.why}")
        else:
            keys = ", ".join(t for t in s.targets if not t.startswith("extra."))
            rows["mapped"].append(f"  {flag}" + (f" -> {keys}" if keys else "") + (f": {s.why}" if s.why else ""))
    return [
        "OpenRLHF train_ppo_ray flags (0.11.2's dotted names, 0.11's underscore names in brackets). Conveyor's",
        "own keys win where a name is both: --eval.dataset, --eval.split, --eval.temperature and",
        "--eval.n_samples_per_prompt are the `eval:` keys, with the same meaning. Flags not given keep",
        "Conveyor's defaults (python -m launch.train_ppo_ray takes OpenRLHF's). Sample counts",
        "(train.batch_size, train.micro_batch_size) become learner.num_mini_batches and",
        "gradient_accumulation_steps; rollout.batch_size counts prompts, as buffer.prompts_per_step.",
        "Mapped, with the same meaning:", *wrap(rows["mapped"]),
        "Accepted, no effect here (a note says so):", *wrap(rows["accepted"]),
        "Refused (the run stops at parse time, naming the flag):", *wrap(rows["refused"]),
    ]


def wrap(rows: list[str]) -> list[str]:
    import textwrap

    return [line for row in rows for line in textwrap.wrap(row, 110, subsequent_indent=" " * 6,
                                                            break_on_hyphens=False)]

