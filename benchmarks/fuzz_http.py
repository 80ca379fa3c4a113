"""HTTP fuzzing, the long run: tests/entrypoints/test_http_fuzz.py (schemathesis against the
server's OpenAPI schema, every route, valid and invalid bodies, all its checks) with many more
examples per route than CI's 4.

    python benchmarks/fuzz_http.py --examples 200 [--report fuzz.json]

Exit status 0: no server error, no answer outside the schema, and the engine alive at the end
(/health ok, an ordinary request served). The statuses seen, by valid and invalid body, are
printed (and written to --report). Failures are printed by pytest with a curl line to reproduce each.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=200, help="examples per route and phase (CI: 4)")
    ap.add_argument("--report", default=None, help="write the tally of statuses to this JSON file")
    args = ap.parse_args()
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "SPECPIPE_HTTP_FUZZ_EXAMPLES": str(args.examples)}
    if args.report:
        env["SPECPIPE_HTTP_FUZZ_REPORT"] = str(Path(args.report).resolve())
    test = root / "tests" / "entrypoints" / "test_http_fuzz.py"
    raise SystemExit(subprocess.call([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", str(test)],
                                     cwd=root, env=env))


if __name__ == "__main__":
    main()
