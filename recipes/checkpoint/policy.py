"""Checkpoint policy of a resume: which iteration to load, which save dir may be written, what
a resume may change.

The file format, the staged write and the run's lifecycle live in :mod:`ckpt.io`
(:class:`ckpt.io.manager.CheckpointManager`); this module decides. Before launch
:func:`prepare_resume` takes the resolved :class:`~ckpt.io.manager.ResumePlan`,
refuses a save dir that holds another run's checkpoints, compares the config with the
checkpoint's, prints the changes and pins the iteration; in the workers
:func:`agree_load_iteration` makes every rank load the iteration global rank 0 resolved.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import open_dict

from ckpt.format.records import IMPORTED_KEY, saved_layout
from ckpt import io as checkpoint
from ckpt.io import CheckpointError
from recipes.config.schema import given_fields, given_overrides, to_dict
from recipes.families import with_family
from ckpt.adapt.optim_kinds import optimizer_mismatch
from recipes.config.shape_fields import changed_shape_fields


class NothingToTrain(Exception):
    """The checkpoint to load is already at or past ``train.train_iters`` (not an error)."""


def is_rank0() -> bool:
    """Global rank 0, or the one process before launch: under torchrun/Slurm every rank runs the
    pre-launch checks, and only one may repair a save dir."""
    dist = sys.modules.get("torch.distributed")  # not imported before launch (start-up time)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def agree_load_iteration(ck) -> int | None:
    """Every rank's checkpoint to load: global rank 0's ``checkpoint.load`` and the iteration
    it resolves (unless the config pins it), broadcast, so a dir that another run is saving
    into, or a ``checkpoint.load=auto`` that each torchrun/Slurm rank resolved on its own while
    rank 0 repaired the dir, cannot give ranks different checkpoints. Sets ``ck.load`` to rank
    0's (every rank calls this: a collective). A pinned iteration (the launcher's
    :func:`prepare_resume` pins it) is taken as is: each rank's
    :meth:`~ckpt.io.manager.ResumePlan.open` checks it."""
    import torch

    from ckpt.io.manager import ResumePlan

    box = [None, None]
    if torch.distributed.get_rank() == 0:
        box[0] = ck.load
        if ck.load is not None and ck.load_iteration is not None:
            box[1] = int(ck.load_iteration)
        elif ck.load is not None:
            try:
                box[1] = ResumePlan.resolve_iteration(ck, repair=True)
            except CheckpointError as exc:
                box[1] = exc
    torch.distributed.broadcast_object_list(box, src=0)
    if isinstance(box[1], CheckpointError):
        raise box[1]
    if ck.load != box[0]:
        with open_dict(ck):
            ck.load = box[0]
    return box[1] if box[0] is not None else None


def check_save_dir(ck, load_iteration: int | None, auto: bool = False) -> None:
    """Refuse a ``checkpoint.save`` that cannot be written or that holds another run's saves.

    A dir is this run's to continue when it is also ``checkpoint.load`` and the iteration loaded
    is its newest complete save, or ``checkpoint.load=auto`` (``auto``) chose it (the newest of
    its lineage; another lineage's newer saves may sit beside it); else any complete save or tracker in it belongs to another run
    (a re-submitted job, a fork from an earlier iteration), and saving there would replace its
    checkpoints or move its tracker back, unless ``checkpoint.allow_existing_save=true``.

    Raises:
        CheckpointError: naming the dir, what it holds and the ways on.
    """
    if not ck.save:
        return
    root = Path(ck.save)
    _check_writable(root)
    if is_rank0():
        checkpoint.recover_replaced(root)
    saved = checkpoint.saved_iterations(root)
    tracked = checkpoint.tracked(root) if (root / checkpoint.TRACKER).exists() else None
    if not saved and tracked is None:
        return
    same_dir = ck.load is not None and Path(ck.load).resolve() == root.resolve()
    if same_dir and (auto or load_iteration == max(saved + [tracked or 0])):
        return
    if ck.get("allow_existing_save", False):
        return
    what = f"complete saves of iterations {saved}" + (f", tracker at {tracked}" if tracked is not None else "")
    newest = "checkpoint.load=auto resumes from its newest complete save" + (
        f", iteration {saved[-1]}" if saved else "")
    if same_dir:
        how = (f"it would save over iterations after {load_iteration}: {newest}; or save "
               f"elsewhere (checkpoint.save=OTHER_DIR)")
    else:
        how = (f"continue it ({newest}) or save elsewhere (checkpoint.save=OTHER_DIR)")
    raise CheckpointError(
        f"checkpoint.save={str(root)!r} already holds another run's checkpoints ({what}): {how}; "
        f"checkpoint.allow_existing_save=true saves into it anyway (a save of an existing "
        f"iteration replaces it once complete)")


def _check_writable(root: Path) -> None:
    """The save dir can be created and written (checked before the model is built)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write_probe.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise CheckpointError(f"checkpoint.save={str(root)!r} is not writable: {exc.strerror or exc}; "
                              f"set checkpoint.save to a writable dir") from None


# ---------------------------------------------------------------------------------------------
# What a resume may change
# ---------------------------------------------------------------------------------------------

# Changing any of these changes which samples the run sees (megatron's GPTDataset shuffle and
# sample boundaries depend on them).
DATA_FIELDS = ("train.seed", "model.seq_length", "data.source", "data.paths", "data.split",
               "data.tokenizer", "data.vocab_size", "data.eod_id", "data.jsonl_key",
               "data.chat_template", "data.chat_overlong", "data.chat_packing",
               "data.valid_paths", "data.chat_split", "data.chat_valid_split")
# Data fields newer than some checkpoints: absent from one's run config, they held these values.
ADDED_DATA_DEFAULTS = {"data.chat_template": None, "data.chat_overlong": "truncate",
                       "data.chat_packing": False, "data.valid_paths": [], "data.chat_split":
                       "train", "data.chat_valid_split": "validation"}
# megatron's OptimizerParamScheduler (and the optimizer's param-group keys) hold these.
SCHEDULE_FIELDS = ("optim.lr", "optim.min_lr", "optim.lr_warmup_iters", "optim.lr_decay_iters",
                   "optim.lr_decay_style", "optim.weight_decay")
# Adam's param-group hyper-parameters: torch's load_state_dict restores the checkpoint's, so they
# follow the lr schedule's policy (kept, or written after the load with the override).
ADAM_FIELDS = ("optim.adam_beta1", "optim.adam_beta2", "optim.adam_eps")
# Muon's param-group momentum: restored from the checkpoint like Adam's betas.
MUON_GROUP_FIELDS = ("optim.muon_momentum",)
KEPT_ON_RESUME = SCHEDULE_FIELDS + ADAM_FIELDS + MUON_GROUP_FIELDS
# Where outputs go and how the run logs: no effect on the saved state or the training.
_NEUTRAL = ("logger", "checkpoint", "output_dir", "data.cache_dir")
_RESHARD = ("weights and optimizer state resharded to the new layout at load (the distributed "
            "optimizer's each rank's new range); per-rank RNG states not restored")
# The layout fields (parallelism.*, GTP degrees and alignment): what changing each does.
LAYOUT_EFFECTS = {
    "parallelism.tensor_model_parallel_size": _RESHARD,
    "parallelism.pipeline_model_parallel_size": _RESHARD,
    "parallelism.virtual_pipeline_model_parallel_size": _RESHARD,
    "parallelism.context_parallel_size": _RESHARD + "; each sequence split over the new cp ranks",
    "parallelism.expert_model_parallel_size": _RESHARD + " (experts regrouped over the new ep)",
    "parallelism.expert_tensor_parallel_size": _RESHARD + " (experts' linears split anew)",
    "gtp.gtp_remat_size": _RESHARD,
    "gtp.expert_gtp_remat_size": _RESHARD,
    "gtp.pad_for_alignment": _RESHARD + " (padding rows re-laid; checkpoints hold none)",
    "parallelism.data_parallel_size": (
        "replicas changed; data.global_batch_size unchanged, so the same samples in the same "
        "order (micro-batches per replica change); " + _RESHARD),
    "parallelism.sequence_parallel": ("activations split over tp ranks or not; no effect on the "
                                      "saved state or the loss"),
    "parallelism.nproc_per_node": "processes started on this machine (the world size follows)",
}


@dataclass(frozen=True)
class Change:
    """One config field that differs from the checkpoint's run config."""

    field: str
    saved: object
    now: object
    effect: str


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _decay_iters(cfg: dict):
    return _get(cfg, "optim.lr_decay_iters") or _get(cfg, "train.train_iters")


def resume_changes(saved: dict, now: dict, consumed_samples: int) -> list[Change]:
    """Every field of ``now`` (the resolved run config) that differs from ``saved`` (the
    checkpoint's), with what it does on this resume.

    ``optim.lr_decay_iters`` is compared as the decay length it means (null: train.train_iters).
    """
    override = bool(_get(now, "optim.override_opt_param_scheduler"))
    flat_saved, flat_now = _flatten(saved), _flatten(now)
    for name, value in ADDED_DATA_DEFAULTS.items():
        flat_saved.setdefault(name, value)
    flat_saved["optim.lr_decay_iters"] = _decay_iters(saved)
    flat_now["optim.lr_decay_iters"] = _decay_iters(now)
    changes, shaped = [], changed_shape_fields(saved.get("model") or {}, now.get("model") or {})
    for name in sorted(set(flat_saved) | set(flat_now)):
        old, new = flat_saved.get(name), flat_now.get(name)
        if old == new or name.endswith(".name") or name.split(".")[0] in _NEUTRAL or name in _NEUTRAL:
            continue
        if name.startswith("optim.muon_") and _get(now, "optim.optimizer") != "muon":
            continue  # no effect on Adam (and absent from checkpoints older than optim=muon)
        if name in DATA_FIELDS and name not in flat_saved:
            effect = ("REFUSED: not recorded in the checkpoint, so the data it saw cannot be "
                      "compared (checkpoint.allow_data_change=true resumes with this value)")
        elif name in DATA_FIELDS:
            effect = "REFUSED: changes the data seen (checkpoint.allow_data_change=true allows it)"
        elif name == "data.global_batch_size":
            effect = (f"batches of {new} samples from sample {consumed_samples} on"
                      if consumed_samples % int(new) == 0 else
                      f"REFUSED: {consumed_samples} consumed samples are not a whole number of "
                      f"batches of {new} (checkpoint.allow_data_change=true allows it)")
        elif name in KEPT_ON_RESUME:
            effect = ("new value used (optim.override_opt_param_scheduler=true)" if override else
                      f"checkpoint's {old} kept (optim.override_opt_param_scheduler=true takes the new)")
        elif name == "precision.params_dtype":
            from ckpt.adapt import precision_change  # imports torch (start-up time)

            effect = precision_change.describe(old, new)
        elif name in LAYOUT_EFFECTS:
            effect = LAYOUT_EFFECTS[name]
        elif name == "train.train_iters":
            effect = "runs to the new end; samples already planned keep their order"
        elif name.startswith("gtp.") or name.removeprefix("model.") in shaped:
            effect = "checked against the checkpoint's tensors at load"
        elif name == "optim.override_opt_param_scheduler":
            effect = "lr schedule policy"
        else:
            effect = "used from now on"
        changes.append(Change(name, old, new, effect))
    return changes


def format_changes(changes: list[Change]) -> str:
    """The changes as an aligned text table (one header line, one line per field)."""
    rows = [("field", "checkpoint", "now", "effect")] + [
        (c.field, repr(c.saved), repr(c.now), c.effect) for c in changes]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"  {r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}"
                     for r in rows)


