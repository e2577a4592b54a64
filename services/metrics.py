"""The trainer's Prometheus metrics: one registry, one /metrics endpoint in the driver process.

Names are fixed by DESIGN.md ("Prometheus metric names"); the Grafana dashboard and the alert
rules in deploy/ query exactly these. Everything is recorded once per trained step by
``TrainerMetrics.record_step``; gauges hold the last step, the histogram and the counter
accumulate. ``series_counts()`` says how many points each series received (for run.json).

Only prometheus_client is imported here: no Ray, no torch.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections import Counter as _Tally
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from config.run import TrainerConfig
from records.exec_result import EXEC_STATUSES
from records.run_dir import PHASES as STEP_PHASES

_TRAINER = TrainerConfig()  # the schema's defaults: declared there, read here

# Phase names of DESIGN.md, in step order. `total` is wall time from the step's start to the
# adapter being live on every replica; `save_checkpoint` only exists on steps that save.
PHASES: tuple[str, ...] = (
    *STEP_PHASES,
    "total",
)

# Scalar step metrics exported as gauges: key of `record_step(metrics=...)` -> (name, help).
# Keys not listed here are accepted and ignored (metrics.jsonl keeps every scalar; Prometheus
# exports this fixed, bounded set).
STEP_GAUGES: dict[str, tuple[str, str]] = {
    "ppl_ratio": (
        "counterpoint_ppl_ratio",
        "Training ppl over rollout ppl, mean_i exp(d_i); 1.0 = engines agree.",
    ),
    "rollout_kl": ("counterpoint_rollout_kl", "Token-mean(rollout logp - trainer logp)."),
    "rollout_k3_kl": (
        "counterpoint_rollout_k3_kl", "Token-mean k3 estimator of KL(rollout || trainer)."
    ),
    "reward_mean": ("counterpoint_reward_mean", "Mean reward of the step's completions."),
    "pass_rate": (
        "counterpoint_pass_rate", "Fraction of the step's completions that pass the verifier."
    ),
    "frac_reward_zero_std": (
        "counterpoint_frac_reward_zero_std",
        "Fraction of prompt groups whose rewards all tie (no learning signal).",
    ),
    "kl": ("counterpoint_kl", "KL of the policy to the reference model (learner estimate)."),
    "entropy": (
        "counterpoint_entropy", "Mean token entropy of the policy on the step's completions."
    ),
    "grad_norm": ("counterpoint_grad_norm", "Gradient norm before clipping."),
    "learning_rate": ("counterpoint_learning_rate", "Learning rate of the step's update."),
    "adapter_staleness": (
        "counterpoint_adapter_staleness",
        "Policy versions between the adapter that sampled and the one updated (one-step-off mode).",
    ),
    "tokens_per_second": (
        "counterpoint_tokens_per_second",
        "Generated tokens per second of the gen phase (defaults to tokens / phases_s['gen']).",
    ),
    "update_weights_beside_gen_s": (
        "counterpoint_update_weights_beside_gen_seconds",
        "Seconds of the step's update_weights phase during which the next step's generation still ran "
        "(one_step_off: a merging replica loads the adapter after it; not a slow transfer).",
    ),
}

# Every name a scrape of the trainer shows (the histogram and counter as exposed on the wire).
METRIC_NAMES: tuple[str, ...] = (
    *(name for name, _ in STEP_GAUGES.values()),
    "counterpoint_phase_seconds",
    "counterpoint_phase_duration_seconds",
    "counterpoint_step",
    "counterpoint_step_seconds",
    "counterpoint_adapter_version",
    "counterpoint_generated_tokens_total",
    "counterpoint_last_step_timestamp_seconds",
    "counterpoint_recoveries_total",
)

# Tree mode (issue 14): the round diagnostics of search/diagnostics.py, exported by
# ``record_search`` from the step's `search_*` scalars. Key (without `search_`) -> (name, help).
SEARCH_GAUGES: dict[str, tuple[str, str]] = {
    "valid_share": ("counterpoint_search_valid_share", "Share of the round's nodes with status ok."),
    "debug_success_rate": (
        "counterpoint_search_debug_success_rate", "Share of the round's debug nodes that are ok."
    ),
    "improve_success_rate": (
        "counterpoint_search_improve_success_rate",
        "Share of the round's improve nodes that are ok and beat their parent on the selection metric.",
    ),
    "reward_mean": ("counterpoint_search_reward_mean", "Mean reward of the round's nodes."),
    "reward_std": ("counterpoint_search_reward_std", "Population std of the round's node rewards."),
    "frac_groups_zero_reward_std": (
        "counterpoint_search_frac_groups_zero_reward_std",
        "Share of the round's sibling groups whose rewards all tie (no learning signal).",
    ),
    "model_families": (
        "counterpoint_search_model_families", "Distinct model families among the round's valid nodes."
    ),
    "honest_test_metric": (
        "counterpoint_search_honest_test_metric",
        "Test metric of the node the search chose on the selection metric (task's own scale).",
    ),
    "tree_nodes": ("counterpoint_search_tree_nodes", "Nodes of the search tree after the round."),
}
SEARCH_STATUSES = EXEC_STATUSES  # bounded label values
SEARCH_MODES = ("draft", "improve", "debug")
# The round against the task's reference ladder (search/diagnostics.py `<stat>_vs_<rung>`): one
# series per (rung, stat), labelled rather than named per rung. Rungs are the ladder's (ladder.json
# beside the tasks: a handful), so the label stays bounded.
SEARCH_LADDER_STATS = ("best", "median", "honest")
_LADDER_KEY = re.compile(rf"search_({'|'.join(SEARCH_LADDER_STATS)})_vs_(\w+)")
_SELECTION_KEY = re.compile(r"search_(best|median)_(val|test)_metric")
SEARCH_METRIC_NAMES: tuple[str, ...] = (
    *(name for name, _ in SEARCH_GAUGES.values()),
    "counterpoint_search_nodes",
    "counterpoint_search_mode_nodes",
    "counterpoint_search_gen_seconds",
    "counterpoint_search_vs_ladder",
    "counterpoint_search_selection_metric",
)

# Step phases span milliseconds (adv) to many minutes (gen/update on a big model).
PHASE_BUCKETS: tuple[float, ...] = (
    0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, float("inf"),
)


class TrainerMetrics:
    """Owns the trainer's CollectorRegistry and serves it on ``host:port`` once started."""

    def __init__(self, host: str = _TRAINER.metrics_host, port: int = _TRAINER.metrics_port) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"metrics port {port} is outside 0..65535")
        self.host = host
        self.port = port
        self.registry = CollectorRegistry(auto_describe=True)
        self._server = None
        self._lock = threading.Lock()
        self._points: _Tally[str] = _Tally()
        reg = self.registry
        self._gauges = {
            key: Gauge(name, doc, registry=reg) for key, (name, doc) in STEP_GAUGES.items()
        }
        self._phase_seconds = Gauge(
            "counterpoint_phase_seconds", "Seconds spent in each phase of the last step.",
            ["phase"], registry=reg,
        )
        self._phase_duration = Histogram(
            "counterpoint_phase_duration_seconds", "Seconds per phase, every step.",
            ["phase"], buckets=PHASE_BUCKETS, registry=reg,
        )
        self._step = Gauge("counterpoint_step", "Last trained step.", registry=reg)
        self._step_seconds = Gauge(
            "counterpoint_step_seconds", "Wall seconds of the last step (phase total).",
            registry=reg,
        )
        self._adapter_version = Gauge(
            "counterpoint_adapter_version", "Adapter version published by the last step.",
            registry=reg,
        )
        # prometheus_client appends `_total` on the wire: counterpoint_generated_tokens_total.
        self._generated_tokens = Counter(
            "counterpoint_generated_tokens", "Completion tokens generated for training.",
            registry=reg,
        )
        self._last_step_ts = Gauge(
            "counterpoint_last_step_timestamp_seconds", "Unix time the last step finished.",
            registry=reg,
        )
        # One series per part of services/recovery.py's bounded set, at 0 from the start, so an
        # increase() over a window that holds the first recovery sees it.
        from services.recovery import PARTS as RECOVERY_PARTS

        self._recoveries = Counter(
            "counterpoint_recoveries", "Failures a run recovered from (or stopped at), per part "
            "(rollout, grader, learner, node, driver); run.json `recoveries` says what each was.",
            ["part"], registry=reg,
        )
        for part in RECOVERY_PARTS:
            self._recoveries.labels(part=part)
        self._base_shared = Gauge(
            "counterpoint_base_weights_shared", "1 when the learner maps the rollout replica's base weights "
            "(one copy on the GPU), 0 when it holds its own copy (run.json `base_weights` says why).",
            registry=reg,
        )

    def record_base_weights(self, shared: bool) -> None:
        self._base_shared.set(1.0 if shared else 0.0)
        with self._lock:
            self._points["counterpoint_base_weights_shared"] += 1

    def start(self) -> int:
        """Serve /metrics; return the bound port (port 0 picks a free one)."""
        if self._server is not None:
            raise RuntimeError(f"metrics server already serving on {self.host}:{self.port}")
        try:
            server, _thread = start_http_server(self.port, addr=self.host, registry=self.registry)
        except OSError as err:
            raise OSError(f"cannot serve /metrics on {self.host}:{self.port}: {err}") from err
        self._server = server
        self.port = server.server_port
        return self.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def record_step(
        self,
        step: int,
        metrics: Mapping[str, float],
        phases_s: Mapping[str, float],
        generated_tokens: int,
        adapter_version: int,
    ) -> None:
        """Export one trained step. ``phases_s`` must hold ``total``; unknown phases are errors."""
        unknown = sorted(set(phases_s) - set(PHASES))
        if unknown:
            raise ValueError(
                f"unknown phase name(s) {unknown}; expected a subset of {list(PHASES)}"
            )
        if "total" not in phases_s:
            raise ValueError("phases_s lacks 'total' (wall time of the step)")
        bad = {k: v for k, v in phases_s.items() if not (math.isfinite(v) and v >= 0)}
        if bad:
            raise ValueError(f"phase durations must be finite and >= 0, got {bad}")
        if generated_tokens < 0:
            raise ValueError(f"generated_tokens must be >= 0, got {generated_tokens}")

        # None = not measured this step (e.g. staleness in sync mode): the gauge keeps its value.
        values = {k: float(v) for k, v in metrics.items() if k in STEP_GAUGES and v is not None}
        if "tokens_per_second" not in values and phases_s.get("gen", 0) > 0:
            values["tokens_per_second"] = generated_tokens / phases_s["gen"]

        with self._lock:
            for key, value in values.items():
                self._gauges[key].set(value)
                self._points[STEP_GAUGES[key][0]] += 1
            # Every phase gets a gauge value each step (0 when absent, e.g. save_checkpoint), so a
            # stacked panel of the last step never shows a previous step's checkpoint time.
            for phase in PHASES:
                seconds = float(phases_s.get(phase, 0.0))
                self._phase_seconds.labels(phase=phase).set(seconds)
                self._points[f'counterpoint_phase_seconds{{phase="{phase}"}}'] += 1
                if phase in phases_s:
                    self._phase_duration.labels(phase=phase).observe(seconds)
                    self._points[f'counterpoint_phase_duration_seconds{{phase="{phase}"}}'] += 1
            self._step.set(step)
            self._step_seconds.set(float(phases_s["total"]))
            self._adapter_version.set(adapter_version)
            self._generated_tokens.inc(generated_tokens)
            self._last_step_ts.set(time.time())
            for name in (
                "counterpoint_step",
                "counterpoint_step_seconds",
                "counterpoint_adapter_version",
                "counterpoint_generated_tokens_total",
                "counterpoint_last_step_timestamp_seconds",
            ):
                self._points[name] += 1

    def record_search(self, scalars: Mapping[str, float | int | None]) -> None:
        """Export a tree round's diagnostics (the step's `search_*` scalars). The gauges are
        registered on the first call, so a flat run never shows counterpoint_search_* at 0."""
        with self._lock:
            if not hasattr(self, "_search"):
                reg = self.registry
                self._search = {k: Gauge(n, doc, registry=reg) for k, (n, doc) in SEARCH_GAUGES.items()}
                self._search_nodes = Gauge("counterpoint_search_nodes", "Nodes of the last round per status.",
                                           ["status"], registry=reg)
                self._search_modes = Gauge("counterpoint_search_mode_nodes", "Nodes of the last round per mode.",
                                           ["mode"], registry=reg)
                self._search_seconds = Gauge(
                    "counterpoint_search_gen_seconds",
                    "Seconds of the last round spent generating (part=llm) and executing (part=exec).",
                    ["part"], registry=reg)
                self._search_ladder = Gauge(
                    "counterpoint_search_vs_ladder",
                    "Last round against each rung of the task's reference ladder, oriented (positive = "
                    "better than the rung): stat=best|median is the round's best|median selection metric "
                    "minus the rung's, stat=honest the chosen node's test metric minus the rung's.",
                    ["rung", "stat"], registry=reg)
                self._search_selection = Gauge(
                    "counterpoint_search_selection_metric",
                    "Best|median selection metric (search.select_on) of the last round's valid nodes, on "
                    "the task's own scale.", ["stat", "split"], registry=reg)
            for key, gauge in self._search.items():
                value = scalars.get(f"search_{key}")
                if value is not None:  # None = not defined this round (no debug nodes, ...)
                    gauge.set(float(value))
                    self._points[SEARCH_GAUGES[key][0]] += 1
            for status in SEARCH_STATUSES:
                self._search_nodes.labels(status=status).set(float(scalars.get(f"search_status_{status}") or 0))
                self._points[f'counterpoint_search_nodes{{status="{status}"}}'] += 1
            for mode in SEARCH_MODES:
                self._search_modes.labels(mode=mode).set(float(scalars.get(f"search_mode_{mode}") or 0))
                self._points[f'counterpoint_search_mode_nodes{{mode="{mode}"}}'] += 1
            for part in ("llm", "exec"):
                self._search_seconds.labels(part=part).set(float(scalars.get(f"search_gen_{part}_seconds") or 0))
                self._points[f'counterpoint_search_gen_seconds{{part="{part}"}}'] += 1
            # Per-round values that a round may lack (no valid node: None): the series is removed
            # rather than left at an earlier round's value, so a panel shows the gap.
            for key, value in scalars.items():
                if m := _LADDER_KEY.fullmatch(key):
                    self._set_or_remove(self._search_ladder, "counterpoint_search_vs_ladder", value,
                                        rung=m.group(2), stat=m.group(1))
                elif m := _SELECTION_KEY.fullmatch(key):
                    self._set_or_remove(self._search_selection, "counterpoint_search_selection_metric", value,
                                        stat=m.group(1), split=m.group(2))

    def record_recovery(self, entry) -> None:
        """One services.recovery.Recovery: counterpoint_recoveries_total{part} + 1."""
        self._recoveries.labels(part=entry.part).inc()
        with self._lock:
            self._points[f'counterpoint_recoveries_total{{part="{entry.part}"}}'] += 1

    def _set_or_remove(self, gauge: Gauge, name: str, value: float | int | None, **labels: str) -> None:
        if value is None:
            try:
                gauge.remove(*labels.values())
            except KeyError:  # never set
                pass
            return
        gauge.labels(**labels).set(float(value))
        self._points[name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"] += 1

    def series_counts(self) -> dict[str, int]:
        """Series name (with labels where it has some) -> points recorded, sorted by name."""
        with self._lock:
            return dict(sorted(self._points.items()))
