"""The search space: which knobs a search varies on a device, and the choices it tries for each."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

from autotune.errors import UsageError
from autotune.inputs import load_yaml, read_text, shown
from autotune.knobs import Knob, Role, checked, knob_named
from autotune.transform import all_knobs, all_transforms

DEVICES = ("cpu", "cuda")

Config = Mapping[str, Any]
SPACE_KEYS = {"knobs", "others", "start", "expensive"}


def bundled_space_text(device: str) -> str:
    """The text of ``search_spaces/<device>.yaml`` as installed (editable or regular install alike)."""
    return resources.files("autotune.search_spaces").joinpath(f"{device}.yaml").read_text(encoding="utf-8")


@dataclass(frozen=True)
class SpaceFile:
    """A search space file: the choices of the knobs it lists, and what happens to the knobs it does not list."""

    choices: Mapping[str, tuple[Any, ...]]
    others: str = "default"  # "default": unlisted knobs keep their default; "all": every choice they declare
    # the configuration the field switches on for the device, in order of expected effect (the search starts there)
    start: Mapping[str, Any] = field(default_factory=dict)
    # choices whose warm-up can take minutes: tried last, on top of the best configuration, when the budget allows
    expensive: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)


def read_space(device: str, path: Path | None = None) -> SpaceFile:
    """The space of ``path``, or the bundled one of ``device``; a bad file is one UsageError line."""
    if path is None:
        # lenient: a knob whose transform is not installed here is skipped (tests check the files strictly)
        return parse_space(bundled_space_text(device), f"search_spaces/{device}.yaml", strict=False)
    return parse_space(read_text(Path(path), "a search space"), str(path))


def parse_space(text: str, where: str, strict: bool = True) -> SpaceFile:
    """The search space in ``text``; ``strict=False`` skips knobs whose transform is not installed here."""
    doc = load_yaml(text, where)
    if not isinstance(doc, dict) or set(doc) - SPACE_KEYS or not isinstance(doc.get("knobs"), dict):
        raise UsageError(
            f"{where}: expected 'knobs:' (knob name -> list of choices) and optionally 'others: default|all', "
            "'start:' (knob -> choice) and 'expensive:' (knob -> list of choices)"
        )
    others = doc.get("others", "default")
    if type(others) is not str or others not in ("default", "all"):
        raise UsageError(
            f"{where}: 'others' must be default (unlisted knobs keep their default) or all, not {shown(others)}"
        )
    known = all_knobs()
    out: dict[str, tuple[Any, ...]] = {}
    for name, choices in doc["knobs"].items():
        if not strict and name not in known:
            continue
        knob = knob_named(name, known, where)
        if not isinstance(choices, list) or not choices:
            raise UsageError(f"{where}: knob '{name}' needs a non-empty list of choices, e.g. {list(knob.choices)}")
        out[name] = _declared(name, choices, known, where)
    start = _choice_map(doc.get("start"), "start", where, known, strict, single=True)
    expensive = _choice_map(doc.get("expensive"), "expensive", where, known, strict, single=False)
    return SpaceFile(out, "all" if others == "all" else "default", start, expensive)


def _declared(name: str, choices: Iterable[Any], known: Mapping[str, Knob], where: str) -> tuple[Any, ...]:
    """``choices`` of knob ``name`` as its declared choices, without repeats (see ``knobs.checked``)."""
    return tuple(dict.fromkeys(checked({name: c}, known, where)[name] for c in choices))


def _choice_map(section: Any, key: str, where: str, known: Mapping[str, Knob], strict: bool, single: bool) -> dict:
    """The ``start`` (knob -> choice) or ``expensive`` (knob -> choices) section of a space file, checked."""
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise UsageError(f"{where}: '{key}' must map knob names to " + ("a choice" if single else "lists of choices"))
    out: dict[str, Any] = {}
    for name, value in section.items():
        if not strict and name not in known:
            continue
        if single:
            out[name] = checked({name: value}, known, f"{where}: {key}")[name]
        elif not isinstance(value, list):
            raise UsageError(f"{where}: {key}: knob '{name}' needs a list of choices")
        else:
            out[name] = _declared(name, value, known, f"{where}: {key}")
    return out


@dataclass(frozen=True)
class SearchSpace:
    """The knobs a search varies, each with its choices (the default first), and why the others are left out."""

    device: str
    knobs: tuple[Knob, ...]
    choices: Mapping[str, tuple[Any, ...]]
    left_out: Mapping[str, str] = field(default_factory=dict)  # knob -> why it is not searched

    @property
    def size(self) -> int:
        n = 1
        for k in self.knobs:
            n *= len(self.choices[k.name])
        return n

    def baseline(self) -> dict[str, Any]:
        return {k.name: k.default for k in self.knobs}

    def changed(self, config: Config) -> tuple[Knob, ...]:
        """The searched knobs whose value in ``config`` is not their default."""
        return tuple(k for k in self.knobs if config.get(k.name, k.default) != k.default)

    def configs(self) -> Iterator[dict[str, Any]]:
        """Every configuration: the baseline, then each knob changed alone, then the combinations."""
        base = self.baseline()
        seen = {config_key(base)}
        yield dict(base)
        for k in self.knobs:
            for choice in self.choices[k.name]:
                config = {**base, k.name: choice}
                if config_key(config) not in seen:
                    seen.add(config_key(config))
                    yield config
        names = [k.name for k in self.knobs]
        for values in itertools.product(*(self.choices[n] for n in names)):
            config = dict(zip(names, values))
            if config_key(config) not in seen:
                seen.add(config_key(config))
                yield config

    def distributions(self):
        import optuna

        return {k.name: optuna.distributions.CategoricalDistribution(list(self.choices[k.name])) for k in self.knobs}

    def describe(self) -> dict[str, list[Any]]:
        return {k.name: list(self.choices[k.name]) for k in self.knobs}

    def foreign(self, config: Config) -> list[tuple[str, Any]]:
        """The entries of ``config`` that are not a knob of this space set to one of its choices (a configuration
        read from a study that others can write to)."""
        names = {k.name for k in self.knobs}
        out = [(k.name, config[k.name]) for k in self.knobs if k.name in config and not has(self.choices[k.name], config[k.name])]
        return out + [(n, v) for n, v in config.items() if n not in names]


def same_value(a: Any, b: Any) -> bool:
    """Equal by type and value: 1 is not True, 2.0 is not 2."""
    return type(a) is type(b) and a == b


def has(choices: Iterable[Any], value: Any) -> bool:
    """Whether ``value`` is one of ``choices`` (by type and value)."""
    return any(same_value(c, value) for c in choices)


def config_key(config: Config) -> str:
    """A stable text key of a configuration, for finding configurations already measured."""
    return json.dumps(dict(sorted(config.items())), sort_keys=True)


def build_space(script_knobs: Iterable[Knob], device: str, wanted: SpaceFile) -> SearchSpace:
    """The knobs of this script that apply to ``device``, with the choices ``wanted`` gives them.

    A knob the file lists gets exactly those choices, plus its default (the baseline must be in the space); one
    it does not list keeps its default (``others: default``) or is searched over every choice it declares
    (``others: all``, as in the bundled files, so that a new transform is searched without editing them).
    """
    transform_devices = {t.name: t.devices for t in all_transforms()}
    knobs, choices, left_out = [], {}, {}
    for knob in sorted(script_knobs, key=lambda k: k.name):
        if device not in knob.devices or device not in transform_devices.get(knob.transform, knob.devices):
            left_out[knob.name] = f"does not apply on {device}"
            continue
        if knob.name in wanted.choices:
            # (a script's knob may offer fewer choices than the knob declares: autocast without fp16)
            listed = tuple(c for c in wanted.choices[knob.name] if has(knob.choices, c))
        elif wanted.others == "all":
            listed = knob.choices
        else:
            left_out[knob.name] = "not in the search space"
            continue
        picked = tuple(dict.fromkeys([knob.default, *listed]))
        if len(picked) < 2:
            left_out[knob.name] = "pinned to its default" if knob.name in wanted.choices else "a single choice"
            continue
        knobs.append(knob)
        choices[knob.name] = picked
    return SearchSpace(device, tuple(knobs), choices, left_out)


def with_role(role: Role) -> tuple[Knob, ...]:
    """Every knob of that role, in the transforms' order (the search reads roles, never knob names)."""
    return tuple(k for k in all_knobs().values() if k.role is role)


