"""Imported by patched scripts: knob values, the transforms' runtime helpers and the trial protocol.

Standard library and PyYAML only; torch is imported lazily, inside the helpers that need it, so importing this
module costs nothing measurable and never initialises CUDA.

Knob values come from the YAML file named by ``AUTOTUNE_CONFIG`` or, without it, ``autotune.yaml`` beside the
script. With neither, every knob takes its default and the patched script behaves exactly like the original. With
one, each value is checked against every knob autotune declares (``autotune.knob_table``, standard library only).
"""

from __future__ import annotations

import atexit
import contextlib
import gc as _gc
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

CONFIG_ENV = "AUTOTUNE_CONFIG"
TRIAL_ENV = "AUTOTUNE_TRIAL"
CONFIG_NAME = "autotune.yaml"

_values: dict[str, Any] | None = None
_device: str | None = None
# knobs whose non-default value reached the running program: the injected code that reads them ran (the trial
# result lists them, so a knob that was switched on where no code of it runs is not mistaken for a measurement)
_applied: dict[str, None] = {}


def _fail(msg: str) -> None:
    # SystemExit with a string prints one line and exits 1: no traceback inside the user's script.
    raise SystemExit(f"autotune: {msg}")


def _script_dir() -> Path:
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None) or (sys.argv[0] if sys.argv and sys.argv[0] else "")
    return Path(path).resolve().parent if path else Path.cwd()


def _read_yaml(path: Path) -> dict:
    from autotune.errors import UsageError
    from autotune.inputs import load_yaml_file

    try:
        doc = load_yaml_file(path, "a knob config")
    except UsageError as exc:
        _fail(str(exc))
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        _fail(f"{path}: expected a mapping at the top level")
    return doc


def _knob_section(doc: dict, path: Path) -> dict[str, Any]:
    knobs = doc.get("knobs") or {}
    if not isinstance(knobs, dict):
        _fail(f"{path}: 'knobs' must be a mapping of knob name to value")
    return knobs


def _checked(values: dict[str, Any], path: Path) -> dict[str, Any]:
    """``values`` as the knobs' declared choices, checked against every knob autotune has (not the file's list)."""
    from autotune.errors import UsageError
    from autotune.knobs import checked
    from autotune.knob_table import KNOBS

    try:
        return checked(values, KNOBS, str(path))
    except UsageError as exc:
        _fail(str(exc))


def load_config(table_path: Path | None = None, override_path: Path | None = None) -> tuple[dict[str, Any], str | None]:
    """Knob values and device from the knob table beside the script and the optional override file."""
    from autotune.inputs import shown

    table_path = table_path if table_path is not None else _script_dir() / CONFIG_NAME
    env = os.environ.get(CONFIG_ENV)
    override_path = override_path if override_path is not None else (Path(env) if env else None)
    table: dict[str, Any] = {}
    values: dict[str, Any] = {}
    device = None
    if table_path.is_file():
        doc = _read_yaml(table_path)
        device = doc.get("device")
        table = {
            name: spec.get("value", spec.get("default")) if isinstance(spec, dict) else spec
            for name, spec in _knob_section(doc, table_path).items()
        }
        values.update(_checked(table, table_path))
    if override_path is not None:
        if not override_path.exists():
            _fail(f"{override_path}: {CONFIG_ENV} names a file that does not exist")
        doc = _read_yaml(override_path)
        device = doc.get("device", device)
        override = {
            name: spec.get("value") if isinstance(spec, dict) else spec
            for name, spec in _knob_section(doc, override_path).items()
        }
        unread = [name for name in override if table and name not in table]
        if unread:
            _fail(f"{override_path}: unknown knob {shown(unread[0])} (this script has: {', '.join(sorted(table))})")
        values.update(_checked(override, override_path))
    if device is not None and (type(device) is not str or device not in ("cpu", "cuda")):
        _fail(f"device must be 'cpu' or 'cuda', not {shown(device)}")
    return values, device


def _loaded() -> dict[str, Any]:
    global _values, _device
    if _values is None:
        _values, _device = load_config()
    return _values


def knob(name: str, default: Any, record: bool = True) -> Any:
    """The configured value of knob ``name``, or ``default`` when no config sets it.

    A value other than the default counts as applied (see ``applied``) unless ``record`` is false: helpers whose
    effect depends on more than the knob record it themselves, when it takes effect.
    """
    value = _loaded().get(name, default)
    if record and value != default:
        _applied.setdefault(name)
    return value


def took_effect(*names: str) -> None:
    """Record knobs as applied: their helper changed the program."""
    for name in names:
        _applied.setdefault(name)


