"""A framework's settings given as keyword arguments where the script builds its config or trainer
(``TrainingArguments(...)``, ``L.Trainer(...)``): the settings the script leaves out become knobs there."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.transform import Edits, Status, Transform
from autotune.syntax import add_args, kwarg, star_kwargs


def string_value(node: cst.BaseExpression) -> str | None:
    value = node.evaluated_value if isinstance(node, cst.SimpleString) else None
    return value if isinstance(value, str) else None


def keyword_settings(
    transform: Transform,
    facts: ModuleFacts,
    call: cst.Call,
    edits: Edits,
    settings: Mapping[str, tuple[str, ...]],
    helper: str,
    what: str,
    on: Callable[[str, cst.BaseExpression], bool],
    baked: Callable[[list[str]], dict[str, str]],
) -> None:
    """Report and edit ``call``, whose keywords give a framework's settings.

    ``settings``: each knob's setting -> the keywords that decide it (a script that writes one keeps its choice:
    "already present" where ``on(keyword, value)``, else "kept as written"). Gated, ``**_autotune.<helper>(...)``
    is appended, told which settings the script gives itself; baked, ``baked(free settings)`` gives the keywords
    (name -> code) to append.
    """
    if any(facts.is_runtime_call(a.value, helper) for a in call.args if a.star == "**"):
        transform.report(facts, call, Status.PRESENT, f"{what} settings are already knobs")
        return
    splat = next((a for a in call.args if a.star), None)
    if splat is not None:
        transform.report(facts, call, Status.NOT_APPLICABLE,
                         f"{splat.star}{facts.code(splat.value)} may give the settings: which, is not known")
        return
    written = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
    kept = []
    for setting, keywords in settings.items():
        given = [k for k in keywords if k in written]
        if given:
            kept.append(setting)
            code = ", ".join(f"{k}={facts.code(written[k])}" for k in given)
            present = any(on(k, written[k]) for k in given)
            status = Status.PRESENT if present else Status.USER
            transform.report(facts, call, status, f"the script sets {code}" + ("" if present else ": its choice is kept"))
    free = [s for s in settings if s not in kept and (transform.mode.gated or transform.knob(s).default
                                                       != transform.mode.value(transform.knob(s)))]
    if not free:
        return
    verb = "becomes a knob" if len(free) == 1 else "become knobs"
    transform.report(facts, call, Status.APPLICABLE, f"{what}: {', '.join(free)} {verb}")
    if transform.mode.gated:
        transform.settings_read.update(free)
        code = edits.runtime(helper)
        args = f"script_sets=({', '.join(map(code_of, kept))}{',' if len(kept) == 1 else ''})" if kept else ""
        edits.rewrite(call, lambda node: add_args(node, star_kwargs(f"{code}({args})")))
    else:
        values = baked(free)
        if values:
            edits.rewrite(call, lambda node: add_args(node, *(kwarg(k, v) for k, v in values.items())))


def code_of(value: object) -> str:
    """A value as a person writes it in a call: strings in double quotes."""
    return f'"{value}"' if isinstance(value, str) else repr(value)
