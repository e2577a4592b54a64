"""The GRPO driver: the step loop of DESIGN.md.

One step: sample prompts -> gen (rollout replicas, adapter v) -> score (grader) -> adv (pure
function) -> learner (old_log_prob, ref, update_actor) -> update_weights (adapter v+1 live on
every replica) [-> save_checkpoint]. `one_step_off` overlaps generation for step t+1 with the
update of step t; every sample records the adapter version it was sampled with and the
staleness is a metric.

The services are passed in (`RunParts`): this module knows their typed interfaces, not how
they are started (services/launch.py does that), so the loop stays on one screen.

How a step's completions are collected is chosen once per run (`RunParts.collect`):
`collect_flat` (G completions per prompt, then one ScoreBatch) or, with
trainer.rollout_mode = "tree", services/tree_round.py's `TreeRounds` (one round of tree search
whose generation and execution interleave; it reports its own gen and score seconds).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from learner.advantages import compute_advantages, frac_reward_zero_std
from learner.types import TrainBatch
from model.adapter import AdapterPayload, AdapterRef
from rollout.types import Prompt, Sample, SamplingParams
from config import RunConfig
from graders.spread import score_spread
from services.recovery import backoff_delays, first_line, retried_what
from services.step_timer import PhaseTimer, finished_at, seconds_beside

log = logging.getLogger("counterpoint.train")


# ---------------------------------------------------------------- typed boundaries of the parts
class Grader(Protocol):
    def score_batch(self, items: list[tuple[str, str]]) -> list[Any]: ...


class Rollout(Protocol):
    def generate(self, prompts: list[Prompt], params: SamplingParams, version: int) -> list[Sample]: ...
    def publish(self, payload: AdapterPayload | AdapterRef) -> None: ...
    def sync(self, version: int) -> float: ...


class Learner(Protocol):
    def step(self, batch: TrainBatch) -> Any: ...
    def save_checkpoint(self, step: int, data_position: dict[str, Any]) -> Any: ...


@dataclass
class RunParts:
    cfg: RunConfig
    cases: dict[str, Any]  # case id -> grader Case (messages, prefixes, ...)
    sampler: Any  # services.sampler.PromptSampler
    grader: Grader
    rollout: Rollout
    learner: Learner
    record: Callable[["StepRecord"], None]  # archive + metrics + progress, one call per step
    version: int = 0  # adapter version live on every replica
    collect: Callable[..., tuple["Rollouts", list[Any]]] | None = None  # None = collect_flat
    archive: Callable[["RoundRecord"], None] | None = None  # the round to disk before the update
    recoveries: Any = None  # services.recovery.RecoveryLog: what a retry saved (None = not recorded)
    # The grader app's ended spells with no running replica, not taken before: (unix start,
    # seconds) (graders/autoscale.py ReplicaWatch.take_empty_spells; None: an external grader).
    grader_outages: Callable[[], list[tuple[float, float]]] | None = None
    # The grader replicas the driver killed for leaving a ping unanswered, not taken before:
    # (time.monotonic(), {replica_id, quiet_s, why}) (ReplicaWatch.take_replaced; None: external).
    grader_replaced: Callable[[], list[tuple[float, dict]]] | None = None


@dataclass
class Rollouts:
    """One step's generations, flattened: sample i belongs to group groups[i]."""

    step: int
    case_ids: list[str]  # per sample
    prompts: list[Prompt]  # per sample
    samples: list[Sample]
    groups: list[int]
    gen_seconds: float = 0.0
    search: Any = None  # tree mode: the search.round.Round these samples are the nodes of


@dataclass
class RoundRecord:
    """A step's rollouts as scored, with their advantages: archived before the learner trains
    on them, so a driver that dies in the update, the sync or the save leaves them on disk."""

    step: int
    rollouts: Rollouts
    scores: list[Any]
    rewards: list[float]
    advantages: list[float]


@dataclass
class StepRecord:
    step: int
    rollouts: Rollouts
    scores: list[Any]
    rewards: list[float]
    advantages: list[float]
    learner_metrics: dict[str, float]
    phases_s: dict[str, float]
    total_s: float
    adapter_version: int
    extra: dict[str, float] = field(default_factory=dict)