def fit_threads(space: SearchSpace, default: int, cores: int) -> SearchSpace:
    """The bundled CPU space lists thread counts for any machine. On this one, the count a run gets anyway (its
    default: OMP_NUM_THREADS or the cores) would measure the baseline again, and a count above the cores only
    oversubscribes them: both are left out (a 2-core machine searches default and 1)."""
    for name in (k.name for k in with_role(Role.THREADS) if k.name in space.choices):
        kept = tuple(c for c in space.choices[name] if c == "default" or (c != default and c <= cores))
        if kept == space.choices[name]:
            continue
        if len(kept) > 1:
            space = replace(space, choices={**space.choices, name: kept})
            continue
        why = f"no thread count other than this machine's {default} fits its {cores} core(s)"
        space = replace(
            space,
            knobs=tuple(k for k in space.knobs if k.name != name),
            choices={n: c for n, c in space.choices.items() if n != name},
            left_out={**space.left_out, name: why},
        )
    return space


def restore_space(
    script_knobs: Iterable[Knob], device: str, choices: Mapping[str, list[Any]], left_out: Mapping[str, str]
) -> SearchSpace:
    """The space a study was searched over, from its description (``SearchSpace.describe``) and what was left out."""
    known = {k.name: k for k in script_knobs}
    missing = sorted(set(choices) - set(known))
    if missing:
        raise UsageError(
            f"the study searched knob(s) this script no longer has ({', '.join(missing)}): the script changed since"
        )
    names = sorted(choices)
    # the description comes from the study's storage, which others can write to
    where = "the study's search space"
    if any(not isinstance(choices[n], list) for n in names):
        raise UsageError(f"{where}: each knob needs a list of choices")
    declared = {n: _declared(n, choices[n], known, where) for n in names}
    return SearchSpace(device, tuple(known[n] for n in names), declared, dict(left_out))
