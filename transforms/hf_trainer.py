"""hf_trainer: the Hugging Face Trainer's own settings (TrainingArguments), where the script builds or parses them."""

from __future__ import annotations

import libcst as cst

from autotune.analysis import ModuleFacts
from autotune.knobs import Knob, Numerics, Role
from autotune.transform import Edits, Status, Transform
from autotune.bound import unbound
from autotune.syntax import argument, is_literal, stmt
from autotune.transforms._dist import literal_string
from autotune.transforms._settings import code_of, keyword_settings, searched

# TrainingArguments and the subclasses libraries ship (a local subclass of any of them counts too)
ARGUMENT_CLASSES = {
    "transformers.TrainingArguments",
    "transformers.training_args.TrainingArguments",
    "transformers.Seq2SeqTrainingArguments",
    "transformers.training_args_seq2seq.Seq2SeqTrainingArguments",
    "trl.SFTConfig",
    "trl.DPOConfig",
}
PARSERS = {"transformers.HfArgumentParser", "transformers.hf_argparser.HfArgumentParser"}


class HfTrainer(Transform):
    """Mixed precision, TF32, torch.compile, the fused optimizer, the loader's workers and gradient checkpointing as the
    Hugging Face Trainer's own settings."""

    name = "hf_trainer"
    tracks_settings = True
    knobs = (
        Knob(
            "hf_trainer.precision",
            ("default", "bf16", "fp16"),
            "default",
            Numerics.LOWP,
            role=Role.PRECISION,
            help="TrainingArguments bf16=True or fp16=True: the Trainer's mixed precision (fp16 needs CUDA)",
        ),
        Knob(
            "hf_trainer.tf32",
            (False, True),
            False,
            Numerics.LOWP,
            frozenset({"cuda"}),
            help="TrainingArguments tf32=True: TF32 tensor cores for float32 matmuls",
        ),
        Knob(
            "hf_trainer.torch_compile",
            (False, True),
            False,
            Numerics.REORDER,
            help="TrainingArguments torch_compile=True: the Trainer compiles the model (checkpoint keys unchanged)",
            compiles=True,
        ),
        Knob(
            "hf_trainer.optim",
            ("default", "adamw_torch_fused"),
            "default",
            Numerics.REORDER,
            help="TrainingArguments optim: PyTorch's fused AdamW where the installed transformers does not already "
            "default to it",
        ),
        Knob(
            "hf_trainer.dataloader_num_workers",
            (0, 1, 2, 4),
            0,
            Numerics.EXACT,
            help="TrainingArguments dataloader_num_workers: worker processes that load batches",
        ),
        Knob(
            "hf_trainer.dataloader_prefetch_factor",
            (2, 4, 8),
            2,
            Numerics.EXACT,
            help="TrainingArguments dataloader_prefetch_factor: batches each worker loads ahead (only with the "
            "dataloader_num_workers knob's workers; 2 is DataLoader's own default)",
        ),
        Knob(
            "hf_trainer.dataloader_persistent_workers",
            (False, True),
            False,
            Numerics.EXACT,
            help="TrainingArguments dataloader_persistent_workers: keep the workers alive between epochs (only with "
            "the dataloader_num_workers knob's workers); the loader then draws its seed once, not once per epoch, so "
            "from the second epoch on the shuffle differs: not searched by default",
        ),
        Knob(
            "hf_trainer.gradient_checkpointing",
            (False, True),
            False,
            Numerics.EXACT,
            role=Role.MEMORY_SAVER, on=True,
            help="TrainingArguments gradient_checkpointing: the model recomputes its activations in backward (the "
            "Trainer calls its gradient_checkpointing_enable; models without support fail the trial); saves memory, "
            "costs time",
        ),
        Knob(
            "hf_trainer.batch_split",
            (1, 2, 4, 8, 16, 0.5, 0.25),
            1,
            Numerics.REORDER,
            role=Role.SPLIT,
            help="per_device_train_batch_size times this, gradient_accumulation_steps divided by it: the same samples "
            "in the same order in each optimizer step, in fewer, bigger micro-batches (only where it divides exactly, "
            "and not for a model with BatchNorm or dropout, which draw per micro-batch); 0.5 and 0.25 halve or "
            "quarter the micro-batch, for memory: the search tries them only where a configuration at the script's "
            "own micro-batch ran out of memory",
        ),
    )

    def apply(self, facts: ModuleFacts, edits: Edits) -> None:
        hf = any(f.framework.hugging_face for f in self.project.tuned_frameworks())
        for call in facts.calls:
            qual = facts.qualname(call.func)
            if qual in PARSERS:
                self._parser(facts, call, edits, hf)
            elif self.project.derives(facts, call.func, ARGUMENT_CLASSES):
                self._arguments(facts, call, edits, hf)
            elif getattr(self.project.framework_of(facts, call.func), "hugging_face", False):
                self._batch_split(facts, call, edits)

    def _batch_split(self, facts: ModuleFacts, call: cst.Call, edits: Edits) -> None:
        """``Trainer(model=model, args=training_args, ...)``: just before it, the micro-batch and the accumulation
        steps of ``training_args`` split each optimizer step's samples as the batch_split knob asks."""
        trains = any(f.module is facts and f.framework.hugging_face
                     for f in self.project.tuned_frameworks())
        args = argument(call, 1, "args")
        model = argument(call, 0, "model")
        model = model if isinstance(model, cst.Name) and model.value not in ("None", "True", "False") else None
        at = facts.statement_of(call)
        if any(facts.is_runtime_call(c, "hf_batch_split") for c in facts.calls):
            self.report(facts, call, Status.PRESENT, "the batch split is already a knob")
            return
        if not trains:
            return  # a Trainer built inside the call that trains: patch refuses the script (see Project.no_loop_reason)
        if not isinstance(args, cst.Name) or unbound(facts, at, args.value) or _conditional(facts, call, at):
            what = f"args={facts.code(args)}" if args is not None else "no args="
            self.report(facts, call, Status.NOT_APPLICABLE,
                        f"{what}: the batch split needs the TrainingArguments as a name bound before the Trainer is built")
            return
        model_code = model.value if model is not None and not unbound(facts, at, model.value) else None
        self.report(facts, call, Status.APPLICABLE, (
            f"{args.value}.per_device_train_batch_size x gradient_accumulation_steps: the split of each optimizer "
            "step's samples becomes a knob (bigger micro-batches, fewer accumulation steps, the same samples in the "
            "same order)" + ("; left as it is for a model with BatchNorm or dropout, checked when the Trainer is built"
                             if model_code else "; the model is not a name here: BatchNorm or dropout, which draw per "
                             "micro-batch, are left to the loss gate")))
        if self.mode.gated:
            self.settings_read.add("batch_split")
            extra = f", model={model_code}" if model_code else ""
            edits.insert_before(at, stmt(f"{edits.runtime('hf_batch_split')}({args.value}{extra})\n"))
            return
        k = self.mode.value(self.knob("batch_split"))
        a = args.value
        if k > 1:
            edits.insert_before(at, stmt(
                f"if {a}.gradient_accumulation_steps % {k} == 0:  # autotune: micro-batch x{k}, accumulation /{k}: "
                "same samples per step\n"
                f"    {a}.per_device_train_batch_size *= {k}\n"
                f"    {a}.gradient_accumulation_steps //= {k}\n"))
        elif k < 1:
            d = round(1 / k)
            edits.insert_before(at, stmt(
                f"if {a}.per_device_train_batch_size % {d} == 0:  # autotune: micro-batch /{d}, accumulation x{d}: "
                "same samples per step\n"
                f"    {a}.per_device_train_batch_size //= {d}\n"
                f"    {a}.gradient_accumulation_steps *= {d}\n"))

    def _arguments(self, facts: ModuleFacts, call: cst.Call, edits: Edits, hf: bool) -> None:
        """``TrainingArguments(output_dir=..., ...)``: the settings the script leaves out become knobs there."""
        if not hf and not any(facts.is_runtime_call(a.value, "hf_trainer_args") for a in call.args if a.star == "**"):
            self.report(facts, call, Status.NOT_APPLICABLE, "no Hugging Face Trainer trains in this script")
            return
        keyword_settings(self, facts, call, edits, HF_SETTINGS, "hf_trainer_args", "TrainingArguments", _on,
                         self._baked, {s: ("hf_trainer_switch", SWITCHED_OFF) for s in SWITCHES})

    def _parser(self, facts: ModuleFacts, call: cst.Call, edits: Edits, hf: bool) -> None:
        """``parser = HfArgumentParser((ModelArguments, TrainingArguments))``: the knobs become the parser's
        defaults, so that a value given on the command line wins."""
        classes = call.args[0].value if call.args and call.args[0].keyword is None else None
        elements = [e.value for e in classes.elements] if isinstance(classes, (cst.Tuple, cst.List)) else [classes]
        if classes is None or not any(self.project.derives(facts, e, ARGUMENT_CLASSES) for e in elements):
            return  # a parser of the script's own dataclasses only
        at = facts.statement_of(call)
        node = at.body[0] if isinstance(at, cst.SimpleStatementLine) and len(at.body) == 1 else None
        if not (isinstance(node, cst.Assign) and node.value is call and len(node.targets) == 1
                and isinstance(node.targets[0].target, cst.Name)):
            self.report(facts, call, Status.NOT_APPLICABLE, "the parser is not assigned to a name of its own")
            return
        parser = node.targets[0].target.value
        if any(facts.is_runtime_call(c, "hf_trainer_defaults") for c in facts.calls):
            self.report(facts, call, Status.PRESENT, "the Trainer's settings are already knobs")
            return
        if not hf:
            self.report(facts, call, Status.NOT_APPLICABLE, "no Hugging Face Trainer trains in this script")
            return
        free = [s for s in HF_SETTINGS if searched(self, s)]
        self.report(
            facts, call, Status.APPLICABLE,
            f"the parser's defaults for {', '.join(free)} become knobs: a value given on the command line wins "
            "(arguments read from a JSON or YAML file do not use the parser's defaults)",
        )
        if self.mode.gated:
            self.settings_read.update(free)
            edits.insert_after(at, stmt(f"{parser}.set_defaults(**{edits.runtime('hf_trainer_defaults')}({parser}))\n"))
        else:
            values = self._baked(free)
            if values:
                keywords = ", ".join(f"{k}={v}" for k, v in values.items())
                edits.insert_after(at, stmt(f"{parser}.set_defaults({keywords})\n"))

    def _baked(self, settings: list[str]) -> dict[str, str]:
        """The keyword arguments (name -> code) a person would write for the chosen values of ``settings``."""
        values = {s: self.mode.value(self.knob(s)) for s in settings}
        return {k: code_of(v) for k, v in hf_settings(values, _baked_default_optim(values)).items()}


