"""dataloader: workers, pinned memory, persistent workers and prefetching as knobs, never an illegal combination."""

from __future__ import annotations

import itertools
import types
import warnings

import libcst as cst
import pytest
import torch
import yaml
from torch.utils.data import DataLoader, TensorDataset
from transform_cases import baked, case, losses, original, patched, sites, statuses

from autotune import runtime
from autotune.project import load_project
from autotune.patch import run, select
from autotune.search.space import read_space
from autotune.transform import Status
from autotune.transforms.dataloader import SETTINGS, Dataloader

T = "dataloader"
A, U, N = Status.APPLICABLE, Status.USER, Status.NOT_APPLICABLE
KNOBS = {k.name: k for k in Dataloader.knobs}
DATASET = TensorDataset(torch.arange(8.0))


@pytest.mark.parametrize(
    "name, expected",
    [
        ("plain", [A]),
        ("user_workers", [A]),
        ("user_zero_workers", [A]),
        ("switched_off", [A]),  # a config's switches, off by default
        ("batch_sampler", [A]),
        ("all_set", [U]),
        ("kwargs_splat", [N]),  # read from a config file
        ("kwargs_update", [A]),  # a literal dict .update()d with another
        ("kwargs_conditional", [A]),  # one of two literal dicts
        ("kwargs_passed_on", [N]),  # handed to a function that may set anything
        ("kwargs_wrapper", [A]),  # a wrapper's **kwargs, passed by name by its one caller (makemore's shape)
        ("lookalike", []),  # a local class named DataLoader
        ("no_training_loop", [N]),
    ],
)
def test_sites(name, expected):
    assert statuses(T, name) == expected


def test_reasons():
    assert sites(T, "user_workers")[0].reason == (
        "DataLoader: pin_memory, persistent_workers, prefetch_factor become knobs; num_workers=args.workers: the "
        "script's own switch (present, switched off where 0 or False), which the knobs turn on there"
    )
    assert sites(T, "switched_off")[0].reason == (
        'DataLoader: persistent_workers, prefetch_factor become knobs; num_workers=cfg["workers"], '
        'pin_memory=cfg["pin_memory"] and torch.cuda.is_available(): the script\'s own switches (present, switched '
        "off where 0 or False), which the knobs turn on there"
    )
    assert sites(T, "user_zero_workers")[0].reason == "DataLoader: pin_memory becomes a knob; num_workers=0 kept as written"
    assert sites(T, "kwargs_splat")[0].reason == "**CONFIG may set the loader settings"
    assert sites(T, "kwargs_passed_on")[0].reason == "**loader_kwargs may set the loader settings"
    assert sites(T, "kwargs_wrapper")[0].reason == (
        "DataLoader: pin_memory, persistent_workers, prefetch_factor become knobs; num_workers in **kwargs kept as "
        "written"
    )
    assert sites(T, "kwargs_update")[0].reason == (
        "DataLoader: persistent_workers, prefetch_factor become knobs; num_workers in **train_kwargs, "
        "pin_memory in **train_kwargs kept as written"
    )


def test_the_knob_table_lists_only_knobs_that_can_change_something():
    def knob_names(name):
        return [k.name for k in run(load_project(case(T, name)), select([T]), hooks=False).knobs]

    assert knob_names("plain") == sorted(KNOBS)
    assert knob_names("user_zero_workers") == ["dataloader.pin_memory"]
    # num_workers=0 written as a constant is the script's choice; num_workers=args.workers is its switch: a knob
    assert "dataloader.num_workers" in knob_names("user_workers")


# --- the runtime helper -----------------------------------------------------------------------------------

ABSENT = object()
SCRIPT_VALUES = {
    "num_workers": [ABSENT, 0, 2],
    "pin_memory": [ABSENT, False, True],
    "persistent_workers": [ABSENT, False, True],
    "prefetch_factor": [ABSENT, None, 4],
}
KNOB_VALUES = {
    "dataloader.num_workers": [0, 2],
    "dataloader.pin_memory": [False, True],
    "dataloader.persistent_workers": [False, True],
    "dataloader.prefetch_factor": [2, 8],
}


def _legal(kwargs) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            DataLoader(DATASET, **kwargs)
    except ValueError:
        return False
    return True


@pytest.fixture
def set_knobs(tmp_path, monkeypatch):
    def apply(values):
        path = tmp_path / "knobs.yaml"
        path.write_text(yaml.safe_dump({"knobs": values}))
        monkeypatch.setenv(runtime.CONFIG_ENV, str(path))
        runtime.reset()

    yield apply
    runtime.reset()


