"""A trial run by the search: it reads the user's files where the script expects them and never writes them."""

from __future__ import annotations

from pathlib import Path

from autotune.project import load_project
from autotune.patch import run
from autotune.search.trial import Outcome, Runner, TrialSettings

# nanoGPT-style saving, every way a script writes a file: torch.save by name, into a folder it makes, an appended
# log, a file beside the working directory, numpy, and a write-then-rename; each read back as the script left it
SAVER = '''
import os
from pathlib import Path

import numpy as np
import torch

out_dir = "out"
os.makedirs(out_dir, exist_ok=True)
os.makedirs(os.path.join(out_dir, "new"), exist_ok=True)
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(8):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    torch.save(model.state_dict(), "ckpt.pt")
    torch.save(model.state_dict(), "data/ckpt.pt")  # into a folder of the user's, first written by torch.save
    torch.save(model.state_dict(), os.path.join(out_dir, "ckpt.pt"))
    assert set(torch.load("ckpt.pt")) == {"weight", "bias"}  # its own checkpoint, not the user's
    with open("log.txt", "a") as f:
        f.write(f"step {i}\\n")
    assert open("log.txt").read().startswith("USER LOG\\nstep 0\\n")  # appended to a copy of the user's log
    Path("../beside.txt").write_text("trial")
    np.save("data/array.npy", np.zeros(3))
    with open("tmp.pt", "wb") as f:
        f.write(b"trial")
    os.replace("tmp.pt", "data/final.pt")
    assert open("data/input.txt").read() == "USER DATA"  # the user's inputs, by the same relative path
'''


def _user_folder(root: Path) -> dict[Path, str]:
    files = {
        root / "run" / "ckpt.pt": "USER CKPT",
        root / "run" / "out" / "ckpt.pt": "USER OUT",
        root / "run" / "log.txt": "USER LOG\n",
        root / "run" / "data" / "input.txt": "USER DATA",
        root / "run" / "data" / "array.npy": "USER ARRAY",
        root / "run" / "data" / "final.pt": "USER FINAL",
        root / "run" / "data" / "ckpt.pt": "USER DATA CKPT",
        root / "beside.txt": "USER BESIDE",
    }
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return files


def _trial(tmp_path: Path, body: str, cwd: Path):
    script = tmp_path / "code" / "train.py"
    script.parent.mkdir()
    script.write_text(body)
    runner = Runner(run(load_project(script)), tmp_path / "work", TrialSettings((), cwd, "cpu", 1, 2))
    return runner.run({}, "baseline", timeout=240)


def test_a_trials_writes_land_in_its_own_folder_never_on_the_users_files(tmp_path):
    files = _user_folder(tmp_path / "user")
    before = {p for p in (tmp_path / "user").rglob("*")}
    result = _trial(tmp_path, SAVER, tmp_path / "user" / "run")
    assert result.status is Outcome.OK, result.stderr_tail
    assert {p: p.read_bytes().decode(errors="replace") for p in files} == files  # every file of the user's as it was
    assert {p for p in (tmp_path / "user").rglob("*")} == before  # and nothing new among them ("out/new")


def test_a_trial_may_not_overwrite_the_users_files_by_their_absolute_path(tmp_path):
    files = _user_folder(tmp_path / "user")
    body = SAVER.replace('"ckpt.pt"', repr(str(tmp_path / "user" / "run" / "ckpt.pt")), 1)
    result = _trial(tmp_path, body, tmp_path / "user" / "run")
    assert result.status is Outcome.CRASH and "a trial does not overwrite or delete your files" in result.stderr_tail
    assert {p: p.read_bytes().decode(errors="replace") for p in files} == files


# a datasets cache under HF_HOME inside the working directory, as the Hugging Face libraries use it: its lock file
# opened for writing and removed, an entry written again; and a lock file the script keeps beside its data
CACHE_USER = '''
import os

import torch

cache = os.path.join(os.environ["HF_HOME"], "datasets")
with open(os.path.join(cache, "entry.lock"), "w"):
    pass
os.remove(os.path.join(cache, "entry.lock"))
with open(os.path.join(cache, "entry.arrow"), "wb") as f:
    f.write(b"CACHED")
with open(os.path.join(os.environ["DATA"], "input.lock"), "w"):
    pass
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(8):
    loss = model(torch.ones(8, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


def test_a_trial_uses_the_libraries_shared_cache_and_lock_files_in_the_users_folder(tmp_path, monkeypatch):
    files = _user_folder(tmp_path / "user")
    cache = tmp_path / "user" / "run" / "hf_home" / "datasets"
    cache.mkdir(parents=True)
    (cache / "entry.lock").write_text("")
    (cache / "entry.arrow").write_text("CACHED")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "user" / "run" / "hf_home"))
    monkeypatch.setenv("DATA", str(tmp_path / "user" / "run" / "data"))
    result = _trial(tmp_path, CACHE_USER, tmp_path / "user" / "run")
    assert result.status is Outcome.OK, result.stderr_tail
    assert {p: p.read_bytes().decode(errors="replace") for p in files} == files  # the user's other files as they were
    assert (cache / "entry.arrow").read_text() == "CACHED"