# What a resume takes from its run unless given (Megatron-LM's --use-checkpoint-args): of train,
# the data order, loss and eval a taken data.split needs; one tokenizer field given gives all 3.
TAKEN_FROM_CHECKPOINT = {"model": None, "data": None,
                         "train": ("seed", "calculate_per_token_loss", "eval_iters")}
_NOT_TAKEN, _TOGETHER = {"data": ("cache_dir",)}, {"data": ("tokenizer", "eod_id", "vocab_size")}


def take_checkpoint_fields(cfg, plan, overrides: list[str] | None = None) -> str | None:
    """Before validation, give a resume the checkpoint's model and data: each field of
    :data:`TAKEN_FROM_CHECKPOINT` that the command line does not give takes the value the
    checkpoint's run had, so a fine-tune (``checkpoint.pretrained`` chose its model and
    tokenizer, ``data=text data.paths=[...]`` its data) resumes at another layout by
    ``checkpoint.load=DIR`` alone. A given field keeps its value, which the checks that follow
    compare with the checkpoint's (:func:`recipes.config.prelaunch.check_model_shape`; a changed data
    field is refused unless ``checkpoint.allow_data_change``, :func:`prepare_resume`);
    ``model=NAME`` (``data=NAME``) or ``experiment=NAME`` gives every field of the group, and
    giving one tokenizer field gives all three. A saved value is data: only a plain value
    (number, bool, string without ``${``, null, or a list of them) of the field's type is taken.

    ``plan``: the resolved :class:`~ckpt.io.manager.ResumePlan` (None: no resume);
    ``overrides``: the command line's (default: Hydra's). Returns a note naming the fields taken
    that differed from this config's, or None.

    Raises:
        CheckpointError: ``plan`` is an import of a Hugging Face model (weights only: start
            from it with ``checkpoint.pretrained``), or its saved run config is not a mapping
            or holds a value that is not plain or not of the field's type (named).
    """
    if plan is None:
        return None
    if plan.common.get(IMPORTED_KEY):
        raise CheckpointError(
            f"checkpoint.load: {plan.path} is an import of a Hugging Face model (weights only: no "
            f"optimizer, schedule or data position to resume); start from it with "
            f"checkpoint.pretrained={Path(plan.path).parent} instead")
    config = (plan.common.get("train_state") or {}).get("config") or {}
    saved = with_family(_mapping(config, plan.path, "train_state.config"))
    overrides = given_overrides() if overrides is None else overrides
    if any(o.split("=", 1)[0].lstrip("+~") == "experiment" for o in overrides):
        return None
    taken = []
    with open_dict(cfg):
        for group, names in TAKEN_FROM_CHECKPOINT.items():
            given, chosen = given_fields(overrides, group)
            together = set(_TOGETHER.get(group, ()))
            given |= (together if given & together else set()) | set(_NOT_TAKEN.get(group, ()))
            if chosen or not saved.get(group):
                continue
            for key, value in _mapping(saved[group], plan.path, group).items():
                if ((names is None or key in names) and key in cfg[group] and key not in given
                        and cfg[group][key] != value):
                    assign_saved(cfg[group], key, value, plan.path, f"{group}.{key}")
                    if key != "name":  # the preset's label: no override needed
                        taken.append(f"{group}.{key}={spelled(value)}")
    if not taken:
        return None
    return f"> from {plan.path} (not given here): " + " ".join(taken)


