"""Next-token choice and incremental detokenization with stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingConfig:
    """``temperature == 0`` is greedy; otherwise temperature and nucleus (top-p) sampling."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be within (0, 1], got {self.top_p}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")


class Sampler:
    def __init__(self, config: SamplingConfig) -> None:
        self.config = config
        self.generator = torch.Generator()
        if config.seed is not None:
            self.generator.manual_seed(config.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: Tensor) -> int:
        cfg = self.config
        if cfg.temperature == 0.0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float().cpu() / cfg.temperature, dim=-1)
        if cfg.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            outside = torch.cumsum(sorted_p, 0) - sorted_p >= cfg.top_p
            sorted_p[outside] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        return int(torch.multinomial(probs, 1, generator=self.generator))


class TextStream:
    """Turns token ids into text pieces, never emitting a half character or any part
    of a stop string."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = text[:cut], True
            return self._emit(len(self.text))
        self.text = text
        if text.endswith("\ufffd"):  # an incomplete multi-byte character
            return ""
        return self._emit(max(self.emitted, len(text) - self.hold))

    def flush(self) -> str:
        return self._emit(len(self.text.rstrip("\ufffd")))

    def _emit(self, upto: int) -> str:
        piece = self.text[self.emitted : upto]
        self.emitted = max(self.emitted, upto)
        return piece
