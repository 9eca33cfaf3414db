"""The command line: ``autotune scan|patch|bake|search|report``; one small function per subcommand."""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from autotune import __version__
from autotune.analysis import source_lines
from autotune.project import Project, load_project
from autotune.errors import AutotuneError, NoTrainingLoop, UsageError
from autotune.isolate import ISOLATIONS, OVERLAY
from autotune.patch import CONFIG_NAME, DIFF_NAME, PatchResult, check_out_dir, run, select, write_in_place, write_outputs
from autotune.transform import Site, Status, all_knobs, all_transforms

STATUS_STYLE = {
    Status.APPLICABLE: "green",
    Status.PRESENT: "cyan",
    Status.USER: "yellow",
    Status.NOT_APPLICABLE: "dim",
    Status.NOT_ANALYSED: "red",
}

JSON_SCHEMA_VERSION = 1


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exit code 2 (its own default), without the usage dump."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(message)

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        """A subcommand with a ``script_args`` default takes everything after the first ``--`` as the script's."""
        if self.get_default("script_args") is None or args is None:
            return super().parse_known_args(args, namespace)
        args = list(args)
        cut = args.index("--") if "--" in args else len(args)
        ns, extra = super().parse_known_args(args[:cut], namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)} (arguments for the script go after --)")
        ns.script_args = args[cut + 1 :]
        return ns, extra


def _finite(text: str) -> float:
    """A float argument that is a number: nan and inf are refused (a nan timeout never fires)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, not {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, not {text!r}")
    return value


def _split_list(value: str | None) -> list[str] | None:
    """A comma-separated option's names; None where the option was not given (``--only ,`` gives an empty list)."""
    return None if value is None else [v.strip() for v in value.split(",") if v.strip()]


def _loops_summary(project: Project) -> list[dict]:
    out = []
    for loop in project.loops:
        line, _ = loop.module.position(loop.node)
        out.append({"path": loop.module.display, "line": line, "kind": type(loop.node).__name__.lower()})
    return out


def _site_json(site: Site) -> dict:
    return {
        "transform": site.transform,
        "path": site.path,
        "line": site.line,
        "col": site.col,
        "status": site.status.name.lower(),
        "reason": site.reason,
    }


def cmd_scan(args: argparse.Namespace, console: Console) -> int:
    project = load_project(Path(args.path))
    transforms = select(_split_list(args.only), _split_list(args.skip))
    sites = run(project, transforms).sites
    if args.json:
        doc = {
            "schema": JSON_SCHEMA_VERSION,
            "script": args.path,
            "files": [m.display for m in project.modules],
            "training_loops": _loops_summary(project),
            "framework_training": [
                {"framework": str(f.framework), "path": f.module.display, "line": f.module.position(f.call)[0],
                 "call": f.module.code(f.call.func)}
                for f in project.frameworks
            ],
            "sites": [_site_json(s) for s in sites],
            "transforms": [
                {
                    "name": t.name,
                    "description": t.description(),
                    "numerics": str(t.numerics()),
                    "devices": sorted(t.devices),
                    "knobs": [{"name": k.name, "choices": list(k.choices), "default": k.default} for k in t.knobs],
                }
                for t in transforms
            ],
        }
        print(json.dumps(doc, indent=2))
        return 0
    loops = _loops_summary(project)
    if loops:
        where = ", ".join(f"{l['path']}:{l['line']}" for l in loops)
        console.print(f"[bold]{escape(args.path)}[/]: {len(project.modules)} file(s), training loop(s) at {escape(where)}")
    elif project.tuned_frameworks():
        f = project.tuned_frameworks()[0]
        console.print(f"[bold]{escape(args.path)}[/]: {len(project.modules)} file(s), training runs inside "
                      f"{escape(str(f.framework))} ({escape(f.where())}): its settings are the knobs")
    else:
        console.print(f"[bold]{escape(args.path)}[/]: {escape(project.no_loop_reason())}")
    from rich.table import Table  # only here: start-up is part of every command's time

    table = Table(show_lines=False)
    for col in ("transform", "location", "status", "why"):
        table.add_column(col)
    for s in sites:
        style = STATUS_STYLE[s.status]
        # the script's own text (its path, code in a reason: ``x[start:start + batch_size]``) is not markup
        table.add_row(s.transform, escape(s.location), f"[{style}]{s.status}[/]", escape(s.reason))
    if sites:
        console.print(table)
    counts = {st: sum(s.status is st for s in sites) for st in Status}
    console.print(", ".join(f"{n} {st}" for st, n in counts.items() if n) or "no sites found")
    return 0


