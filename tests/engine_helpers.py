"""Running one request to completion on a given pipeline: what the lossless, step-count and
oracle tests share (production code serves requests through Engine / EngineCore.run)."""

from __future__ import annotations

from typing import Optional

from specpipe.engine.core import EngineCore
from specpipe.messages import Pipeline
from specpipe.request import Request
from specpipe.spec_decode.sources import TokenSource


def decode(pipe: Pipeline, req: Request, mode: str, source: Optional[TokenSource] = None, width: int = 8,
           depth: int = 4, **core_options) -> EngineCore:
    core = EngineCore(pipe, mode, source, width=width, depth=depth, **core_options)
    core.run([req])
    return core