def test_dataloader_kwargs_every_combination(set_knobs):
    checked = 0
    for knob_values in itertools.product(*KNOB_VALUES.values()):
        knobs = dict(zip(KNOB_VALUES, knob_values))
        set_knobs(knobs)
        for script_values in itertools.product(*SCRIPT_VALUES.values()):
            script = {k: v for k, v in zip(SCRIPT_VALUES, script_values) if v is not ABSENT}
            out = runtime.dataloader_kwargs(**script)
            context = f"script {script}, knobs {knobs} -> {out}"
            # what the script wrote is passed on as written
            assert {k: out[k] for k in script} == script, context
            # a legal call stays legal, whatever the knobs say
            if _legal(script):
                assert _legal(out), context
            workers = out.get("num_workers", 0)
            if workers == 0:
                assert "prefetch_factor" not in out or "prefetch_factor" in script, context
                assert not out.get("persistent_workers") or "persistent_workers" in script, context
            # the knobs decide what the script left out
            if "num_workers" not in script:
                assert workers == knobs["dataloader.num_workers"], context
            if "pin_memory" not in script:
                assert out.get("pin_memory", False) == knobs["dataloader.pin_memory"], context
            if "persistent_workers" not in script:
                assert out.get("persistent_workers", False) == (knobs["dataloader.persistent_workers"] and workers > 0)
            if "prefetch_factor" not in script and workers > 0:
                assert out.get("prefetch_factor", 2) == knobs["dataloader.prefetch_factor"], context
            assert set(out) <= set(SETTINGS), context
            checked += 1
    assert checked == 16 * 81


def test_dataloader_kwargs_defaults_add_nothing(set_knobs):
    set_knobs({})
    assert runtime.dataloader_kwargs() == {}
    assert runtime.dataloader_kwargs(num_workers=3) == {"num_workers": 3}


# --- baked code ---------------------------------------------------------------------------------------------


def _baked_settings(text: str, workers: int) -> dict:
    """The loader settings a baked script passes, evaluated with ``args.workers == workers``."""
    module = cst.parse_module(text)
    found = []

    class Finder(cst.CSTVisitor):
        def visit_Call(self, node: cst.Call) -> None:
            if module.code_for_node(node.func).endswith("DataLoader"):
                found.append(node)

    module.visit(Finder())
    (call,) = found
    env = {"args": types.SimpleNamespace(workers=workers)}
    return {
        a.keyword.value: eval(module.code_for_node(a.value), env)  # noqa: S307 - our own generated literals
        for a in call.args
        if a.keyword is not None and a.keyword.value in SETTINGS
    }


ALL_VALUES = list(itertools.product(*(k.choices for k in Dataloader.knobs)))
DEFAULTS = {("num_workers", 0), ("pin_memory", False), ("persistent_workers", False), ("prefetch_factor", None)}


def case_text(name: str) -> str:
    return case(T, name).read_text()


@pytest.mark.parametrize("name", ["plain", "user_workers", "user_zero_workers"])
def test_baked_calls_are_legal_and_match_the_runtime(name, set_knobs):
    for values in ALL_VALUES:
        knobs = dict(zip(KNOBS, values))
        text = baked(T, name, knobs, device="cuda")
        set_knobs(knobs)
        for workers in (0, 2):
            settings = _baked_settings(text, workers)
            assert _legal(settings), (knobs, settings)
            script = _baked_settings(case_text(name), workers)
            if name == "user_workers":  # num_workers=args.workers: the script's switch, which the knob turns on at 0
                script["num_workers"] = runtime.dataloader_switch("num_workers", script["num_workers"])
            expected = runtime.dataloader_kwargs(**script)
            # baked code writes plain values only where they differ from DataLoader's own defaults
            normal = {k: v for k, v in settings.items() if (k, v) not in DEFAULTS}
            assert normal == {k: v for k, v in expected.items() if (k, v) not in DEFAULTS}, (knobs, workers)


