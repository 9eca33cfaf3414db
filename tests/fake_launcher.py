"""A stand-in for torchrun without torch, for fast launcher tests: ``fake_launcher.py [--nproc N] [--ignore-term]
SCRIPT ARGS...``.

Like torchrun it starts N copies of ``python SCRIPT ARGS`` with RANK, LOCAL_RANK and WORLD_SIZE set, each in a
session of its own, and exits with the status of the first rank that failed. Unlike torchrun it never stops the
other ranks when one fails, and with ``--ignore-term`` it ignores SIGTERM and leaves its ranks running: the worst
launcher the search has to clean up after.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys


def main() -> int:
    parser = argparse.ArgumentParser(prog="fake_launcher.py")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    opts = parser.parse_args()
    if opts.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    procs = []
    for rank in range(opts.nproc):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(opts.nproc)}
        procs.append(subprocess.Popen([sys.executable, opts.script, *opts.args], env=env, start_new_session=True))
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c != 0), 0)


if __name__ == "__main__":
    sys.exit(main())