def _baked_default_optim(values: dict[str, Any]) -> str | None:
    """The installed TrainingArguments' own optim where the optim knob asks for one (None where transformers is not
    installed): the tuned script writes no optim the Trainer uses already, as a trial does not set it (its runtime
    asks the same)."""
    try:
        return _default_optim(values)
    except ImportError:
        return None


def _conditional(facts: ModuleFacts, call: cst.Call, at: cst.BaseStatement) -> bool:
    """Whether ``call`` runs only on some paths through its statement (an if-expression's branch, a lambda's body,
    the right of and/or): a statement put before it would run where the Trainer is not built."""
    for node in facts.ancestors(call):
        if node is at:
            return False
        if isinstance(node, (cst.IfExp, cst.Lambda, cst.BooleanOperation, cst.BaseComp)):
            return True
    return False


def _on(keyword: str, value: cst.BaseExpression) -> bool:
    """Whether the script's ``keyword=value`` turns the fast path on: True, the fused optimizer, or a compile mode or
    backend (which turn compilation on: TrainingArguments.__post_init__)."""
    if keyword == "optim":
        return literal_string(value) == FUSED
    return is_literal(value, True) or (keyword.startswith("torch_compile_") and isinstance(value, cst.SimpleString))


# === runtime: what the patched script runs (python -m autotune.catalog copies it into autotune/runtime_helpers.py) ===