def applied() -> list[str]:
    """The knobs that took effect in this process so far, in the order they first did."""
    nccl = _nccl_set if _nccl_set and _nccl_running() else []
    return list(dict.fromkeys([*_applied, *nccl]))


def reset() -> None:
    """Forget the loaded config (tests, and scripts that change AUTOTUNE_CONFIG at run time)."""
    global _values, _device
    _values, _device = None, None
    _applied.clear()
    _nccl_set.clear()


def device_type() -> str:
    """The device the knobs target: the config's ``device``, else cuda when available, else cpu."""
    _loaded()  # the config may name the device
    if _device is not None:
        return _device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# --- fused_optimizer ---------------------------------------------------------------------------------------


def optimizer_impl() -> dict[str, bool]:
    """Keyword arguments that select the optimizer implementation: {}, {'foreach': True} or {'fused': True}."""
    impl = knob("fused_optimizer.impl", "default")
    return {} if impl == "default" else {impl: True}


# --- autocast ----------------------------------------------------------------------------------------------

_scaler_obj = None
_update_pending = False  # an optimizer stepped through the scaler since its last update()


def _dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


def autocast(bf16_only: bool = False):
    """The autocast region autotune injected around forward and loss; a null context by default.

    ``bf16_only``: the script has no place where fp16's gradient scaling could go (an optimizer not bound on every
    path to a clipping), so fp16 is refused rather than run unscaled.
    """
    dtype = knob("autocast.dtype", "default")
    if dtype == "default":
        return contextlib.nullcontext()
    if bf16_only and dtype != "bf16":
        _fail(f"autocast.dtype={dtype} is not offered for this script (bf16 only: fp16's gradient scaling has no "
              "safe place here; see autotune scan)")
    import torch

    return torch.autocast(device_type=device_type(), dtype=_dtype(dtype))


def autocast_dtype(script_dtype):
    """The dtype of an autocast region the script already had: its own by default, else the knob's."""
    dtype = knob("autocast.dtype", "default")
    return script_dtype if dtype == "default" else _dtype(dtype)


def scaler_enabled(script_enabled: bool = True) -> bool:
    """Whether the script's own GradScaler stays on: off under bf16, which needs no loss scaling."""
    dtype = knob("autocast.dtype", "default")
    return bool(script_enabled) and dtype != "bf16"


def _scaler():
    global _scaler_obj
    if _scaler_obj is None:
        import torch

        _scaler_obj = torch.amp.GradScaler(device_type())
    return _scaler_obj


def _fp16_injected() -> bool:
    return knob("autocast.dtype", "default") == "fp16"


def scale(loss):
    """``loss`` scaled by autotune's GradScaler under fp16; ``loss`` itself otherwise."""
    global _update_pending
    if not _fp16_injected():
        return loss
    scaler = _scaler()
    if _update_pending:
        # one update() after all the optimizer steps that followed the previous backward (several optimizers
        # stepped on one loss must be unscaled with the same scale)
        scaler.update()
        _update_pending = False
    return scaler.scale(loss)


def unscale_(optimizer) -> None:
    """Unscale gradients before clipping, under fp16 only."""
    if _fp16_injected():
        _scaler().unscale_(optimizer)


def optimizer_step(optimizer, *args, **kwargs):
    """``optimizer.step()``, through autotune's GradScaler under fp16 (its update() comes with the next scale())."""
    global _update_pending
    if not _fp16_injected():
        return optimizer.step(*args, **kwargs)
    result = _scaler().step(optimizer, *args, **kwargs)
    _update_pending = True
    return result


# --- backend_flags -----------------------------------------------------------------------------------------


def backend_flags(script_sets: tuple[str, ...] = ()) -> None:
    """Set the TF32, matmul-precision and cuDNN flags the knobs ask for; touch nothing by default.

    ``script_sets`` names the flags the script sets itself ("tf32", "matmul_precision", "cudnn_benchmark"):
    those stay as the script wrote them, whatever the config says.
    """

    def setting(name: str, default: Any) -> Any:
        return default if name in script_sets else knob(f"backend_flags.{name}", default)

    tf32 = setting("tf32", False)
    precision = setting("matmul_precision", "highest")
    benchmark = setting("cudnn_benchmark", False)
    if not (tf32 or benchmark or precision != "highest"):
        return
    import torch

    if tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if precision != "highest":
        torch.set_float32_matmul_precision(precision)
    if benchmark:
        torch.backends.cudnn.benchmark = True


# --- threads -----------------------------------------------------------------------------------------------