@pytest.mark.parametrize("name, dict_name", [("kwargs_update", "train_kwargs"), ("kwargs_conditional", "kwargs")])
def test_baked_dict_splat_is_legal_on_every_path(name, dict_name):
    """The splatted dict holds workers on CUDA only: baked settings read it there and never repeat its keys."""
    knobs = {"dataloader.num_workers": 2, "dataloader.pin_memory": True, "dataloader.persistent_workers": True,
             "dataloader.prefetch_factor": 4}
    module = cst.parse_module(baked(T, name, knobs))
    found = []

    class Finder(cst.CSTVisitor):
        def visit_Call(self, node: cst.Call) -> None:
            if module.code_for_node(node.func).endswith("DataLoader"):
                found.append(node)

    module.visit(Finder())
    (call,) = found
    for loader_dict in ({}, {"num_workers": 1, "pin_memory": True}):
        env = {dict_name: loader_dict}
        settings = {
            a.keyword.value: eval(module.code_for_node(a.value), env)  # noqa: S307 - our own generated code
            for a in call.args
            if a.keyword is not None and a.keyword.value in SETTINGS
        }
        assert not set(settings) & set(loader_dict), (settings, loader_dict)
        assert _legal({**loader_dict, **settings}), (settings, loader_dict)
        assert bool(settings.get("persistent_workers")) == bool(loader_dict.get("num_workers")), settings


def test_defaults_bake_nothing():
    defaults = {k.name: k.default for k in Dataloader.knobs}
    assert baked(T, "plain", defaults) == case_text("plain")


# --- running it ---------------------------------------------------------------------------------------------

# Every value of every knob that runs on the CPU appears at least once (pin_memory is for CUDA).
CPU_CONFIGS = [
    {"dataloader.num_workers": 1},
    {"dataloader.num_workers": 2, "dataloader.persistent_workers": True, "dataloader.prefetch_factor": 4},
    {"dataloader.num_workers": 4, "dataloader.prefetch_factor": 8},
    {"dataloader.num_workers": 8},
    {"dataloader.num_workers": 16, "dataloader.persistent_workers": True},
]


@pytest.mark.slow
def test_losses_plain(tmp_path):
    # loader workers change who loads a batch, never which: the same losses at every count (the baked script at
    # each choice trains like the patched one: test_bake_every_choice; here one bake, of the most settings)
    base = original(tmp_path, T, "plain")
    gated = patched(T, "plain")
    assert losses(tmp_path, "default", gated) == base
    for i, knobs in enumerate(CPU_CONFIGS):
        assert losses(tmp_path, f"on{i}", gated, knobs) == base, knobs
    assert losses(tmp_path, "baked", baked(T, "plain", CPU_CONFIGS[1])) == base


@pytest.mark.slow
def test_losses_through_a_wrappers_kwargs(tmp_path):
    # the settings reach the loader through the wrapper's **kwargs: the knobs fill in what its caller leaves out
    args = ["--workers", "2"]
    base = original(tmp_path, T, "kwargs_wrapper", args)
    gated = patched(T, "kwargs_wrapper")
    assert losses(tmp_path, "default", gated, args=args) == base
    knobs = {"dataloader.persistent_workers": True, "dataloader.prefetch_factor": 4}
    on = losses(tmp_path, "on", gated, knobs, args=args)
    assert losses(tmp_path, "baked", baked(T, "kwargs_wrapper", knobs), args=args) == on == base


def test_a_wrappers_kwargs_with_a_caller_that_splats_a_dict_are_unknown(tmp_path):
    text = case(T, "kwargs_wrapper").read_text().replace(
        "EndlessLoader(data, batch_size=16, num_workers=args.workers)", "EndlessLoader(data, **vars(args))")
    script = tmp_path / "train.py"
    script.write_text(text)
    (site,) = run(load_project(script), select([T]), hooks=False).sites
    assert site.status is N and site.reason == "**kwargs may set the loader settings"


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["0", "2"])
def test_losses_with_the_scripts_own_workers(tmp_path, workers):
    args = ["--workers", workers]
    base = original(tmp_path, T, "user_workers", args)
    gated = patched(T, "user_workers")
    assert losses(tmp_path, "default", gated, args=args) == base
    knobs = {"dataloader.persistent_workers": True, "dataloader.prefetch_factor": 8}
    on = losses(tmp_path, "on", gated, knobs, args=args)
    assert losses(tmp_path, "baked", baked(T, "user_workers", knobs), args=args) == on == base
    # the script's switch off (--workers 0): the knob turns it on; on (--workers 2): the script's count stands
    knobs = {"dataloader.num_workers": 4}
    on = losses(tmp_path, "switched", gated, knobs, args=args)
    assert losses(tmp_path, "switched_baked", baked(T, "user_workers", knobs), args=args) == on == base


@pytest.mark.slow
@pytest.mark.parametrize("name", ["kwargs_update", "kwargs_conditional"])
def test_losses_with_a_splatted_dict(tmp_path, name):
    base = original(tmp_path, T, name)
    gated = patched(T, name)
    assert losses(tmp_path, "default", gated) == base
    knobs = {"dataloader.persistent_workers": True, "dataloader.prefetch_factor": 4}
    on = losses(tmp_path, "on", gated, knobs)
    assert losses(tmp_path, "baked", baked(T, name, knobs)) == on == base


