"""The generator's control loop: lease prompts, sample completions, push rollouts.

One iteration:

1. take new weights if the weight-sync service has a round for us (between batches, so every
   token of a batch carries the same policy version; but see `interrupt` mode below);
2. lease up to `groups_per_lease` prompt groups from the buffer, reporting our weights version
   (the buffer's admission control may answer `Wait`);
3. tokenize the prompts (chat template when there is one; a vision-language prompt's images as
   one placeholder each, actors/prompts.py), truncate or refuse long ones;
4. sample `n_samples` completions of each in one engine call, while a thread renews the lease
   (with `generator.env`: one multi-turn episode per sample, actors/envs/episodes.py; with
   `generator.agent`: agent code plays each sample through the OpenAI-compatible endpoint,
   actors/agents/openai_server.py);
5. push one `Rollout` per completion to the scorers, through the buffer's relay (a prompt with
   images: its ids as the engine expanded them, and the images, for the learner's forward).

Weight-sync mode `interrupt` (the service's `weight_sync.mode`, with `generator.async_engine`):
step 4 runs on the engine's own thread while this one keeps polling the weight-sync service; a
round that arrives then is loaded into the running batch (vLLM pauses it, keeping its KV cache,
loads, resumes), and each rollout's per-token `versions` say which weights sampled each token,
e.g. [3, 3, 3, 4, 4]. The service's client is only ever used from this thread.

The buffer answers `Wait(done=True)` when the dataset is exhausted: the loop exits with 0. A first
SIGTERM/SIGINT lets the batch in flight finish and be pushed; a second one interrupts it.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections import Counter
from concurrent.futures import wait
from dataclasses import dataclass, field, replace

import numpy as np

from actors.agents.sessions import load_agent
from actors.config import GeneratorConfig
from actors.engines import build_engine
from actors.engines.base import Completion, Engine, Sampling
from actors.envs.agent_executor import ExecutorEpisodes
from actors.envs.episodes import rollout_of, run_episodes
from actors.envs.loader import load_env
from actors.prompts import PromptRefused, encode_prompt, fit_prompt
from actors.tasks import TaskEnvs
from actors.weight_hook import WeightSyncHook
from buffer.client import BufferClient, BufferError
from buffer.messages import ID_DTYPE, LOGPROB_DTYPE, LeaseGrant, Rollout, Wait
from common.images import BadImage, pil_image
from common.ready import mark_ready

log = logging.getLogger("conveyor.generator")


# --------------------------------------------------------------------------------------------
# lease renewal


class LeaseKeeper:
    """Renews leases from its own thread (an engine call blocks the main one) with its own client
    (ZeroMQ sockets are not thread-safe).

    A lease is renewed every `renew_fraction * ttl` while its batch is generated, and after its
    rollouts are pushed for up to `after_push_s` more: the buffer counts a lease open until the
    scored samples arrive, so scoring time must be covered too. The buffer refusing a renewal of a
    pushed lease usually means it was answered; before the push, it means the lease was lost.
    """

    def __init__(self, host: str, port: int, renew_fraction: float, timeout_s: float, after_push_s: float):
        self._client = BufferClient(host, port, timeout_s=timeout_s)
        self._fraction = renew_fraction
        self._after_push_s = after_push_s
        # lease_id -> [ttl_s, last renewed, renew until (None: while generating)]
        self._leases: dict[int, list] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.renewed = 0
        self.lost = 0
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
        self._thread.start()

    def hold(self, grant: LeaseGrant) -> None:
        with self._lock:
            self._leases[grant.lease_id] = [grant.ttl_s, time.monotonic(), None]

    def pushed(self, lease_id: int) -> None:
        with self._lock:
            if lease_id in self._leases:
                if self._after_push_s > 0:
                    self._leases[lease_id][2] = time.monotonic() + self._after_push_s
                else:
                    del self._leases[lease_id]

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            now = time.monotonic()
            with self._lock:
                for i in [i for i, (_, _, until) in self._leases.items() if until is not None and now > until]:
                    del self._leases[i]
                due = [i for i, (ttl, last, _) in self._leases.items() if now - last >= self._fraction * ttl]
            for lease_id in due:
                try:
                    self._client.renew(lease_id)
                    ok, why = True, ""
                except (BufferError, TimeoutError) as e:
                    ok, why = False, str(e)
                with self._lock:
                    entry = self._leases.get(lease_id)
                    if entry is None:
                        continue
                    if ok:
                        self.renewed += 1
                        entry[1] = time.monotonic()
                        continue
                    del self._leases[lease_id]
                    generating = entry[2] is None
                    self.lost += generating
                if generating:  # expired already (or the buffer restarted): the results will be refused
                    log.warning("lease %d could not be renewed while generating: %s", lease_id, why)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if not self._thread.is_alive():  # (else it still waits on a renewal: its socket is not closed under it)
            self._client.close()


# --------------------------------------------------------------------------------------------
# generating (weight sync: actors/weight_hook.py)


def generate_batch(engine: Engine, prompt_ids: list[list[int]], n: int, sampling: Sampling,
                   sync: WeightSyncHook | None, images: list[list[bytes] | None] | None = None
                   ) -> list[list[Completion]]:
    """`engine.generate`, or in `interrupt` mode the same batch with new weights loaded into it as
    they come: the batch runs on the engine's thread while this one polls the service. `images`:
    per prompt its images or None (None: a text batch, which every engine takes as before)."""
    more = {} if images is None else {"images": images}
    if sync is None or sync.mode != "interrupt" or not engine.loads_mid_batch:
        return engine.generate(prompt_ids, n, sampling, **more)
    batch = engine.submit(prompt_ids, n, sampling, **more)
    while wait([batch], timeout=sync.poll_s).not_done:
        try:
            sync.poll_mid_batch(engine)
        except TimeoutError:  # the service out of reach: the batch goes on (the loop's poll has the patience)
            pass
    return batch.result()


# --------------------------------------------------------------------------------------------
# the loop


@dataclass
class Counters:
    leases: int = 0
    groups: int = 0
    samples: int = 0
    tokens: int = 0
    truncated: int = 0
    refused: int = 0
    generate_s: float = 0.0
    env: Counter = field(default_factory=Counter)  # multi-turn episodes: failures by kind, truncations


def install_signal_handlers(stop: threading.Event) -> None:
    """First SIGTERM/SIGINT: finish the batch in flight, then exit. Second: interrupt it."""

    def handler(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        log.info("%s: finishing the batch in flight, then exiting", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def make_rollouts(grant: LeaseGrant, cfg: GeneratorConfig, engine: Engine, sampling: Sampling,
                  client: BufferClient, worker_id: str, counts: Counters,
                  sync: WeightSyncHook | None = None, factory=None, agents=None) -> list[Rollout]:
    """Steps 3-4 for one lease: the rollouts of its groups (refused groups are reported, not sampled);
    with an environment `factory`, one multi-turn episode per sample (actors/envs/episodes.py); with
    `agents` (an `actors.agents.openai_server.AgentServer`), one agent session per sample; with a
    `TaskEnvs` for `factory`, each group's task's environment (the lease split by environment)."""
    if isinstance(factory, TaskEnvs):
        return factory.split(grant, lambda part, f: make_rollouts(part, cfg, engine, sampling, client, worker_id,
                                                                  counts, sync, f, agents))
    groups, prompt_ids = [], []
    tools = getattr(factory, "chat_tools", None)  # (a tools environment's schemas, for the template)
    for g in grant.groups:
        ids: list[int] = []
        try:
            if g.images and (agents is not None or isinstance(factory, ExecutorEpisodes)):
                raise PromptRefused("a prompt with images cannot start an agent session or an OpenRLHF "
                                    "AgentExecutor's own execute: those take text prompts only")
            for k, image in enumerate(g.images or ()):  # (one that cannot be decoded fails its group, not the lease)
                try:
                    pil_image(image)
                except BadImage as e:
                    raise PromptRefused(f"image {k}: {e}") from None
            ids = encode_prompt(engine.tokenizer, g.prompt, cfg.use_chat_template, g.messages, tools, g.images)
            fitted, why = fit_prompt(ids, cfg, len(g.images or ()))
        except PromptRefused as e:
            fitted, why = None, str(e)
        if fitted is None:
            _refuse(grant, g, client, counts, why)
            continue
        counts.truncated += len(fitted) < len(ids)
        groups.append(g)
        prompt_ids.append(fitted)
    if not groups:
        return []
    if grant.temperature is not None:  # an evaluation lease: sampled as the evaluation says
        sampling = replace(sampling, temperature=grant.temperature)
    if factory is not None or agents is not None:
        return episode_rollouts(grant, groups, prompt_ids, cfg, engine, sampling, client, worker_id, counts,
                                factory, sync, agents)
    # The version of every token, unless the weights change mid-batch (then the engine says per token).
    version = engine.version
    t0 = time.monotonic()
    budgets = [min(cfg.max_new_tokens, cfg.max_len - len(ids)) if cfg.max_len else sampling.max_tokens
               for ids in prompt_ids]
    # (None for a text lease: engines are called as they always were)
    images = [g.images or None for g in groups] if any(g.images for g in groups) else None
    try:
        completions = generate_batch(engine, prompt_ids, grant.n_samples, replace(sampling, max_tokens=max(budgets)),
                                     sync, images)
    except ValueError as e:
        # The engine refused the inputs (e.g. a prompt past vLLM's max_model_len): retrying will not
        # help, so the groups are reported failed instead of expiring and coming back forever.
        return _give_up(grant, groups, client, counts, f"engine refused the prompt: {e}")
    counts.generate_s += time.monotonic() - t0
    rollouts = []
    placeholders = set(getattr(engine, "placeholder_ids", ()))
    for g, ids, comps, budget in zip(groups, prompt_ids, completions, budgets):
        if g.images:  # the prompt is the engine's: each image's placeholder expanded to its tokens
            if any(c.prompt_ids is None for c in comps):
                _refuse(grant, g, client, counts, "the engine gave no expanded prompt ids for a prompt with images")
                continue
            ids = comps[0].prompt_ids
            if cfg.max_len:  # (its budget too: sampled with at least this many tokens, cut below)
                budget = min(cfg.max_new_tokens, cfg.max_len - len(ids))
                if budget < 1:
                    _refuse(grant, g, client, counts, f"prompt of {len(ids)} tokens with its images expanded leaves "
                                                      f"no completion within generator.max_len={cfg.max_len}")
                    continue
        comps = [cut(c, budget, engine.tokenizer, len(ids)) for c in comps]
        if placeholders:
            comps = [before_placeholder(c, placeholders, engine.tokenizer, len(ids)) for c in comps]
            if not all(c.token_ids for c in comps):
                _refuse(grant, g, client, counts, "a completion began with an image placeholder token, which the "
                                                  "learner's forward cannot take without an image")
                continue
        if cfg.record_routes and any(c.routes is None for c in comps):
            counts.refused += 1
            why = "routing replay: the engine recorded no routes for a completion of this group"
            log.error("group %d: %s", g.group_id, why)
            client.group_failed(grant.lease_id, g.group_id, why)
            continue
        for j, c in enumerate(comps):
            t = len(c.token_ids)
            rollouts.append(Rollout(
                group_id=g.group_id, sample_index=j, lease_id=grant.lease_id,
                prompt_ids=np.asarray(ids, dtype=ID_DTYPE),  # (P,)
                completion_ids=np.asarray(c.token_ids, dtype=ID_DTYPE),  # (T,)
                behav_logprobs=np.asarray(c.logprobs, dtype=LOGPROB_DTYPE),  # (T,)
                versions=(np.full(t, version, dtype=ID_DTYPE) if c.versions is None
                          else np.asarray(c.versions, dtype=ID_DTYPE)),  # (T,) non-decreasing
                prompt=g.prompt, completion=c.text, label=g.label, columns=g.columns,
                finish_reason=c.finish_reason, worker_id=worker_id, images=g.images or None,
                **route_fields(c.routes),
            ))
            counts.tokens += t
        counts.samples += len(comps)
        counts.groups += 1
    return rollouts


def cut(c: Completion, budget: int, tokenizer, prompt_len: int = 0) -> Completion:
    """A completion sampled with a larger max_tokens, ended where its own budget ends (generator.max_len):
    sampling stops at the budget the same way (each token depends on those before it only)."""
    if len(c.token_ids) <= budget:
        return c
    return Completion(c.token_ids[:budget], c.logprobs[:budget], "length",
                      tokenizer.decode(c.token_ids[:budget], skip_special_tokens=True),
                      None if c.versions is None else c.versions[:budget],
                      routes=None if c.routes is None else c.routes[:prompt_len + budget - 1], prompt_ids=c.prompt_ids)


def before_placeholder(c: Completion, placeholders: set[int], tokenizer, prompt_len: int = 0) -> Completion:
    """A vision-language policy's completion ended before the first image (or video) placeholder it
    sampled, if any: the model's forward gives every placeholder an image's features, so a sequence
    with one more placeholder than images cannot be run (the learner refuses it). The tokens kept
    are as sampled; a trained policy practically never samples a placeholder."""
    at = next((t for t, tok in enumerate(c.token_ids) if tok in placeholders), None)
    return c if at is None else cut(c, at, tokenizer, prompt_len)


def _refuse(grant: LeaseGrant, g, client: BufferClient, counts: Counters, why: str) -> None:
    """Report one group of the lease failed (counted by the buffer, not issued again)."""
    counts.refused += 1
    log.warning("group %d refused: %s", g.group_id, why)
    client.group_failed(grant.lease_id, g.group_id, why)


def route_fields(routes) -> dict:
    """A completion's routes ((P+T-1, layers, k) expert ids) as `Rollout` fields; none: {}."""
    if routes is None:
        return {}
    return {"routes": routes.tobytes(), "route_layers": routes.shape[1], "route_k": routes.shape[2],
            "route_width": routes.dtype.itemsize}