def _print_diff(result: PatchResult, console: Console) -> None:
    styles = {"+": "green", "-": "red", "@": "cyan"}
    for line in source_lines(result.diff()):
        style = "bold" if line.startswith(("+++", "---")) else styles.get(line[:1])
        console.print(line, style=style, markup=False, soft_wrap=True)


def cmd_patch(args: argparse.Namespace, console: Console) -> int:
    project = load_project(Path(args.path))
    if not project.trains:
        raise NoTrainingLoop(f"{args.path}: {project.no_loop_reason()}; nothing patched")
    result = run(project, select(_split_list(args.only), _split_list(args.skip)))
    if not result.changed:
        present = sum(s.status is Status.PRESENT for s in result.sites)
        console.print(f"{args.path}: nothing to patch ({present} optimization(s) already present); nothing written")
        return 0
    if not (args.diff or args.in_place):  # before the diff is shown: a refused folder is the one thing said
        check_out_dir(Path(args.out), project, (CONFIG_NAME, DIFF_NAME))
    _print_diff(result, console)
    if args.diff:
        return 0
    if args.in_place:
        written = write_in_place(result)
        console.print(f"patched in place (backups: *.orig): {', '.join(map(str, written))}")
        return 0
    out = Path(args.out)
    written = write_outputs(result, out, args.path)
    rel = result.files[0].rel
    # an entry below the project's root imports the root's packages: run as a module from there
    module = ".".join(rel.with_suffix("").parts)
    how = f"cd {shlex.quote(str(out))} && python -m {module}" if rel.parent != Path() else f"python {shlex.quote(str(out / rel))}"
    console.print(
        f"wrote {len(written)} files to {out}/ ({len(result.knobs)} knobs at their defaults in autotune.yaml, "
        f"diff in {DIFF_NAME}); run it with: {how}"
    )
    return 0


def cmd_bake(args: argparse.Namespace, console: Console) -> int:
    from autotune.bake import bake, check_out_dir, read_config, write_baked
    from autotune.search.identity import resolve_device

    project = load_project(Path(args.path))
    values, device = read_config(Path(args.config))
    device = device or resolve_device("auto")
    out = check_out_dir(Path(args.out), project)
    result = bake(project, values, device)
    gated = {k.name for k in run(project, select()).knobs}
    changed = {k: v for k, v in values.items() if v != all_knobs()[k].default}
    unused = sorted(k for k in changed if k not in gated)
    doc = {"script": args.path, "device": device, "knobs": values}
    header = f"# The knob values `autotune bake` wrote into {args.path} as plain code.\n"
    written = write_baked(result, out, doc, header)
    if unused:
        console.print(f"not used by this script (no site for them): {', '.join(unused)}", markup=False)
    what = ", ".join(f"{k}={v}" for k, v in changed.items() if k not in unused) or "every knob at its default: no change"
    where = "diff in tuned.diff" if result.diff() else "no tuned.diff: nothing changed"
    console.print(f"baked {what}; wrote {len(written)} files to {out}/ ({where})", markup=False)
    return 0


