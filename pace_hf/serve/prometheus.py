"""The server's Prometheus metrics, in a registry of its own (two servers in one process stay apart)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

disable_created_metrics()  # the _created series only double the output

# attribute: (kind, metric name, help, labels); one table, so a new metric is one line
METRICS = {
    "prefill": (Counter, "pace_prefill_tokens", "Prompt tokens prefilled", ()),
    "reused": (Counter, "pace_reused_tokens",
               "History tokens served from a kept or resumed session instead of prefilled", ()),
    "generated": (Counter, "pace_generated_tokens", "Tokens generated", ()),
    "requests": (Counter, "pace_requests", "Chat requests answered, by status", ("status",)),
    "resumes": (Counter, "pace_session_resumes", "Sessions resumed from the store", ()),
    "resume_failures": (Counter, "pace_session_resume_failures",
                        "Resumes that failed (a corrupt or foreign save, or a store that did not answer): a fresh "
                        "session was started", ()),
    "rewinds": (Counter, "pace_session_rewinds", "Sessions cropped to an edited history", ()),
    "rebuilds": (Counter, "pace_session_rebuilds", "Sessions started over because an edit reached evicted tokens", ()),
    "restores": (Counter, "pace_restores", "Cache restores of evicted spans from the tiers", ()),
    "stall": (Counter, "pace_stall_seconds", "Seconds forwards waited for restores", ()),
    "saves": (Counter, "pace_saves", "Turns saved to the store", ()),
    "save_failures": (Counter, "pace_save_failures", "Saves that failed", ()),
    "stale": (Counter, "pace_stale_sessions",
              "Sessions held in memory that another replica saved since: resumed from the store", ()),
    "busy": (Counter, "pace_busy_sessions", "Turns refused (409) because another replica held the session's lease", ()),
    "retired": (Counter, "pace_retired_sessions", "Sessions deleted from the store by retention", ()),
    "cancelled": (Counter, "pace_cancelled", "Generations stopped by a client disconnect", ()),
    "rejected": (Counter, "pace_rejected", "Requests refused because the queue was full", ()),
    "decode_steps": (Counter, "pace_decode_steps", "Batched decode forwards (one token for each active turn)", ()),
    "decode_rows": (Counter, "pace_decode_rows",
                    "Tokens those forwards decoded, one per active turn: rows / steps is the mean batch", ()),
    "queue_depth": (Gauge, "pace_queue_depth", "Requests waiting for the model", ()),
    "resident": (Gauge, "pace_resident_sessions", "Sessions whose cache is in memory", ()),
    "parked": (Gauge, "pace_parked_sessions", "Sessions parked in the store by this server", ()),
    "ttft": (Histogram, "pace_time_to_first_token_seconds", "From dequeue to the first token", ()),
}


class Metrics:
    """Every metric of ``METRICS`` as an attribute (``metrics.saves.inc()``), in ``registry``."""

    def __init__(self):
        self.registry = CollectorRegistry()
        for attribute, (kind, name, doc, labels) in METRICS.items():
            setattr(self, attribute, kind(name, doc, labels, registry=self.registry))