def _give_up(grant: LeaseGrant, groups, client: BufferClient, counts: Counters, why: str) -> list[Rollout]:
    """Report every group of the lease failed (not issued again): nothing to push."""
    log.error("lease %d: %s", grant.lease_id, why)
    for g in groups:
        counts.refused += 1
        client.group_failed(grant.lease_id, g.group_id, why[:2000])
    return []


def episode_rollouts(grant: LeaseGrant, groups, prompt_ids, cfg: GeneratorConfig, engine: Engine,
                     sampling: Sampling, client: BufferClient, worker_id: str, counts: Counters, factory,
                     sync: WeightSyncHook | None, agents=None) -> list[Rollout]:
    """The lease's multi-turn episodes (or agent sessions, whose first request is their prompt) as
    rollouts; a group with a failed episode is given up."""
    t0 = time.monotonic()

    def generate(contexts, turn, images=None):  # (images: per context, a vision-language episode's so far)
        return [c[0] for c in generate_batch(engine, contexts, 1, turn, sync, images)]

    try:
        played = (agents.play(groups, grant.n_samples, engine, sampling, cfg, generate, counts.env) if agents else
                  run_episodes(groups, prompt_ids, grant.n_samples, engine, sampling, cfg, factory, generate,
                               counts.env))
    except ValueError as e:  # the engine refused a context (e.g. past vLLM's max_model_len)
        return _give_up(grant, groups, client, counts, f"engine refused an episode's context: {e}")
    counts.generate_s += time.monotonic() - t0
    rollouts = []
    for g in groups:
        episodes = played[g.group_id]
        failed = next((e.failure for e in episodes if e.failure is not None), None)
        if failed is not None:
            source = "agent" if agents is not None else "environment"
            log.warning("group %d given up: an episode's %s failed (%s: %s)", g.group_id, source, failed.kind,
                        failed.message[:300])
            client.group_failed(grant.lease_id, g.group_id, f"{source} {failed.kind}: {failed.message}"[:2000])
            continue
        rollouts += [rollout_of(e, grant.lease_id, worker_id) for e in episodes]
        counts.tokens += sum(len(e.ids) for e in episodes)
        counts.samples += len(episodes)
        counts.groups += 1
    return rollouts


