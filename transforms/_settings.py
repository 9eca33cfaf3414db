"""A framework's settings given as keyword arguments where the script builds its config or trainer
(``TrainingArguments(...)``, ``L.Trainer(...)``): the settings the script leaves out become knobs there."""

from __future__ import annotations

import ast
from collections.abc import Callable, Mapping, Sequence

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.transform import Edits, Status, Transform
from autotune.syntax import add_args, expr, is_constant, kwarg, star_kwargs
from autotune.transforms._dist import literal_string


# Lightning's precisions (Trainer and Fabric alike) that already compute in reduced precision: the script's choice
LIGHTNING_REDUCED = frozenset({"bf16-mixed", "16-mixed", "bf16", "16", "bf16-true", "16-true", "transformer-engine"})


def lightning_precision_on(value: cst.BaseExpression) -> bool:
    """Whether a Lightning ``precision=`` value the script writes already computes in reduced precision."""
    return literal_string(value) in LIGHTNING_REDUCED or (isinstance(value, cst.Integer) and value.value == "16")


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
    switches: Mapping[str, tuple[str, tuple]] | None = None,
) -> None:
    """Report and edit ``call``, whose keywords give a framework's settings.

    ``settings``: each knob's setting -> the keywords that decide it (a script that writes one keeps its choice:
    "already present" where ``on(keyword, value)``, else "kept as written"). Gated, ``**_autotune.<helper>(...)``
    is appended, told which settings the script gives itself; baked, ``baked(free settings)`` gives the keywords
    (name -> code) to append.

    ``switches``: setting -> (runtime helper, the values that mean off) for the settings a script may switch itself
    (``mixed_precision=args.mixed_precision``): its switch becomes the knob, which sets the value only where the
    script's is off in a run; gated ``_autotune.<helper>("<setting>", <value>)``, baked ``<value> if <value> not
    in <off> else <choice>``. A setting decided by several keywords, each a flag (TrainingArguments' ``bf16=args.bf16,
    fp16=args.fp16``), switches each keyword it chooses, only where all the script's flags for it are off: gated
    ``_autotune.<helper>("<setting>", <value>, "<keyword>", <the others' values>...)``, baked ``<value> if <value>
    not in <off> or <other> not in <off> else True``.
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
    switched: dict[str, tuple[str, str]] = {}  # keyword -> (setting, the helper's code or the baked value's code)
    for setting, keywords in settings.items():
        given = [k for k in keywords if k in written]
        switch = (switches or {}).get(setting)
        if switch is not None and any(facts.is_runtime_call(written[k], switch[0]) for k in given):
            kept.append(setting)
            transform.report(facts, call, Status.PRESENT, f"{what} settings are already knobs")
        elif switch is not None and ((written_off := _written_off(transform, setting, keywords, given, written,
                                                                   switch[1]))
                                     or _switchable(transform, setting, keywords, given, written)):
            kept.append(setting)
            values = {k: facts.code(written[k]) for k in given}
            off = " or ".join(map(code_of, switch[1]))
            shown = ", ".join(f"{k}={v}" for k, v in values.items())
            each = "it is" if len(given) == 1 else "each is"
            transform.report(facts, call, Status.APPLICABLE, (
                f"{shown} writes out the default, full precision (no choice of the script's to keep), which the "
                f"{transform.name}.{setting} knob sets" if written_off else
                f"{shown}: the script's own switch (present, switched off where {each} {off}), which the "
                f"{transform.name}.{setting} knob turns on there"))
            offs = tuple_code(switch[1])
            choice = None if transform.mode.gated else transform.mode.value(transform.knob(setting))
            for keyword, value in values.items():
                others = [v for k, v in values.items() if k != keyword]
                flag = keyword in transform.knob(setting).choices  # a flag per choice: it turns on its choice
                if transform.mode.gated:
                    transform.settings_read.add(setting)
                    rest = f', "{keyword}"' + "".join(f", {o}" for o in others) if flag else ""
                    switched[keyword] = (setting, f'{edits.runtime(switch[0])}("{setting}", {value}{rest})')
                    continue
                baked_choice = ("True" if choice == keyword else None) if flag else code_of(choice)
                if choice != transform.knob(setting).default and baked_choice is not None:
                    test = " or ".join(f"{v} not in {offs}" for v in (value, *others))
                    # a default written out is replaced; a switch of the script's stays one, on where it was off
                    switched[keyword] = (setting, baked_choice if written_off else f"{value} if {test} else {baked_choice}")
        elif given:
            kept.append(setting)
            code = ", ".join(f"{k}={facts.code(written[k])}" for k in given)
            present = any(on(k, written[k]) for k in given)
            status = Status.PRESENT if present else Status.USER
            transform.report(facts, call, status, f"the script sets {code}" + ("" if present else ": its choice is kept"))
    free = [s for s in settings if s not in kept and searched(transform, s)]
    extra: list[cst.Arg] = []
    if free:
        verb = "becomes a knob" if len(free) == 1 else "become knobs"
        transform.report(facts, call, Status.APPLICABLE, f"{what}: {', '.join(free)} {verb}")
        if transform.mode.gated:
            transform.settings_read.update(free)
            code = edits.runtime(helper)
            args = f"script_sets={tuple_code(kept)}" if kept else ""
            extra = [star_kwargs(f"{code}({args})")]
        else:
            extra = [kwarg(k, v) for k, v in baked(free).items()]
    if not (extra or switched):
        return

    def rewrite(node: cst.Call) -> cst.Call:
        node = node.with_changes(args=[
            a.with_changes(value=expr(switched[a.keyword.value][1])) if a.keyword is not None
            and a.keyword.value in switched else a for a in node.args])
        return add_args(node, *extra) if extra else node

    edits.rewrite(call, rewrite)


PRECISIONS = ("precision", "mixed_precision")  # the settings whose default written out is no choice (_written_off)


def _written_off(transform: Transform, setting: str, keywords: tuple[str, ...], given: list[str],
                 written: dict[str, cst.BaseExpression], off: tuple) -> bool:
    """Whether the script writes ``setting``'s default out as constants (``precision="32-true"``, ``bf16=False``):
    no choice of its own, the same as leaving it out, so the knob may set it. Each keyword given must be one that
    decides the setting as a switch would (the setting's own keyword, or flags that each name a choice). Precision
    only: full precision is the absence of a choice, while ``torch_compile=False`` written out may be a refusal."""
    if not given or setting not in PRECISIONS:
        return False
    for k in given:
        try:
            value = ast.literal_eval(cst.Module([]).code_for_node(written[k]))
        except (ValueError, SyntaxError, TypeError):
            return False
        if not any(value == o and type(value) is type(o) for o in off):
            return False
    flags = [k for k in keywords if k in transform.knob(setting).choices]
    return set(given) <= set(flags) if flags else given == [keywords[0]]


def _switchable(transform: Transform, setting: str, keywords: tuple[str, ...], given: list[str],
                written: dict[str, cst.BaseExpression]) -> bool:
    """Whether the script's keywords for ``setting`` are its own switch: each given as a variable, and either the
    setting's own keyword alone (``torch_compile=args.compile``, not with a ``torch_compile_mode``) or flags that
    each name a choice of the knob (``bf16=args.bf16, fp16=args.fp16``)."""
    if not given or any(is_constant(written[k]) for k in given):
        return False
    flags = [k for k in keywords if k in transform.knob(setting).choices]
    return set(given) <= set(flags) if flags else given == [keywords[0]]


def searched(transform: Transform, setting: str) -> bool:
    """Whether the knob ``<transform>.<setting>`` is written into the script: always where the patch is gated,
    where it is baked only at a choice other than its default."""
    knob = transform.knob(setting)
    return transform.mode.gated or transform.mode.value(knob) != knob.default


def code_of(value: object) -> str:
    """A value as a person writes it in a call: strings in double quotes."""
    return f'"{value}"' if isinstance(value, str) else repr(value)


def tuple_code(values: Sequence[object]) -> str:
    """A tuple of values as a person writes it: ``("bf16",)``, ``(None, "no")``."""
    return f"({', '.join(map(code_of, values))}{',' if len(values) == 1 else ''})"
