"""Knob declarations shared by transforms, the runtime and the search (standard library only)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from autotune.errors import UsageError
from autotune.inputs import shown


class Numerics(str, Enum):
    """How far a knob may move the losses away from the original script's."""

    EXACT = "exact"  # bitwise-identical losses expected
    REORDER = "reorder"  # floating-point reordering only
    LOWP = "lowp"  # reduced precision

    def __str__(self) -> str:
        return self.value


NUMERICS_ORDER = (Numerics.EXACT, Numerics.REORDER, Numerics.LOWP)


class Role(str, Enum):
    """What a knob is to the search, beyond its numerics: the search reads roles, never knob names."""

    PRECISION = "precision"  # reduced-precision compute: its bf16 choice stays out of the start where the CPU emulates bf16
    SPLIT = "split"  # multiplies the micro-batch at a fixed samples-per-step (fewer, bigger micro-batches)
    MEMORY_SAVER = "memory_saver"  # frees memory at a cost (activation checkpointing): on only with a bigger micro-batch
    THREADS = "threads"  # the intra-op thread count: its choices are fitted to the machine's cores

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Knob:
    """One tunable setting: its choices, the default that reproduces the original, and where it applies."""

    name: str  # "<transform>.<setting>": the transform's module name, a dot, the setting
    choices: tuple[Any, ...]
    default: Any
    numerics: Numerics
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    help: str = ""
    # a value other than the default compiles code as the run starts (torch.compile, inductor's autotuning), which
    # can take minutes: the search gives such a trial a longer timeout
    compiles: bool = False
    role: Role | None = None
    on: Any = None  # a MEMORY_SAVER's choice that turns it on

    def __post_init__(self) -> None:
        if self.choice(self.default) is NO_CHOICE:
            raise ValueError(f"knob {self.name}: default {self.default!r} not in {self.choices!r}")
        if (self.role is Role.MEMORY_SAVER) != (self.on is not None) or (
                self.on is not None and self.choice(self.on) is NO_CHOICE):
            raise ValueError(f"knob {self.name}: a memory saver names the choice that turns it on, and only it does")

    def choice(self, value: Any) -> Any:
        """The declared choice equal to ``value`` in type and value (2.0 is not 2, True is not 1), else ``NO_CHOICE``.

        Code is written from the declared choice, never from the value given, which may come from a file.
        """
        return next((c for c in self.choices if type(c) is type(value) and c == value), NO_CHOICE)

    @property
    def transform(self) -> str:
        return self.name.split(".", 1)[0]


NO_CHOICE = object()  # Knob.choice: no such choice (None could one day be a choice)


def checked(values: Mapping[Any, Any], known: Mapping[str, Knob], where: str) -> dict[str, Any]:
    """``values`` with each value replaced by the knob's declared choice; an unknown knob or value is a UsageError.

    Every path that takes knob values from outside (a config, a search space, a study, the runtime) comes here.
    """
    out: dict[str, Any] = {}
    for name, value in values.items():
        knob = knob_named(name, known, where)
        choice = knob.choice(value)
        if choice is NO_CHOICE:
            raise UsageError(
                f"{where}: knob '{name}' has no choice {shown(value)} ({type(value).__name__}; "
                f"choices: {', '.join(map(repr, knob.choices))})"
            )
        out[name] = choice
    return out


def knob_named(name: Any, known: Mapping[str, Knob], where: str) -> Knob:
    """The knob called ``name``; an unknown one is a UsageError that lists the known ones."""
    knob = known.get(name) if isinstance(name, str) else None
    if knob is None:
        raise UsageError(f"{where}: unknown knob {shown(name)} (known: {', '.join(sorted(known))})")
    return knob


def compiles(knobs: Iterable[Knob], config: Mapping[str, Any]) -> bool:
    """Whether ``config`` sets one of ``knobs`` that compiles code as the run starts away from its default: such a run
    gets a longer timeout, in the search and in bench/bench_search.py alike."""
    return any(k.compiles and config.get(k.name, k.default) != k.default for k in knobs)
