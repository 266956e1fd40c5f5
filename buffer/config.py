"""The replay buffer's configuration, its address as the roles that dial it see it, and its endpoints."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from buffer.rollouts import MAX_IMAGE_BYTES, MAX_IMAGES
from common.config import Endpoint, Section
from common.curve import Mode as CurveMode
from common.images import ImageLimits


class BufferConfig(Section):
    """Section `buffer:` of the run config."""

    section: ClassVar[str] = "buffer"

    host: str = "127.0.0.1"
    """Interface the buffer binds (and the address clients use); 127.0.0.1 unless roles span machines."""
    curve: CurveMode = "auto"
    """CurveZMQ on the buffer's four sockets (common/curve.py): `auto` = on exactly when `host` is
    not loopback; `on` also on loopback; `off` never (a trusted network only). On, it needs the
    run's keys (`CONVEYOR_KEYS`; `python -m launch.keys RUN_DIR`; the launchers make them)."""
    port: int = Field(5555, gt=0, lt=65533)
    """Control socket (ROUTER: leases, batches, metrics). The next three ports are the ingest socket
    (PULL, scored rollouts), the relay input (PULL, raw rollouts from generators) and the relay
    output (PUSH, to scorers), so port+3 must stay below 65536."""
    prompts: str = ""
    """Prompt dataset(s): a JSONL or Parquet file, a `datasets.save_to_disk` folder or a Hugging Face
    dataset folder; several, comma-separated, are mixed by `prompt_probs`."""
    prompt_probs: list[float] | None = None
    """With several datasets in `prompts`: the share of each (OpenRLHF's `--prompt_data_probs`,
    e.g. `0.7,0.3`), mixed as `datasets.interleave_datasets` mixes them for OpenRLHF (seeded by
    shuffle_seed; a dataset that runs out starts again until every one was used whole; see
    buffer/prompts.py); None: the datasets one after the other."""
    prompt_split: str = "train"
    """The split to read from a dataset folder that holds several (a DatasetDict)."""
    input_key: str = "prompt"
    """Column of a row holding the prompt: a string, or a list of chat messages
    ({"role", "content"}) that the generator renders with the tokenizer's chat template."""
    label_key: str = "label"
    """Column holding the label the reward function checks against (optional per row)."""
    columns: list[str] | None = None
    """The row's other columns that travel with its rollouts to the reward functions (as keyword
    arguments: tests, metadata, difficulty, ...): None: every column but the prompt and the label;
    []: none. At most 1 MiB of JSON per row (buffer/prompts.py)."""
    image_key: str = "images"
    """Column holding a vision-language prompt's images (OpenRLHF's `--data.image_key`): one image or
    a list, each as bytes, a {"bytes", "path"} map (a `datasets.Image` column), base64 text or a file
    path relative to the dataset's folder. Each "<image>" in the prompt stands for the next one; a
    string prompt with images and no "<image>" gets them at its start (buffer/prompts.py). Images
    may also stand in chat messages' content parts ({"type": "image", "image": ...})."""
    max_images_per_prompt: int = Field(1, ge=0, le=MAX_IMAGES)
    """A prompt with more images is refused when the prompts are read, naming its row; 0: text
    prompts only (as OpenRLHF's 0): a row with an image is refused and "<image>" is plain text."""
    max_image_bytes: int = Field(4 << 20, gt=0, le=MAX_IMAGE_BYTES)
    """An image file larger than this many bytes is refused, naming its row (at most 16 MiB, what
    one image may take on the wire)."""
    max_image_pixels: int = Field(4096 * 4096, gt=0)
    """An image of more pixels (width x height) is refused, naming its row, before it is decoded;
    the model's processor resizes the rest to its own bounds."""
    input_template: str = ""
    """A template with one `{}` a string prompt is put into (e.g. `Question: {}\nAnswer:`), before the
    chat template if there is one (OpenRLHF leaves it out with --apply_chat_template); chat-message
    prompts are left as they are; empty: none."""
    max_samples: int = Field(0, ge=0)
    """Use at most this many rows of each dataset and this many prompts after mixing (as OpenRLHF's
    `--max_samples`); 0: all."""
    prompts_per_step: int = Field(8, ge=1)
    """Prompt groups in one learner step's batch (all ranks together)."""
    n_samples_per_prompt: int = Field(4, ge=1)
    """Completions sampled per prompt (the group size)."""
    max_staleness: int = Field(1, ge=0)
    """Versions a sample may lag the learner when trained on (0 = synchronous)."""
    lease_ttl_s: float = Field(60.0, gt=0)
    """A lease not answered (or renewed) within this many seconds is issued again."""
    max_epochs: int = Field(1, ge=1)
    """Passes over the prompt dataset; after the last the buffer answers `done`."""
    shuffle_seed: int | None = 0
    """Seed for the order prompts are leased in each epoch (None keeps file order) and for the mix of
    several datasets by prompt_probs (0 when None)."""
    state_dir: str = ""
    """Where accepted groups and counters are persisted (empty: not persisted)."""
    max_queued_groups: int = 4096
    """Complete groups held for learners at most; past it the oldest are dropped and counted."""
    log_interval_s: float = Field(30.0, gt=0)
    """Seconds between the info-level summaries the buffer logs."""
    fsync: str = "never"
    """When the state log is fsynced (records always reach the OS before the buffer answers, so a
    killed buffer loses nothing it acknowledged; this is about a lost machine): `never`, `batch`
    (once per pass of the loop that wrote anything; ~1 fsync per request burst), `record` (after
    every record: the safest, one disk flush per lease and group, slow on network disks), or an
    interval in seconds such as `5`."""
    compact_mb: float = Field(64.0, gt=0)
    """Rewrite the state log while running once it has grown by this many MB (and by more than its
    size after the last rewrite): disk use follows what is in flight, not the run's length."""
    dynamic_filtering: bool = False
    """DAPO's dynamic sampling: a complete group whose rewards carry no signal (all equal, or a mean
    outside dynamic_filtering_range) is filtered (counted in `buffer/filtered`, recorded as dropped
    with reason `filtered`) and a replacement prompt is leased in its place, so every step still
    trains prompts_per_step informative groups. Where a sample's scorer gave a filter score (OpenRLHF's
    `scores`: `ScoredRollout.metadata["filter_score"]`, buffer/rules.py), that is judged, not its reward."""
    dynamic_filtering_range: list[float] | None = None
    """With dynamic_filtering: also filter a group unless low < its mean reward < high (OpenRLHF's
    `--dynamic_filtering_reward_range`); None: only groups whose rewards are all equal."""
    dynamic_filtering_max_rounds: int = Field(10, ge=1)
    """Cap on replacement prompts: at most this many times prompts_per_step groups are filtered per
    learner step; past it the buffer stops filtering for that step, says so in the log and counts
    `buffer/filter_cap_hits` (a task the policy always or never solves cannot spin for ever)."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Logging level of the buffer process: debug (a line per lease and batch), info, warning."""

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, v: object) -> object:
        return v.lower() if isinstance(v, str) else v

    @field_validator("fsync", mode="before")
    @classmethod
    def _fsync(cls, v: object) -> str:
        try:
            fsync_policy(str(v))
        except ValueError:
            raise ValueError("must be never, batch, record or a number of seconds > 0") from None
        return str(v)

    @field_validator("dynamic_filtering_range")
    @classmethod
    def _range(cls, r: list[float] | None) -> list[float] | None:
        if r is not None and (len(r) != 2 or not r[0] < r[1]):
            raise ValueError("must be two numbers [low, high] with low < high")
        return r

    @property
    def image_limits(self) -> ImageLimits:
        return ImageLimits(self.max_image_bytes, self.max_image_pixels, self.max_images_per_prompt, "buffer")

    def problems(self) -> list[str]:
        errs = []
        if self.max_queued_groups < self.prompts_per_step:
            errs.append(f"buffer.max_queued_groups={self.max_queued_groups} must be >= "
                        f"buffer.prompts_per_step={self.prompts_per_step} (a step's batch must fit)")
        if self.dynamic_filtering and self.n_samples_per_prompt < 2:
            errs.append("buffer.dynamic_filtering needs n_samples_per_prompt >= 2 (a group of one sample "
                        "always has equal rewards)")
        return errs

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.host, self.port)


