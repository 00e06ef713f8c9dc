"""The gRPC API (`engine.proto`) and its generated stubs (committed; see generate.py)."""
