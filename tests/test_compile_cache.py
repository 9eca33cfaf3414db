"""Compile caches carried to the tuned script: a trial that compiles leaves what it compiled as one file, the tuned
script loads it first thing, and a file it cannot use costs only a normal compile. No timing is asserted."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from autotune.bake import bake
from autotune.compile_cache import CACHE_NAME, with_loader
from autotune.patch import run
from autotune.project import load_project
from autotune.search.trial import Outcome, Runner, TrialSettings

SCRIPT = '''
"""A tiny MLP trained in a loop of its own."""

import torch



class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(16, 32)
        self.out = torch.nn.Linear(32, 1)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(x)))


torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
data = [(torch.randn(8, 16), torch.randn(8, 1)) for _ in range(6)]
for x, y in data:
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"final loss {loss.item():.6f}")
'''


def test_the_loader_goes_after_the_docstring_and_future_imports_once():
    text = '#!/usr/bin/env python\n# header\n"""Doc."""\n\nfrom __future__ import annotations\n\n# imports\nimport torch\n'
    loaded = with_loader(text)
    assert loaded.startswith('#!/usr/bin/env python\n# header\n"""Doc."""\n\nfrom __future__ import annotations\n\n\n'
                             "def _autotune_compile_cache():")
    assert loaded.endswith("_autotune_compile_cache()\n\n\n# imports\nimport torch\n")
    assert with_loader(loaded) == loaded  # idempotent
    compile(loaded, "tuned.py", "exec")
    bare = with_loader("import torch\n")
    assert bare.startswith("def _autotune_compile_cache():") and bare.endswith("_autotune_compile_cache()\n\n\nimport torch\n")


def _fresh_env(tmp_path: Path, name: str) -> dict[str, str]:
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / name)}


@pytest.mark.slow
def test_a_compiling_trial_leaves_its_compiled_code_and_the_tuned_script_loads_it_or_compiles_as_usual(tmp_path):
    script = tmp_path / "code" / "train.py"
    script.parent.mkdir()
    script.write_text(textwrap.dedent(SCRIPT).lstrip())
    project = load_project(script)
    saved = tmp_path / "work" / CACHE_NAME
    settings = TrialSettings((), tmp_path, "cpu", 1, 2, {"CUDA_VISIBLE_DEVICES": "",
                                                         "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    config = {"compile.mode": "default"}
    result = Runner(run(project), tmp_path / "work", settings).run(config, "confirm", 300, compile_cache=saved)
    assert result.status is Outcome.OK, result.stderr_tail
    assert saved.stat().st_size > 0

    # the file holds the compiler's entries: a fresh process with an empty cache loads them
    probe = "import sys, torch; info = torch.compiler.load_cache_artifacts(open(sys.argv[1], 'rb').read()); " \
            "print(sorted(k for k, v in info.artifacts.items() if v))"
    loaded = subprocess.run([sys.executable, "-c", probe, str(saved)], env=_fresh_env(tmp_path, "probe"),
                            capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr
    assert "inductor" in loaded.stdout, loaded.stdout

    # the search's measure of what it saves: a run with new, empty compiler caches that loads the file first, as
    # the tuned script's loader does, and says whether torch took it
    again = Runner(run(project), tmp_path / "work", settings).run(config, "cache", 300, fresh_caches=True,
                                                                    load_cache=saved)
    assert again.status is Outcome.OK and again.compile_cache_loaded is True, again.stderr_tail
    assert result.compile_cache_loaded is None  # (given none to load)

    # the tuned script (the knob baked in, the loader first) trains as the trial did: with the file (an empty
    # compiler cache besides), and with a file it cannot use (the trial's cache: a warm compile, to save time)
    tuned = tmp_path / "tuned"
    tuned.mkdir()
    baked = bake(project, config, "cpu").files[0].new_text
    (tuned / "train.py").write_text(with_loader(baked))
    finals = []
    for case, data in (("carried", saved.read_bytes()), ("inductor", b"not a cache")):
        (tuned / CACHE_NAME).write_bytes(data)
        done = subprocess.run([sys.executable, "train.py"], cwd=tuned, env=_fresh_env(tmp_path, case),
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (case, done.stderr[-2000:])
        finals.append(done.stdout.strip().splitlines()[-1])
    assert finals[0].startswith("final loss ") and len(set(finals)) == 1, finals


def test_a_file_torch_cannot_load_is_said_not_loaded(tmp_path):
    from autotune.trial_files import load_compile_cache

    (tmp_path / "junk.bin").write_bytes(b"not a cache")
    assert load_compile_cache(str(tmp_path / "junk.bin")) is False
    assert load_compile_cache(str(tmp_path / "missing.bin")) is False
