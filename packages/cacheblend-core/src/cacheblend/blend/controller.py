"""The loading controller (paper §5.2): recompute as much as loading can hide.

Per layer, the fusor recomputes the HKVD tokens while the next layer's cached K/V is
being fetched.  If loading a layer takes ``T_load`` and recomputing one token of one
layer takes ``c``, then up to ``T_load / c`` tokens per layer are free: the ratio is
raised to that (better quality at no TTFT cost), never below the user's quality floor.
Conversely, for placing caches, the slowest (cheapest) tier whose per-layer load still
hides behind recomputing the floor ratio costs nothing extra — that is the tier the
controller suggests.

Speeds are measured, not assumed: every fused prefill reports its compute time per
active token and layer, and every lazy read its bytes per second per tier; both are
kept as exponential moving averages.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..config import BlendConfig
from .loader import pipelined


@dataclass
class Decision:
    ratio: float
    tier: str
    load_layer_s: float
    recompute_layer_s: float
    suggested_tier: str | None
    reason: str

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class LoadingController:
    quality_floor: float = BlendConfig.recompute_ratio  # the default ratio is the floor
    max_ratio: float = 1.0
    smoothing: float = 0.3
    compute_s_per_token_layer: float | None = None
    bandwidth: dict[str, float] = field(default_factory=dict)  # tier -> bytes per second
    # The engine's ``prefetch``: whether layers are read beside the fusor, so that recompute
    # can hide their loading (None: by the tier and the cores, as the loader decides, see
    # loader.pipelined).  A controller on its own assumes the paper's pipelined reads.
    prefetch: bool | None = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.quality_floor <= self.max_ratio <= 1.0:
            raise ValueError("need 0 <= quality_floor <= max_ratio <= 1")

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def observe_compute(self, compute_s: float, token_layers: int) -> None:
        if token_layers > 0 and compute_s > 0:
            self.compute_s_per_token_layer = self._ema(self.compute_s_per_token_layer, compute_s / token_layers)

    def observe_load(self, tier: str, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.bandwidth[tier] = self._ema(self.bandwidth.get(tier), nbytes / seconds)

    def decide(self, candidates: int, fixed_tokens: int, bytes_per_layer: int, tier: str,
               floor: float | None = None) -> Decision:
        """Ratio for a prompt with ``candidates`` reused chunk tokens (plus ``fixed_tokens``
        always computed) whose caches come from ``tier`` at ``bytes_per_layer``."""
        floor = self.quality_floor if floor is None else floor
        c = self.compute_s_per_token_layer
        bw = self.bandwidth.get(tier)
        load = bytes_per_layer / bw if bw else 0.0
        suggested = self._suggest(candidates, fixed_tokens, bytes_per_layer, floor)
        if c is None or candidates == 0:
            return Decision(floor, tier, load, 0.0, suggested, "no compute speed measured yet: quality floor")
        if not self.pipelined(tier):
            return Decision(floor, tier, load, c * (floor * candidates + fixed_tokens), suggested,
                            "layers are read before they are fused, not beside (no core to spare for a "
                            "loader): recompute hides no loading, ratio kept at the floor")
        hidden_tokens = load / c - fixed_tokens
        free = max(0.0, min(self.max_ratio, hidden_tokens / candidates))
        ratio = max(floor, free)
        recompute = c * (ratio * candidates + fixed_tokens)
        if free > floor:
            why = (f"loading {load * 1e3:.1f} ms/layer from {tier} hides recompute of {free:.0%} "
                   f"({c * 1e6:.0f} us per token-layer): ratio raised above the floor {floor:.0%}")
        else:
            why = (f"loading {load * 1e3:.1f} ms/layer from {tier} is shorter than recomputing the floor "
                   f"{floor:.0%} ({recompute * 1e3:.1f} ms/layer): ratio kept at the floor")
        return Decision(ratio, tier, load, recompute, suggested, why)

    def pipelined(self, tier: str) -> bool:
        """Whether reads from ``tier`` run beside the fusor (the loader's own rule)."""
        return pipelined(self.prefetch, {tier})

    def _suggest(self, candidates: int, fixed_tokens: int, bytes_per_layer: int, floor: float) -> str | None:
        """The slowest measured tier whose load hides behind recomputing the floor."""
        c = self.compute_s_per_token_layer
        if c is None:
            return None
        budget = c * (floor * candidates + fixed_tokens)
        fits = [(bw, t) for t, bw in self.bandwidth.items()
                if self.pipelined(t) and bytes_per_layer / bw <= budget]
        if fits:
            return min(fits)[1]
        # Nothing hides the load: the fastest measured tier costs the least TTFT.
        return max(self.bandwidth, key=self.bandwidth.__getitem__) if self.bandwidth else None
