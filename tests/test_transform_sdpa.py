"""sdpa: the rewritten attention computes what the hand-written one did (outputs and gradients), look-alikes stay."""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import pytest
import torch

import autotune.runtime as runtime
from autotune.project import load_project
from autotune.patch import run, select
from autotune.transform import Status

CASES = Path(__file__).resolve().parent.parent / "fixtures" / "transforms" / "sdpa"
_count = itertools.count()


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"sdpa_case_{next(_count)}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def knob(tmp_path, monkeypatch):
    """Set ``sdpa.attention`` for the gated fixture outputs, through the runtime's own config file."""

    def set_value(value: str) -> None:
        config = tmp_path / f"{value}.yaml"
        config.write_text(f"knobs:\n  sdpa.attention: {value}\n")
        monkeypatch.setenv(runtime.CONFIG_ENV, str(config))
        runtime.reset()

    yield set_value
    runtime.reset()


def _run(module_cls, build, inputs, seed=0):
    """Output and gradients (inputs and parameters) of a freshly seeded module on the given inputs."""
    torch.manual_seed(seed)
    mod = build(module_cls)
    tensors = [t.detach().clone().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t for t in inputs]
    out = mod(*tensors)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = [t.grad for t in tensors if isinstance(t, torch.Tensor) and t.grad is not None]
    grads += [p.grad for p in mod.parameters()]
    return out.detach(), grads


def _no_dropout(mod):
    for m in mod.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return mod


def _cases():
    g = torch.Generator().manual_seed(1)
    pad = torch.ones(3, 24, dtype=torch.long)
    pad[0, 20:] = 0
    pad[2, 5:] = 0
    causal = torch.triu(torch.full((12, 12), float("-inf")), diagonal=1)
    return {
        "gpt_causal": [
            ("CausalSelfAttention", lambda c: c(n_embd=64, n_head=4, block_size=32, dropout=0.0), [torch.randn(2, 32, 64, generator=g)]),
            # a shorter sequence than the registered buffer: the slice [:T, :T] of the causal mask
            ("CausalSelfAttention", lambda c: c(n_embd=64, n_head=4, block_size=32, dropout=0.0), [torch.randn(2, 17, 64, generator=g)]),
        ],
        "karpathy_head": [("Head", lambda c: _no_dropout(c(16)), [torch.randn(2, 40, 384, generator=g)])],
        "encoder_masks": [
            # masked (padding) and scaled by a temperature: not SDPA's default scale
            ("PaddedSelfAttention", lambda c: c(d_model=64, n_heads=4, attn_pdrop=0.0), [torch.randn(3, 24, 64, generator=g), pad]),
            ("PaddedSelfAttention", lambda c: c(d_model=64, n_heads=4, attn_pdrop=0.0), [torch.randn(3, 24, 64, generator=g)]),
            # additive mask and einsum products
            (
                "CrossAttention",
                lambda c: c(d_model=64, n_heads=4),
                [torch.randn(2, 10, 64, generator=g), torch.randn(2, 14, 64, generator=g), torch.randn(2, 1, 10, 14, generator=g)],
            ),
        ],
        "mqa_einsum": [
            # one key/value head broadcast to every query head; rotary embeddings; a boolean causal buffer, sliced
            ("MultiQueryAttention", lambda c: c(dim=64, n_head=4, max_len=32), [torch.randn(2, 32, 64, generator=g)]),
            ("MultiQueryAttention", lambda c: c(dim=64, n_head=4, max_len=32), [torch.randn(2, 17, 64, generator=g)]),
        ],
        "llama_gqa": [
            # grouped heads, additive causal mask, softmax in float32 cast back
            ("Attention", lambda c: c(dim=64, n_heads=4, n_kv_heads=2), [torch.randn(2, 12, 64, generator=g), causal]),
            ("Attention", lambda c: c(dim=64, n_heads=4, n_kv_heads=2), [torch.randn(2, 12, 64, generator=g), None]),
        ],
    }


CASE_PARAMS = [(name, i) for name, variants in _cases().items() for i in range(len(variants))]


