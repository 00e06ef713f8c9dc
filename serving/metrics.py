"""Prometheus metrics of one server, in its own registry (several servers may live in one test process)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """TTFT, TPOT, end-to-end latency, queue time, tokens, prefix-cache hits, requests by finish reason, queue
    depth, running slots."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("dsjax_time_to_first_token_seconds", "Arrival to first generated token", registry=r,
                              buckets=_LATENCY)
        self.tpot = Histogram("dsjax_time_per_output_token_seconds", "Mean time between tokens after the first",
                              registry=r, buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0))
        self.e2e = Histogram("dsjax_request_latency_seconds", "Arrival to the last token", registry=r,
                             buckets=_LATENCY)
        self.queue_time = Histogram("dsjax_queue_time_seconds", "Arrival to joining a batch slot", registry=r,
                                    buckets=_LATENCY)
        self.prompt_tokens = Counter("dsjax_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("dsjax_generation_tokens", "Generated tokens", registry=r)
        self.requests = Counter("dsjax_requests", "Finished requests", ["finish_reason"], registry=r)
        self.rejected = Counter("dsjax_rejected_requests", "Requests refused before admission", ["reason"], registry=r)
        self.prefix_cache_queries = Counter("dsjax_prefix_cache_queries", "Admissions that looked up the prefix cache",
                                            registry=r)
        self.prefix_cache_hits = Counter("dsjax_prefix_cache_hits", "Admissions that started from a cached prefix",
                                         registry=r)
        self.cached_prompt_tokens = Counter("dsjax_prompt_tokens_cached", "Prompt tokens not prefilled again",
                                            registry=r)
        self.queue_depth = Gauge("dsjax_queue_depth", "Requests waiting for a slot", registry=r)
        self.running = Gauge("dsjax_running_slots", "Batch slots holding a request", registry=r)
        self.slots = Gauge("dsjax_batch_slots", "Batch slots (max-num-seqs)", registry=r)
        self.acceptance = Gauge("dsjax_acceptance_length", "Tokens per decode step per row (bonus token counted; "
                                "1 without speculative decoding)", registry=r)
        self.acceptance.set(1.0)
        self.spec_steps = Counter("dsjax_spec_decode_steps", "Draft-verify steps, summed over rows", registry=r)
        self.spec_drafted = Counter("dsjax_spec_decode_draft_tokens", "Draft tokens proposed", registry=r)
        self.spec_accepted = Counter("dsjax_spec_decode_accepted_tokens", "Draft tokens accepted", registry=r)
        self._spec_tokens = self._spec_row_steps = 0
        self.kv_source = Counter("dsjax_kv_source", "Turns of named conversations by where their KV came from",
                                 ["source"], registry=r)
        self.kv_bytes = Counter("dsjax_kv_handoff_bytes", "KV bytes pulled from peers", ["path"], registry=r)
        self.kv_transfer = Histogram("dsjax_kv_transfer_seconds", "Time to get a conversation's KV from its owner "
                                     "(lookup, acquire, transfer, verify), hit or miss", registry=r, buckets=_LATENCY)
        self.kv_discarded = Counter("dsjax_kv_discarded_bytes", "Bytes that arrived from a peer in a transfer that "
                                    "failed, and were dropped", registry=r)
        self.kv_failures = Counter("dsjax_kv_handoff_failures", "Handoffs that ended in a recompute, by reason",
                                   ["reason"], registry=r)
        for source in ("local", "peer", "recompute"):
            self.kv_source.labels(source=source)
        self.info = Gauge("dsjax_model_info", "The served model", ["model"], registry=r)
        self.info.labels(model=model_name).set(1)
        self.started = time.time()

    def finished(self, req, reason: str | None) -> None:
        now = time.monotonic()
        self.requests.labels(finish_reason=reason or "unknown").inc()
        self.e2e.observe(now - req.arrival)
        if req.first_token_at is not None and req.generated > 1:
            self.tpot.observe((now - req.first_token_at) / (req.generated - 1))

    def speculative(self, row_steps: int, drafted: int, accepted: int, tokens: int) -> None:
        """One row's share of a speculative dispatch; the acceptance length is tokens per row step overall."""
        self.spec_steps.inc(row_steps)
        self.spec_drafted.inc(drafted)
        self.spec_accepted.inc(accepted)
        self._spec_tokens += tokens
        self._spec_row_steps += row_steps
        self.acceptance.set(self._spec_tokens / self._spec_row_steps)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