def threads() -> None:
    """Set the CPU threads torch's operators run on, as the knob asks; touch nothing by default."""
    n = knob("threads.intra_op", "default")
    if n == "default":
        return
    import torch

    torch.set_num_threads(int(n))


# --- channels_last -----------------------------------------------------------------------------------------


def channels_last(obj):
    """A module or 4-D tensor in channels_last memory format when the knob is on; anything else unchanged."""
    if not knob("channels_last.enabled", False, record=False):
        return obj
    import torch

    if isinstance(obj, torch.nn.Module):
        if any(p.dim() == 4 for p in obj.parameters()):  # a model without 4-D weights stays as it was
            took_effect("channels_last.enabled")
        return obj.to(memory_format=torch.channels_last)
    if isinstance(obj, torch.Tensor) and obj.dim() == 4:
        return obj.contiguous(memory_format=torch.channels_last)
    return obj


# --- dataloader --------------------------------------------------------------------------------------------


def dataloader_kwargs(**script: Any) -> dict[str, Any]:
    """DataLoader keyword arguments: those the script wrote, plus the knobs' for the ones it left out.

    Never returns ``prefetch_factor`` or ``persistent_workers=True`` with zero workers, which DataLoader rejects.
    """
    out = dict(script)
    # a knob for a keyword the script wrote itself changes nothing: recorded only where it is used
    workers = out.setdefault("num_workers", knob("dataloader.num_workers", 0, record=False))
    if workers and "num_workers" not in script:
        took_effect("dataloader.num_workers")
    pin = knob("dataloader.pin_memory", False, record=False)
    if pin and "pin_memory" not in script:
        out["pin_memory"] = True
        took_effect("dataloader.pin_memory")
    if workers:
        if "persistent_workers" not in script and knob("dataloader.persistent_workers", False, record=False):
            out["persistent_workers"] = True
            took_effect("dataloader.persistent_workers")
        prefetch = knob("dataloader.prefetch_factor", 2, record=False)
        if "prefetch_factor" not in script and prefetch != 2:
            out["prefetch_factor"] = prefetch
            took_effect("dataloader.prefetch_factor")
    if out["num_workers"] == 0 and "num_workers" not in script:
        del out["num_workers"]  # leave DataLoader's own default in place, as the script did
    return out


# --- non_blocking ------------------------------------------------------------------------------------------


def non_blocking() -> bool:
    """Whether host-to-device copies in the loop are asynchronous."""
    return bool(knob("non_blocking.enabled", False))


# --- gc ----------------------------------------------------------------------------------------------------

_gc_paused = False


def gc_pause() -> None:
    """Collect, freeze and disable the garbage collector before the loop, when the knob is on."""
    global _gc_paused
    if knob("gc.freeze", False) and not _gc_paused:
        _gc.collect()
        _gc.freeze()
        _gc.disable()
        _gc_paused = True


def gc_resume() -> None:
    """Undo ``gc_pause`` after the loop."""
    global _gc_paused
    if _gc_paused:
        _gc.enable()
        _gc.unfreeze()
        _gc_paused = False


# --- allocator ---------------------------------------------------------------------------------------------


def allocator_env() -> None:
    """Add ``expandable_segments:True`` to PYTORCH_CUDA_ALLOC_CONF; must run before torch initialises CUDA."""
    if not knob("allocator.expandable_segments", False):
        return
    # torch reads PYTORCH_CUDA_ALLOC_CONF in place of PYTORCH_ALLOC_CONF when both are set: merge with the one in use
    current = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF", ""))
    if "expandable_segments" not in current:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, [current, "expandable_segments:True"]))


# --- sdpa --------------------------------------------------------------------------------------------------


def sdpa_enabled() -> bool:
    """Whether hand-written attention runs as F.scaled_dot_product_attention instead of the script's own code."""
    return knob("sdpa.attention", "manual") == "sdpa"


# --- checkpointing -----------------------------------------------------------------------------------------

_CHECKPOINT_EVERY = {"none": 0, "all": 1, "every_2nd": 2}


def _checkpoint_every() -> int:
    return _CHECKPOINT_EVERY[knob("checkpointing.blocks", "none")]


class _Checkpointed:
    """A block that runs under activation checkpointing while training with gradients, and plainly otherwise."""

    __slots__ = ("block",)

    def __init__(self, block: Any) -> None:
        self.block = block

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        if self.block.training and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self.block, *args, use_reentrant=False, **kwargs)
        return self.block(*args, **kwargs)