@pytest.mark.parametrize(("case", "variant"), CASE_PARAMS, ids=[f"{c}-{i}" for c, i in CASE_PARAMS])
def test_rewritten_attention_matches_manual(case, variant, knob):
    cls_name, build, inputs = _cases()[case][variant]
    original = getattr(_load(CASES / f"{case}.in.py"), cls_name)
    gated = getattr(_load(CASES / f"{case}.out.py"), cls_name)
    baked = getattr(_load(CASES / f"{case}.bake.py"), cls_name)
    want_out, want_grads = _run(original, build, inputs)

    knob("manual")  # the default: the script's own code, bit for bit
    out, grads = _run(gated, build, inputs)
    assert torch.equal(out, want_out)
    assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))

    for variant_cls, value in ((gated, "sdpa"), (baked, None)):
        if value:
            knob(value)
        out, grads = _run(variant_cls, build, inputs)
        torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-5)
        assert len(grads) == len(want_grads)
        for a, b in zip(grads, want_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_knob_really_switches_to_sdpa(knob, monkeypatch):
    """The gated code calls F.scaled_dot_product_attention only when the knob says so."""
    gated = _load(CASES / "gpt_causal.out.py")
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", lambda *a, **k: calls.append(k) or real(*a, **k))
    mod = gated.CausalSelfAttention(n_embd=32, n_head=2, block_size=8, dropout=0.1)
    knob("manual")
    mod(torch.randn(1, 8, 32))
    assert calls == []
    knob("sdpa")
    mod(torch.randn(1, 8, 32))
    assert calls == [{"dropout_p": 0.1, "is_causal": True}]
    mod.eval()
    mod(torch.randn(1, 8, 32))
    assert calls[-1] == {"dropout_p": 0.0, "is_causal": True}, "no attention dropout outside training"


def _sites(case: str) -> list:
    return [s for s in run(load_project(CASES / f"{case}.in.py"), select(["sdpa"]), hooks=False).sites]


def test_look_alikes_are_reported_not_rewritten():
    bow = _sites("bag_of_words")
    assert [s.status for s in bow] == [Status.NOT_APPLICABLE, Status.NOT_APPLICABLE]
    assert all("not q @ k^T" in s.reason for s in bow)
    returned = _sites("weights_returned")
    assert [s.status for s in returned] == [Status.NOT_APPLICABLE, Status.NOT_APPLICABLE]
    assert "`p_attn` (the attention weights) is also used at line 21" in returned[0].reason
    assert "`att` (the attention weights) is also used at line 36" in returned[1].reason


def test_existing_sdpa_is_present():
    flag = _sites("flash_flag")
    assert [(s.status, s.line) for s in flag] == [(Status.PRESENT, 39)]
    # nanoGPT's self.flash = hasattr(F, "scaled_dot_product_attention"): on wherever torch has SDPA
    assert flag[0].reason == ("F.scaled_dot_product_attention where self.flash, which the script sets wherever torch "
                              "has it")
    already = _sites("already_sdpa")
    assert {s.status for s in already} == {Status.PRESENT}
    assert len(already) == 2


def _patch_text(tmp_path: Path, source: str) -> tuple[list, str]:
    script = tmp_path / "attn.py"
    script.write_text(source)
    result = run(load_project(script), select(["sdpa"]), hooks=False)
    return list(result.sites), result.files[0].new_text


HEADER = "import math\nimport torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\n\n"


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (
            "def f(q, k, v, mask):\n"
            "    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))\n"
            "    s = s.masked_fill(mask == 0, -1e9)\n"
            "    return F.softmax(s, dim=-1) @ v\n",
            "-1e9 instead of -inf",
        ),
        (
            "def f(q, k, v, mask):\n"
            "    s = q @ k.transpose(-2, -1) + mask\n"
            "    s = s / math.sqrt(q.size(-1))\n"
            "    return F.softmax(s, dim=-1) @ v\n",
            "added before the scores are scaled",
        ),
        (
            "def f(q, k, v):\n"
            "    s = q @ k\n"
            "    return F.softmax(s, dim=-1) @ v\n",
            "not q @ k.transpose(-2, -1)",
        ),
        (
            "def f(q, k, v, t):\n"
            "    s = q @ k.transpose(-2, -1) * t\n"
            "    return F.softmax(s, dim=-1) @ v\n",
            "not a plain number",
        ),
        (
            "def f(q, k, v):\n"
            "    s = q @ k.transpose(-2, -1) * q.size(-1) ** -0.5\n"
            "    p = F.softmax(s, dim=1)\n"
            "    return p @ v\n",
            "other than the last",
        ),
        (
            "def f(q, k, v, log):\n"
            "    s = q @ k.transpose(-2, -1) * q.size(-1) ** -0.5\n"
            "    p = F.softmax(s, dim=-1)\n"
            "    log.append(s)\n"
            "    return p @ v\n",
            "`s` (an intermediate of the attention) is also used at line 10",
        ),
        (
            "def f(q, k, v):\n"
            "    s = q @ k.transpose(-2, -1) * q.size(-1) ** -0.5\n"
            "    return F.softmax(s.float(), dim=-1) @ v\n",
            "never cast back",
        ),
    ],
    ids=["finite-fill", "mask-before-scale", "k-not-transposed", "tensor-scale", "wrong-dim", "scores-kept", "float-kept"],
)
def test_near_misses_say_why(tmp_path, body, reason):
    sites, text = _patch_text(tmp_path, HEADER + body)
    assert [s.status for s in sites] == [Status.NOT_APPLICABLE]
    assert reason in sites[0].reason
    assert text == HEADER + body