class _Patience:
    """Tolerates a service that does not answer (restarting, not up yet, or out of reach: a network
    partition) for `limit_s` in a row."""

    def __init__(self, limit_s: float, service: str = "buffer"):
        self.limit_s, self.service = limit_s, service
        self.since: float | None = None

    def call(self, fn, *args):
        """fn(*args), or None after a timeout that is still within patience; raises past it."""
        try:
            out = fn(*args)
        except TimeoutError as e:
            now = time.monotonic()
            self.since = self.since or now
            if now - self.since > self.limit_s:
                raise TimeoutError(f"{self.service} silent for {now - self.since:.0f}s: {e}") from None
            log.warning("%s; retrying", e)
            return None
        self.since = None
        return out


def run(cfg: GeneratorConfig, stop: threading.Event | None = None) -> int:
    """Generate until the buffer is done, a signal comes (or `stop` is set), or `max_batches` leases;
    the exit code. Without `stop`, SIGTERM/SIGINT are handled (on the main thread)."""
    worker_id = cfg.worker_id or f"gen-{socket.gethostname()}-{os.getpid()}"
    if stop is None:
        stop = threading.Event()
        if threading.current_thread() is threading.main_thread():
            install_signal_handlers(stop)
    t_start = time.monotonic()
    factory = None
    if cfg.env:  # (before the engine: a bad environment is said at once)
        factory = load_env(cfg.env, cfg.env_args, "generator.env")
    if cfg.task_envs:  # each row's task's environment, the others `env`'s
        factory = TaskEnvs({t: load_env(spec, cfg.task_env_args.get(t), f"generator.task_envs.{t}")
                            for t, spec in cfg.task_envs.items()}, cfg.task_key, factory)
    agent = None
    if cfg.agent:  # (the same: a bad agent spec is said before the engine starts)
        agent = load_agent(cfg.agent, cfg.agent_args, "generator.agent")
    engine = build_engine(cfg)
    log.info("%s: %s engine on %s ready in %.1fs", worker_id, cfg.engine, cfg.model, time.monotonic() - t_start)
    t_start = time.monotonic()
    sampling = Sampling(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                        max_tokens=cfg.max_new_tokens, stop_token_ids=list(cfg.stop_token_ids))
    client = BufferClient(cfg.buffer_host, cfg.buffer_port, timeout_s=cfg.request_timeout_s)
    keeper = LeaseKeeper(cfg.buffer_host, cfg.buffer_port, cfg.renew_fraction, cfg.request_timeout_s,
                         cfg.renew_after_push_s)
    sync: WeightSyncHook | None = None
    patience = _Patience(cfg.buffer_patience_s)
    ws_patience = _Patience(cfg.buffer_patience_s, "weight-sync service")  # (as long: the same network)
    counts, last = Counters(), Counters()
    t_log = time.monotonic()
    waiting_since, next_wait_log = None, cfg.log_every_s  # how long the buffer has answered Wait
    code, ready = 0, False
    agents = None
    try:
        if agent is not None:  # the endpoint is up, its port bound, before the first lease
            from actors.agents.openai_server import AgentServer

            agents = AgentServer(agent, cfg.agent_args, cfg.openai_host, cfg.openai_port,
                                 model_name=os.path.basename(cfg.model.rstrip("/")) or "policy")
        if cfg.weight_sync_port:
            sync = WeightSyncHook.connect(cfg, worker_id, engine)
            sync.initial(engine)
        mark_ready("generator", worker_id=worker_id, version=engine.version)
        ready = True
        while not stop.is_set():
            if sync is not None:
                ws_patience.call(sync.poll, engine)
            reply = patience.call(client.lease, worker_id, cfg.groups_per_lease, engine.version)
            if reply is None:
                continue
            if isinstance(reply, Wait):
                if reply.done:
                    log.info("buffer is done (%s)", reply.reason)
                    break
                waiting_since = waiting_since or time.monotonic()
                if time.monotonic() - waiting_since >= next_wait_log:
                    log.info("no lease for %.0fs: %s", time.monotonic() - waiting_since, reply.reason)
                    next_wait_log += cfg.log_every_s
                stop.wait(reply.retry_after_s)
                continue
            waiting_since, next_wait_log = None, cfg.log_every_s
            counts.leases += 1
            log.info("lease %d: %d groups x %d samples (v%d)", reply.lease_id, len(reply.groups),
                     reply.n_samples, engine.version)
            keeper.hold(reply)
            rollouts = make_rollouts(reply, cfg, engine, sampling, client, worker_id, counts, sync, factory, agents)
            if rollouts:  # (unanswered within patience: dropped; the lease expires and is issued again)
                patience.call(client.push_rollouts, rollouts)
            keeper.pushed(reply.lease_id)
            if time.monotonic() - t_log >= cfg.log_every_s:
                _log_throughput(counts, last, time.monotonic() - t_log, keeper, engine.version)
                _mark_counts(worker_id, engine.version, counts)
                last, t_log = Counters(**counts.__dict__), time.monotonic()
            if cfg.max_batches and counts.leases >= cfg.max_batches:
                break
    except KeyboardInterrupt:
        log.info("interrupted")
    except TimeoutError as e:
        log.error("%s; giving up", e)
        code = 1
    finally:
        _log_throughput(counts, Counters(), time.monotonic() - t_start, keeper, engine.version, final=True)
        if ready:  # (never before: the record says the generator is ready)
            _mark_counts(worker_id, engine.version, counts, final=True)
        keeper.close()
        client.close()
        if sync is not None:
            sync.close()
        if agents is not None:
            agents.close()
        engine.close()
    return code


