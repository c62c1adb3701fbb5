"""Next-token choice and incremental detokenization with stop strings."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..config import SamplingConfig

__all__ = ["Sampler", "SamplingConfig", "TextStream"]


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
        # Shifted so the largest is 0 before the division: a tiny temperature (1e-40) then takes
        # the others to -inf, not the logits to inf and the softmax to NaN.
        # In float64, where a denormal temperature (1e-320) is not rounded to 0.
        logits = logits.double().cpu()
        probs = torch.softmax((logits - logits.max()) / cfg.temperature, dim=-1)
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
        """The rest of the text, less a character the answer stopped in the middle of (its
        bytes span tokens that were never decoded): dropped from ``text`` too, so the
        streamed pieces join to exactly the result's text."""
        self.text = self.text.rstrip("\ufffd")
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        piece = self.text[self.emitted : upto]
        self.emitted = max(self.emitted, upto)
        return piece
