"""Errors users can act on: each names the offending thing and what would be right."""


class DsjaxError(Exception):
    """Base class for every error dsjax raises on bad input."""


class ConfigError(DsjaxError, ValueError):
    """A config.json, preset name or config field is unknown or inconsistent."""


class ContextLimitError(ConfigError):
    """The requested max_seq_len lies outside what the model's positions allow; `limit` is the most it holds."""

    def __init__(self, message: str, limit: int):
        super().__init__(message)
        self.limit = limit


class CheckpointError(DsjaxError, ValueError):
    """A checkpoint tensor is missing, unexpected, misshapen or of the wrong dtype."""


class InputError(DsjaxError, ValueError):
    """Token ids, positions or generation arguments are out of range."""


class ImageError(InputError):
    """An image that cannot be used: unreadable, corrupt, empty, too large, or of an unsupported format."""