def _mark_counts(worker_id: str, version: int, c: Counters, final: bool = False) -> None:
    """What this generator has done so far, in its ready record (its launcher's status shows it)."""
    mark_ready("generator", worker_id=worker_id, version=version, leases=c.leases, groups=c.groups,
               samples=c.samples, tokens=c.tokens, episodes=dict(c.env), final=final)


def _log_throughput(c: Counters, prev: Counters, dt: float, keeper: LeaseKeeper, version: int,
                    final: bool = False) -> None:
    tokens = c.tokens - prev.tokens
    gen_s = c.generate_s - prev.generate_s
    log.info("%s%d tokens in %.1fs (%.0f tok/s; %.0f tok/s while generating), %d samples, %d groups; "
             "total leases=%d truncated=%d refused=%d renewed=%d lost=%d version=%d",
             "total: " if final else "", tokens, dt, tokens / max(dt, 1e-9), tokens / max(gen_s, 1e-9),
             c.samples - prev.samples, c.groups - prev.groups, c.leases, c.truncated, c.refused,
             keeper.renewed, keeper.lost, version)
    if c.env:  # episodes' and agent sessions' counts (failures by kind, truncations)
        log.info("%sepisodes: %s", "total " if final else "", " ".join(f"{k}={v}" for k, v in sorted(c.env.items())))