def test_function_attention_without_scale_gets_scale_one(tmp_path):
    """Unscaled scores (q pre-scaled elsewhere) need scale=1.0, not SDPA's default 1/sqrt(d)."""
    body = "def attend(q, k, v):\n    w = torch.matmul(q, k.mT).softmax(-1)\n    return torch.matmul(w, v)\n"
    sites, text = _patch_text(tmp_path, HEADER + body)
    assert [s.status for s in sites] == [Status.APPLICABLE]
    assert "F.scaled_dot_product_attention(q, k, v, scale=1.0)" in text
    namespace: dict = {}
    exec(compile(text, "attn.py", "exec"), namespace)
    exec(compile(HEADER + body, "orig.py", "exec"), namespace | {"__name__": "orig"}, orig := {})
    q, k, v = torch.randn(3, 2, 5, 8).unbind(0)
    runtime.reset()
    torch.testing.assert_close(namespace["attend"](q, k, v), orig["attend"](q, k, v))


PROJECT = Path(__file__).resolve().parent.parent / "fixtures" / "projects" / "minigpt"


def test_attention_in_a_package_module_is_rewritten_there():
    result = run(load_project(PROJECT / "train.py"), select(["sdpa"]), hooks=False)
    (site,) = result.sites
    assert site.status is Status.APPLICABLE and site.path.endswith("mingpt/model.py")
    changed = [f.rel.as_posix() for f in result.files if f.changed]
    assert changed == ["mingpt/model.py"]


@pytest.mark.slow
def test_package_project_trains_the_same_with_sdpa(tmp_path):
    """The minGPT-style project (model, optimizer and loop in three modules), patched: the default reproduces the
    original bit for bit; SDPA gives the same losses up to float reordering (dropout 0)."""
    from loss_probe import run_probe

    from autotune.patch import write_outputs

    out = tmp_path / "patched"
    write_outputs(run(load_project(PROJECT / "train.py"), select(["sdpa"])), out, "train.py")
    config = tmp_path / "sdpa.yaml"
    config.write_text("knobs:\n  sdpa.attention: sdpa\n")
    args = ["--steps", "4", "--dropout", "0"]
    env = {"OMP_NUM_THREADS": "1"}
    want = run_probe(PROJECT / "train.py", args, steps=4, env=env, timeout=300)
    assert run_probe(out / "train.py", args, steps=4, env=env, timeout=300) == want
    got = run_probe(out / "train.py", args, steps=4, env={**env, runtime.CONFIG_ENV: str(config)}, timeout=300)
    assert [float.fromhex(v) for v in got] == pytest.approx([float.fromhex(v) for v in want], rel=1e-5)


def test_transpose_2_3_runs_sdpa_only_for_4d_keys(tmp_path, knob):
    """``k.transpose(2, 3)`` is k^T only for 4-D keys: the rewrite checks the rank, else runs the script's code."""
    body = (
        "def attend(q, k, v):\n"
        "    s = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(q.size(-1))\n"
        "    return torch.matmul(F.softmax(s, dim=-1), v)\n"
    )
    sites, text = _patch_text(tmp_path, HEADER + body)
    assert [s.status for s in sites] == [Status.APPLICABLE]
    assert "if _autotune.sdpa_enabled() and k.dim() == 4:" in text
    namespace: dict = {}
    exec(compile(text, "attn.py", "exec"), namespace)
    exec(compile(HEADER + body, "orig.py", "exec"), namespace | {"__name__": "orig"}, orig := {})
    knob("sdpa")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g) for _ in range(3))
    torch.testing.assert_close(namespace["attend"](q, k, v), orig["attend"](q, k, v))
    # 5-D: transpose(2, 3) is not the last two dims, and SDPA would compute something else
    q, k, v = torch.randn(1, 2, 3, 4, 5, generator=g), torch.randn(1, 2, 5, 3, 6, generator=g), torch.randn(1, 2, 3, 6, 7, generator=g)
    assert torch.equal(namespace["attend"](q, k, v), orig["attend"](q, k, v))


