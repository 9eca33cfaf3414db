"""autotune search: trials of knob configurations, an equivalence gate, an Optuna study and the tuned outputs.

- ``space``: which knobs are searched on a device, with which choices (``search_spaces/<device>.yaml``)
- ``trial``: one run of the patched script as a subprocess, and its typed ``TrialResult``; ``ranks``: a launcher's
  ranks merged into one result
- ``gate``: per-step losses against the baseline's, within a tolerance from the knobs' numerics classes
- ``study``: the Optuna study in its storage (SQLite in the output folder by default)
- ``budget``: what a run costs, the least search a budget must hold, run lengths that fit it
- ``strategy``: the strong start, blame, coordinate descent, duels of ties, hope; ``stats``: the sign test and
  the median's interval of paired ratios
- ``options`` (what was asked), ``identity`` (device, fingerprint, threads), ``outcome`` (what was found): values
- ``search``: the running search (set-up, trials, the study as this worker sees it); ``explore``: the search
  phase (baselines interleaved, the strategy's proposals, TPE or enumeration), then ``confirm``: A/B pairs
- ``report``: the baked script, autotune.yaml, tuned.diff and report.md; ``plot``: throughput.png; ``live``: progress
"""

from autotune.search.options import SearchOptions
from autotune.search.outcome import SearchOutcome
from autotune.search.search import run_search

__all__ = ["SearchOptions", "SearchOutcome", "run_search"]
