"""`dsjax serve` flags (names users know from vLLM / SGLang) and the one `ServeConfig` they become."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from dsjax.config import NUMERICS, kernels_arg
from dsjax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    model: str = "dsjax-small"
    served_model_name: str | None = None
    numerics: str = "reference-bf16"
    kernels: str = "auto"
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    max_num_seqs: int = 8
    max_model_len: int | None = None
    speculative_config: dict | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 50051            # -1: no gRPC server
    api_key: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    max_queue: int = 256
    prefill_chunk: int = 64
    prefill_schedule: str = "exact"   # V4.1: "replay" runs the decoder layers over each prompt's last window only
    steps_per_dispatch: int = 8
    max_logprobs: int = 20
    prefix_cache_entries: int = 8
    max_request_bytes: int = 4 << 20
    drain_timeout: float = 30.0
    default_thinking: bool = True
    allow_remote_images: bool = False  # fetch http(s) image_url parts (off: only data URLs are accepted)
    weights_seed: int = 0
    compilation_cache: str | None = "default"
    mem_fraction: float | None = None
    skip_memory_check: bool = False
    log_level: str = "info"
    # KV handoff between servers (serving-kv-handoff.md §8)
    redis_url: str | None = None
    server_id: str | None = None
    kv_peer_port: int = -1            # -1: no KvPeer service (and no handoff)
    cluster_token: str | None = None
    kv_store_bytes: int = 1 << 30
    kv_handoff_timeout: float = 2.0  # the budget's cap (seconds)
    kv_handoff_alpha: float = 0.5     # budget = α × the estimated prefill the pull saves ...
    kv_handoff_floor: float = 0.25    # ... but at least this (seconds), and never past the request's deadline
    kv_lease_seconds: float = 30.0    # a lease the puller stops renewing is freed after this
    kv_transport: str = "auto"        # auto (NIXL when importable) | nixl | grpc
    kv_test_chunk_delay: float = 0.0  # tests only: seconds between Pull chunks
    kv_chunk_bytes: int = 1 << 20

    def validate(self) -> "ServeConfig":
        def positive(name, lo=1):
            if getattr(self, name) < lo:
                raise ConfigError(f"--{name.replace('_', '-')} must be ≥ {lo}, got {getattr(self, name)}")
        for name in ("tensor_parallel_size", "data_parallel_size", "max_num_seqs", "max_queue", "prefill_chunk",
                     "steps_per_dispatch", "max_request_bytes"):
            positive(name)
        positive("max_logprobs", 0)
        positive("prefix_cache_entries", 0)
        if self.max_model_len is not None:
            positive("max_model_len", 2)
        if self.max_num_seqs % self.data_parallel_size:
            raise ConfigError(f"--max-num-seqs {self.max_num_seqs} must be a multiple of --data-parallel-size "
                              f"{self.data_parallel_size}")
        self.num_speculative_tokens  # validates the JSON's contents
        if self.prefill_schedule not in ("exact", "replay"):
            raise ConfigError(f"--prefill-schedule must be exact or replay, got {self.prefill_schedule!r}")
        if self.prefill_schedule == "replay" and self.speculative_config:
            raise ConfigError("--prefill-schedule replay serves without --speculative-config")
        if self.kv_peer_port >= 0 and not self.cluster_token:
            raise ConfigError("--kv-peer-port needs --cluster-token-file (peers authenticate every KvPeer call)")
        if self.redis_url and self.kv_peer_port < 0:
            raise ConfigError("--redis-url needs --kv-peer-port (the port peers pull this server's KV from)")
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"--redis-url must be redis://host:port[/db] (or rediss://, unix://), got {self.redis_url!r}")
        if self.kv_transport not in ("auto", "nixl", "grpc"):
            raise ConfigError(f"--kv-transport must be auto, nixl or grpc, got {self.kv_transport!r}")
        positive("kv_store_bytes")
        if not (self.kv_handoff_alpha > 0 and 0 <= self.kv_handoff_floor <= self.kv_handoff_timeout
                and self.kv_lease_seconds > 0):
            raise ConfigError("--kv-handoff-alpha and --kv-lease-seconds must be > 0, and 0 ≤ --kv-handoff-floor ≤ "
                              "--kv-handoff-timeout")
        positive("kv_chunk_bytes", 4096)
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise ConfigError("TLS needs both --ssl-certfile and --ssl-keyfile")
        for path in (self.ssl_certfile, self.ssl_keyfile):
            if path and not os.path.isfile(path):
                raise ConfigError(f"TLS file {path} does not exist")
        return self

    @property
    def num_speculative_tokens(self) -> int:
        """Draft tokens per step from --speculative-config (vLLM's JSON: method mtp, num_speculative_tokens k);
        0 without it."""
        spec = self.speculative_config
        if not spec:
            return 0
        if not isinstance(spec, dict):
            raise ConfigError(f"--speculative-config must be a JSON object, got {spec!r}")
        unknown = set(spec) - {"method", "num_speculative_tokens"}
        if unknown:
            raise ConfigError(f"--speculative-config: unsupported key(s) {sorted(unknown)}; supported: method, "
                              "num_speculative_tokens")
        method = spec.get("method", "mtp")
        if method not in ("mtp", "deepseek_mtp"):
            raise ConfigError(f"--speculative-config: method {method!r} is not served; use \"mtp\" (V4's MTP head)")
        k = spec.get("num_speculative_tokens", 2)
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 8:
            raise ConfigError(f"--speculative-config: num_speculative_tokens must be an integer in [1, 8], got {k!r}")
        return k

    @property
    def model_id(self) -> str:
        return self.served_model_name or self.model


def add_serve_args(p: argparse.ArgumentParser) -> None:
    d = ServeConfig()
    g = p.add_argument_group("model")
    g.add_argument("--model", default=d.model, help="checkpoint directory, bundled checkpoint or preset name (default: dsjax-small, the trained bundled model)")
    g.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    g.add_argument("--numerics", default=d.numerics, choices=NUMERICS)
    g.add_argument("--kernels", default=d.kernels, type=kernels_arg,
                   help="auto | pallas | xla | reference, then optional per-op overrides (auto+moe_gemm=xla)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size)
    g.add_argument("--data-parallel-size", "-dp", type=int, default=d.data_parallel_size)
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="batch slots decoded together")
    g.add_argument("--max-model-len", type=int, default=None, help="tokens per sequence, prompt + output "
                   "(default: min(model max, 4096))")
    g.add_argument("--speculative-config", default=None, help='JSON, as vLLM\'s: \'{"method": "mtp", "num_speculative_tokens": 2}\' '
                   "(MTP drafts verified on the device; greedy output unchanged)")
    g.add_argument("--weights-seed", type=int, default=d.weights_seed, help="seed of a preset's random weights")
    s = p.add_argument_group("server")
    s.add_argument("--host", default=d.host, help="address of both servers (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=d.port, help="HTTP port (OpenAI API; default 8000)")
    s.add_argument("--grpc-port", type=int, default=d.grpc_port, help="gRPC port (default 50051; -1 turns it off)")
    s.add_argument("--api-key", default=None, help="require this key (HTTP Bearer, gRPC metadata); see --api-key-file")
    s.add_argument("--api-key-file", default=None, help="read the key from a file (keeps it out of `ps`)")
    s.add_argument("--ssl-certfile", default=None, help="TLS certificate (PEM) for HTTP and gRPC")
    s.add_argument("--ssl-keyfile", default=None, help="TLS private key (PEM)")
    s.add_argument("--max-queue", type=int, default=d.max_queue, help="waiting requests before 429/RESOURCE_EXHAUSTED")
    s.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes, help="largest request body")
    s.add_argument("--drain-timeout", type=float, default=d.drain_timeout,
                   help="seconds SIGTERM waits for running requests before aborting them")
    s.add_argument("--no-thinking", dest="default_thinking", action="store_false",
                   help="chat requests that do not say otherwise run without thinking (default: thinking on)")
    s.add_argument("--allow-remote-images", action="store_true",
                   help="fetch http(s) image_url parts (default: refused with a 400; data: URLs are always accepted)")
    s.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"])
    e = p.add_argument_group("engine")
    e.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk, help="prompt tokens per row per prefill step")
    e.add_argument("--prefill-schedule", choices=["exact", "replay"], default=d.prefill_schedule,
                   help="V4.1 only: exact (every layer for every prompt token, default) or replay (CED with SWA "
                        "bounded replay: decoder layers over each prompt's last window only; 1.35-1.47x faster "
                        "prefill on the H200, logits close to but not equal to exact; text prompts only)")
    e.add_argument("--steps-per-dispatch", type=int, default=d.steps_per_dispatch,
                   help="decode steps per device dispatch (requests join and leave between dispatches)")
    e.add_argument("--prefix-cache-entries", type=int, default=d.prefix_cache_entries,
                   help="recent prompts whose decode-state row is kept for reuse (0: off); each costs one slot's state")
    e.add_argument("--max-logprobs", type=int, default=d.max_logprobs, help="largest top_logprobs a request may ask")
    e.add_argument("--compilation-cache", default="default",
                   help="JAX persistent compilation cache directory ('default': ~/.cache/dsjax/xla; 'none': off)")
    k = p.add_argument_group("KV handoff between servers")
    k.add_argument("--redis-url", default=None, help="Redis recording which server owns which conversation's KV")
    k.add_argument("--server-id", default=None, help="this server's name in Redis (default: host-pid)")
    k.add_argument("--kv-peer-port", type=int, default=d.kv_peer_port,
                   help="port of the internal KvPeer gRPC service (-1: off); bind it to the pod network only")
    k.add_argument("--cluster-token-file", default=None, help="file with the secret shared by the cluster's servers "
                   "(authenticates KvPeer calls and keys conversation ids)")
    k.add_argument("--kv-store-bytes", type=int, default=d.kv_store_bytes, help="host KV store budget in bytes")
    k.add_argument("--kv-handoff-timeout", type=float, default=d.kv_handoff_timeout,
                   help="the most seconds a turn may spend getting its KV from a peer before it recomputes")
    k.add_argument("--kv-handoff-alpha", type=float, default=d.kv_handoff_alpha,
                   help="a pull may take α x the measured prefill time of the tokens it saves (within the floor, the "
                        "timeout and the request's deadline)")
    k.add_argument("--kv-handoff-floor", type=float, default=d.kv_handoff_floor,
                   help="the least seconds a pull is given (short prompts' estimates fall below one round trip)")
    k.add_argument("--kv-lease-seconds", type=float, default=d.kv_lease_seconds,
                   help="owner side: a lease not renewed for this long is freed (pullers renew every half of it)")
    k.add_argument("--kv-transport", default=d.kv_transport, choices=["auto", "nixl", "grpc"],
                   help="data path: NIXL READ (auto: when nixl_cu13 imports) with the chunked gRPC stream as fallback")
    k.add_argument("--kv-chunk-bytes", type=int, default=d.kv_chunk_bytes, help="bytes per chunk of the gRPC data path")
    k.add_argument("--kv-test-chunk-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    e.add_argument("--mem-fraction", type=float, default=None, help="device memory share for the fit check")
    e.add_argument("--skip-memory-check", action="store_true", help="start even if the plan says it does not fit")


def from_args(args: argparse.Namespace) -> ServeConfig:
    key = args.api_key
    if args.api_key_file:
        with open(args.api_key_file, encoding="utf-8") as f:
            key = f.read().strip()
    spec = None
    if args.speculative_config:
        try:
            spec = json.loads(args.speculative_config)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--speculative-config is not JSON: {e}") from None
    names = {f.name for f in dataclasses.fields(ServeConfig)}
    kw = {k: v for k, v in vars(args).items() if k in names}
    token = None
    if args.cluster_token_file:
        try:
            with open(args.cluster_token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as e:
            raise ConfigError(f"--cluster-token-file: {e}") from None
        if len(token) < 16:
            raise ConfigError(f"--cluster-token-file {args.cluster_token_file}: the token needs at least 16 characters")
    kw.update(api_key=key or None, speculative_config=spec, cluster_token=token)
    return ServeConfig(**kw).validate()