def test_a_switched_off_attention_flag_becomes_the_knob(tmp_path):
    # llm.c's train_gpt2.py: FLASH = args.flash (0 unless --flash 1) chooses SDPA or the hand-written attention
    from transform_cases import baked, case, losses, patched

    (site,) = _sites("flash_switch")
    assert (site.status, site.line) == (Status.APPLICABLE, 32)
    assert "the script's own switch (present, switched off where FLASH is false)" in site.reason
    original = case("sdpa", "flash_switch").read_text()
    gated = patched("sdpa", "flash_switch")
    assert losses(tmp_path, "default", gated) == losses(tmp_path, "original", original)
    with_flash = [float.fromhex(h) for h in losses(tmp_path, "flash", original, args=["--flash", "1"])]
    on = [float.fromhex(h) for h in losses(tmp_path, "on", gated, {"sdpa.attention": "sdpa"})]
    assert on == with_flash  # the knob takes the script's own SDPA branch
    assert [float.fromhex(h) for h in losses(tmp_path, "baked", baked("sdpa", "flash_switch",
                                                                        {"sdpa.attention": "sdpa"}))] == on
    manual = [float.fromhex(h) for h in losses(tmp_path, "manual", original)]
    assert on == pytest.approx(manual, rel=1e-4)  # and SDPA trains as the manual attention does, to rounding


@pytest.mark.parametrize(("name", "definition"), [
    ("flash_constant", "USE_FLASH = False"),  # a module constant, read in a model's forward
    ("flash_config_dict", '"flash": False'),  # an entry of the one dict that configures the script
])
def test_a_switched_off_flag_defined_once_is_turned_on_where_it_is_defined(tmp_path, name, definition):
    # the flag is defined once and read only by the attention's switch: the tuned script flips it there, as its
    # author would, and leaves the if as written
    from transform_cases import baked, case, losses, patched

    (site,) = _sites(name)
    assert site.status is Status.APPLICABLE
    assert site.reason.endswith(f"where it is defined ({definition} -> True), as nothing else reads it")
    original = case("sdpa", name).read_text()
    gated = patched("sdpa", name)
    assert losses(tmp_path, "default", gated) == losses(tmp_path, "original", original)
    on = losses(tmp_path, "on", gated, {"sdpa.attention": "sdpa"})
    tuned = baked("sdpa", name, {"sdpa.attention": "sdpa"})
    assert losses(tmp_path, "baked", tuned) == on  # the flipped definition runs what the trials measured
    changed = [(a, b) for a, b in zip(original.splitlines(), tuned.splitlines(), strict=True) if a != b]
    assert changed == [(a, a.replace("False", "True")) for a, _ in changed] and len(changed) == 1
    manual = [float.fromhex(h) for h in losses(tmp_path, "manual", original)]
    assert [float.fromhex(h) for h in on] == pytest.approx(manual, rel=1e-4)


_FLAG_SCRIPT = """\
import math

import torch
from torch.nn import functional as F

{defs}


def attend(q, k, v):
    if {test}:
        return F.scaled_dot_product_attention(q, k, v)
    w = F.softmax((q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1)), dim=-1)
    return w @ v
"""
_CONFIG = 'config = {"lr": 1e-3, "flash": False}'


