"""The whole run's configuration: one YAML file with a section per role, composed here.

    run:         RunConfig (this file): run folder, mode, how many of each role
    buffer:      buffer.config.BufferConfig
    generator:   actors.config.GeneratorConfig
    scorer:      actors.config.ScorerConfig
    learner:     learner.config.LearnerConfig
    weight_sync: weight_sync.config.WeightSyncConfig
    eval:        buffer.config.EvalConfig (evaluation during training)

Command-line overrides are dotted (`--learner.lr 1e-6`); the flags of OpenRLHF's quick start are
accepted as aliases with the same meaning (`--pretrain`, `--n_samples_per_prompt`, ...). An unknown
flag is an error that suggests the closest known one. Addresses and shared values (the buffer's
port, the policy folder, the run folder) are written into every section that needs them, so each
role can be started alone from the resolved file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Sequence

from pydantic import Field, field_validator

from buffer.reasoning_gym import SCHEME as REASONING_GYM
from common.config import ConfigError, Section, apply_flags, build, is_set, read_yaml, render_help, suggest
from common.curve import Mode as CurveMode
from common.curve import is_loopback
from launch.config import tie_addresses

# OpenRLHF's train_ppo_ray flags (0.11.2 and 0.11's names): mapped, accepted or refused, flag by flag
from launch.openrlhf.flags import ALIASES
from launch.openrlhf.resolve import resolve as resolve_openrlhf


class RunConfig(Section):
    """Section `run:`: what the local launcher starts and where it writes."""

    section: ClassVar[str] = "run"

    run_dir: str = "runs/run"
    """Folder for logs (one file per role), metrics, checkpoints and the resolved config."""
    mode: Literal["async", "sync"] = "async"
    """`async`: generators run ahead of the learner within `buffer.max_staleness` versions.
    `sync`: lockstep (generate a batch, score, train, sync weights, repeat): max_staleness is forced to 0."""
    num_generators: int = Field(1, ge=1)
    """Generator processes (each one vLLM engine of `generator.tensor_parallel_size` workers)."""
    num_scorers: int = Field(1, ge=1)
    """Scorer processes sharing the scoring work."""
    learner_ranks: int = Field(1, ge=1)
    """DeepSpeed learner ranks (started with torchrun when more than one)."""
    base_port: int = 0
    """First of the 5 consecutive ports the run uses (buffer: 4, weight sync: 1); 0 picks free ones."""
    max_wall_s: float = 0.0
    """Stop the run (as a failure) after this many seconds; 0: no limit."""
    generator_cpus: str = ""
    """CPU list the generators are pinned to (taskset syntax, e.g. `0`); empty: no pinning."""
    learner_cpus: str = ""
    """CPU list the learner ranks are pinned to; empty: no pinning."""
    threads_per_role: int = 0
    """OMP/MKL threads per process (0: leave the libraries' defaults)."""
    ready_timeout_s: float = 600.0
    """How long a role may take to start (vLLM engines and DeepSpeed take tens of seconds on CPU)."""
    auto_resume: int = Field(0, ge=0)
    """After a learner, buffer or weight-sync crash, restart the whole run from its last checkpoint
    by itself, up to this many times (said on the terminal and in logs/launcher.log); 0: stop with
    the role's exit code and the command that resumes."""
    max_restarts: int = Field(3, ge=0)
    """launch.local: times each generator or scorer is started again after it dies (launch.ray
    uses ray.max_restarts)."""
    restart_delay_s: float = Field(2.0, ge=0)
    """Seconds between a generator's or scorer's death and its restart."""
    stall_timeout_s: float = Field(1200.0, ge=0)
    """Stop the run (exit code 8) when the learner finishes no step for this many seconds, and say
    why (the buffer's diagnosis); 0: never."""
    disk_wait_s: float = Field(600.0, ge=0)
    """With `auto_resume`: after a role ran out of disk space (exit code 9), wait at most this many
    seconds for `disk_min_free_mb` to be free on the run's filesystems (its folder, buffer.state_dir),
    then resume; past it, stop with code 9. 0: resume only if the space is free already."""
    disk_min_free_mb: float = Field(1024.0, ge=0)
    """The free space (MB, 10^6 bytes) a run out of disk waits for before it resumes by itself: at
    least a checkpoint's size, or the run fills the disk again at its next save."""

    gpus: str = "auto"
    """GPUs the run may use on each machine: `auto` (every GPU nvidia-smi lists, or
    $CONVEYOR_FAKE_GPUS for planning: "8", "2x8", "8:141"), `none` (every role on the CPU), or
    device indices such as `0,1,2,3`. launch/devices/ gives each role its own (`--plan` prints it)."""
    gpu_memory_gb: float = Field(0.0, ge=0)
    """Memory of each GPU in GiB for the plan's memory check; 0: as nvidia-smi reports it."""
    placement: Literal["auto", "separate", "colocate", "colocate_scorers"] = "auto"
    """How roles share GPUs (launch/devices/plan.py): `separate` (every process on GPUs of its own),
    `colocate` (engines and scorers on the learner's GPUs, with memory shares: OpenRLHF's
    --colocate_all_models), `colocate_scorers` (scorers on the learner's GPUs: --colocate_actor_ref,
    --colocate_critic_reward), `auto` (separate when the GPUs suffice, else the next that fits)."""
    model_params_b: float = Field(0.0, ge=0)
    """The policy's size in billions of parameters, for the memory check when its folder is not on
    this machine (0: read from the folder; unknown: the check is skipped, and the plan says so)."""

    curve: CurveMode = "auto"
    """CurveZMQ on every socket of the run (common/curve.py; sets buffer.curve and weight_sync.curve):
    `auto` = on exactly when the buffer or the weight-sync service binds anything but loopback,
    `on` always, `off` never (a trusted network). On, the launcher makes the run's keys in
    `<run_dir>/keys` (0700) and hands each role its identity."""

    @field_validator("base_port")
    @classmethod
    def _base_port(cls, port: int) -> int:
        if port and not 1024 <= port < 65530:
            raise ValueError("must be 0 or in [1024, 65530)")
        return port


def section_classes() -> dict[str, type]:
    from actors.config import GeneratorConfig, ScorerConfig
    from buffer.config import BufferConfig, EvalConfig
    from learner.config import LearnerConfig
    from weight_sync.config import WeightSyncConfig

    return {"run": RunConfig, "buffer": BufferConfig, "generator": GeneratorConfig, "scorer": ScorerConfig,
            "learner": LearnerConfig, "weight_sync": WeightSyncConfig, "eval": EvalConfig}


def run_help(doc: str) -> str:
    """`--help` of a launcher that reads the whole run config: every section's keys, the aliases."""
    return render_help(doc, section_classes(), ALIASES)


@dataclass
class Run:
    """The composed configuration: one dataclass per section."""

    run: RunConfig
    buffer: Any
    generator: Any
    scorer: Any
    learner: Any
    weight_sync: Any
    eval: Any
    extra: dict = field(default_factory=dict)  # OpenRLHF sample counts, resolved in `finish`
    explicit: dict = field(default_factory=dict)  # the keys the user set (file + flags), as a tree

    def sections(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in section_classes()}

    def to_dict(self) -> dict:
        """Every section as plain values, the SECRETS blanked (this is what the resolved config
        file holds; the roles that need a secret get it in their environment: `secret_env`)."""
        out = {name: cfg.to_dict() for name, cfg in self.sections().items()}
        for section, key, _ in SECRETS:
            if out[section].get(key):
                out[section][key] = ""
        return out

    def stale_state(self) -> str:
        """Why starting this run would mix with an earlier one in the same folder ("" when it would not)."""
        state = Path(self.buffer.state_dir)
        if state.is_dir() and any(state.iterdir()) and not self.learner.resume:
            return (f"{self.run.run_dir} holds an earlier run (buffer state in {state}): pass "
                    f"--learner.resume true to continue it, or choose a new --run.run_dir")
        return ""


def load_run_config(path: str | Path | None, argv: Sequence[str] = (), paths: bool = True) -> Run:
    """Read the YAML file, apply overrides and aliases, tie the sections together and check them
    (`paths` False: all but the existence of the model and prompt paths, as `--plan` does for a
    run meant for another machine)."""
    classes = section_classes()
    tree = read_yaml(path)
    for name in tree:
        if name not in classes:
            raise ConfigError(f"{path}: unknown section {name!r}{suggest(name, list(classes))}")
    extra = apply_flags(tree, argv, classes, ALIASES)
    built = {name: build(cls, tree.get(name), name) for name, cls in classes.items()}
    run = Run(**built, extra=extra, explicit=tree)
    finish(run, explicit=tree, paths=paths)
    return run


def finish(run: Run, explicit: dict | None = None, paths: bool = True) -> None:
    """Tie the sections together (addresses, policy, run folder) and run every cross-field check.

    Idempotent: each derived value is computed from keys `finish` never writes (the aliases in
    `run.extra`, the sample counts, what the user set), so applying it again changes nothing."""
    explicit = explicit or {}
    r, b, g, s, l, w = run.run, run.buffer, run.generator, run.scorer, run.learner, run.weight_sync
    if run.extra:
        # OpenRLHF counts samples: train_batch_size per optimizer step, micro_train_batch_size per
        # forward. With --rollout_batch_size (prompts per step) a step holds several optimizer steps.
        n = b.n_samples_per_prompt
        if "train_batch_size" in run.extra:
            tbs = run.extra["train_batch_size"]
            if "rollout_batch_size" in run.extra:
                if tbs < 1 or (b.prompts_per_step * n) % tbs:
                    raise ConfigError(f"--train_batch_size={tbs} does not divide the {b.prompts_per_step * n} "
                                      f"samples of a step (--rollout_batch_size x n_samples_per_prompt)")
                l.num_mini_batches = b.prompts_per_step * n // tbs
            elif tbs % n:
                raise ConfigError(f"--train_batch_size={tbs} is not a multiple of n_samples_per_prompt={n}")
            else:
                b.prompts_per_step = tbs // n
        if "micro_train_batch_size" in run.extra:
            per_rank = b.prompts_per_step * n // max(1, r.learner_ranks // l.sequence_parallel)  # (per share)
            micro = run.extra["micro_train_batch_size"]
            if micro < 1 or per_rank % micro:
                raise ConfigError(f"--micro_train_batch_size={micro} does not divide the {per_rank} samples "
                                  f"each of {r.learner_ranks} rank(s) trains on per step")
            l.gradient_accumulation_steps = per_rank // micro // max(1, l.num_mini_batches)
            if l.gradient_accumulation_steps < 1:
                raise ConfigError(f"--micro_train_batch_size={micro} x learner.num_mini_batches="
                                  f"{l.num_mini_batches} exceeds the {per_rank} samples per rank")
    resolve_openrlhf(run, explicit)  # the OpenRLHF flags that need others, and the refused ones
    if w.mode == "interrupt" and g.engine == "vllm":
        g.async_engine = True  # loading into a running batch needs vLLM's AsyncLLM
    if r.mode == "sync":
        b.max_staleness = 0
        l.sync_every = 1
    if not g.model:
        g.model = l.model_path
    if not l.model_path:
        l.model_path = g.model
    l.run_dir = str(Path(r.run_dir))
    if not b.state_dir:
        b.state_dir = str(Path(r.run_dir) / "buffer_state")
    ev = run.eval
    if ev.dataset and not is_set(explicit, "eval.samples_dir"):
        ev.samples_dir = str(Path(r.run_dir) / "eval")
    if not is_set(explicit, "learner.eval_every"):
        l.eval_every = ev.every if ev.dataset else 0
    tie_addresses((g, s, l), b, w)
    secure = r.curve == "on" or (r.curve == "auto" and not (is_loopback(b.host) and is_loopback(w.host)))
    b.curve = w.curve = "on" if secure else "off"  # (one decision: every role holds the same keys or none)
    if not is_set(explicit, "generator.lora_rank"):
        g.lora_rank = l.lora_rank  # the generator serves the adapters the learner trains
    if not is_set(explicit, "generator.max_images_per_prompt"):
        g.max_images_per_prompt = max(1, b.max_images_per_prompt)  # vLLM's image limit: what the buffer issues
    if not is_set(explicit, "generator.record_routes"):
        g.record_routes = l.routing_replay != "off"  # the learner replays the routes the generators record
    if not is_set(explicit, "scorer.max_new_tokens"):
        s.max_new_tokens = g.max_new_tokens
    if not is_set(explicit, "learner.temperature"):
        l.temperature = g.temperature if g.temperature > 0 else 1.0
    if l.kl_coef > 0 and not s.reference and not l.lora_rank:  # (LoRA: the learner's base is the reference)
        s.reference = l.model_path
    if g.env or g.agent:  # the episode's reward (environment or agent code); a reward function adds to it if named
        if not is_set(explicit, "scorer.kinds"):
            s.kinds = [k for k in s.kinds if k != "reward_fn" or s.reward_fn]
        if "env" not in s.kinds:
            s.kinds = [*s.kinds, "env"]
    if s.reference and "reference" not in s.kinds:
        s.kinds = [*s.kinds, "reference"]
    if s.reward_model and "reward_model" not in s.kinds:
        s.kinds = [*s.kinds, "reward_model"]

    errors = []
    for cfg in run.sections().values():
        try:
            cfg.validate()
        except ConfigError as e:
            errors.append(str(e))
    if not l.model_path:
        errors.append("no policy: set learner.model_path (or --pretrain)")
    elif paths and not Path(l.model_path).is_dir():
        errors.append(f"learner.model_path={l.model_path!r} is not a folder")
    if ev.every and not ev.dataset:
        errors.append(f"eval.every={ev.every} needs eval.dataset (the prompts to evaluate on)")
    if l.eval_every and l.eval_every % l.sync_every:
        errors.append(f"eval.every={l.eval_every} must be a multiple of learner.sync_every={l.sync_every}: the "
                      f"generators only ever hold the versions the learner publishes")
    if ("teacher" in s.kinds) != (l.distill_coef > 0):
        errors.append(f"on-policy distillation needs both a teacher scorer and learner.distill_coef > 0 "
                      f"(scorer.kinds={s.kinds}, learner.distill_coef={l.distill_coef})")
    elif "teacher" in s.kinds and paths and s.teacher and l.model_path:
        from actors.config import tokenizer_mismatch

        why = tokenizer_mismatch(l.model_path, s.teacher)
        if why:
            errors.append(f"scorer.teacher={s.teacher!r} does not share the policy's tokenizer (learner.model_path="
                          f"{l.model_path!r}): {why}; distillation compares their log-probs token by token")
    if s.tasks and b.columns is not None and s.task_key not in b.columns:
        errors.append(f"scorer.tasks picks each row's reward by its column {s.task_key!r} (scorer.task_key), "
                      f"but buffer.columns={b.columns} does not carry it to the scorers")
    shares = r.learner_ranks // l.sequence_parallel  # (a sequence-parallel group trains one share)
    if r.learner_ranks % l.sequence_parallel:
        errors.append(f"learner.sequence_parallel={l.sequence_parallel} does not divide run.learner_ranks="
                      f"{r.learner_ranks} (each group of ranks shares the sequences of one share)")
    elif b.prompts_per_step % shares:
        errors.append(f"buffer.prompts_per_step={b.prompts_per_step} is not divisible by the {shares} learner "
                      f"share(s) (run.learner_ranks={r.learner_ranks} / learner.sequence_parallel="
                      f"{l.sequence_parallel}): each share is whole prompt groups")
    else:
        per_rank = b.prompts_per_step // shares * b.n_samples_per_prompt
        need = l.num_mini_batches * l.gradient_accumulation_steps
        if per_rank < need:
            errors.append(f"each rank trains on {per_rank} samples per step (buffer.prompts_per_step="
                          f"{b.prompts_per_step} x n_samples_per_prompt={b.n_samples_per_prompt} / "
                          f"{shares} share(s)), fewer than learner.num_mini_batches x "
                          f"gradient_accumulation_steps = {need}")
    datasets = [p.strip() for p in b.prompts.split(",") if p.strip()]  # files or dataset folders
    for p in datasets if paths else ():
        if not Path(p).exists() and not p.startswith(REASONING_GYM):
            errors.append(f"buffer.prompts: {p!r} is neither a file nor a folder nor a {REASONING_GYM}<task> spec "
                          f"(buffer.prompts={b.prompts!r})")
    if not datasets:
        errors.append("no prompts: set buffer.prompts (or --prompt_data) to a JSONL or Parquet file "
                      "or a dataset folder")
    elif b.prompt_probs is not None and len(b.prompt_probs) != len(datasets):
        errors.append(f"buffer.prompt_probs={b.prompt_probs} needs one share per dataset of buffer.prompts "
                      f"({len(datasets)}: {datasets})")
    if errors:
        raise ConfigError("; ".join(errors))


def assign_ports(run: Run, base: int) -> None:
    """Buffer on base..base+3, weight sync on base+4, written into every section that dials them."""
    run.buffer.port = base
    run.weight_sync.port = base + 4
    finish(run, explicit=run.explicit)


SECRETS = (("scorer", "remote_token", "CONVEYOR_RM_TOKEN"), ("scorer", "judge_token", "CONVEYOR_JUDGE_TOKEN"))
"""(section, key, environment variable): values never written to a file; the role reads the variable."""


def secret_env(run: Run) -> dict[str, str]:
    """The environment that carries the run's SECRETS to its roles (those set only)."""
    return {env: str(getattr(getattr(run, section), key)) for section, key, env in SECRETS
            if getattr(getattr(run, section), key)}


def write_resolved(run: Run, path: str | Path) -> Path:
    import yaml

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# resolved by launch.local: every role reads its section of this file\n"
                    + yaml.safe_dump(run.to_dict(), sort_keys=False))
    return path
