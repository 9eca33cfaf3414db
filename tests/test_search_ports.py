"""The interfaces the search's collaborators type their argument by (autotune/search/ports.py) are what a running
Search provides: every attribute and method each names, with the same parameters. A member renamed in one place
and not the other fails here, not in the middle of a confirmation."""

from __future__ import annotations

import inspect
import typing

import pytest

from autotune.search import costs, ports

from test_search_strategy import fake_search  # (pytest puts tests/ on the path)

INTERFACES = [ports.Runs, ports.Trials, ports.Confirming, ports.Exploring, ports.Viewed, ports.Shown]  # (Clock: its ``costs``)


def _members(iface) -> tuple[set[str], set[str]]:
    """An interface's attributes (annotated) and methods (defined), its bases' included."""
    attrs, methods = set(), set()
    for klass in iface.__mro__:
        if klass in (typing.Protocol, typing.Generic, object):
            continue
        attrs |= set(getattr(klass, "__annotations__", {}))
        methods |= {n for n, v in vars(klass).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return attrs - methods, methods


@pytest.mark.parametrize("iface", [*INTERFACES, ports.Clock, costs.Costed], ids=lambda i: i.__name__)
def test_a_running_search_provides_each_interface(iface, tmp_path, monkeypatch):
    search, _, _ = fake_search(tmp_path, monkeypatch)
    if iface is ports.Clock:  # the time accounting is its own object
        search, Search = search.costs, costs.Costs
    else:
        from autotune.search.search import Search
    attrs, methods = _members(iface)
    assert attrs or methods
    for name in sorted(attrs):
        assert hasattr(search, name) or name in inspect.getsource(Search.__init__), f"{iface.__name__}.{name}"
    for name in sorted(methods):
        declared, provided = inspect.getattr_static(iface, name), inspect.getattr_static(Search, name, None)
        assert provided is not None, f"Search lacks {iface.__name__}.{name}"
        if isinstance(declared, property):
            assert isinstance(provided, property), name
            continue
        want = list(inspect.signature(declared).parameters)
        got = list(inspect.signature(provided).parameters)
        assert got == want, f"{iface.__name__}.{name}: Search has {got}, the interface {want}"


def test_no_collaborator_types_the_search_loosely_or_reads_its_private_members():
    from pathlib import Path
    import re

    here = Path(ports.__file__).parent
    for name in ("explore", "confirm", "view", "whole", "carried", "live", "from_study"):
        text = (here / f"{name}.py").read_text()
        assert "Search = Any" not in text and "search: Any" not in text, name
        assert not re.search(r"\b(s|search|self\.s)\._[a-z]", text), f"{name}.py reads a private member of the search"
