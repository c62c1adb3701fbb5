"""The options of a fused prefill and of a request, each default defined once.

* :class:`BlendConfig` — the HKVD selection of one fused prefill (paper §4.2);
* :class:`SamplingConfig` — decoding;
* :class:`RequestOptions` — what a request may set: the method, the selection and
  decoding, validated and named the same way by every entry point.

Imports neither torch nor transformers, so clients of a server can use it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from ..errors import CacheBlendError

METHODS = ("full", "prefix", "reuse", "blend")
DEVIATIONS = ("v", "k", "kv")
CHUNK_SINKS = ("bos", "frame")
KV_DTYPES = ("float32", "bfloat16", "float16")
SELECTIONS = ("deviation", "attention", "impact", "probe")
CHUNK_BUDGETS = ("global", "attention")
SHIFT_PARTS = ("kv", "k", "v")
RATIO_MODES = ("auto", "guard")
# RequestOptions fields that shape the selection (BlendConfig) besides the ratio
SELECTION_FIELDS = ("check_layers", "deviation", "gradual", "selection", "chunk_heads", "chunk_budget", "probe_share",
                    "shift_share", "shift_parts", "shift_values_from", "max_risk", "max_exposure", "check_pool")
_SHARES = ("recompute_ratio", "check_pool", "probe_share", "shift_share", "shift_values_from", "max_risk",
           "max_exposure")  # BlendConfig's fields within [0, 1] (the max_ ones: or None)
GUARD_MAX_RISK = 0.95  # the guard's default margin-risk limit, chosen on dev with the exposure limit (docs/fidelity.md)
GUARD_MAX_EXPOSURE = 0.02  # the guard's default limit on risk × exposure, chosen on dev (docs/fidelity.md)


@dataclass(frozen=True)
class BlendConfig:
    """How much of the reused KV to recompute, and how to choose it.

    ``recompute_ratio`` is the share of reused chunk tokens recomputed from the last check
    layer on (the paper's r, default 15 %).  ``check_layers`` are the layers at which
    deviation is measured (official code: layer 1).  ``deviation`` compares values
    (``"v"``, the official choice), pre-RoPE keys (``"k"``) or both.  With ``gradual``
    and several check layers, the first check keeps ``gradual_start`` × r (capped at 1)
    and the kept share shrinks linearly to r at the last check layer.

    ``selection`` ranks the candidates (:mod:`cacheblend.blend.selection`): by deviation
    (HKVD, the paper's), by the question's ``"attention"`` at the check layer, by
    ``"impact"`` (attention × value error), or by the question ``"probe"``: the question's
    attention over every layer in a full-reuse pass (:mod:`cacheblend.blend.probe`).  With
    ``probe_share`` below 1 the probe picks that share of the budget and deviation at the
    check layer the rest; at 1 the probe's tokens are recomputed from layer 0 with no
    check layer.  ``chunk_heads`` recomputes the first k tokens of
    every reused chunk first; ``chunk_budget="attention"`` spreads the budget over chunks
    by the question's attention to them.  ``shift_share`` spends that share of each chunk's
    tokens, evenly spaced, of the budget on a sample whose fresh K/V estimate the chunk's
    *shift*: the mean change the missing context makes to every token of the chunk, per
    layer and head, added to the tokens left stale (:mod:`cacheblend.blend.shift`); the
    probe at ``probe_share=1`` has no check layer to keep a sample at, and no shift.
    ``shift_parts`` says which of the keys and values the shift moves (``"kv"``, ``"k"``
    or ``"v"``); ``shift_values_from`` moves values only from that fraction of the
    model's depth on (0: every layer after the check layer; on Qwen's samsum dev prompts
    the early layers' value shift carried all of the shift's loss, docs/internals).
    ``check_pool`` below 1 runs the layers up to the check layer only for each chunk's top
    share by the deviation hint stored at ingestion (:mod:`cacheblend.blend.hint`); the check
    ranks that pool (chunks stored without a hint get the full check).
    ``max_risk`` turns on the quality guard: a
    prefill whose fidelity risk (:func:`cacheblend.blend.fusor.first_token_risk`) is above
    it runs again at each ratio of ``guard_ladder`` in turn (1.0: exact, full prefill's K/V)
    until the risk is within the limit.  ``max_exposure`` also escalates a prefill whose risk
    times its exposure (:mod:`cacheblend.blend.exposure`: how much the first token's
    attention rests on stale, deviating K/V) is above it: a confident answer built on stale
    context.
    """

    recompute_ratio: float = 0.15
    check_layers: tuple[int, ...] = (1,)
    deviation: str = "v"
    gradual: bool = False
    gradual_start: float = 2.0
    selection: str = "deviation"
    chunk_heads: int = 0
    chunk_budget: str = "global"
    probe_share: float = 1.0
    shift_share: float = 0.03  # dev: KL 0.119 -> 0.082 against 0 (docs/fidelity.md)
    shift_parts: str = "kv"
    shift_values_from: float = 0.0
    max_risk: float | None = None
    max_exposure: float | None = None
    check_pool: float = 0.5  # dev: KL +0.000 against 1.0, both models, 5-12 % sooner (docs/fidelity.md)
    guard_ladder: tuple[float, ...] = (1.0,)  # dev: a 30 % rung first was slower and no more faithful

    def __post_init__(self) -> None:
        for name, x in ((name, getattr(self, name)) for name in _SHARES):
            if not (x is None and name.startswith("max_")) and (
                    isinstance(x, bool) or not isinstance(x, (int, float)) or not 0.0 <= x <= 1.0):
                raise ValueError(f"{name} must be within [0, 1]{' or None' if name.startswith('max_') else ''}, "
                                 f"got {x!r}")
        if self.deviation not in DEVIATIONS:
            raise ValueError(f"deviation must be one of {DEVIATIONS}, got {self.deviation!r}")
        if isinstance(self.check_layers, (str, bytes)) or not hasattr(self.check_layers, "__iter__"):
            raise ValueError(f"check_layers must be a sequence of layer indices, got {self.check_layers!r}")
        layers = tuple(self.check_layers)
        if not layers:
            raise ValueError("check_layers must name at least one layer")
        if any(isinstance(x, bool) or not isinstance(x, int) for x in layers):
            raise ValueError(f"check_layers must be integers, got {layers}")
        if any(x < 0 for x in layers) or sorted(set(layers)) != list(layers):
            raise ValueError(f"check_layers must be distinct, ascending and >= 0, got {layers}")
        if not isinstance(self.gradual, bool):  # a JSON client's "false" string would be truthy
            raise ValueError(f"gradual must be True or False, got {self.gradual!r}")
        if self.gradual_start < 1.0:
            raise ValueError("gradual_start must be >= 1")
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}, got {self.selection!r}")
        if self.chunk_budget not in CHUNK_BUDGETS:
            raise ValueError(f"chunk_budget must be one of {CHUNK_BUDGETS}, got {self.chunk_budget!r}")
        if isinstance(self.chunk_heads, bool) or not isinstance(self.chunk_heads, int) or self.chunk_heads < 0:
            raise ValueError(f"chunk_heads must be an int >= 0, got {self.chunk_heads!r}")
        if self.shift_parts not in SHIFT_PARTS:
            raise ValueError(f"shift_parts must be one of {SHIFT_PARTS}, got {self.shift_parts!r}")
        ladder = tuple(self.guard_ladder)
        if not ladder or any(not 0 < x <= 1 for x in ladder) or sorted(ladder) != list(ladder):
            raise ValueError(f"guard_ladder must be ascending ratios within (0, 1], got {ladder}")
        object.__setattr__(self, "guard_ladder", ladder)
        object.__setattr__(self, "check_layers", layers)
        object.__setattr__(self, "recompute_ratio", float(self.recompute_ratio))

    @property
    def uses_attention(self) -> bool:
        """Whether the selection reads the question's attention at the check layer."""
        return self.selection != "deviation" or self.chunk_budget == "attention"

    def validate_for(self, num_layers: int) -> None:
        if self.check_layers[-1] >= num_layers:
            raise ValueError(
                f"check_layers {self.check_layers} out of range for a {num_layers}-layer model"
            )

    def keep_ratio(self, check_index: int) -> float:
        """Share of all reused tokens still recomputed after check layer ``check_index``."""
        r = self.recompute_ratio
        m = len(self.check_layers)
        if not self.gradual or m == 1:
            return r
        first = min(1.0, r * self.gradual_start)
        return first + (r - first) * check_index / (m - 1)


@dataclass(frozen=True)
class SamplingConfig:
    """``temperature == 0`` is greedy; otherwise temperature and nucleus (top-p) sampling.
    ``ignore_eos`` (vLLM's name) decodes past end-of-sequence tokens up to ``max_new_tokens``:
    fixed-length answers for latency measurements; stop strings still apply."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        for name in ("temperature", "top_p"):  # numbers, not "0.5" or True, and finite (inf sampled noise)
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be within (0, 1], got {self.top_p}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -2**63 <= self.seed < 2**64):  # what torch.Generator takes
            raise ValueError(f"seed must be an int in [-2**63, 2**64) or None, got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")


_BLEND = BlendConfig()
_SAMPLING = SamplingConfig()


@dataclass(frozen=True)
class RequestOptions:
    """What one request may set besides its content.

    ``method``: one of :data:`METHODS`; ``recompute_ratio``: a share, or ``"auto"`` (the
    loading controller picks it, never below ``quality_floor``); ``check_layers``,
    ``deviation``, ``gradual``: the HKVD selection (:class:`BlendConfig`); the rest:
    decoding (:class:`SamplingConfig`); ``learn``: cache long unknown paragraphs of a chat
    prompt as new chunks (:meth:`Engine.start_chat`); ``timeout``: seconds the whole request
    may take, checked between the layers of the fused prefill and between decoded tokens
    (``TimeoutError``; None: no limit)."""

    method: str = "blend"
    recompute_ratio: float | str = _BLEND.recompute_ratio
    quality_floor: float = _BLEND.recompute_ratio
    check_layers: Sequence[int] = _BLEND.check_layers
    deviation: str = _BLEND.deviation
    gradual: bool = _BLEND.gradual
    selection: str = _BLEND.selection
    chunk_heads: int = _BLEND.chunk_heads
    chunk_budget: str = _BLEND.chunk_budget
    probe_share: float = _BLEND.probe_share
    shift_share: float = _BLEND.shift_share
    shift_parts: str = _BLEND.shift_parts
    shift_values_from: float = _BLEND.shift_values_from
    max_risk: float | None = _BLEND.max_risk
    max_exposure: float | None = _BLEND.max_exposure
    check_pool: float = _BLEND.check_pool
    max_new_tokens: int = _SAMPLING.max_new_tokens
    temperature: float = _SAMPLING.temperature
    top_p: float = _SAMPLING.top_p
    stop: Sequence[str] | str = _SAMPLING.stop
    seed: int | None = _SAMPLING.seed
    ignore_eos: bool = _SAMPLING.ignore_eos
    learn: bool = True
    timeout: float | None = None

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def per_call(cls, options: Mapping[str, Any], renamed: Mapping[str, str], where: str) -> dict[str, Any]:
        """An adapter's per-call options under the core's names (``renamed``: the adapter's
        name to the core's), every name checked.  One rule for every adapter: None for an
        option whose unset value is None (``max_risk``, ``seed``, ``timeout``) sets it to
        None; None for any other means "not given", so the adapter's own value applies."""
        out = dict(options)
        for name, core in renamed.items():
            if name in out:
                value = out.pop(name)
                out[core] = value if value is not None else out.get(core)
        cls.check_names(out, where)
        nullable = {name for name, value in cls().as_dict().items() if value is None}
        return {name: value for name, value in out.items() if value is not None or name in nullable}

    @classmethod
    def check_names(cls, options: Mapping[str, Any], where: str = "") -> None:
        """Raise the one error every entry point gives for an option it does not know."""
        unknown = sorted(set(options) - set(cls.names()))
        if unknown:
            at = f"{where}: " if where else ""
            raise CacheBlendError(f"{at}unknown options {unknown}; known: {', '.join(cls.names())}")

    @classmethod
    def parse(cls, options: Mapping[str, Any], base: RequestOptions | None = None) -> RequestOptions:
        """``options`` over ``base`` (default: the defaults), checked now, so bad input fails
        before any work starts."""
        cls.check_names(options)
        opts = replace(base or cls(), **dict(options))
        if opts.method not in METHODS:
            raise CacheBlendError(f"method must be one of {METHODS}, got {opts.method!r}")
        if opts.timeout is not None and (isinstance(opts.timeout, bool) or not isinstance(opts.timeout, (int, float))
                                         or not opts.timeout > 0):
            raise CacheBlendError(f"timeout must be a positive number of seconds or None, got {opts.timeout!r}")
        if not isinstance(opts.learn, bool):
            raise CacheBlendError(f"learn must be True or False, got {opts.learn!r}")
        if isinstance(opts.recompute_ratio, str) and opts.recompute_ratio not in RATIO_MODES:
            raise CacheBlendError(f"recompute_ratio must be a share within [0, 1], 'auto' or 'guard', "
                                  f"got {opts.recompute_ratio!r}")
        # every selection field is checked whatever the method: a bad ratio beside method="full" is bad input too
        (opts if opts.method == "blend" else replace(opts, method="blend")).blend()
        opts.sampling()
        return opts

    @property
    def auto(self) -> bool:
        return self.method == "blend" and self.recompute_ratio == "auto"

    @property
    def guard(self) -> bool:
        return self.method == "blend" and self.recompute_ratio == "guard"

    def blend(self, num_layers: int | None = None) -> BlendConfig:
        """The selection (ratio 0 unless blending; ``quality_floor`` to start ``auto`` and
        ``guard``; the guard's risk limit is ``max_risk``, else :data:`GUARD_MAX_RISK`, and
        its exposure limit ``max_exposure``, else :data:`GUARD_MAX_EXPOSURE`)."""
        ratio = (self.quality_floor if self.auto or self.guard else self.recompute_ratio) \
            if self.method == "blend" else 0.0
        max_risk, max_exposure = (self.max_risk, self.max_exposure) if self.method == "blend" else (None, None)
        if self.guard:  # the guard's own limits where the request sets none
            max_risk = GUARD_MAX_RISK if max_risk is None else max_risk
            max_exposure = GUARD_MAX_EXPOSURE if max_exposure is None else max_exposure
        try:
            floor = self.quality_floor
            if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0.0 <= floor <= 1.0:
                raise ValueError(f"quality_floor must be within [0, 1], got {self.quality_floor!r}")
            selection = {f: getattr(self, f) for f in SELECTION_FIELDS} | {"max_risk": max_risk,
                                                                            "max_exposure": max_exposure}
            config = BlendConfig(recompute_ratio=ratio, **selection)  # type: ignore[arg-type]
            if num_layers is not None:
                config.validate_for(num_layers)
        except (TypeError, ValueError) as e:
            raise CacheBlendError(str(e)) from e
        return config

    def sampling(self) -> SamplingConfig:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        try:
            return SamplingConfig(self.max_new_tokens, self.temperature, self.top_p, stop, self.seed, self.ignore_eos)
        except (TypeError, ValueError) as e:
            raise CacheBlendError(str(e)) from e

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
