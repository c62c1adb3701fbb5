"""What a request may set besides its content: the method, the HKVD selection, decoding.

One definition for the in-process :class:`~cacheblend.engine.Engine` and the
:class:`~cacheblend.remote.RemoteEngine`, so both accept, default and check the same
options and name a bad one the same way."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from .blend.selection import BlendConfig
from .decode import SamplingConfig
from .errors import CacheBlendError

METHODS = ("full", "prefix", "reuse", "blend")


@dataclass(frozen=True)
class RequestOptions:
    """``recompute_ratio``: a share, or ``"auto"`` (the loading controller picks it, never
    below ``quality_floor``); ``check_layers``, ``deviation``, ``gradual``: the HKVD
    selection (:class:`BlendConfig`); the rest: decoding (:class:`SamplingConfig`)."""

    method: str = "blend"
    recompute_ratio: float | str = 0.15
    quality_floor: float = 0.15
    check_layers: Sequence[int] = (1,)
    deviation: str = "v"
    gradual: bool = False
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    stop: Sequence[str] | str = ()
    seed: int | None = None

    @classmethod
    def parse(cls, options: dict) -> RequestOptions:
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise CacheBlendError(f"unknown option(s) {unknown}; known: {', '.join(known)}")
        opts = cls(**options)
        if opts.method not in METHODS:
            raise CacheBlendError(f"method must be one of {METHODS}, got {opts.method!r}")
        return opts

    @property
    def auto(self) -> bool:
        return self.method == "blend" and self.recompute_ratio == "auto"

    def blend(self, num_layers: int | None = None) -> BlendConfig:
        """The HKVD selection (ratio 0 unless blending; ``quality_floor`` to start ``auto``)."""
        ratio = (self.quality_floor if self.auto else self.recompute_ratio) if self.method == "blend" else 0.0
        try:
            config = BlendConfig(recompute_ratio=ratio, check_layers=tuple(self.check_layers),
                                 deviation=self.deviation, gradual=self.gradual)
            if num_layers is not None:
                config.validate_for(num_layers)
        except (TypeError, ValueError) as e:
            raise CacheBlendError(str(e)) from e
        return config

    def sampling(self) -> SamplingConfig:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        try:
            return SamplingConfig(self.max_new_tokens, float(self.temperature), float(self.top_p), stop, self.seed)
        except (TypeError, ValueError) as e:
            raise CacheBlendError(str(e)) from e