class EvalConfig(Section):
    """Section `eval:` of the run config: evaluation during training, served by the run's own
    generators at the current policy version and scored by its scorers; never trained on."""

    section: ClassVar[str] = "eval"

    dataset: str = ""
    """Evaluation prompts (the formats and columns of `buffer.prompts`); empty: no evaluation."""
    split: str = "train"
    """The split to read from a dataset folder that holds several."""
    every: int = Field(0, ge=0)
    """Evaluate the policy of every this many learner steps (and the initial one); 0: never."""
    n_samples_per_prompt: int = Field(4, ge=1)
    """Completions per evaluation prompt: pass@1 averages them, pass@k takes the best."""
    temperature: float = Field(0.6, ge=0)
    """Sampling temperature of evaluation completions (0: greedy)."""
    max_samples: int = Field(0, ge=0)
    """Evaluate at most this many prompts; 0: all."""
    pass_threshold: float = 1.0
    """A sample passes when its reward is at least this (for a 0/1 reward: when it is right);
    eval/pass@1 and eval/pass@k count passing samples."""
    samples_dir: str = ""
    """Folder the buffer writes each round's samples to (`version_<v>.jsonl`); default `<run_dir>/eval`."""


class BufferAddress(Section):
    """The buffer's address, declared once for every role that dials it (generator, scorer,
    learner). Launchers fill it in from the run config's `buffer:` section."""

    buffer_host: str = "127.0.0.1"
    """Address of the buffer; taken from the config's `buffer:` section unless set here."""
    buffer_port: int = Field(5555, gt=0, lt=65533)
    """The buffer's control port (ingest: +1, relay input: +2, relay output: +3); taken from the
    config's `buffer:` section unless set here."""

    @property
    def buffer_endpoint(self) -> Endpoint:
        return Endpoint(self.buffer_host, self.buffer_port)


def fsync_policy(value: str) -> float | None:
    """`buffer.fsync` as seconds between fsyncs: None never, 0.0 every record, -1.0 every loop pass."""
    v = str(value).strip().lower()
    if v == "never":
        return None
    if v == "record":
        return 0.0
    if v == "batch":
        return -1.0
    try:
        seconds = float(v[:-1] if v.endswith("s") else v)
    except ValueError:
        raise ValueError(f"buffer.fsync={value!r} must be never, batch, record or a number of seconds") from None
    if not seconds > 0:
        raise ValueError(f"buffer.fsync={value!r}: an interval must be > 0 seconds")
    return seconds


def endpoints(host: str, port: int) -> dict[str, str]:
    """The four ZeroMQ endpoints of a buffer at `host:port`."""
    e = Endpoint(host, port)
    return {"control": e.url(0), "ingest": e.url(1), "relay_in": e.url(2), "relay_out": e.url(3)}