from typing import Any

from autotune.knob_values import default, knob, on_reset, took_effect

# each knob's setting -> the TrainingArguments fields that decide it (a script that writes one keeps its choice)
HF_SETTINGS = {
    "precision": ("bf16", "fp16"),
    "tf32": ("tf32",),
    "torch_compile": ("torch_compile", "torch_compile_mode", "torch_compile_backend"),
    "optim": ("optim",),
    "dataloader_num_workers": ("dataloader_num_workers",),
    "dataloader_prefetch_factor": ("dataloader_prefetch_factor",),
    "dataloader_persistent_workers": ("dataloader_persistent_workers",),
    "gradient_checkpointing": ("gradient_checkpointing",),
}
# settings that need the knob's loader workers: TrainingArguments refuses a prefetch factor without workers, and
# DataLoader persistent workers (a script's own worker count is not known where the arguments are built)
WITH_WORKERS = ("dataloader_prefetch_factor", "dataloader_persistent_workers")
FUSED = "adamw_torch_fused"
# the settings a script may switch itself (``TrainingArguments(bf16=args.bf16)``), and the values that mean off
SWITCHES = ("precision", "tf32", "torch_compile")
SWITCHED_OFF = (None, False)
_script_chose: set[str] = set()  # settings whose switch the script turned on itself in this run


