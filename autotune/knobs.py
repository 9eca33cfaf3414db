"""Knob declarations shared by transforms, the runtime and the search (standard library only)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class Numerics(str, Enum):
    """How far a knob may move the losses away from the original script's."""

    EXACT = "exact"  # bitwise-identical losses expected
    REORDER = "reorder"  # floating-point reordering only
    LOWP = "lowp"  # reduced precision

    def __str__(self) -> str:
        return self.value


NUMERICS_ORDER = (Numerics.EXACT, Numerics.REORDER, Numerics.LOWP)


@dataclass(frozen=True)
class Knob:
    """One tunable setting: its choices, the default that reproduces the original, and where it applies."""

    name: str  # "<transform>.<setting>", e.g. "autocast.dtype"
    choices: tuple[Any, ...]
    default: Any
    numerics: Numerics
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    help: str = ""
    # a value other than the default compiles code as the run starts (torch.compile, inductor's autotuning), which
    # can take minutes: the search gives such a trial a longer timeout
    compiles: bool = False

    def __post_init__(self) -> None:
        if self.default not in self.choices:
            raise ValueError(f"knob {self.name}: default {self.default!r} not in {self.choices!r}")

    @property
    def transform(self) -> str:
        return self.name.split(".", 1)[0]
