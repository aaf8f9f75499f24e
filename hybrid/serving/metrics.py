"""The server's `/metrics`: Prometheus text exposition of the engine's and the runner's counters.

Gauges and counters as Prometheus names them (`_total` for counters), every name prefixed `hybrid_`, and one
histogram, `hybrid_engine_step_seconds` (the wall time of each engine step: one forward of about
`max_num_batched_tokens` tokens, decode and prefill chunks together), with cumulative `_bucket{le=...}`
lines, `_sum` and `_count` (https://prometheus.io/docs/instrumenting/exposition_formats/).
"""

from __future__ import annotations

import threading
import time

STEP_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Histogram:
    """Observations counted into cumulative buckets of upper bounds `buckets` (seconds), plus +Inf.
    `observe` is called from the engine's thread, `lines` from the server's: a lock keeps the buckets,
    sum and count of one exposition consistent."""

    def __init__(self, buckets: tuple[float, ...] = STEP_SECONDS_BUCKETS):
        if list(buckets) != sorted(set(buckets)):
            raise ValueError(f"histogram buckets must increase, got {buckets}")
        self.buckets = tuple(buckets)
        self._counts = [0] * (len(buckets) + 1)  # per bucket, not cumulative; the last: above every bound
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        i = next((i for i, bound in enumerate(self.buckets) if value <= bound), len(self.buckets))
        with self._lock:
            self._counts[i] += 1
            self._sum += value

    @property
    def count(self) -> int:
        with self._lock:
            return sum(self._counts)

    def lines(self, name: str, help_text: str) -> list[str]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        out = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        running = 0
        for bound, n in zip(self.buckets + (float("inf"),), counts):
            running += n
            out.append(f'{name}_bucket{{le="{"+Inf" if bound == float("inf") else format(bound, "g")}"}} {running}')
        return out + [f"{name}_sum {total:.6f}", f"{name}_count {running}"]


def exposition(runner) -> str:
    """The Prometheus text of `runner` (a `hybrid.serving.runner.EngineRunner`, which imports this module)
    and its engine, read between the engine's steps or during one (each
    number is read once; they may be a step apart from each other)."""
    e = runner.engine
    lines: list[str] = []

    def metric(name: str, kind: str, value, help_text: str) -> None:
        lines.extend([f"# HELP hybrid_{name} {help_text}", f"# TYPE hybrid_{name} {kind}", f"hybrid_{name} {value}"])

    metric("requests_running", "gauge", len(e.scheduler.running), "requests holding a state slot")
    metric("requests_waiting", "gauge", len(e.scheduler.waiting), "requests queued or preempted")
    metric("kv_blocks_used", "gauge", e.blocks.num_blocks - e.blocks.num_free, "KV blocks held by requests")
    metric("kv_blocks_total", "gauge", e.blocks.num_blocks, "KV blocks in the pool")
    metric("state_slots_used", "gauge", e.slots.num_slots - e.slots.num_free, "Mamba state slots held")
    metric("state_slots_total", "gauge", e.slots.num_slots, "Mamba state slots")
    prefix = e.prefix
    metric("prefix_cache_hits_total", "counter", prefix.hits if prefix else 0, "admissions resumed from the prefix cache")
    metric("prefix_cache_queries_total", "counter", prefix.queries if prefix else 0, "admissions looked up")
    metric("prefix_cache_tokens_total", "counter", prefix.cached_tokens if prefix else 0,
           "prompt tokens served by the prefix cache")
    metric("prefix_cache_snapshots", "gauge", len(prefix.snapshots) if prefix else 0,
           "Mamba state snapshots kept by the prefix cache")
    metric("prefix_cache_snapshot_bytes", "gauge", prefix.nbytes if prefix else 0,
           "bytes of the prefix cache's snapshots (their bound: the engine's prefix_cache_bytes)")
    metric("prefix_cache_blocks", "gauge", e.blocks.num_cached() if prefix else 0,
           "KV blocks named by a cached prefix, held by requests or free (free ones are handed out last)")
    metric("preemptions_total", "counter", e.scheduler.num_preemptions, "requests preempted for KV blocks")
    spec = e.speculative_stats
    if spec is not None:  # vLLM's spec_decode counters under this prefix
        metric("spec_decode_num_drafts_total", "counter", spec.rounds, "verifications of drafted tokens")
        metric("spec_decode_num_draft_tokens_total", "counter", spec.drafted, "tokens drafted and verified")
        metric("spec_decode_num_accepted_tokens_total", "counter", spec.accepted, "drafted tokens accepted")
        metric("spec_decode_acceptance_rate", "gauge", f"{spec.acceptance_rate:.4f}",
               "accepted / drafted tokens since the server started")
    metric("generation_tokens_total", "counter", runner.generated_tokens, "tokens generated")
    elapsed = max(time.monotonic() - runner.started, 1e-9)
    metric("generation_tokens_per_second", "gauge", f"{runner.generated_tokens / elapsed:.3f}",
           "tokens generated per second since the server started")
    lines += runner.step_seconds.lines("hybrid_engine_step_seconds",
                                       "wall time of each engine step (one forward, decode and prefill together)")
    return "\n".join(lines) + "\n"