def checkpoint_blocks(blocks: Any) -> Any:
    """The blocks a loop runs: themselves by default, else every (or every other) one checkpointed."""
    every = _checkpoint_every()
    if not every:
        return blocks
    return [_Checkpointed(b) if i % every == 0 else b for i, b in enumerate(blocks)]


def checkpoint_sequential(seq: Any, x: Any) -> Any:
    """``seq(x)`` for an nn.Sequential of blocks, its blocks checkpointed as ``checkpoint_blocks`` does."""
    every = _checkpoint_every()
    if not every:
        return seq(x)
    for i, block in enumerate(seq):
        x = _Checkpointed(block)(x) if i % every == 0 else block(x)
    return x


def checkpoint_switch(model: Any, method: str) -> None:
    """Call the model library's own activation-checkpointing switch ``method`` when the knob is on."""
    if not knob("checkpointing.framework", False):
        return
    if method == "gradient_checkpointing_enable":
        try:  # non-reentrant, as autotune checkpoints blocks itself
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        except TypeError:  # transformers before 4.35 takes no arguments
            model.gradient_checkpointing_enable()
    else:
        getattr(model, method)(True)


# --- compile -----------------------------------------------------------------------------------------------

_CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")
_compile_spans: list[tuple[float, float]] = []
_compile_began: float | None = None
_compile_watched = False


def _compile_kwargs() -> dict[str, Any]:
    mode = knob("compile.mode", "none", record=False)
    kwargs: dict[str, Any] = {} if mode == "default" else {"mode": mode}
    dynamic = knob("compile.dynamic", "default")
    if dynamic != "default":
        kwargs["dynamic"] = bool(dynamic)
    return kwargs


def compile_model(model: Any, blocks: Any = ()) -> Any:
    """Compile ``model`` in place as the knobs ask: nothing by default.

    Module.compile() compiles in place, so ``model`` stays the same object and its state_dict keys never gain
    the ``_orig_mod.`` prefix that ``model = torch.compile(model)`` adds. With ``compile.scope: blocks`` each
    module of the containers at the attribute paths ``blocks`` (``["transformer.h"]``) is compiled instead;
    without such containers the whole model is.
    """
    if knob("compile.mode", "none", record=False) == "none" or getattr(model, "_autotune_compiled", False):
        return model
    import torch._inductor.config

    inner = model
    if isinstance(model, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)):
        # the wrapped model is compiled: DDP runs it as it is; DataParallel runs it itself on one device, but
        # its replicas on several would call the original's compiled forward on another device's inputs
        if isinstance(model, torch.nn.DataParallel) and len(model.device_ids or ()) > 1:
            return model
        inner = model.module
    kwargs = _compile_kwargs()
    # eager's random numbers: inductor's own give other dropout masks, and the losses could not be compared
    torch._inductor.config.fallback_random = True
    _watch_compile_time()
    targets: list[Any] = []
    if knob("compile.scope", "model", record=False) == "blocks":
        for path in blocks:
            targets.extend(inner.get_submodule(path))
    for module in targets or [inner]:
        module.compile(**kwargs)
    took_effect("compile.mode", *(("compile.scope",) if targets else ()))
    model._autotune_compiled = True  # a plain attribute: not a parameter, buffer or state_dict entry
    return model


def compile_step_begin() -> None:
    """At the start of each training step: tell CUDA graphs a new step begins (modes that use them, on CUDA)."""
    if knob("compile.mode", "none") in _CUDAGRAPH_MODES and device_type() == "cuda":
        import torch

        torch.compiler.cudagraph_mark_step_begin()


def _watch_compile_time() -> None:
    """Record the wall time torch spends compiling (tracing, lazy backward compilation, CUDA graph recording)."""
    global _compile_watched
    if _compile_watched:
        return
    _compile_watched = True
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:  # pragma: no cover - a torch without compile callbacks: compile time stays unknown
        return

    def began(_args: Any) -> None:
        global _compile_began
        _compile_began = time.perf_counter()

    def ended(_args: Any) -> None:
        if _compile_began is not None:
            _compile_spans.append((_compile_began, time.perf_counter()))

    callback_handler.register_start_callback(began)
    callback_handler.register_end_callback(ended)


def compile_seconds(since: float | None = None) -> float | None:
    """Seconds spent compiling (only the part after ``since``, a perf_counter time, when given); None when
    nothing was compiled through ``compile_model``."""
    if not _compile_watched:
        return None
    lower = float("-inf") if since is None else since
    return sum(max(0.0, end - max(start, lower)) for start, end in _compile_spans)


# --- no_sync -----------------------------------------------------------------------------------------------