def hf_trainer_switch(setting: str, script_value: Any, keyword: str | None = None, *others: Any) -> Any:
    """``bf16=args.bf16`` (``keyword``; ``others``: the script's values for the setting's other flags, fp16's) or
    ``tf32=args.tf32``: the script's value where any of its switches for the setting is on; where all are off, True
    for the knob's choice (the flag named ``keyword``, where the setting has several)."""
    value = knob(f"hf_trainer.{setting}", record=False)
    if script_value not in SWITCHED_OFF or any(o not in SWITCHED_OFF for o in others):
        _script_chose.add(setting)
        return script_value
    if value == default(f"hf_trainer.{setting}") or (keyword is not None and value != keyword):
        return script_value
    return True  # counted where the Trainer's resolved arguments hold it: hf_trainer_resolved


on_reset(_script_chose.clear)


def hf_settings(values: dict[str, Any], default_optim: str | None) -> dict[str, Any]:
    """TrainingArguments fields (name -> value) for knob settings (setting -> choice); a choice at its default sets
    nothing. ``default_optim``: the installed TrainingArguments' own optim, where known (fused there already: not
    set again)."""
    out: dict[str, Any] = {}
    for setting, value in values.items():
        if setting == "precision" and value != "default":
            out[value] = True
        elif setting in ("tf32", "torch_compile") and value:
            out[setting] = True
        elif setting == "optim" and value != "default" and value != default_optim:
            out["optim"] = value
        elif setting in ("dataloader_num_workers", "gradient_checkpointing") and value:
            out[setting] = value
        elif setting in WITH_WORKERS and value != default(f"hf_trainer.{setting}") and values.get("dataloader_num_workers"):
            out[setting] = value
    return out


def _installed_optim() -> str | None:
    import dataclasses

    from transformers import TrainingArguments

    field = next((f for f in dataclasses.fields(TrainingArguments) if f.name == "optim"), None)
    value = field.default if field is not None else None
    return str(getattr(value, "value", value)) if value is not None else None


def _knob_values(script_sets: tuple[str, ...]) -> dict[str, Any]:
    return {s: knob(f"hf_trainer.{s}", record=False) for s in HF_SETTINGS if s not in script_sets}


def _default_optim(values: dict[str, Any]) -> str | None:
    """The installed TrainingArguments' own optim, asked only where the optim knob is off its default."""
    return _installed_optim() if values.get("optim", "default") != "default" else None


def hf_trainer_args(script_sets: tuple[str, ...] = ()) -> dict[str, Any]:
    """The TrainingArguments keywords the knobs ask for, except for the settings the script gives itself
    (``script_sets``): nothing at the defaults."""
    values = _knob_values(script_sets)
    return hf_settings(values, _default_optim(values))


def hf_trainer_defaults(parser: Any) -> dict[str, Any]:
    """Defaults for the parser's TrainingArguments fields: the knobs' settings, except those the command line
    gives (it wins: a precision given there leaves both bf16 and fp16 to it). Nothing at the defaults."""
    values = _knob_values(())
    if all(v == default(f"hf_trainer.{s}") for s, v in values.items()):
        return {}  # the command line need not be read
    given = _given_on_command_line(parser)
    values = {s: v for s, v in values.items() if not given.intersection(HF_SETTINGS[s])}
    return hf_settings(values, _default_optim(values))