@pytest.mark.cuda
@pytest.mark.slow
def test_pinned_memory_on_cuda(tmp_path):
    base = original(tmp_path, T, "user_zero_workers")
    gated = patched(T, "user_zero_workers")
    knobs = {"dataloader.pin_memory": True}
    on = losses(tmp_path, "on", gated, knobs, device="cuda")
    assert losses(tmp_path, "baked", baked(T, "user_zero_workers", knobs, device="cuda")) == on == base


def test_a_dataset_that_moves_items_to_the_device_keeps_its_loader():
    """Workers cannot use CUDA and CUDA tensors cannot be pinned: the dataset reaches the loader as a parameter of
    the trainer's __init__, and is followed back to the class its caller builds."""
    (site,) = sites(T, "dataset_on_device")
    assert site.status is N
    assert site.reason.startswith("PairDataset.__getitem__ moves items to the device (self.x[idx].to(...), line 20)")
    assert patched(T, "dataset_on_device") == case(T, "dataset_on_device").read_text()


def test_persistent_workers_change_the_shuffle_from_the_second_epoch_so_no_default_space_searches_them():
    # A persistent loader draws its seed once instead of once per epoch, so the global random stream, and with it
    # the shuffle, differs from the second epoch on. A short trial inside one epoch cannot see that, so the
    # bundled spaces keep the knob at its default. Should torch ever draw per epoch here, this fails: offer it again.
    def first_batches(persistent):
        torch.manual_seed(0)
        loader = DataLoader(TensorDataset(torch.arange(16)), batch_size=4, shuffle=True, num_workers=1,
                            persistent_workers=persistent)
        return [[batch[0].tolist() for batch in loader][0] for _ in range(3)]

    plain, persistent = first_batches(False), first_batches(True)
    assert plain[0] == persistent[0] and plain[1:] != persistent[1:]
    for device in ("cpu", "cuda"):
        assert read_space(device).choices["dataloader.persistent_workers"] == (False,), device


def test_a_switch_of_the_scripts_is_its_value_where_on_and_the_knobs_where_off(set_knobs):
    set_knobs({})
    assert runtime.dataloader_switch("num_workers", 0) == 0 and "dataloader.num_workers" not in runtime.applied()
    set_knobs({"dataloader.num_workers": 4, "dataloader.pin_memory": True})
    assert runtime.dataloader_switch("num_workers", 2) == 2  # the script asked for workers: its count stands
    assert "dataloader.num_workers" not in runtime.applied()
    assert runtime.dataloader_switch("num_workers", 0) == 4 and "dataloader.num_workers" in runtime.applied()
    assert runtime.dataloader_switch("pin_memory", False) is True
    assert runtime.dataloader_kwargs(num_workers=runtime.dataloader_switch("num_workers", 0))["num_workers"] == 4


@pytest.mark.slow
def test_losses_with_the_scripts_switches_off(tmp_path):
    base = original(tmp_path, T, "switched_off")
    gated = patched(T, "switched_off")
    assert losses(tmp_path, "default", gated) == base
    knobs = {"dataloader.num_workers": 2, "dataloader.prefetch_factor": 4}
    on = losses(tmp_path, "on", gated, knobs)
    assert losses(tmp_path, "baked", baked(T, "switched_off", knobs)) == on == base


def test_a_worker_count_kept_as_written_bakes_prefetching_only_where_it_has_workers(tmp_path):
    """num_workers=args.workers beside persistent_workers is the script's choice, not a switch: a baked
    prefetch_factor must still depend on it (baking it unconditionally fails with --workers 0)."""
    from autotune.transform import Mode

    script = tmp_path / "persist.py"
    script.write_text(case_text("user_workers").replace(
        "num_workers=args.workers,  # 0 while debugging", "num_workers=args.workers,\n        persistent_workers=args.workers > 0,"))
    assert "persistent_workers=args.workers > 0" in script.read_text()
    knobs = {"dataloader.num_workers": 2, "dataloader.prefetch_factor": 4}
    (file,) = run(load_project(script), select([T]), Mode(values=knobs, device="cpu"), hooks=False).files
    for workers in (0, 2):
        settings = _baked_settings(file.new_text, workers)
        assert settings["num_workers"] == workers and _legal(settings), (workers, settings)