def no_sync(model, final_micro_step: bool):
    """``model.no_sync()`` on an accumulation micro-step that does not step, when the knob is on; else a null
    context. A model the script left unwrapped (no DDP in this run) has no ``no_sync`` and gets the null context."""
    if final_micro_step or not knob("no_sync.enabled", False):
        return contextlib.nullcontext()
    skip = getattr(model, "no_sync", None)
    return skip() if skip is not None else contextlib.nullcontext()


# --- ddp ---------------------------------------------------------------------------------------------------

_DDP_DEFAULTS = {"bucket_cap_mb": 25, "gradient_as_bucket_view": False, "static_graph": False}


def ddp_kwargs(**script: Any) -> dict[str, Any]:
    """DistributedDataParallel keyword arguments: those the script wrote, plus the knobs' where they differ from
    torch's defaults."""
    out = dict(script)
    for name, default in _DDP_DEFAULTS.items():
        value = knob(f"ddp.{name}", default)
        if name not in script and value != default:
            out[name] = value
    return out


# --- fsdp --------------------------------------------------------------------------------------------------

_FSDP_DEFAULTS = {"forward_prefetch": False, "backward_prefetch": "pre", "limit_all_gathers": True, "use_orig_params": False}
_BACKWARD_PREFETCH = {"pre": "BACKWARD_PRE", "post": "BACKWARD_POST"}


def fsdp_kwargs(**script: Any) -> dict[str, Any]:
    """FullyShardedDataParallel keyword arguments: the script's, plus the knobs' where they differ from torch's."""
    out = dict(script)
    for name, default in _FSDP_DEFAULTS.items():
        value = knob(f"fsdp.{name}", default)
        if name in script or value == default:
            continue
        if name == "backward_prefetch":
            from torch.distributed.fsdp import BackwardPrefetch

            value = getattr(BackwardPrefetch, _BACKWARD_PREFETCH[value]) if value != "none" else None
        out[name] = value
    return out


def fully_shard_kwargs(**script: Any) -> dict[str, Any]:
    """``fully_shard`` keyword arguments: the script's, plus ``reshard_after_forward`` when the knob sets one."""
    out = dict(script)
    value = knob("fsdp.reshard_after_forward", "default")
    if "reshard_after_forward" not in script and value != "default":
        out["reshard_after_forward"] = value
    return out


# --- nccl_env ----------------------------------------------------------------------------------------------

# knob setting -> (environment variable, value for each choice); "default" leaves the variable unset
NCCL_ENV = {
    "algo": ("NCCL_ALGO", {"ring": "Ring", "tree": "ring,tree;allreduce:tree"}),
    "min_nchannels": ("NCCL_MIN_NCHANNELS", None),
    "buffsize_mb": ("NCCL_BUFFSIZE", None),
}


def nccl_env_value(setting: str, value: Any) -> str:
    """The environment value for a choice of ``nccl_env.<setting>``."""
    names = NCCL_ENV[setting][1]
    if names is not None:
        return names[value]
    return str(int(value) * 1024 * 1024) if setting == "buffsize_mb" else str(value)


def nccl_env(script_sets: tuple[str, ...] = ()) -> None:
    """Set the NCCL variables the knobs ask for, before any process group starts.

    A variable already in the environment, or one the script sets itself (named in ``script_sets``), is left alone.
    """
    for setting, (var, _) in NCCL_ENV.items():
        value = knob(f"nccl_env.{setting}", "default", record=False)
        if value == "default" or var in script_sets or var in os.environ:
            continue
        os.environ[var] = nccl_env_value(setting, value)
        _nccl_set.append(f"nccl_env.{setting}")


_nccl_set: list[str] = []  # the nccl_env knobs whose variable this process set: applied once NCCL runs


