"""The errors a speculative config raises: every one a ``ValueError``, like vLLM's."""


class SpeculativeConfigError(ValueError):
    """An invalid speculative config; the message names the offending field."""


class UnsupportedSpeculativeMethodError(SpeculativeConfigError, NotImplementedError):
    """Auto-detection found no method (vLLM raises NotImplementedError here)."""