def _mapping(value, path, what: str) -> dict:
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: its saved run config's {what} is a "
                              f"{type(value).__name__}, not a mapping: not a checkpoint of this "
                              f"project, or damaged")
    return value


def _plain(value) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, str):
        return "${" not in value  # an OmegaConf interpolation would run at resolve time
    return value is None or isinstance(value, (bool, int, float))


def assign_saved(node, key: str, value, path, name: str) -> None:
    """``node[key] = value`` for a value read from the checkpoint ``path`` (``name``: the
    dotted field, for the message).

    Raises:
        CheckpointError: ``value`` is not plain (:func:`_plain`) or not of the field's type.
    """
    from omegaconf.errors import OmegaConfBaseException

    if not _plain(value):
        raise CheckpointError(f"{path}: its saved run config has {name}={value!r}: not a plain "
                              f"value; refused (a checkpoint is data)")
    try:
        node[key] = value
    except (OmegaConfBaseException, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: its saved run config has {name}={value!r}, not a valid "
                              f"value ({type(exc).__name__}); give {name}=... on the command "
                              f"line") from None


def spelled(value) -> str:
    """A value as a Hydra override spells it (null, true/false)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(spelled(v) for v in value) + "]"
    return str(value)


def prepare_resume(cfg, parallel_dims, plan=None, auto: bool = False) -> None:
    """Pre-launch checks and decisions of a run that loads a checkpoint (and of every run's save
    dir). ``plan``: the :class:`~ckpt.io.manager.ResumePlan` of ``checkpoint.load``
    already resolved in this process (None: resolved here); ``auto``: ``checkpoint.load=auto``
    chose it (:func:`check_save_dir`). Updates ``cfg`` in place so the
    recorded config is what runs:
    ``checkpoint.load_iteration`` pinned to the iteration resolved now (every rank loads it) and,
    unless ``optim.override_opt_param_scheduler``, the lr schedule fields and Adam's betas and eps
    set to the checkpoint's (:data:`KEPT_ON_RESUME`).

    Raises:
        NothingToTrain: the checkpoint is at or past ``train.train_iters``.
        CheckpointError: the checkpoint cannot be loaded, the save dir is taken, a refused change
            (data, batch size, stock GTP format across layouts), naming the fields and the way on.
    """
    ck = cfg.checkpoint
    if plan is None and ck.load is not None:
        # Lazy (start-up time): megatron is imported before launch only by a run that loads.
        from ckpt.io.manager import ResumePlan

        plan = ResumePlan.resolve(ck, repair=is_rank0())
    iteration = None if plan is None else plan.iteration
    check_save_dir(ck, iteration, auto=auto)
    if iteration is None:
        return
    if iteration >= cfg.train.train_iters:
        raise NothingToTrain(
            f"nothing to train: {checkpoint.iter_dir(ck.load, iteration)} is at iteration "
            f"{iteration} and train.train_iters={cfg.train.train_iters}; raise train.train_iters "
            f"to continue (the checkpoint is left untouched)")
    common = plan.common
    _check_stock_format(cfg, parallel_dims, saved_layout(common), ck.load)
    saved = with_family(common["train_state"].get("config") or {})
    _check_optimizer(cfg, parallel_dims, saved, saved_layout(common), ck.load)
    consumed, now = int(common["train_state"].get("consumed_samples", 0)), to_dict(cfg)
    changes = resume_changes(saved, now, consumed) if saved else []
    refused = [c for c in changes if c.effect.startswith("REFUSED")]
    if changes and int(os.environ.get("RANK", "0")) == 0:
        print(f"> resuming from iteration {iteration} of {ck.load} with changed config:\n"
              + format_changes(changes), flush=True)
    if refused and not ck.get("allow_data_change", False):
        raise CheckpointError(
            "resuming would change the data the run sees: " + "; ".join(
                f"{c.field} {c.saved!r} -> {c.now!r}" if "not recorded" not in c.effect else
                f"{c.field} (not recorded in the checkpoint) -> {c.now!r}" for c in refused)
            + f" (the checkpoint's values are in {ck.load}; set them back, or "
              f"checkpoint.allow_data_change=true)")
    with open_dict(cfg):
        ck.load_iteration = iteration
        if saved and not cfg.optim.get("override_opt_param_scheduler", False):
            for name in KEPT_ON_RESUME:
                key = name.split(".")[1]
                if _get(saved, name) is None and name in ADAM_FIELDS + MUON_GROUP_FIELDS:
                    continue  # a checkpoint from before the field was recorded
                value = _decay_iters(saved) if key == "lr_decay_iters" else _get(saved, name)
                assign_saved(cfg.optim, key, value, ck.load, name)


def _check_optimizer(cfg, parallel_dims, saved: dict, saved_layout: dict, root) -> None:
    """Refuse a resume into another optimizer (Adam <-> Muon), and a Muon resume that changes
    ``precision.params_dtype``, before launch; warn when a Muon run in
    ``muon_tp_mode=blockwise`` (per-TP-shard orthogonalization) changes TP size.

    Raises:
        CheckpointError: naming both values and the ways on.
    """
    before = _get(saved, "optim.optimizer") or "adam"
    now = cfg.optim.optimizer
    if saved and before != now:
        raise CheckpointError(optimizer_mismatch(str(root), before, now, str(root)))
    dtype_then = _get(saved, "precision.params_dtype")
    if now == "muon" and dtype_then is not None and dtype_then != cfg.precision.params_dtype:
        raise CheckpointError(
            f"{root} is a Muon run in precision.params_dtype={dtype_then}; changing it to "
            f"{cfg.precision.params_dtype} on resume is not supported with optim.optimizer=muon "
            f"(megatron's chained Muon + Adam optimizer state); resume with "
            f"precision.params_dtype={dtype_then}")
    tp_then = saved_layout.get("tensor_model_parallel_size")
    tp_now = parallel_dims.tensor_model_parallel_size
    modes = {_get(saved, "optim.muon_tp_mode"), cfg.optim.get("muon_tp_mode")}
    if now == "muon" and "blockwise" in modes and tp_then not in (None, tp_now) and is_rank0():
        print(f"> warning: optim.muon_tp_mode=blockwise orthogonalizes each tensor-parallel "
              f"shard on its own, so this resume at tensor_model_parallel_size={tp_now} "
              f"(saved at {tp_then}) trains differently from the uninterrupted run; "
              f"optim.muon_tp_mode=duplicated gives the same update at any TP", flush=True)


def _check_stock_format(cfg, parallel_dims, saved_layout: dict, root) -> None:
    """megatron-core 0.19.2's stock GTP format reads files at the offsets of the run's own
    padding: it loads only a checkpoint saved at the same tp, gtp_remat_size and alignment."""
    if cfg.checkpoint.get("format", "logical") != "stock" or \
            max(parallel_dims.gtp_remat_size, parallel_dims.expert_gtp_remat_size) == 1:
        return
    keys = ("tensor_model_parallel_size", "gtp_remat_size", "pad_for_alignment",
            "expert_tensor_parallel_size", "expert_gtp_remat_size")
    mine = {k: getattr(parallel_dims, k) for k in keys}
    theirs = {k: saved_layout.get(k) for k in keys}
    if mine != theirs:
        raise CheckpointError(
            f"checkpoint.format=stock cannot load {root}: it was saved at {theirs}, this run "
            f"is {mine}, and the stock format would read its rows at shifted offsets; use "
            f"checkpoint.format=logical (loads any layout)")


def planned_samples(train_state: dict, iteration: int, saved_cfg: dict | None, cfg) -> list[int]:
    """Sample counts of the run's data segments, extended to cover ``cfg``'s train_iters.

    The first segment is the one the run was started with (``train_iters * global_batch_size``);
    a resume that runs longer adds a segment for the extra samples (built with the next seed)
    instead of resizing the first, whose shuffle would change (megatron's GPTDataset shuffles
    over the number of samples asked for). Kept in the checkpoint's train state as ``data_plan``.

    Args:
        train_state: the checkpoint's (``consumed_samples``, ``data_plan``), or ``{}``.
        iteration: the iteration loaded (0 for a fresh run).
        saved_cfg: the checkpoint's run config (None for a fresh run).
        cfg: this run's config.
    """
    plan = [int(n) for n in train_state.get("data_plan") or []]
    if not plan:
        first = saved_cfg or {}
        iters = _get(first, "train.train_iters") or cfg.train.train_iters
        gbs = _get(first, "data.global_batch_size") or cfg.data.global_batch_size
        plan = [int(iters) * int(gbs)]
    needed = int(train_state.get("consumed_samples", 0)) + (
        int(cfg.train.train_iters) - int(iteration)) * int(cfg.data.global_batch_size)
    if needed > sum(plan):
        plan.append(needed - sum(plan))
    return plan