@pytest.mark.parametrize(("defs", "test", "found"), [
    ("USE_FLASH = False", "USE_FLASH", "False"),
    ("USE_FLASH = 0", "USE_FLASH", "0"),
    ("USE_FLASH: bool = False", "USE_FLASH", "False"),
    ("USE_FLASH = True", "USE_FLASH", "True"),  # on already: the switch is present, nothing to turn on
    (_CONFIG + '\nlr = config["lr"]', 'config["flash"]', "False"),
    ("config = dict(lr=1e-3, flash=0)", 'config["flash"]', "0"),
    # read or written elsewhere, or not plainly a literal: the switch stays where it is
    ("USE_FLASH = False\nprint('flash:', USE_FLASH)", "USE_FLASH", None),
    ("USE_FLASH = False\nUSE_FLASH = bool(int('0'))", "USE_FLASH", None),  # llm.c: FLASH = args.flash below
    ("USE_FLASH = False\ndef enable():\n    global USE_FLASH\n    USE_FLASH = True", "USE_FLASH", None),
    ("USE_FLASH = False\ndef f(USE_FLASH=True):\n    return USE_FLASH", "USE_FLASH", None),
    ("USE_FLASH = False\nexec('USE_FLASH = True')", "USE_FLASH", None),  # nanoGPT's configurator.py
    ("import os\nUSE_FLASH = os.environ.get('FLASH') == '1'", "USE_FLASH", None),
    ("USE_FLASH, STEPS = False, 10", "USE_FLASH", None),
    ("USE_FLASH = None", "USE_FLASH", None),
    (_CONFIG + '\nconfig["flash"] = True', 'config["flash"]', None),
    (_CONFIG + '\nconfig["lr"] *= 2', 'config["flash"]', None),
    (_CONFIG + "\nconfig.update(flash=True)", 'config["flash"]', None),
    (_CONFIG + "\nprint(config)", 'config["flash"]', None),  # passed on: what reads it there is unseen
    (_CONFIG + '\nprint(config["flash"])', 'config["flash"]', None),
    ('base = {}\nconfig = {**base, "flash": False}', 'config["flash"]', None),
    ('config = {"flash": False, "flash": True}', 'config["flash"]', None),
    ("config = dict(flash=False, **{'lr': 1})", 'config["flash"]', None),
])
def test_the_definition_a_flag_is_turned_on_at(tmp_path, defs, test, found):
    import libcst as cst

    from autotune.transforms._flag import definition

    script = tmp_path / "attn.py"
    script.write_text(_FLAG_SCRIPT.format(defs=defs, test=test))
    project = load_project(script)
    facts = project.entry
    (switch,) = [n for n in facts.nodes(cst.If) if facts.code(n.test) == test]
    literal = definition(project, facts, [switch.test])
    assert (None if literal is None else facts.code(literal)) == found


def test_a_flag_another_module_names_stays_switched_where_it_is(tmp_path):
    # train.py sets model.FLASH itself: flipping model.py's definition would not be the only way it changes
    import libcst as cst

    from autotune.transforms._flag import definition

    (tmp_path / "model.py").write_text(_FLAG_SCRIPT.format(defs="FLASH = False", test="FLASH"))
    (tmp_path / "train.py").write_text("import model\n\nmodel.FLASH = True\n")
    project = load_project(tmp_path / "train.py")
    facts = next(m for m in project.modules if m.path.name == "model.py")
    (switch,) = [n for n in facts.nodes(cst.If) if facts.code(n.test) == "FLASH"]
    assert definition(project, facts, [switch.test]) is None
    (tmp_path / "train.py").write_text("import model\n")
    project = load_project(tmp_path / "train.py")
    facts = next(m for m in project.modules if m.path.name == "model.py")
    (switch,) = [n for n in facts.nodes(cst.If) if facts.code(n.test) == "FLASH"]
    assert facts.code(definition(project, facts, [switch.test])) == "False"


@pytest.mark.parametrize(("spec", "role", "shared"), [
    ("bhtd,bhsd->bhts", "qk", False),
    ("bhtd,bsd->bhts", "qk", True),  # multi-query: one key head, broadcast over the query heads
    ("bhts,bsd->bhtd", "av", True),
    ("...hld,...sd->...hls", "qk", True),  # any leading dimensions, the head the last of them
    ("bhtd,hsd->bhts", "qk", None),  # the key keeps the heads and drops the batch: not a shared head
    ("bhtd,bsd->bts", "qk", None),  # the heads summed away: not attention per head
])
def test_einsum_attention_with_one_key_value_head(spec, role, shared):
    import libcst as cst

    from autotune.transforms._attention_exprs import _einsum

    found = _einsum(cst.parse_expression(f'torch.einsum("{spec}", a, b)'), role)
    assert (None if found is None else found.shared) == shared
