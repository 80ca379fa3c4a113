"""A clear sentence instead of a multiprocessing traceback for scripts without a main guard.

Stage processes are started with the `spawn` method (fork is unsafe with threads and CUDA), and
a spawned child first re-imports the parent's main script. A script that builds an engine at
module level would then build one again inside every child, which multiprocessing refuses; the
user would only see "stage 1 failed to start". So before spawning, look at the caller's main
script: if the engine is being created by module-level code that is not under
`if __name__ == "__main__":`, say so.
"""

from __future__ import annotations

import ast
import multiprocessing
import sys
from pathlib import Path


MESSAGE = ("SpecPipe starts its pipeline stages as new processes, which re-import your script: put the code "
           "that creates the engine (LLM(...), Engine(...)) under `if __name__ == \"__main__\":`")


def check_main_guard() -> None:
    if multiprocessing.parent_process() is not None and multiprocessing.current_process().name.startswith(
            "specpipe-stage"):
        raise SystemExit(f"specpipe: error: {MESSAGE}")  # a stage child re-importing an unguarded script
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None or not Path(path).is_file():
        return  # interactive session, `python -c`, or a frozen app: nothing is re-imported
    # The script's top-level frame: the line of module-level code that led here (directly, or
    # through functions it called) is what a child would run again.
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_globals is main.__dict__ and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if frame is None:
        return  # not reached from the script's module-level code (e.g. a thread)
    if not _under_main_guard(Path(path), frame.f_lineno):
        # One sentence, no traceback: the fix is in the user's script, not in a stack trace.
        raise SystemExit(f"specpipe: error: {MESSAGE}")


def _under_main_guard(path: Path, line: int) -> bool:
    try:
        tree = ast.parse(path.read_text(), str(path))
    except (OSError, SyntaxError, ValueError):
        return True  # cannot tell: do not get in the way
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_test(node.test):
            end = getattr(node, "end_lineno", None) or line
            if node.lineno <= line <= end:
                return True
    return False


def _is_main_test(test: ast.expr) -> bool:
    """`__name__ == "__main__"` (either side)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    consts = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return bool(names and consts)
