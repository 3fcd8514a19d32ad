"""The server's `/metrics`: Prometheus' text exposition format (version 0.0.4), written here (the
server needs no client library; tests/serve/test_metrics.py reads it with prometheus_client's parser).

    jaxspec_kv_blocks{state="used"|"cached"|"free"}  gauge: the KV pool's blocks held by running requests,
                                                     cached (a prompt's blocks nobody holds: reusable
                                                     until evicted) and never used or evicted
    jaxspec_kv_blocks_total                          gauge: blocks in the pool
    jaxspec_prefix_cache_queried_tokens_total        counter: prompt tokens admitted
    jaxspec_prefix_cache_hit_tokens_total            counter: of them, found cached (not prefilled)
    jaxspec_prefix_cache_hit_rate                    gauge: hit / queried tokens since start (0 before any)
    jaxspec_prefix_cache_evicted_blocks_total        counter: cached blocks handed to another request
    jaxspec_queue_depth                              gauge: requests waiting for a slot or blocks
    jaxspec_running_requests                         gauge: requests in the batch (prefilling or decoding)
    jaxspec_generated_tokens_total                   counter: tokens the batch produced for requests
    jaxspec_requests_served_total                    counter: requests answered to the end
    jaxspec_time_to_first_token_seconds              histogram: a request's queueing + prefill until its
                                                     first token is handed to its response
    jaxspec_inter_token_latency_seconds              histogram: seconds per token between a request's
                                                     deliveries (n tokens after a gap of t: n times t / n)

The counters the engine keeps (the pool's) restart with an engine the scheduler rebuilds after an
internal failure; the scheduler adds the old engine's to its base, so they never go down.
"""
from __future__ import annotations

import bisect
import math
import threading

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds: a CPU's first token takes seconds, an H200's tens of milliseconds (vLLM's TTFT buckets, widened).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Histogram:
    """Cumulative buckets (upper bounds `bounds`, then +Inf), a sum and a count."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds, self.counts, self.sum, self.count = tuple(bounds), [0] * (len(bounds) + 1), 0.0, 0

    def observe(self, v: float, n: int = 1) -> None:
        if not math.isfinite(v) or n < 1:  # a clock's hiccup is no observation
            return
        self.counts[bisect.bisect_left(self.bounds, v)] += n
        self.sum += v * n
        self.count += n

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for b, c in zip(self.bounds + (math.inf,), self.counts):
            total += c
            out.append(f'{name}_bucket{{le="{_num(b)}"}} {total}')
        return out + [f"{name}_sum {_num(self.sum)}", f"{name}_count {self.count}"]


class Metrics:
    """What the scheduler's worker records as requests run (`first`, `more`, `generated`), read by
    /metrics from the event loop's thread (a lock around both)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ttft, self.itl = Histogram(TTFT_BUCKETS), Histogram(ITL_BUCKETS)
        self.generated = 0
        self.base = dict(queried=0, hit=0, evicted=0)  # the pool counters of engines since dropped

    def tokens(self, n: int, *, first_s: float | None = None, gap_s: float | None = None) -> None:
        """`n` tokens delivered to a request: its first delivery `first_s` after it arrived (the
        first token's latency; the rest came with it), or a later one `gap_s` after its last."""
        with self.lock:
            self.generated += n
            if first_s is not None:
                self.ttft.observe(first_s)
            elif gap_s is not None and n:
                self.itl.observe(gap_s / n, n)

    def retire(self, pool) -> None:
        """An engine is dropped: keep its pool's counters."""
        with self.lock:
            for k in self.base:
                self.base[k] += getattr(pool, k)

    def render(self, *, pool, waiting: int, running: int, served: int) -> str:
        """The exposition text; `pool`: the engine's `prefix_cache.BlockPool`, or None before the
        engine is built (its gauges are 0)."""
        with self.lock:
            queried, hit, evicted = (self.base[k] + (getattr(pool, k) if pool else 0)
                                     for k in ("queried", "hit", "evicted"))
            used, cached, free = (pool.used, len(pool.idle), len(pool.free)) if pool else (0, 0, 0)
            out = []
            out += _family("jaxspec_kv_blocks", "gauge", "KV pool blocks by state: held by running requests, "
                           "cached (reusable until evicted), free",
                           [f'jaxspec_kv_blocks{{state="{s}"}} {v}'
                            for s, v in (("used", used), ("cached", cached), ("free", free))])
            out += _one("jaxspec_kv_blocks_total", "gauge", "KV pool blocks", pool.num_blocks if pool else 0)
            out += _one("jaxspec_prefix_cache_queried_tokens_total", "counter", "prompt tokens admitted", queried)
            out += _one("jaxspec_prefix_cache_hit_tokens_total", "counter",
                        "prompt tokens found cached (not prefilled again)", hit)
            out += _one("jaxspec_prefix_cache_hit_rate", "gauge", "hit / queried prompt tokens since start",
                        hit / queried if queried else 0.0)
            out += _one("jaxspec_prefix_cache_evicted_blocks_total", "counter",
                        "cached KV blocks evicted for another request", evicted)
            out += _one("jaxspec_queue_depth", "gauge", "requests waiting for a slot or KV blocks", waiting)
            out += _one("jaxspec_running_requests", "gauge", "requests in the batch", running)
            out += _one("jaxspec_generated_tokens_total", "counter", "tokens generated for requests", self.generated)
            out += _one("jaxspec_requests_served_total", "counter", "requests answered to the end", served)
            out += _family("jaxspec_time_to_first_token_seconds", "histogram",
                           "seconds from a request's arrival to its first token", self.ttft.lines(
                               "jaxspec_time_to_first_token_seconds"))
            out += _family("jaxspec_inter_token_latency_seconds", "histogram",
                           "seconds per token between a request's token deliveries",
                           self.itl.lines("jaxspec_inter_token_latency_seconds"))
        return "\n".join(out) + "\n"


def _family(name: str, kind: str, help_: str, samples: list[str]) -> list[str]:
    return [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *samples]


def _one(name: str, kind: str, help_: str, value) -> list[str]:
    return _family(name, kind, help_, [f"{name} {_num(value)}"])


def _num(v) -> str:
    if isinstance(v, int):
        return str(v)
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))
