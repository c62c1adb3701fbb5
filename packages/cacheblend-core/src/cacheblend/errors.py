"""The errors bad input raises: a ``ValueError`` whose message names the problem."""

from __future__ import annotations


class CacheBlendError(ValueError):
    """Bad input to the engine (or to a client of a CacheBlend server); the message names the problem."""


class UnknownChunkError(CacheBlendError, KeyError):
    """A chunk handle this engine cannot resolve (unknown key, or made by another model)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""