# ---------------------------------------------------------------- the pieces of a step
def prompts_for_step(parts: RunParts, step: int) -> tuple[list[str], list[Prompt]]:
    """G prompts per sampled case. With forced openings, rollout i of a group gets opening
    i mod |alphabet| (voice-leading spec 13.3); otherwise the G prompts are identical."""
    tcfg = parts.cfg.trainer
    case_ids: list[str] = []
    prompts: list[Prompt] = []
    for case_id in parts.sampler.batch_for_step(step):
        case = parts.cases[case_id]
        messages = tuple({"role": m["role"], "content": m["content"]} for m in case.messages)
        prefixes = list(case.prefixes) if tcfg.prefix_mode == "forced_opening" else []
        for i in range(tcfg.group_size):
            prefix = prefixes[i % len(prefixes)] if prefixes else ""
            case_ids.append(case_id)
            prompts.append(Prompt(messages=messages, assistant_prefix=prefix))
    return case_ids, prompts


def sampling_params(cfg: RunConfig, step: int) -> SamplingParams:
    r = cfg.rollout
    # One seed per (run seed, step): reruns and resumes sample the same way.
    return SamplingParams.from_rollout(r, seed=cfg.seed * 1_000_003 + step)


def with_retries(call: Callable[[], Any], what: str, retries: int, backoff_s: float,
                 retried: Callable[[list[str], float], None] | None = None) -> Any:
    """Run `call`, retrying with exponential backoff (a replica may be dying and replaced);
    after `retries` failures the last error propagates: never a partial result. A call that
    answered after failing is reported to `retried` (its errors, seconds from the first failure)."""
    errors: list[str] = []
    first_failure = 0.0
    delays = backoff_delays(retries, backoff_s)
    for attempt in range(retries + 1):
        try:
            out = call()
            if errors and retried is not None:
                retried(errors, time.monotonic() - first_failure)
            return out
        except Exception as err:  # Ray wraps replica failures in several exception types
            if not errors:
                first_failure = time.monotonic()
            errors.append(first_line(err))
            if attempt == retries:
                raise
            delay = delays[attempt]
            log.warning("%s failed (%s: %s); retry %d/%d in %.1f s", what, type(err).__name__,
                        str(err).splitlines()[0][:200] if str(err) else "", attempt + 1, retries, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def generate(parts: RunParts, step: int, version: int) -> Rollouts:
    t0 = time.perf_counter()
    case_ids, prompts = prompts_for_step(parts, step)
    samples = generate_checked(parts, step, version, prompts, sampling_params(parts.cfg, step), f"step {step}")
    groups = [i // parts.cfg.trainer.group_size for i in range(len(prompts))]
    return Rollouts(step, case_ids, prompts, samples, groups, time.perf_counter() - t0)


def generate_checked(parts: RunParts, step: int, version: int, prompts: list[Prompt], params: SamplingParams,
                     call: str) -> list[Sample]:
    """One generate call of a step, flat or tree (`call` names it: "step 3", "step 3, expansion
    1"): retried (a replica may be dying and replaced) with each saved call recorded as a rollout
    recovery; one sample per prompt in prompt order, every one sampled with adapter `version`,
    or an error (never a partial or stale batch)."""
    rc = parts.cfg.rollout
    what = f"generate ({call})"
    healed = getattr(parts.rollout, "healed_events", None)
    seen = len(healed) if healed is not None else 0
    samples = with_retries(lambda: parts.rollout.generate(prompts, params, version), what,
                           rc.max_retries, rc.retry_backoff_s,
                           _recorder(parts, "rollout", step, f"generate ({call}, adapter v{version})",
                                     replaced=getattr(parts.rollout, "replaced_events", None)))
    if healed is not None and parts.recoveries is not None:
        for _, q in healed[seen:]:  # stalled past half its deadline, then went on: an outage all the same
            parts.recoveries.record("rollout", step, f"rollout replica {q['replica_id']} made no progress for "
                                    f"{q['quiet_s']:.0f} s in generate ({call}), then went on by itself",
                                    q["quiet_s"], outcome="stalled", outage_s=q["quiet_s"],
                                    replica_id=q["replica_id"], node_id=q["node_id"], why=q["why"])
    if len(samples) != len(prompts):
        raise RuntimeError(f"rollout returned {len(samples)} samples for {len(prompts)} prompts")
    samples = sorted(samples, key=lambda s: s.prompt_index)
    stale = [s.adapter_version for s in samples if s.adapter_version != version]
    if stale:
        raise RuntimeError(f"rollout answered with adapter versions {sorted(set(stale))}, asked for {version}")
    return samples


def _recorder(parts: RunParts, part: str, step: int, call: str,
              replaced: list[tuple[float, dict]] | None = None) -> Callable[[list[str], float], None] | None:
    """What `with_retries` reports a saved call to: one recovery entry (run.json `recoveries`,
    counterpoint_recoveries_total{part}), with the adapter version each live replica holds.
    ``replaced``: the rollout client's list of replicas it killed for making no progress; those
    killed during the call are named, and the outage counts from their last progress."""
    if parts.recoveries is None:
        return None
    seen = len(replaced) if replaced is not None else 0

    def record(errors: list[str], seconds: float) -> None:
        held = getattr(parts.rollout, "replicas", None)
        details: dict[str, Any] = {"errors": errors}
        if held is not None:
            try:
                details["replica_versions"] = held()
            except Exception as err:  # a record: never the reason a recovered step fails
                details["replica_versions"] = f"unknown ({first_line(err)})"
        killed = list(replaced[seen:]) if replaced is not None else []
        what, outage = with_replaced(retried_what(call, errors), seconds, killed, details, "replica")
        parts.recoveries.record(part, step, what, seconds, outage_s=outage, **details)

    return record


def completion_text(prompt: Prompt, sample: Sample) -> str:
    """What the grader scores: the whole assistant turn, forced prefix included."""
    return prompt.assistant_prefix + sample.text


def score(parts: RunParts, ro: Rollouts) -> list[Any]:
    items = [(cid, completion_text(p, s)) for cid, p, s in zip(ro.case_ids, ro.prompts, ro.samples)]
    return score_checked(parts, ro.step, items, parts.cfg.grader.chunk_for(len(items)))


def score_checked(parts: RunParts, step: int, items: list[tuple[str, str]], chunk: int) -> list[Any]:
    """One ScoreBatch of a step, flat or tree, in chunks sent concurrently so they spread over
    the grader replicas; each chunk is retried inside the client, a call it saved is recorded as
    a grader recovery, and a failed chunk raises rather than return a partial batch."""
    events = getattr(parts.grader, "retry_events", None)
    seen = len(events) if events is not None else 0
    replies = score_spread(parts.grader, items, chunk)
    killed = parts.grader_replaced() if parts.grader_replaced is not None else []
    if events is not None and len(events) > seen and parts.recoveries is not None:
        # the grader client retried some chunk of this batch (a replica died under it) and answered
        new = list(events[seen:])
        errors = [f"{rpc} {err}" for _, rpc, err in new]
        record_grader_retry(parts, step, retried_what(f"ScoreBatch (step {step})", errors),
                            time.monotonic() - new[0][0], killed, errors=errors)
    elif killed and parts.recoveries is not None:  # a frozen replica killed with no call of ours on it
        record_grader_retry(parts, step, f"ScoreBatch (step {step}) answered", 0.0, killed)
    record_grader_outages(parts, step)
    if len(replies) != len(items):
        raise RuntimeError(f"grader returned {len(replies)} scores for {len(items)} completions")
    return replies


def with_replaced(what: str, seconds: float, killed: list[tuple[float, dict]], details: dict[str, Any],
                  noun: str) -> tuple[str, float | None]:
    """A recovery's ``what`` and ``outage_s`` given the replicas the driver killed for making no
    progress meanwhile, (when, {replica_id, quiet_s, why[, node_id]}): they are named, listed in
    ``details['replaced_quiet']``, and the outage counts from their last progress. No kill: the
    outage is unknown beyond ``seconds`` (None)."""
    if not killed:
        return what, None
    details["replaced_quiet"] = [{k: round(q[k], 3) if k == "quiet_s" else q[k]
                                  for k in ("replica_id", "node_id", "why", "quiet_s") if k in q} for _, q in killed]
    last_progress = min(when - q["quiet_s"] for when, q in killed)
    names = ", ".join(q["replica_id"] for _, q in killed)
    return (f"{what}; {noun} {names} made no progress and was replaced",
            max(seconds, time.monotonic() - last_progress))


def record_grader_retry(parts: RunParts, step: int, what: str, seconds: float, killed: list[tuple[float, dict]],
                        **details: Any) -> None:
    """One grader recovery entry; ``killed``: the frozen replicas the driver killed meanwhile
    (graders/autoscale.py ReplicaPinger)."""
    what, outage = with_replaced(what, seconds, killed, details, "grader replica")
    parts.recoveries.record("grader", step, what, seconds, outage_s=outage, **details)


def record_grader_outages(parts: RunParts, step: int) -> None:
    """Each spell the grader app had no running replica (all of them died and Serve started
    others) as a grader recovery entry lasting that long: calls routed around it left no retry
    to record. Taken on the step loop's thread, so the receipt is written from one thread."""
    if parts.grader_outages is None or parts.recoveries is None:
        return
    for _, seconds in parts.grader_outages():
        parts.recoveries.record("grader", step, f"the grader app had no running replica for {seconds:.1f} s; "
                                "Serve started new ones", seconds, outage_s=seconds)


def collect_flat(parts: RunParts, step: int, version: int, timer: PhaseTimer,
                 ahead: Future[Rollouts] | None = None) -> tuple[Rollouts, list[Any]]:
    """Flat GRPO: G completions per prompt (or those generated ahead), then one ScoreBatch."""
    with timer("gen"):
        ro = ahead.result() if ahead is not None else generate(parts, step, version)
    with timer("score"):
        scores = score(parts, ro)
    return ro, scores


def advantages(cfg: RunConfig, rewards: list[float], groups: list[int], valid: list[bool]) -> torch.Tensor:
    lc = cfg.learner
    return compute_advantages(
        torch.tensor(rewards, dtype=torch.float32), torch.tensor(groups), estimator=lc.advantage,
        scale_rewards=lc.scale_rewards, valid=torch.tensor(valid), invalid_advantage=lc.invalid_advantage,
    )


def train_batch(ro: Rollouts, rewards: list[float], adv: torch.Tensor) -> TrainBatch:
    return TrainBatch(
        prompt_ids=[s.prompt_token_ids for s in ro.samples],
        response_ids=[s.token_ids for s in ro.samples],
        rollout_logprobs=[s.logprobs for s in ro.samples],
        advantages=adv.tolist(),
        rewards=list(rewards),
        group_ids=list(ro.groups),
    )


# ---------------------------------------------------------------- the loop
def run_steps(parts: RunParts, first_step: int) -> None:
    """Train steps first_step..cfg.trainer.steps. Fits on one screen by design."""
    cfg = parts.cfg
    overlap = cfg.trainer.mode == "one_step_off"
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gen") if overlap else None
    ahead: Future[Rollouts] | None = None
    ahead_ended: Callable[[], float | None] = lambda: None
    collect = parts.collect or collect_flat
    try:
        for step in range(first_step, cfg.trainer.steps + 1):
            timer = PhaseTimer()
            ro, scores = collect(parts, step, parts.version, timer, ahead)
            with timer("adv"):
                rewards = [float(s.reward) for s in scores]
                valid = [bool(s.format_ok) for s in scores]
                adv = advantages(cfg, rewards, ro.groups, valid)
            if parts.archive is not None:  # on disk (untrained) before the learner sees it
                parts.archive(RoundRecord(step, ro, scores, rewards, adv.tolist()))
            if pool is not None and step < cfg.trainer.steps:  # sample t+1 with adapter v while v+1 trains
                ahead = pool.submit(generate, parts, step + 1, parts.version)
                ahead_ended = finished_at(ahead)
            result = parts.learner.step(train_batch(ro, rewards, adv))
            timer.add(result.phases_s)
            with timer("update_weights"):
                adapter = result.adapter  # version stamped by the learner (model.adapter.adapter_version)
                parts.rollout.publish(adapter)
                with_retries(lambda: parts.rollout.sync(adapter.version), f"sync adapter v{adapter.version}",
                             parts.cfg.rollout.max_retries, parts.cfg.rollout.retry_backoff_s,
                             _recorder(parts, "rollout", step, f"sync adapter v{adapter.version}"))
            parts.version = adapter.version
            live_s = timer.total()  # DESIGN.md: a step ends when its adapter is live on every replica
            if cfg.trainer.save_every and step % cfg.trainer.save_every == 0 or step == cfg.trainer.steps:
                with timer("save_checkpoint"):
                    parts.learner.save_checkpoint(step, parts.sampler.position(step + 1))
            # Optimizer steps between the oldest adapter that sampled this batch and the policy it
            # trained (0 on-policy; 1 with one_step_off once the pipeline is full).
            staleness = step - min(s.adapter_version for s in ro.samples)
            parts.record(StepRecord(
                step=step, rollouts=ro, scores=scores, rewards=rewards, advantages=adv.tolist(),
                learner_metrics=dict(result.metrics), phases_s=dict(timer.seconds), total_s=live_s,
                adapter_version=parts.version,
                extra={"frac_reward_zero_std": frac_reward_zero_std(torch.tensor(rewards), torch.tensor(ro.groups)),
                       "adapter_staleness": float(staleness),
                       # the generate call's own seconds; with one_step_off the `gen` phase is only
                       # the wait for it, the rest overlapped the previous update
                       "generate_s": ro.gen_seconds,
                       # 0 where no generation ran beside the sync (sync mode), as staleness is 0 there:
                       # one series on every run's dashboard
                       "update_weights_beside_gen_s": (seconds_beside(timer.spans.get("update_weights"), ahead_ended())
                                                       if overlap else 0.0)},
            ))
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
