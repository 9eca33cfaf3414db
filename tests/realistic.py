"""The realistic fixtures and their truth: locations in expected.yaml, and precision and recall of scan against it.

    python tests/realistic.py        # the table per transform, then every miss and every false report
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
REALISTIC = REPO / "fixtures" / "realistic"
CASES = sorted(p.parent for p in REALISTIC.glob("*/expected.yaml"))

# (file relative to the case folder, line or None for any line of the file)
Place = tuple[str, int | None]


@dataclass(frozen=True)
class Location:
    """One expected site: the places it may be reported at (a model chosen in if/else is one site)."""

    spec: str
    places: tuple[Place, ...]

    def matches(self, place: Place) -> bool:
        return any(f == place[0] and (line is None or line == place[1]) for f, line in self.places)


@dataclass(frozen=True)
class Case:
    """One realistic fixture: its entry script, how it runs on CPU, and where each transform applies."""

    folder: Path
    entry: Path
    module: str | None
    args: tuple[str, ...] | None  # None: cannot run here
    applies: dict[str, tuple[Location, ...]]
    not_applicable: dict[str, dict[str, str]]

    @property
    def name(self) -> str:
        return self.folder.name


def resolve(folder: Path, spec: str) -> Location:
    """``FILE``, ``FILE:LINE``, ``FILE:~TEXT`` (first line holding TEXT), alternatives joined by `` | ``."""
    places = []
    for alt in spec.split(" | "):
        file, sep, where = alt.strip().partition(":")
        lines = (folder / file).read_text(encoding="utf-8").splitlines()
        if not sep:
            places.append((file, None))
        elif where.startswith("~"):
            found = next((i for i, text in enumerate(lines, 1) if where[1:] in text), None)
            if found is None:
                raise ValueError(f"{folder.name}/expected.yaml: no line of {file} holds {where[1:]!r}")
            places.append((file, found))
        else:
            places.append((file, int(where)))
    return Location(spec, tuple(places))


def load_case(folder: Path) -> Case:
    doc = yaml.safe_load((folder / "expected.yaml").read_text(encoding="utf-8"))
    applies = {t: tuple(resolve(folder, s) for s in specs) for t, specs in (doc.get("applies") or {}).items()}
    not_applicable = {t: dict(v) for t, v in (doc.get("not_applicable") or {}).items()}
    for specs in not_applicable.values():
        for spec in specs:
            resolve(folder, spec)  # a typo in the truth fails loudly
    run = doc.get("run")
    return Case(
        folder,
        folder / doc["entry"],
        doc.get("module"),
        tuple(str(a) for a in run) if run is not False else None,
        applies,
        not_applicable,
    )


@dataclass(frozen=True)
class Tally:
    """Counts for one transform: reported applicable sites (and how many are true), expected sites (and found)."""

    reported: int = 0
    correct: int = 0
    expected: int = 0
    found: int = 0

    def __add__(self, other: Tally) -> Tally:
        return Tally(*(a + b for a, b in zip(vars(self).values(), vars(other).values())))

    @property
    def precision(self) -> float:
        return self.correct / self.reported if self.reported else 1.0

    @property
    def recall(self) -> float:
        return self.found / self.expected if self.expected else 1.0


@dataclass(frozen=True)
class Outcome:
    """What scan said about one case against its truth."""

    case: Case
    tallies: dict[str, Tally]
    misses: tuple[str, ...]  # "transform: spec" expected and not reported
    false: tuple[str, ...]  # "transform: file:line reason" reported and not expected
    error: str | None = None


def score(case: Case) -> Outcome:
    """Scan ``case`` and compare its applicable sites with the truth."""
    from autotune.project import load_project
    from autotune.patch import scan
    from autotune.transform import Status

    try:
        sites = [s for s in scan(load_project(case.entry)) if s.status is Status.APPLICABLE]
        error = None
    except Exception as exc:  # a crash is measured too: every expected site is missed
        sites, error = [], f"{type(exc).__name__}: {exc}"
    root = case.folder.resolve()
    tallies: dict[str, Tally] = {}
    misses, false = [], []
    for name in sorted({*case.applies, *(s.transform for s in sites)}):
        expected = case.applies.get(name, ())
        mine = [s for s in sites if s.transform == name]
        places = [(Path(s.path).resolve().relative_to(root).as_posix(), s.line) for s in mine]
        correct = [any(loc.matches(p) for loc in expected) for p in places]
        found = [any(loc.matches(p) for p in places) for loc in expected]
        tallies[name] = Tally(len(mine), sum(correct), len(expected), sum(found))
        misses += [f"{name}: {loc.spec}" for loc, ok in zip(expected, found) if not ok]
        false += [f"{name}: {p[0]}:{p[1]} {s.reason}" for s, p, ok in zip(mine, places, correct) if not ok]
    return Outcome(case, tallies, tuple(misses), tuple(false), error)


def measure() -> list[Outcome]:
    return [score(load_case(folder)) for folder in CASES]


def totals(outcomes: list[Outcome]) -> dict[str, Tally]:
    out: dict[str, Tally] = {}
    for o in outcomes:
        for name, t in o.tallies.items():
            out[name] = out.get(name, Tally()) + t
    return out


def table(outcomes: list[Outcome]) -> str:
    """Precision and recall per transform and overall, one line each."""
    per = totals(outcomes)
    rows = [f"{'transform':16} {'precision':>9} {'recall':>7}  (true/reported, found/expected)"]
    for name, t in sorted(per.items()):
        rows.append(f"{name:16} {t.precision:9.2f} {t.recall:7.2f}  ({t.correct}/{t.reported}, {t.found}/{t.expected})")
    all_ = sum(per.values(), Tally())
    rows.append(f"{'overall':16} {all_.precision:9.2f} {all_.recall:7.2f}  ({all_.correct}/{all_.reported}, "
                f"{all_.found}/{all_.expected}) over {len(outcomes)} scripts")
    return "\n".join(rows)


def details(outcomes: list[Outcome]) -> str:
    lines = []
    for o in outcomes:
        if o.error:
            lines.append(f"{o.case.name}: scan failed: {o.error}")
        lines += [f"{o.case.name}: missed {m}" for m in o.misses]
        lines += [f"{o.case.name}: false {f}" for f in o.false]
    return "\n".join(lines)


if __name__ == "__main__":
    results = measure()
    print(table(results))
    print(details(results))
    sys.exit(0)
