"""API keys: one shared secret, compared in constant time (HTTP `Authorization: Bearer`, gRPC metadata)."""

from __future__ import annotations

import hashlib
import hmac


class ApiKey:
    """`ApiKey(None)` accepts everything; otherwise `accepts(presented)` compares digests with hmac.compare_digest,
    so neither the key's content nor its length leaks through timing."""

    def __init__(self, key: str | None):
        self._digest = hashlib.sha256(key.encode()).digest() if key else None

    @property
    def required(self) -> bool:
        return self._digest is not None

    def accepts(self, presented: str | None) -> bool:
        if self._digest is None:
            return True
        candidate = hashlib.sha256((presented or "").encode("utf-8", "surrogateescape")).digest()
        return hmac.compare_digest(candidate, self._digest) and presented is not None

    @staticmethod
    def tenant(header: str | None) -> str:
        """Who is asking, for namespacing conversation ids: a hash of the presented credential."""
        _, _, token = (header or "").partition(" ")
        return hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).hexdigest()[:16] if token else "-"

    def accepts_bearer(self, header: str | None) -> bool:
        """An `Authorization` header value: `Bearer <key>` (scheme case-insensitive)."""
        if self._digest is None:
            return True
        scheme, _, token = (header or "").partition(" ")
        return self.accepts(token.strip() if scheme.lower() == "bearer" else None)
