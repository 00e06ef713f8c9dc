"""A bounded load test against a running `dsjax serve`: N streamed completions, C at a time, over HTTP.

    python -m dsjax.serving.loadgen --url http://127.0.0.1:8000 --requests 32 --concurrency 8 --max-tokens 32

Prints one JSON object: requests, failures, output tokens, wall time, output tokens/s, and p50/p90/p99 of time to
first token, time per output token (after the first) and end-to-end latency. Standard library only; every
request has a timeout, so a stuck server ends the run with failures rather than a hang.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import sys
import time
import urllib.error
import urllib.request


def _one(url: str, model: str, key: str | None, prompt: list[int], max_tokens: int, timeout: float) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), headers)
    t0 = time.perf_counter()
    first = None
    tokens = 0
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text") and first is None:
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    first = first or end
    return {"ttft": first - t0, "e2e": end - t0, "tokens": tokens,
            "tpot": (end - first) / (tokens - 1) if tokens > 1 else None}


def _pct(values, q):
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def run(url: str, *, requests: int, concurrency: int, max_tokens: int, prompt_len: int, key: str | None = None,
        timeout: float = 300, seed: int = 0) -> dict:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        model = json.loads(r.read())["data"][0]["id"]
    rng = random.Random(seed)
    prompts = [[0] + [rng.randrange(3, 120_000) for _ in range(prompt_len - 1)] for _ in range(requests)]
    results, failures = [], []
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(_one, url, model, key, p, max_tokens, timeout) for p in prompts]
        for f in concurrent.futures.as_completed(futures):
            try:
                results.append(f.result())
            except (urllib.error.URLError, OSError, ValueError) as e:
                failures.append(repr(e))
    wall = time.perf_counter() - t0
    out_tokens = sum(r["tokens"] for r in results)
    summary = {"requests": requests, "concurrency": concurrency, "max_tokens": max_tokens, "prompt_len": prompt_len,
               "ok": len(results), "failures": len(failures), "output_tokens": out_tokens, "wall_s": wall,
               "output_tokens_per_s": out_tokens / wall if wall else 0.0}
    for name in ("ttft", "tpot", "e2e"):
        for q in (50, 90, 99):
            summary[f"{name}_p{q}_s"] = _pct([r[name] for r in results], q)
    if failures:
        summary["first_failure"] = failures[0]
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsjax.serving.loadgen", description=__doc__.split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--timeout", type=float, default=300, help="seconds per request")
    args = p.parse_args(argv)
    if not (1 <= args.requests <= 10_000 and 1 <= args.concurrency <= 1024):
        p.error("--requests must lie in [1, 10000] and --concurrency in [1, 1024]")
    print(json.dumps(run(args.url, requests=args.requests, concurrency=args.concurrency, max_tokens=args.max_tokens,
                         prompt_len=args.prompt_len, key=args.api_key, timeout=args.timeout)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
