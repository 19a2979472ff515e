# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Prometheus metrics of sequence hooks, exported with vLLM's own metrics.

The lifecycle counts (`sequence_hooks.counts.HookCounts`); each engine's
adapter exports its coordinator's counts here after each step and each
abort (`SequenceHookMetrics.export`). Shared by both flavours (only
prometheus_client, no vLLM module). They are
created in the process that runs the hooks: V0's engine, V1's engine core.
When that is not the API server's process (`vllm serve`),
prometheus_client's multiprocess mode carries them to the API server's
`/metrics`: V0's server sets it up itself; on V1, stock vLLM sets it up
only with `--api-server-count` > 1, and the plugin's hooked server with
one (`vllm_sequence_hooks.server_metrics`, docs/v1.md).

Two names keep the seed's word "blocked" (its `SequenceStatus.BLOCKED`)
where the code says parked: `syncs_blocked` and `blocked_time_seconds`,
published metric names that dashboards read; each attribute is named as
its metric.
"""

from typing import Any

import prometheus_client

from sequence_hooks.counts import HookCounts

# Upper bounds (seconds) of the blocked-time histogram's buckets.
BLOCKED_TIME_BUCKETS = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 300.0
]

# The collectors of this process, by name: created once, shared by every
# engine (each labels them with its model name).
_COLLECTORS: dict[str, Any] = {}


def _collector(cls, name: str, documentation: str, **kwargs):
    """Returns the process's collector ``name``, registered.

    vLLM's own `Metrics` unregisters every "vllm" collector when an engine
    starts; registering the same object again keeps its values.
    """
    if name not in _COLLECTORS:
        _COLLECTORS[name] = cls(name,
                                documentation,
                                labelnames=["model_name"],
                                registry=None,
                                **kwargs)
    collector = _COLLECTORS[name]
    registry = prometheus_client.REGISTRY
    if collector not in registry._collector_to_names:
        registry.register(collector)
    return collector


# The counters, each named as its count.
COUNTERS = ("promises_spawned", "promises_refused", "syncs_blocked",
            "merged_tokens")
# The gauges the lifecycle keeps, each named as its count (a gauge's
# `inc` takes a negative change).
GAUGES = ("parents_parked", "children_running")


class SequenceHookMetrics:
    """The hook counters, gauges and histogram of one engine.

    Args:
        model_name: The served model name, the `model_name` label.
    """

    def __init__(self, model_name: str):
        # The counts exported so far: counters go up by the difference.
        self._exported = HookCounts()
        labels = {"model_name": model_name}
        self.promises_spawned = _collector(
            prometheus_client.Counter, "vllm:sequence_hook_promises_spawned",
            "Children spawned by <promise>.").labels(**labels)
        self.promises_refused = _collector(
            prometheus_client.Counter,
            "vllm:sequence_hook_promises_refused",
            "Promises that spawned nothing because a limit was reached.",
        ).labels(**labels)
        self.syncs_blocked = _collector(
            prometheus_client.Counter,
            "vllm:sequence_hook_syncs_blocked",
            "Syncs that parked their sequence until its children finished.",
        ).labels(**labels)
        self.blocked_time = _collector(
            prometheus_client.Histogram,
            "vllm:sequence_hook_blocked_time_seconds",
            "Time a sequence spent parked by <sync>, observed when it "
            "resumes or is aborted.",
            buckets=BLOCKED_TIME_BUCKETS).labels(**labels)
        self.parents_parked = _collector(
            prometheus_client.Gauge,
            "vllm:sequence_hook_parents_parked",
            "Sequences parked by <sync> now (aborted ones leave it).",
            multiprocess_mode="sum").labels(**labels)
        self.children_running = _collector(
            prometheus_client.Gauge,
            "vllm:sequence_hook_children_running",
            "Child sequences alive now (running, waiting or parked).",
            multiprocess_mode="sum").labels(**labels)
        self.kv_cache_usage = _collector(
            prometheus_client.Gauge,
            "vllm:sequence_hook_kv_cache_usage_perc",
            "Fraction of KV cache blocks in use, parked parents' included "
            "(vLLM 0.9.2 exports no KV usage on the CPU).",
            multiprocess_mode="sum").labels(**labels)
        self.merged_tokens = _collector(
            prometheus_client.Counter, "vllm:sequence_hook_merged_tokens",
            "Tokens appended to parents by merges.").labels(**labels)

    def export(self, counts: HookCounts) -> None:
        """Brings the metrics up to a coordinator's counts, each by what
        changed since the last export (the gauges too: engines of one
        process that share a model name add up, as they did when each
        moved the gauge itself); each parked time is observed once.

        Args:
            counts: The coordinator's counts (its blocked times taken).
        """
        for name in COUNTERS + GAUGES:
            change = getattr(counts, name) - getattr(self._exported, name)
            if change:
                getattr(self, name).inc(change)
                setattr(self._exported, name, getattr(counts, name))
        for seconds in counts.take_blocked_times():
            self.blocked_time.observe(seconds)
