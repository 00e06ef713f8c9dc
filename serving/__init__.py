"""dsjax.serving: gRPC + HTTP front ends, scheduler, host KV store and Redis ownership (installed as dsjax.serving)."""
