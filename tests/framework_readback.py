"""Run a script with a framework class's ``__init__`` wrapped, and read back what each instance resolved.

Command line (what runs inside the subprocess)::

    python tests/framework_readback.py OUT.json MODULE:CLASS ATTRIBUTE -- SCRIPT.py [args...]

writes the JSON list of ``getattr(instance, ATTRIBUTE)`` (a dotted path, as text) for each instance built, once the
script has ended; the knobs' settings as the framework itself resolved them, not as autotune wrote them.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path


def readback(script: Path, args, cls: str, attribute: str, out: Path, env: dict[str, str | None], cwd: Path) -> list:
    full = {**os.environ}
    for name, value in env.items():
        if value is None:
            full.pop(name, None)
        else:
            full[name] = value
    cmd = [sys.executable, __file__, str(out), cls, attribute, "--", str(script), *args]
    proc = subprocess.run(cmd, env=full, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def main() -> None:
    out, cls, attribute, dashes, script, *args = sys.argv[1:]
    assert dashes == "--"
    module, name = cls.split(":")
    owner = getattr(importlib.import_module(module), name)
    original = owner.__init__
    seen = []

    def init(self, *a, **k):
        original(self, *a, **k)
        value = self
        for part in attribute.split("."):
            value = getattr(value, part)
        seen.append(str(value))

    owner.__init__ = init
    sys.argv = [script, *args]
    sys.path[0] = str(Path(script).resolve().parent)
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        Path(out).write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