def _nccl_running() -> bool:
    """Whether this process has a process group on the NCCL backend (the variables only matter to one)."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    try:
        return bool(dist and dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()).lower())
    except (RuntimeError, ValueError):  # pragma: no cover - a group torn down meanwhile
        return False


# --- trial protocol ----------------------------------------------------------------------------------------


def _end_process_group() -> None:
    """End a distributed rank as its trial ends: every rank waits for the others, then exits at once.

    The script's own ``destroy_process_group()`` at its end never runs then, and leaving the group to the
    interpreter's exit aborted a rank ("terminate called without an active exception", SIGABRT) in 4 of 24 runs of
    a 2-rank DDP script under torchrun, destroying it first in 2 of 24. The result is written by now: nothing the
    trial needs is lost by skipping the exit's clean-up, which runs in the trial's own folder anyway.
    """
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return
        dist.barrier()  # no rank leaves while another still needs it for this step's last collective
    except Exception:  # a group already broken: the result is written, the exit is all that is left
        pass
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


class TrialComplete(SystemExit):
    """Raised by ``step`` when the measured window is over: ends the script with exit code 0."""

    def __init__(self) -> None:
        super().__init__(0)


# (rank, local rank, world size) variables, by launcher: torchrun (and anything built on torch.distributed.run),
# Open MPI's mpirun, MPICH / Intel MPI (PMI), Slurm's srun. The first set whose rank variable is present wins.
RANK_VARS = (
    ("RANK", "LOCAL_RANK", "WORLD_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE"),
    ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"),
)


def rank_info(env: Any = None) -> tuple[int, int, int]:
    """This process's (rank, local rank, world size) as its launcher set them; (0, 0, 1) without a launcher."""
    env = os.environ if env is None else env

    def number(name: str, default: int) -> int:
        value = env.get(name, "").strip()
        return int(value) if value.isdigit() else default

    for rank, local, world in RANK_VARS:
        r = number(rank, -1)
        if r >= 0:
            return r, number(local, r), number(world, r + 1)
    return 0, 0, 1