def _given_on_command_line(parser: Any) -> set[str]:
    """The destinations of the parser's options that ``sys.argv`` gives (``--bf16``, ``--bf16=true``)."""
    import sys

    tokens = sys.argv[1:]
    given = set()
    for action in getattr(parser, "_actions", ()):
        for option in action.option_strings:
            if any(t == option or t.startswith(option + "=") for t in tokens):
                given.add(action.dest)
    return given


def hf_batch_split(args: Any, model: Any = None) -> None:
    """Split each optimizer step's samples as ``hf_trainer.batch_split`` asks, in the TrainingArguments ``args``
    before the Trainer is built: the micro-batch (per_device_train_batch_size) times k, the accumulation steps
    divided by k. The Trainer's sampler orders the same samples whatever the micro-batch, and it scales each
    micro-step's loss to the mean over the step, so each step trains on the same samples, to float rounding.
    Left as it is where k does not divide the accumulation steps, and for a ``model`` whose training draws per
    micro-batch (see ``_per_micro_batch``)."""
    k = knob("hf_trainer.batch_split", record=False)
    if k == 1 or getattr(args, "_autotune_split", False):
        return
    from autotune.runtime_helpers import split_sizes  # batch_split's: one arithmetic for both knobs

    split = split_sizes(args.per_device_train_batch_size, args.gradient_accumulation_steps, k)
    if split is None or (model is not None and _per_micro_batch(model)):
        return
    args.per_device_train_batch_size, args.gradient_accumulation_steps = split
    args._autotune_split = True  # a plain attribute, not a field: TrainingArguments' own output leaves it out
    took_effect("hf_trainer.batch_split")


ATTENTION_DROPOUT = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")


def _per_micro_batch(model: Any) -> bool:
    """Whether ``model`` trains differently on other micro-batches of the same samples: BatchNorm (its statistics
    are per micro-batch), or dropout (its masks are drawn layer by layer for each micro-batch, so the same sample
    gets another mask)."""
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.modules.dropout import _DropoutNd

    if any(isinstance(m, _BatchNorm) or (isinstance(m, _DropoutNd) and m.p > 0) for m in model.modules()):
        return True
    # attention dropout that transformers' models apply functionally (scaled_dot_product_attention's dropout_p)
    config = getattr(model, "config", None)
    return any(isinstance(getattr(config, k, None), (int, float)) and getattr(config, k) > 0 for k in ATTENTION_DROPOUT)


def hf_trainer_resolved(args: Any) -> None:
    """Record the knobs whose setting the Trainer's resolved TrainingArguments ``args`` hold: read back from the
    framework's own object, so that a value the command line or the script gave instead does not count."""
    precision = knob("hf_trainer.precision", record=False)
    if precision != "default" and getattr(args, precision, False) is True and "precision" not in _script_chose:
        took_effect("hf_trainer.precision")
    for setting in ("tf32", "torch_compile"):
        if knob(f"hf_trainer.{setting}", record=False) and getattr(args, setting, None) is True \
                and setting not in _script_chose:
            took_effect(f"hf_trainer.{setting}")
    optim = knob("hf_trainer.optim", record=False)
    resolved = getattr(args, "optim", None)
    if optim != "default" and str(getattr(resolved, "value", resolved)) == optim and _installed_optim() != optim:
        took_effect("hf_trainer.optim")
    workers = knob("hf_trainer.dataloader_num_workers", record=False)
    if workers and getattr(args, "dataloader_num_workers", None) == workers:
        took_effect("hf_trainer.dataloader_num_workers")
        for setting in WITH_WORKERS:
            value = knob(f"hf_trainer.{setting}", record=False)
            if value != default(f"hf_trainer.{setting}") and getattr(args, setting, None) == value:
                took_effect(f"hf_trainer.{setting}")
    if knob("hf_trainer.gradient_checkpointing", record=False) and getattr(args, "gradient_checkpointing", None) is True:
        took_effect("hf_trainer.gradient_checkpointing")