def knob_rows() -> list[dict]:
    """Every knob autotune declares, as ``autotune knobs`` shows it: choices with the default first."""
    rows = []
    for t in all_transforms():
        for k in t.knobs:
            choices = [k.default, *(c for c in k.choices if type(c) is not type(k.default) or c != k.default)]
            devices = sorted(k.devices & t.devices)
            rows.append({"name": k.name, "transform": t.name, "choices": choices, "default": k.default,
                         "numerics": str(k.numerics), "devices": devices, "help": k.help})
    return rows


def knobs_markdown(rows: list[dict]) -> str:
    """The knob table as docs/knobs.md has it (generated: ``autotune knobs --markdown``)."""
    lines = ["| knob | choices (default first) | numerics | devices | what it does |", "|---|---|---|---|---|"]
    for row in rows:
        choices = ", ".join(map(str, row["choices"]))
        cells = [f"`{row['name']}`", choices, row["numerics"], ", ".join(row["devices"]), row["help"]]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def cmd_knobs(args: argparse.Namespace, console: Console) -> int:
    rows = knob_rows()
    if args.json:
        print(json.dumps({"schema": JSON_SCHEMA_VERSION, "knobs": rows}, indent=2))
        return 0
    if args.markdown:
        sys.stdout.write(knobs_markdown(rows))
        return 0
    if not console.is_terminal:  # piped: one knob a line, whole names, fields between tabs (grep, cut -f1)
        for row in rows:
            print("\t".join((row["name"], ",".join(map(str, row["choices"])), row["numerics"], ",".join(row["devices"]),
                              " ".join(row["help"].split()))))
        return 0
    from rich.table import Table

    table = Table(show_lines=False)
    for col in ("knob", "choices (default first)", "numerics", "devices", "what it does"):
        table.add_column(col, overflow="fold")
    for row in rows:
        table.add_row(row["name"], ", ".join(map(str, row["choices"])), row["numerics"], ", ".join(row["devices"]),
                      row["help"])
    console.print(table)
    return 0


def cmd_search(args: argparse.Namespace, console: Console) -> int:
    from autotune.search.live import SearchDisplay
    from autotune.search.report import print_summary, write_outputs
    from autotune.search.options import DEFAULT_STEPS, DEFAULT_WARMUP, SearchOptions
    from autotune.search.search import run_search
    from autotune.search.storage import storage_url

    path = Path(args.path)
    project = load_project(path)
    if not project.trains:
        raise NoTrainingLoop(f"{args.path}: {project.no_loop_reason()}; nothing to search")
    options = SearchOptions(
        script=path,
        args=tuple(args.script_args),
        out=Path(args.out),
        trials=args.trials,
        time_budget=args.time_budget,
        steps=DEFAULT_STEPS if args.steps is None else args.steps,
        warmup=DEFAULT_WARMUP if args.warmup is None else args.warmup,
        lengthen=args.steps is None and args.warmup is None,
        device=args.device,
        storage=storage_url(args.storage),
        study_name=args.study_name,
        space=Path(args.space) if args.space else None,
        rtol=args.rtol,
        timeout=args.timeout,
        confirm=args.confirm,
        whole_runs=args.whole_runs,
        compile_cache=args.compile_cache,
        launcher=args.launcher,
        train_steps=args.train_steps,
        isolation=args.isolation,
    )
    outcome = run_search(options, SearchDisplay(console))
    print_summary(outcome, write_outputs(outcome), console)
    return 0


def cmd_report(args: argparse.Namespace, console: Console) -> int:
    from autotune.search.report import print_summary, write_outputs
    from autotune.search.from_study import report_from_study
    from autotune.search.storage import STORAGE_ENV, storage_url

    script = Path(args.script) if args.script else None
    storage = storage_url(args.storage)
    own = Path(args.out) / "study.db"  # where a search with the same --out keeps its study
    if storage is None and own.is_file():
        storage = str(own)
    if storage is None:
        raise UsageError(
            f"report needs the study's storage: --storage URL, the environment variable {STORAGE_ENV}, or a "
            f"search's output folder (--out; {own} does not exist)"
        )
    outcome = report_from_study(storage, args.study_name, Path(args.out), script)
    print_summary(outcome, write_outputs(outcome), console)
    return 0


