"""The server's Prometheus metrics, in a registry of its own (two servers in one process stay apart)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

disable_created_metrics()  # the _created series only double the output


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.prefill = Counter("pace_prefill_tokens", "Prompt tokens prefilled", registry=r)
        self.reused = Counter("pace_reused_tokens",
                              "History tokens served from a kept or resumed session instead of prefilled", registry=r)
        self.generated = Counter("pace_generated_tokens", "Tokens generated", registry=r)
        self.requests = Counter("pace_requests", "Chat requests answered, by status", ["status"], registry=r)
        self.resumes = Counter("pace_session_resumes", "Sessions resumed from the store", registry=r)
        self.resume_failures = Counter("pace_session_resume_failures",
                                       "Resumes that failed (a corrupt or foreign save, or a store that did not answer): a fresh session was started",
                                       registry=r)
        self.rewinds = Counter("pace_session_rewinds", "Sessions cropped to an edited history", registry=r)
        self.rebuilds = Counter("pace_session_rebuilds",
                                "Sessions started over because an edit reached evicted tokens", registry=r)
        self.restores = Counter("pace_restores", "Cache restores of evicted spans from the tiers", registry=r)
        self.stall = Counter("pace_stall_seconds", "Seconds forwards waited for restores", registry=r)
        self.saves = Counter("pace_saves", "Turns saved to the store", registry=r)
        self.save_failures = Counter("pace_save_failures", "Saves that failed", registry=r)
        self.stale = Counter("pace_stale_sessions",
                             "Sessions held in memory that another replica saved since: resumed from the store",
                             registry=r)
        self.busy = Counter("pace_busy_sessions",
                            "Turns refused (409) because another replica held the session's lease", registry=r)
        self.retired = Counter("pace_retired_sessions", "Sessions deleted from the store by retention", registry=r)
        self.cancelled = Counter("pace_cancelled", "Generations stopped by a client disconnect", registry=r)
        self.rejected = Counter("pace_rejected", "Requests refused because the queue was full", registry=r)
        self.queue_depth = Gauge("pace_queue_depth", "Requests waiting for the model", registry=r)
        self.resident = Gauge("pace_resident_sessions", "Sessions whose cache is in memory", registry=r)
        self.parked = Gauge("pace_parked_sessions", "Sessions parked in the store by this server", registry=r)
        self.ttft = Histogram("pace_time_to_first_token_seconds", "From dequeue to the first token", registry=r)