class _Trial:
    """Times steps after a warm-up, keeps per-step losses on device and writes one JSON result (one per rank under
    a launcher: every rank times and records its own losses; the search merges them)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.warmup = int(spec.get("warmup", 2))
        self.steps = int(spec.get("steps", 10))
        self.rank, self.local_rank, self.world_size = rank_info()
        self.result_path = Path(spec["result"])
        if spec.get("per_rank"):
            self.result_path = self.result_path.with_name(f"{self.result_path.stem}.rank{self.rank}.json")
        self.search_pid: int | None = spec.get("search_pid")
        self.started = time.perf_counter()
        self.count = 0
        self.stamps: list[float] = []
        self.losses: list[Any] = []
        self.pending: list[tuple] = []  # the losses of this optimizer step's micro-steps (gradient accumulation)
        self.batch: int | None = None
        self.written = False
        self.first_step_at: float | None = None
        self.window_start: float | None = None
        if self.warmup <= 0:  # no warm-up: the window opens now
            self.window_start = self.started
            self.stamps.append(self.started)

    def _sync(self) -> None:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def accumulate(self, losses: tuple) -> None:
        self.pending.append(_copies(losses))

    def step(self, losses: tuple, batch: Any) -> None:
        self.count += 1
        if losses:
            self.losses.append(_copies(losses))
        elif self.pending:  # the step's loss is the sum of its micro-steps' (each scaled by 1/accumulation, as a rule)
            self.losses.append(tuple(sum(column[1:], column[0]) for column in zip(*self.pending)))
        self.pending = []
        if self.batch is None and batch is not None and hasattr(batch, "shape") and len(batch.shape) > 0:
            self.batch = int(batch.shape[0])
        if self.count == 1:
            self.first_step_at = time.perf_counter()
        if self.count == self.warmup:
            self._sync()
            self.window_start = time.perf_counter()
            self.stamps.append(self.window_start)
        elif self.count > self.warmup:
            self.stamps.append(time.perf_counter())
        if self.count >= self.warmup + self.steps:
            self._sync()
            self.stamps[-1] = time.perf_counter()
            self.write("ok")
            _end_process_group()
            raise TrialComplete()

    def _loss_values(self) -> list[list[float]]:
        out = []
        for row in self.losses:
            out.append([float(v) for v in row])  # one host sync per value, after the window
        return out

    def _peak_memory(self) -> tuple[int | None, str]:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            return int(torch.cuda.max_memory_allocated()), "cuda_max_allocated"
        own = _own_peak_rss()
        if own is not None:
            return own, "cpu_max_rss"
        try:
            import resource

            rss = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
            return (rss if sys.platform == "darwin" else rss * 1024), "cpu_max_rss"  # bytes on macOS, KiB elsewhere
        except ImportError:  # pragma: no cover - not on Linux/macOS
            return None, "unknown"

    def write(
        self, status: str, error: str | None = None, error_type: str | None = None, error_types: tuple[str, ...] = ()
    ) -> None:
        if self.written:
            return
        self.written = True
        step_times = [b - a for a, b in zip(self.stamps, self.stamps[1:])]
        window = self.stamps[-1] - self.stamps[0] if len(self.stamps) > 1 else None
        try:
            losses = self._loss_values()
        except Exception as exc:  # a failed device (OOM, illegal access) can make losses unreadable
            losses, error = [], error or f"losses unreadable: {exc}"
        peak, peak_kind = self._peak_memory()
        result = {
            "status": status,
            "steps_done": self.count,
            "warmup": self.warmup,
            "steps": self.steps,
            "warmup_s": (self.window_start - self.started) if self.window_start else None,
            "first_step_s": (self.first_step_at - self.started) if self.first_step_at else None,
            # time torch.compile spent (in the warm-up, and the part that fell in the timed window: recompiles)
            "compile_s": compile_seconds(),
            "window_compile_s": compile_seconds(self.window_start) if self.window_start else None,
            "window_s": window,
            "step_times": step_times,
            "losses": losses,
            "batch_size": self.batch,
            "peak_memory": peak,
            "peak_memory_kind": peak_kind,
            "error": error,
            "error_type": error_type,
            "error_types": list(error_types),  # qualified names along the exception's MRO: oom, compile errors
            "applied": applied(),  # knobs that took effect: see took_effect
            "rank": self.rank,
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "pid": os.getpid(),
            "ended": time.time(),  # wall clock, comparable across ranks: which rank failed first
        }
        tmp = self.result_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result), encoding="utf-8")
        os.replace(tmp, self.result_path)


_WRITES = frozenset({"open", "os.mkdir", "os.remove", "os.rmdir", "os.rename", "os.truncate"})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def _keep_user_files(mirror: str, real: str, own: str) -> None:
    """Under a trial, run in a mirror of the user's working directory made of links to its entries: a write
    through a link first turns that link into the trial's own file or folder, so the user's files are only ever
    read; overwriting or deleting one of the user's files by its absolute path is refused (a new file may be made).

    An audit hook, so that every way Python opens or moves a file is covered (open, os.open, numpy, tarfile);
    torch.save writes from C++ by name, so it is wrapped once torch is imported.
    """
    import shutil
    import threading

    inside = threading.local()
    sep = os.sep

    def under(path: str, folder: str) -> bool:
        return path == folder or path.startswith(folder + sep)

    def own_copy(path: str, contents: bool) -> None:
        """Replace each link on the way to ``path`` (in the mirror) by a folder of links; ``path`` itself, if a
        link, by nothing (it is about to be written anew) or, with ``contents``, by a copy of what it points to."""
        parts = os.path.relpath(path, mirror).split(sep)
        here = mirror
        for part in parts[:-1]:
            here = os.path.join(here, part)
            if os.path.islink(here) and os.path.isdir(here):
                target = os.path.realpath(here)
                os.unlink(here)
                os.mkdir(here)
                for name in os.listdir(target):
                    os.symlink(os.path.join(target, name), os.path.join(here, name))
        if os.path.islink(path):
            target = os.path.realpath(path)
            os.unlink(path)
            if contents and os.path.isfile(target):
                shutil.copy2(target, path)

    def check(path: Any, contents: bool = False, final: bool = True, made: bool = False) -> None:
        """``final``: ``path`` itself is about to be written; else made (``made``: a folder) or removed."""
        if isinstance(path, int) or getattr(inside, "busy", False):
            return  # an open file descriptor (checked when opened), or own_copy's own work
        path = os.path.abspath(os.fsdecode(path))
        if under(path, mirror):
            inside.busy = True
            try:
                own_copy(path if final else os.path.join(path, "x"), contents and final)  # "x": the folders only
            finally:
                inside.busy = False
        elif under(path, real) and not under(path, own) and os.path.lexists(path) and (final or not made):
            raise PermissionError(f"autotune: a trial does not overwrite or delete your files ({path}): use a path "
                                  "relative to the working directory, which a trial sees as a folder of its own")

    def hook(event: str, args: tuple) -> None:
        if event == "import":
            _wrap_torch_save()
            return
        if event not in _WRITES:
            return
        if event == "open":
            path, mode, flags = args
            if path is not None and ((mode and any(c in mode for c in "wax+")) or (mode is None and flags & _WRITE_FLAGS)):
                check(path, contents=bool(mode and ("a" in mode or "+" in mode)) or bool(flags & os.O_APPEND))
        elif event == "os.rename":
            src, dst, src_fd, dst_fd = args
            if src_fd in (None, -1):  # -1, None: no folder descriptor, the path is the cwd's or absolute
                check(src, final=False)
            if dst_fd in (None, -1):
                check(dst)
        elif event == "os.truncate":
            check(args[0], contents=True)
        elif args[-1] in (None, -1):  # mkdir, remove, rmdir: a link itself may go, what it points to stays
            check(args[0], final=False, made=event == "os.mkdir")

    global _write_check
    _write_check = check
    sys.addaudithook(hook)


_write_check: Callable[[Any], None] | None = None  # a trial's check of a path it is about to write
_save_checked = False


def _wrap_torch_save() -> None:
    """torch.save by file name writes from C++, unseen by the audit hook: check its path first."""
    global _save_checked
    torch = sys.modules.get("torch")
    save = getattr(torch, "save", None)
    if _save_checked or save is None or _write_check is None:
        return
    _save_checked = True
    check = _write_check
    import functools

    @functools.wraps(save)
    def checked_save(obj, f, *args, **kwargs):
        if isinstance(f, (str, bytes, os.PathLike)):
            check(f)
        return save(obj, f, *args, **kwargs)

    torch.save = checked_save


def _start_trial() -> _Trial | None:
    spec_path = os.environ.get(TRIAL_ENV)
    if not spec_path:
        return None
    spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    if spec.get("mirror"):
        _keep_user_files(spec["mirror"], spec["cwd"], spec["own"])
    trial = _Trial(spec)
    previous_hook = sys.excepthook

    def hook(exc_type, exc, tb):
        names = tuple(f"{t.__module__}.{t.__qualname__}" for t in exc_type.__mro__)
        trial.write("error", error=f"{exc_type.__name__}: {exc}", error_type=exc_type.__name__, error_types=names)
        previous_hook(exc_type, exc, tb)

    sys.excepthook = hook
    atexit.register(lambda: trial.write("short", error=f"script ended after {trial.count} steps"))
    pids = spec.get("pids")
    if pids:  # a launcher may start its ranks in sessions of their own: the search kills them by these ids
        Path(pids).mkdir(parents=True, exist_ok=True)
        # "rank world_size": which ranks started, should none of them live to write a result
        Path(pids, str(os.getpid())).write_text(f"{trial.rank} {trial.world_size}", encoding="utf-8")
    if trial.search_pid is not None:
        _watch_search(trial.search_pid)
    return trial


WATCH_S = 0.5


def _own_peak_rss() -> int | None:
    """This process's peak resident memory in bytes, from Linux's VmHWM; None where there is no /proc.

    Not getrusage's ru_maxrss: Linux keeps that figure across exec, so a trial started by the search (a process
    of a few hundred MiB with libcst and Optuna loaded) would report at least the search's own size.
    """
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user's counts: it cannot be signalled, but it is there)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _watch_search(pid: int) -> None:
    """End this trial, and whatever it started, as soon as the search that launched it is gone (even SIGKILLed),
    or the launcher between them is.

    Without a launcher the search is this process's parent. Under one (torchrun's agent, mpirun) the parent is the
    launcher: its death also ends the trial, as a rank whose agent is gone has nobody left to stop it; and the
    search, which is no parent, is watched by its process id (a pidfd where the OS has them, so a search that died
    but was not reaped yet counts as gone).
    """
    import select
    import threading

    parent = os.getppid()
    fd: int | None = None
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(1)  # the search ended before this trial got this far
    except (AttributeError, OSError):  # no pidfds (not Linux 5.3+): poll the process id instead
        pass

    def search_alive() -> bool:
        if fd is not None:
            return not select.select([fd], [], [], WATCH_S)[0]  # readable once the process has ended
        time.sleep(WATCH_S)
        return pid_alive(pid)

    def watch() -> None:
        while os.getppid() == parent and search_alive():
            pass
        # the trial (or, under a launcher, this rank) runs in its own process group: take its workers along
        if hasattr(os, "killpg") and os.getpgrp() == os.getpid():
            os.killpg(os.getpgrp(), 9)
        os._exit(1)

    threading.Thread(target=watch, name="autotune-search-watch", daemon=True).start()


_trial = _start_trial()


def _copies(losses: tuple) -> tuple:
    # a copy, not a view: under CUDA graphs (compile's reduce-overhead) the loss lives in the graph's static output
    # buffer, which the next replay overwrites; clone() is queued on the device, no host sync
    return tuple(l.detach().clone() if hasattr(l, "detach") else l for l in losses)


def accumulate(*losses: Any) -> None:
    """Called by patched scripts after each micro-step's backward where the step hook cannot see the loss (it is
    bound only inside a gradient-accumulation loop); does nothing outside a trial."""
    if _trial is not None:
        _trial.accumulate(losses)


def step(*losses: Any, batch: Any = None) -> None:
    """Called by patched scripts after each optimizer step; does nothing outside a trial."""
    if _trial is not None:
        if not _save_checked:
            _wrap_torch_save()  # torch was imported without an import after it (the audit hook's other chance)
        _trial.step(losses, batch)
