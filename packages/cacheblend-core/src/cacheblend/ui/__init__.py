"""The explorer web app (``cacheblend ui``; needs the ``ui`` extra: Gradio)."""

from __future__ import annotations

from .app import Explorer, build, launch
from .live import Answer, split_passages, stream_answer

__all__ = ["Answer", "Explorer", "build", "launch", "split_passages", "stream_answer"]