PATH_HELP = "the training script (.py); the local modules it imports are read too"


def _sub(sub, name: str, help: str, examples: str, **kw) -> argparse.ArgumentParser:
    """A subcommand whose --help ends with examples of its use."""
    return sub.add_parser(
        name, help=help, description=help[0].upper() + help[1:] + ".", epilog="examples:\n" + examples,
        formatter_class=argparse.RawDescriptionHelpFormatter, **kw,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="autotune",
        description="Find the fastest equivalent configuration of a PyTorch training script.",
        epilog="example:\n  autotune search train.py -- --batch-size 64\n\n"
        "`autotune COMMAND --help` describes each command.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"autotune {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")

    scan = _sub(
        sub, "scan", "list what could be faster, where, and why",
        "  autotune scan train.py\n  autotune scan train.py --json --only autocast,sdpa\n",
    )
    scan.add_argument("path", help=PATH_HELP)
    scan.add_argument("--json", action="store_true", help="print the sites as JSON (schema in docs/scan.md)")
    scan.add_argument("--only", help="comma-separated transforms to run")
    scan.add_argument("--skip", help="comma-separated transforms to leave out")
    scan.set_defaults(func=cmd_scan)

    patch = _sub(
        sub, "patch", "inject every applicable optimization behind a knob",
        "  autotune patch train.py --diff            # show the change, write nothing\n"
        "  autotune patch train.py --out patched/    # the patched script and its autotune.yaml\n",
    )
    patch.add_argument("path", help=PATH_HELP)
    patch.add_argument("--out", default="autotune-out", help="output folder (default: autotune-out)")
    patch.add_argument("--only", help="comma-separated transforms to apply")
    patch.add_argument("--skip", help="comma-separated transforms to leave out")
    patch.add_argument("--diff", action="store_true", help="print the diff, write nothing")
    patch.add_argument("--in-place", action="store_true", help="edit the script's own files, keeping .orig backups")
    patch.set_defaults(func=cmd_patch)

    bake = _sub(
        sub, "bake", "write chosen knob values into the script as plain code",
        "  autotune bake train.py --config autotune-out/autotune.yaml --out tuned/\n",
    )
    bake.add_argument("path", help=PATH_HELP)
    bake.add_argument("--config", required=True, help="YAML with knobs: {name: value} (e.g. a search's autotune.yaml)")
    bake.add_argument("--out", default="autotune-out", help="output folder (default: autotune-out)")
    bake.set_defaults(func=cmd_bake)

    knobs = _sub(
        sub, "knobs", "list every knob: its choices (default first), numerics, devices and what it does",
        "  autotune knobs              # a table; piped, one knob a line, its fields between tabs\n"
        "  autotune knobs --json\n  autotune knobs --markdown   # docs/knobs.md's table\n",
    )
    shape = knobs.add_mutually_exclusive_group()
    shape.add_argument("--json", action="store_true", help="print the knobs as JSON")
    shape.add_argument("--markdown", action="store_true", help="print the knob table in Markdown")
    knobs.set_defaults(func=cmd_knobs)

    search = _sub(
        sub, "search", "try knob configurations, keep the fastest that trains the same",
        "  autotune search train.py -- --batch-size 64 --epochs 2   # the script's own arguments after --\n"
        "  autotune search train.py --time-budget 600 --out tuned/\n",
        usage="autotune search PATH [options] -- ARGS FOR THE SCRIPT",
    )
    search.add_argument("path", help=PATH_HELP)
    search.add_argument("--out", default="autotune-out", help="output folder (default: autotune-out)")
    search.add_argument(
        "--trials", type=int, metavar="N",
        help="at most N distinct configurations, baseline included; past the descent's end the sampler adds more",
    )
    search.add_argument(
        "--time-budget", type=_finite, metavar="S",
        help="seconds for the whole command, confirmation included (default 900 when --trials is not given either)",
    )
    search.add_argument(
        "--train-steps", type=int, metavar="N",
        help="your real run's length in steps: rank by time to train N steps, compile time included",
    )
    search.add_argument(
        "--isolation", choices=ISOLATIONS, default=OVERLAY,
        help="how trials are kept off your files: overlay (default; Linux: your folders are overlays in a private "
        "mount namespace, whatever the script runs) or python (where that is refused: Python's own writes only)",
    )
    search.add_argument(
        "--steps", type=int,
        help="measured training steps per trial (default 20; more, timing about 1 s, where a step is that cheap)",
    )
    search.add_argument(
        "--warmup", type=int, help="warm-up steps before the measured ones (default 5; more with longer runs)"
    )
    search.add_argument(
        "--device", default="auto", choices=("auto", "cpu", "cuda"),
        help="device to tune for (default: auto, CUDA where torch sees a GPU, else the CPU)",
    )
    search.add_argument(
        "--storage",
        metavar="URL",
        help="database URL or journal file, to share the study (default: $AUTOTUNE_STORAGE, else DIR/study.db)",
    )
    search.add_argument("--study-name", metavar="NAME", help="study name (default: script name + fingerprint)")
    search.add_argument("--space", metavar="FILE", help="search space YAML (default: the bundled one for the device)")
    search.add_argument("--rtol", type=_finite, metavar="X", help="relative loss tolerance for every non-default knob")
    search.add_argument("--timeout", type=_finite, metavar="S", help="seconds before a trial is killed (default: auto)")
    search.add_argument("--confirm", type=int, default=5, metavar="N", help="A/B pairs that confirm the winner (default 5)")
    search.add_argument(
        "--whole-runs",
        type=int,
        default=3,
        metavar="N",
        help="A/B pairs of whole runs, process start to exit, that check the winner where your run's length is known "
        "and the budget covers them (default 3; 0: none)",
    )
    search.add_argument(
        "--no-compile-cache",
        dest="compile_cache",
        action="store_false",
        help="where the tuned script compiles, do not carry what the search compiled to it (compile_cache.bin and the "
        "lines that load it)",
    )
    search.add_argument(
        "--launcher",
        metavar="CMD",
        help='run each trial as CMD SCRIPT ARGS, e.g. "torchrun --standalone --nproc_per_node=2" (distributed trials)',
    )
    search.set_defaults(func=cmd_search, script_args=[])

    report = _sub(
        sub, "report", "write a study's outputs (tuned script, autotune.yaml, report) without running trials",
        "  autotune report                            # the study of the search whose --out was autotune-out/\n"
        "  autotune report --storage autotune-out/study.db --out report/\n"
        "  autotune report --storage postgresql://user@db-host/autotune --study-name cnn-bs64\n",
    )
    report.add_argument(
        "--storage", metavar="URL",
        help="the study's storage: database URL or file (default: $AUTOTUNE_STORAGE, else OUT/study.db)",
    )
    report.add_argument("--study-name", metavar="NAME", help="the study (default: the storage's only study)")
    report.add_argument("--out", default="autotune-out", help="output folder (default: autotune-out)")
    report.add_argument("--script", metavar="PATH", help="where the searched script is now (default: as recorded)")
    report.set_defaults(func=cmd_report)

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    console = Console(highlight=False)
    err = Console(stderr=True, highlight=False)
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command is None:  # bare `autotune`: what it can do, as argparse does for a missing argument
            parser.print_help(sys.stderr)
            return 2
        code = int(args.func(args, console) or 0)
        sys.stdout.flush()  # here, where a closed pipe can still be answered quietly
        return code
    except BrokenPipeError:  # `autotune scan --json x.py | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the flush at exit does not fail again
        return 141  # 128 + SIGPIPE, as a tool the pipe's signal ended
    except AutotuneError as exc:
        err.print(f"autotune: error: {exc}", markup=False, soft_wrap=True)
        return exc.exit_code
    except KeyboardInterrupt:
        err.print("autotune: interrupted")
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
