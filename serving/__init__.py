"""dsjax.serving: `dsjax serve` — one process serving gRPC and an OpenAI-compatible HTTP API over a
continuous-batching scheduler (installed as dsjax.serving; see docs/serving.md).

    config.py          ServeConfig and the `serve` flags
    engine.py          SlotEngine: fixed batch slots over one decode state; rows join and leave between dispatches
    engine_steps.py    its compiled programs besides the decode loops: rows joining, one prefill chunk
    scheduler.py       the engine thread: bounded queue, admission, chunked prefill, aborts, drain
    service.py         what both front ends share: model info, chat encoding, prompt limits, submit/abort
    openai_protocol.py OpenAI request validation (every field supported or refused by name)
    text.py            incremental detokenization and stop strings
    http_app.py        /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics
    grpc_service.py    Engine (Generate, Abort, GetModelInfo), grpc.health.v1, reflection
    auth.py, metrics.py  API key (constant-time), Prometheus metrics
    server.py          start-up, warm-up, SIGTERM drain; ServerThread for tests and notebooks
    kv_layout.py       a state row as bytes (trimmed compressed caches), compat hash
    kv_store.py        host KV store: one arena of blocks, LRU byte budget, leases, generations
    kv_ownership.py    Redis ownership hints (Lua claim / compare-and-delete, liveness, HMAC'd conversation ids)
    kv_peer.py         KvPeer service (Acquire / Pull / Renew / Release) over the host store
    kv_nixl.py         data path A: NIXL READ of a peer's arena (optional nixl_cu13)
    kv_handoff.py      where a turn's KV comes from (local / peer / recompute), snapshots and claims
    kv_bench.py        handoff vs recompute on loopback; bytes per token of the layouts
    proto/             engine.proto, kvpeer.proto and their generated stubs

Nothing here is imported by the model code (design principle 7).
"""
