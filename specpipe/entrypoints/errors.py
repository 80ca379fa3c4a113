"""The errors a user can cause, and how the command line reports them: one clear line, no
traceback (set SPECPIPE_DEBUG=1 to see it)."""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass

from specpipe.config import ConfigError
from specpipe.loader.checkpoint import CheckpointError


def user_error_types() -> tuple[type[BaseException], ...]:
    from specpipe.distributed.remote_pipeline import PipelineError
    from specpipe.loader.default_model import DefaultModelMissing
    from specpipe.tokenizer.tokenizer import TokenizerError
    from specpipe.kv.slot_table import KVCacheFull

    return (ConfigError, CheckpointError, TokenizerError, DefaultModelMissing, PipelineError, KVCacheFull,
            ValueError)


@dataclass
class ExitStatus:
    code: int = 0


@contextlib.contextmanager
def user_errors():
    status = ExitStatus()
    try:
        yield status
    except KeyboardInterrupt:
        print("specpipe: interrupted", file=sys.stderr)
        status.code = 130
    except user_error_types() as e:
        if os.environ.get("SPECPIPE_DEBUG"):
            raise
        print(f"specpipe: error: {e}", file=sys.stderr)
        status.code = 2
