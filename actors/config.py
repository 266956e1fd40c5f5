"""Configuration of the generator and scorer roles (sections `generator:` and `scorer:`).

Light on purpose (no torch, no vllm): `python -m launch.generator --help` answers at once.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from buffer.config import BufferAddress
from common.moved import current_name
from weight_sync.config import WeightSyncAddress

ENGINES = ("vllm", "transformers")
SCORER_KINDS = ("reward_fn", "reward_model", "remote", "reference", "env", "teacher", "judge")
Dtype = Literal["float32", "bfloat16", "float16"]


class GeneratorConfig(WeightSyncAddress, BufferAddress):
    """Section `generator:` of the run config (the buffer and weight-sync addresses come from
    `BufferAddress` and `WeightSyncAddress`)."""

    section: ClassVar[str] = "generator"

    model: str = ""
    """Model folder (any `AutoModelForCausalLM` folder vLLM can load, or a Qwen2-VL-family
    vision-language model's): the policy's initial weights."""
    tokenizer: str = ""
    """Tokenizer folder; empty: the model folder."""
    engine: Literal["vllm", "transformers"] = "vllm"
    """Generation backend: `vllm` (default), or `transformers` (a plain sampling loop, for debugging)."""
    dtype: Dtype = "float32"
    """Weights dtype of the engine (`float32`, `bfloat16`, `float16`)."""
    seed: int = 0
    """Engine seed (vLLM's global seed, the transformers backend's torch generator)."""
    device: str = "cpu"
    """transformers backend only: the torch device it runs on."""
    tensor_parallel_size: int = Field(1, ge=1)
    """vLLM: GPUs one engine spans."""
    gpu_memory_utilization: float = Field(0.0, ge=0, le=1)
    """vLLM: fraction of accelerator memory for weights + KV cache (on CPU: of host memory, for the
    KV cache). 0 means auto: 0.9 with CUDA, 0.05 on CPU (where VLLM_CPU_KVCACHE_SPACE also applies)."""
    max_model_len: int = Field(0, ge=0)
    """vLLM: longest prompt + completion the engine accepts; 0: the model config's limit."""
    worker_extension: str = "actors.engines.vllm.worker.WorkerExtension"
    """vLLM: dotted path of the worker extension class that receives weights (`receive_weights`).
    Skipped, with a warning, when its module cannot be found."""
    cpu_linear: Literal["auto", "plain", "packed"] = "auto"
    """vLLM's CPU build: `packed` = its linear layers compute from a copy of their weights repacked
    for oneDNN (vLLM's default), so every weight round repacks them; `plain` = torch's linear on
    the weights as they are, so a round is a copy into them at memory speed; `auto` = plain for
    float32 (MKL's sgemm: as fast as the packed kernel here, see bench/generation.py
    --cpu-linear), packed otherwise. GPU engines ignore it."""
    lora_rank: int = Field(0, ge=0)
    """The learner trains LoRA adapters of this rank (tied from learner.lora_rank): weight rounds
    then carry only the adapter, which vLLM serves with its LoRA support on (the CPU build too)
    and the transformers backend merges into its weights. 0: rounds carry the full weights."""
    record_routes: bool = False
    """vLLM, a mixture-of-experts policy: record the experts every token is routed to and send them
    with the rollout (tied from learner.routing_replay=rollout). The engine then runs without
    prefix caching (a cached prefix is never routed again). Single-turn rollouts only."""
    async_engine: bool = False
    """vLLM: drive vLLM's `AsyncLLM` from a background thread instead of the offline `LLM`. Needed
    for `weight_sync.mode: interrupt`: the generator keeps polling the weight-sync service while a
    batch generates, and a new version is loaded into the running batch (pause, load, resume; each
    token records the version that sampled it). With the offline engine a generator loads weights
    between batches whatever the mode (it logs a warning in `interrupt` mode)."""

    temperature: float = Field(1.0, ge=0, allow_inf_nan=False)
    """Sampling temperature; 0 = greedy."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1 = off)."""
    top_k: int = Field(0, ge=0)
    """Keep the k most likely tokens (0 = off)."""
    max_new_tokens: int = Field(128, ge=1)
    """Longest completion; one that reaches it ends with finish_reason `length`."""
    max_len: int = Field(0, ge=0)
    """Prompt + completion per sample at most (OpenRLHF's `--data.max_len` without
    `--rollout.max_new_tokens`): a completion ends (`length`) at max_len - its prompt's tokens (an
    image prompt's as the engine expanded them), or at max_new_tokens if sooner; 0: at
    max_new_tokens. Single-turn samples (an episode has max_context_tokens)."""
    stop_token_ids: list[int] = Field(default_factory=list)
    """Token ids that end a completion besides the tokenizer's eos (kept in the completion)."""

    prompt_max_len: int = Field(512, ge=1)
    """Longest prompt in tokens (after the chat template; an image counts as its one placeholder,
    which the engine expands)."""
    long_prompt: Literal["truncate", "refuse"] = "truncate"
    """What to do with a longer prompt: `truncate` keeps its last prompt_max_len tokens; `refuse`
    reports the group failed to the buffer (it is counted there and not issued again). A prompt
    with images is refused either way (a cut could split an image)."""
    use_chat_template: bool = True
    """Wrap each prompt as one user message in the tokenizer's chat template, when it has one."""
    max_images_per_prompt: int = Field(1, ge=1)
    """A vision-language policy (Qwen2-VL family): images one prompt may hold (vLLM's
    `limit_mm_per_prompt`, which sizes the engine's encoder cache); a group with more is reported
    failed. Text policies ignore it."""

    env: str = ""
    """Multi-turn episodes: the environment each sample plays against (actors/envs/loader.py `load_env`: a
    registered name such as `guess`, `file.py:Class`, `module:Class`, or an OpenRLHF agent file);
    empty: one completion per sample. Each policy turn is at most max_new_tokens long. Not with `agent`."""
    env_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the environment's class."""
    task_envs: dict[str, str] = Field(default_factory=dict)
    """Several tasks in one run: task name -> the environment its rows play (as `env`); rows of other
    tasks play `env` (or none). Each row's task is its column `task_key` (actors/tasks.py `TaskEnvs`);
    score them with `scorer.tasks: {TASK: env}`. Not with `agent`."""
    task_env_args: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Each task environment's keyword arguments (task name -> arguments)."""
    task_key: str = "task"
    """The dataset column naming a row's task (as scorer.task_key)."""
    max_turns: int = Field(4, ge=1)
    """Policy turns per episode at most; an episode cut there ends with finish_reason `length`."""
    max_context_tokens: int = Field(0, ge=0)
    """Prompt plus every turn of an episode at most; 0: prompt_max_len + max_turns x max_new_tokens."""
    env_timeout_s: float = Field(30.0, gt=0)
    """One environment call (reset or step) may take this long; past it the episode fails, counted."""
    agent: str = ""
    """Agent code that plays each sample through the generator's OpenAI-compatible endpoint
    (actors/agents/openai_server.py): `path/file.py:function` or `package.module:function`, a function
    `async def agent(base_url, row, **agent_args) -> float | None` written against the `openai`
    client; each sample is a session whose token ids become one rollout when its reward is in.
    Empty: off. Not with `env`. The session's turns are sampled with this section's settings."""
    agent_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the agent function."""
    openai_host: str = "127.0.0.1"
    """Address the OpenAI endpoint listens on (with `agent`)."""
    openai_port: int = Field(0, ge=0, le=65535)
    """Its port; 0: one the system picks (the agents are given their base_url)."""
    session_timeout_s: float = Field(300.0, gt=0)
    """A session whose reward has not come this long after its agent started is expired (counted;
    its group is given up as a failed episode's is)."""
    groups_per_lease: int = Field(4, ge=1)
    """Prompt groups asked for in one lease; all their samples are generated as one engine batch."""
    worker_id: str = ""
    """Name reported to the buffer and the weight-sync service; empty: `gen-<host>-<pid>`."""
    request_timeout_s: float = Field(30.0, gt=0)
    """One buffer request waits this long for its answer."""
    buffer_patience_s: float = 300.0
    """Give up (exit 1) when the buffer, or the weight-sync service, has not answered for this long in
    a row (restarting, or out of reach: a network partition)."""
    renew_fraction: float = Field(0.33, gt=0, lt=1)
    """A lease is renewed every renew_fraction * ttl_s while its batch is being generated."""
    renew_after_push_s: float = Field(60.0, ge=0)
    """Keep renewing a lease this long after its rollouts were pushed, until the buffer reports it
    answered: the buffer holds a lease open until the scored samples arrive. 0 = stop at the push."""
    max_batches: int = Field(0, ge=0)
    """Stop after this many leases (0 = until the buffer says done or a signal comes)."""
    log_every_s: float = 10.0
    """Throughput is logged this often."""

    weight_sync_timeout_s: float = 60.0
    """Before the first lease, wait this long for the current weights (when any were published)."""
    weight_sync_poll_s: float = Field(0.2, gt=0)
    """`interrupt` mode (with async_engine): ask the service for a round this often while a batch
    generates. Well below `weight_sync.join_timeout_s`, or the learner's broadcasts go on without us."""

    def problems(self) -> list[str]:
        errs = []
        if self.max_len and self.prompt_max_len >= self.max_len:
            errs.append(f"generator.prompt_max_len={self.prompt_max_len} leaves no completion within "
                        f"max_len={self.max_len}")
        if self.max_model_len and (self.max_len or self.prompt_max_len + self.max_new_tokens) > self.max_model_len:
            errs.append(f"generator.prompt_max_len={self.prompt_max_len} + max_new_tokens={self.max_new_tokens} "
                        f"exceeds max_model_len={self.max_model_len}")
        if self.buffer_patience_s < self.request_timeout_s:
            errs.append(f"generator.request_timeout_s={self.request_timeout_s} must be <= "
                        f"buffer_patience_s={self.buffer_patience_s}")
        if self.async_engine and self.engine != "vllm":
            errs.append(f"generator.async_engine=true needs generator.engine='vllm' (got {self.engine!r})")
        if self.task_envs and self.agent:
            errs.append("generator.task_envs and generator.agent: a run's samples play environments or agent code, "
                        "not both")
        unknown = sorted(set(self.task_env_args) - set(self.task_envs))
        if unknown:
            errs.append(f"generator.task_env_args names {unknown}, which generator.task_envs does not "
                        f"({sorted(self.task_envs)})")
        if self.record_routes and (self.engine != "vllm" or self.env or self.agent or self.task_envs):
            errs.append("generator.record_routes (learner.routing_replay=rollout) needs generator.engine='vllm' and "
                        "single-turn samples (no env, task_envs or agent): an episode's turns are separate requests, "
                        "whose routes are not joined")
        if self.engine == "vllm" and self.lora_rank > 512:
            errs.append(f"generator.lora_rank={self.lora_rank} (learner.lora_rank): vLLM serves LoRA adapters "
                        f"up to rank 512")
        if self.env and self.agent:
            errs.append(f"generator.env={self.env!r} and generator.agent={self.agent!r}: give one (an environment "
                        f"the generator plays, or agent code that plays through the OpenAI endpoint)")
        if self.agent and (":" not in self.agent or not self.agent.rpartition(":")[2].isidentifier()):
            errs.append(f"generator.agent={self.agent!r} must be path/file.py:function or package.module:function")
        return errs

    def missing(self) -> list[str]:
        return [] if self.model else ["generator.model is empty: give a model folder"]

    @field_validator("worker_extension")
    @classmethod
    def _current_extension(cls, v: str) -> str:
        return current_name(v)  # (a name an earlier run stored: common/moved.py)


class ScorerConfig(BufferAddress):
    """Section `scorer:` of the run config. Each kind in `kinds` adds a component to the reward
    (`scores[kind]`, summed with its weight into `reward`), except `reference`, which adds
    `ref_logprobs` for the learner's KL term."""

    section: ClassVar[str] = "scorer"

    kinds: list[str] = Field(default_factory=lambda: ["reward_fn"])
    """What this process computes, any of `reward_fn`, `reward_model`, `remote`, `reference`, `env`
    (a multi-turn episode's environment reward, `Rollout.env_reward`; added by the run config when
    the generators play an environment)."""

    reward_fn: str = ""
    """Path of a Python file that defines `reward_fn(prompts, completions, labels) -> list[float]`, or
    OpenRLHF's `reward_func(queries, prompts, labels)` returning a tensor or `{"rewards", "scores",
    "extra_logs"}` (`reward_fn` wins if both are defined; see actors/reward_files.py); or a built-in's
    name: `math`, `format`, `code` (actors/verifiers/). Either gets the row's other columns as
    keyword arguments (buffer.columns)."""
    tasks: dict[str, str] = Field(default_factory=dict)
    """Several tasks in one run: task name -> its reward file or built-in, or `env` (the reward of the
    episode its environment played: generator.task_envs); each row picks its task by the column
    `task_key`, and scorer.reward_fn (if set) scores rows of any other task (actors/tasks.py)."""
    task_key: str = "task"
    """The dataset column naming a row's task (`task`, `data_source`, ...)."""
    task_options: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Each task's options for its reward file's configure() (task name -> options)."""
    reward_fn_options: dict[str, Any] = Field(default_factory=dict)
    """Options for the reward file's `configure(options)`, called once when its worker starts (a
    built-in's: see its module, e.g. `{extract: [boxed, last_number]}` for `math`)."""
    reward_fn_weight: float = Field(1.0, allow_inf_nan=False)
    """Weight of the reward function's score in `reward`."""
    reward_fn_timeout_s: float = Field(60.0, gt=0, allow_inf_nan=False)
    """One call of the reward function (a message's samples, batched) may take this long; past it the
    worker process running it is killed (and restarted for the next call) and the samples fail."""

    reward_model: str = ""
    """An `AutoModelForSequenceClassification` folder (one label); the score of the last token of
    prompt + completion text is the reward."""
    reward_model_weight: float = Field(1.0, allow_inf_nan=False)
    """Weight of the reward model's score in `reward`."""
    reward_model_max_len: int = Field(1024, ge=2)
    """Prompt + completion tokens the reward model sees at most (the tail is kept)."""
    reward_normalize: bool = False
    """The reward model's score as (raw - mean) / std with the `mean` and `std` its config.json holds
    (OpenRLHF's reward model training stores them; `--reward.normalize_enable`); a folder without them
    is refused at start."""

    remote_url: str | list[str] = ""
    """HTTP endpoint taking POST `{"prompts", "completions", "labels"}` and answering `{"rewards": [...]}`
    (`remote_protocol` names the other protocol); several (a list, or comma-separated) share each
    message, one contiguous shard per URL (`remote_urls`)."""
    remote_weight: float = Field(1.0, allow_inf_nan=False)
    """Weight of the remote reward in `reward`."""
    remote_timeout_s: float = Field(30.0, gt=0)
    """One HTTP request waits this long."""
    remote_token: str = ""
    """A bearer token sent with each request (a `launch.serve_rm` started with one); empty: the
    environment's CONVEYOR_RM_TOKEN, if set."""
    remote_retries: int = Field(3, ge=1)
    """Attempts per batch before its samples are marked failed."""
    remote_backoff_s: float = Field(0.5, ge=0)
    """Wait before the second attempt; doubled before each later one."""

    # ---- OpenRLHF's reward protocol -----------------------------------------------------------
    remote_protocol: Literal["conveyor", "openrlhf"] = "conveyor"
    """The remote reward's request: `conveyor` (`{"prompts", "completions", "labels"}`) or `openrlhf`
    (`{"query", "prompts", "labels"}`, query = prompt + completion text, as OpenRLHF's `--remote_rm_url`
    servers read it). Either way the answer is `{"rewards"}`, optionally with `scores` (judged by the
    buffer's dynamic filtering instead of the reward) and `extra_logs` (logged per step)."""
    tokenizer: str = ""
    """The policy's tokenizer folder, for OpenRLHF's reward texts (a `reward_func` file, the `openrlhf`
    protocol): queries and prompts decoded from the token ids with special tokens kept, as OpenRLHF
    does. Empty: the prompt's text and prompt + completion text."""

    reference: str = ""
    """The frozen reference model's folder (usually the policy's initial weights)."""
    judge_url: str = ""
    """An LLM judge (kind `judge`, actors/judge.py): an OpenAI-compatible base URL (`http://host:8000/v1`:
    a vLLM server, a hosted API, the generator's own endpoint) asked to grade each prompt + response."""
    judge_model: str = ""
    """The judge's model name; empty: the first id its `/models` lists."""
    judge_template: str = ""
    """The rubric, with `{prompt}`, `{response}` and optionally `{label}`; the judge's answer must end
    with `Score: N` (0..judge_max_score). Empty: a 0-10 helpfulness and correctness rubric."""
    judge_max_score: float = Field(10.0, gt=0, allow_inf_nan=False)
    """The grade's top; the reward is grade / judge_max_score."""
    judge_weight: float = Field(1.0, allow_inf_nan=False)
    """Weight of the judge's reward in `reward`."""
    judge_timeout_s: float = Field(60.0, gt=0)
    """One request waits this long."""
    judge_retries: int = Field(3, ge=1)
    """Attempts per sample (a timeout, a 5xx or 429, an answer without a grade) before it fails."""
    judge_concurrency: int = Field(8, ge=1)
    """Requests in flight at once (one conversation per request)."""
    judge_max_tokens: int = Field(256, ge=1)
    """The judge's answer length."""
    judge_token: str = ""
    """A bearer token for the judge's endpoint (never written to config.yaml); empty: the environment's
    CONVEYOR_JUDGE_TOKEN, if set."""
    teacher: str = ""
    """On-policy distillation: the teacher model's folder (kind `teacher`); its log-probs of the
    student's sampled tokens travel as `teacher_logprobs` to the learner (learner.distill_coef). It
    must share the policy's tokenizer (checked at start)."""

    overlong_buffer_len: int = Field(0, ge=0)
    """DAPO's soft overlong punishment: a completion longer than max_new_tokens - overlong_buffer_len
    gets a penalty growing linearly to overlong_penalty_factor at max_new_tokens (the reward
    component `overlong`, <= 0); 0: off."""
    overlong_penalty_factor: float = Field(1.0, ge=0, allow_inf_nan=False)
    """The penalty at the length limit."""
    max_new_tokens: int = Field(128, ge=1)
    """The generators' completion limit the overlong punishment counts from (taken from the
    `generator:` section unless set here)."""

    dtype: Dtype = "float32"
    """Dtype the reward and reference models are loaded in."""
    device: str = "cpu"
    """Torch device of the reward and reference models."""
    batch_size: int = Field(16, ge=1)
    """Sequences per forward pass of the reward and reference models."""

    poll_s: float = Field(1.0, gt=0)
    """Wait this long for rollouts before checking for a stop signal again."""
    log_every_s: float = 10.0
    """Throughput and failure counts are logged this often."""
    worker_id: str = ""
    """Name in logs; empty: `scorer-<host>-<pid>`."""

    @field_validator("kinds")
    @classmethod
    def _kinds(cls, kinds: list[str]) -> list[str]:
        unknown = [k for k in kinds if k not in SCORER_KINDS]
        if unknown:
            raise ValueError(f"has unknown {unknown}; known: {list(SCORER_KINDS)}")
        if not kinds:
            raise ValueError("is empty: list at least one of " + ", ".join(SCORER_KINDS))
        if len(set(kinds)) != len(kinds):
            raise ValueError("lists a kind twice")
        return kinds

    @field_validator("remote_url")
    @classmethod
    def _url(cls, url: str | list[str]) -> str | list[str]:
        bad = [u for u in (url.split(",") if isinstance(url, str) else url) if u.strip()
               and not u.strip().startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"{bad[0]!r} must start with http:// or https://")
        return url

    @property
    def remote_urls(self) -> list[str]:
        """`remote_url` as a list: a comma-separated string (as a flag gives it) split."""
        urls = self.remote_url.split(",") if isinstance(self.remote_url, str) else self.remote_url
        return [u.strip() for u in urls if u.strip()]

    def problems(self) -> list[str]:
        from actors.verifiers import resolve

        errs = []
        if self.overlong_buffer_len >= self.max_new_tokens:
            errs.append(f"scorer.overlong_buffer_len={self.overlong_buffer_len} must be < max_new_tokens="
                        f"{self.max_new_tokens}")
        for key, value in ([("reward_fn", self.reward_fn)] if self.reward_fn else []) + \
                [(f"tasks.{t}", v) for t, v in self.tasks.items() if v != "env"]:
            try:
                resolve(value)
            except ValueError as e:
                errs.append(str(e).replace("scorer.reward_fn=", f"scorer.{key}="))
        if self.judge_url and not self.judge_url.startswith(("http://", "https://")):
            errs.append(f"scorer.judge_url={self.judge_url!r} must be an http(s) URL (an OpenAI-compatible base)")
        if self.judge_template:
            from actors.judge import check_template

            try:
                check_template(self.judge_template)
            except ValueError as e:
                errs.append(str(e))
        unknown = sorted(set(self.task_options) - set(self.tasks))
        if unknown:
            errs.append(f"scorer.task_options names {unknown}, which scorer.tasks does not ({sorted(self.tasks)})")
        return errs

    def missing(self) -> list[str]:
        needs = {"reward_fn": ("reward_fn", self.reward_fn or self.tasks),
                 "reward_model": ("reward_model", self.reward_model),
                 "remote": ("remote_url", self.remote_urls), "reference": ("reference", self.reference),
                 "teacher": ("teacher", self.teacher), "judge": ("judge_url", self.judge_url)}
        return [f"scorer.kinds includes {kind!r} but scorer.{needs[kind][0]} is empty"
                for kind in self.kinds if kind in needs and not needs[kind][1]]


def tokenizer_mismatch(student: str, teacher: str) -> str:
    """Why `teacher`'s tokenizer is not `student`'s ("" when they are the same): the vocabulary and
    added tokens of their tokenizer.json, else their config.json vocab_size. Light (json only)."""
    import json
    from pathlib import Path

    def vocab(folder: str):
        p = Path(folder) / "tokenizer.json"
        if not p.is_file():
            return None
        tok = json.loads(p.read_text())
        return tok.get("model", {}).get("vocab"), [(t.get("id"), t.get("content")) for t in tok.get("added_tokens", [])]

    a, b = vocab(student), vocab(teacher)
    if a is not None and b is not None:
        if a[0] != b[0]:
            return f"their vocabularies differ ({len(a[0] or {})} and {len(b[0] or {})} entries)"
        return "" if a[1] == b[1] else "their added (special) tokens differ"

    def size(folder: str):
        p = Path(folder) / "config.json"
        return json.loads(p.read_text()).get("vocab_size") if p.is_file() else None

    sa, sb = size(student), size(teacher)
    if sa is None or sb is None or sa != sb:
        return f"no tokenizer.json to compare, and config.json vocab_size {sa} vs {sb}"
    return ""
