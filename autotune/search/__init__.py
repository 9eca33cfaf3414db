"""autotune search: trials of knob configurations, an equivalence gate, an Optuna study and the tuned outputs.

- ``space``: which knobs are searched on a device, with which choices (``search_spaces/<device>.yaml``)
- ``trial``: one run of the patched script as a subprocess, and its typed ``TrialResult``
- ``gate``: per-step losses against the baseline's, within a tolerance from the knobs' numerics classes
- ``study``: the Optuna study in its storage (SQLite in the output folder by default)
- ``search``: the loop (baseline interleaved, enumeration or TPE, confirmation in A/B pairs)
- ``report``: the baked script, autotune.yaml, tuned.diff, report.md and its plot; ``live``: progress display
"""

from autotune.search.search import SearchOptions, SearchOutcome, run_search

__all__ = ["SearchOptions", "SearchOutcome", "run_search"]
