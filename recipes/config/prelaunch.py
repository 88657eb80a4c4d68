"""Checks of a composed config that run once, in ``train.py``'s process, before any worker starts.

:func:`check` adds to :func:`recipes.config.validate.validate` what needs the command line or the files
a run reads: keys added with ``+key`` that no schema has, unknown experiment names, the default
``parallelism.nproc_per_node``, warmup against the run length, the tokenizer, wandb credentials,
the documents each ``data.split`` share gets, and the model shape against the checkpoint to load.
Every refusal is a :class:`~recipes.config.validate.ConfigError` (``train.py`` exits 2) naming the value
and an override that works.
"""

from __future__ import annotations

import difflib
import json
import math
import netrc
import os
from dataclasses import fields, is_dataclass
from typing import Optional
from urllib.parse import urlparse

from ckpt.format.records import CHECKPOINT_FORMATS, unbounded_size
from recipes.families import family_name, parameter_shapes
from ckpt.verify import stored_shapes
from recipes.model import te
from ckpt.io import CheckpointError
from recipes.config.errors import ConfigError
from recipes.config.parallel_dims import ParallelDims, world_size_from_env
from recipes.config.schema import GROUPS, Config, TrainConfig
from recipes.config.shape_fields import changed_shape_fields
from recipes.config.validate import validate


def check(cfg, choices: Optional[dict] = None, plan=None) -> ParallelDims:
    """Validate ``cfg`` for launch; updates it in place (warmup clamp) so what runs is recorded.

    Args:
        cfg: the composed config (without the ``hydra`` node).
        choices: Hydra's ``runtime.choices`` (group -> option); None: taken from the running
            Hydra app when there is one.
        plan: the resolved :class:`ckpt.io.manager.ResumePlan` of ``checkpoint.load``
            (None: each check opens the checkpoint itself).

    Returns:
        The resolved :class:`ParallelDims` (:func:`recipes.config.validate.validate`).

    Raises:
        ConfigError: the first problem found.
        CheckpointError: as :func:`recipes.config.validate.validate`.
    """
    check_choices(_hydra_choices() if choices is None else choices)
    check_keys(cfg)
    check_checkpoint_format(cfg)
    check_transformer_impl(cfg)
    if plan is not None:  # before any check reads a size the resume took from the checkpoint
        check_saved_sizes(plan.path, plan.common, cfg.model)
    clamp_warmup(cfg)
    parallel_dims = validate(cfg, world_size_from_env(cfg), plan)
    check_tokenizer(cfg)
    check_wandb(cfg)
    if not cfg.train.get("dry_run", False):
        check_split(cfg)
        check_chat(cfg)
    if cfg.checkpoint.get("load") is not None:
        check_model_shape(cfg, plan)
    return parallel_dims


def _hydra_choices() -> dict:
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {}
    return dict(HydraConfig.get().runtime.choices)


def _group_options(group: str) -> Optional[list[str]]:
    from hydra.core.global_hydra import GlobalHydra

    if not GlobalHydra.instance().is_initialized():
        return None
    return GlobalHydra.instance().config_loader().get_group_options(group)


def check_transformer_impl(cfg) -> None:
    """``model.transformer_impl`` is null, "transformer_engine" or "local"
    (:data:`recipes.model.te.TRANSFORMER_IMPLS`)."""
    impl = cfg.model.get("transformer_impl")
    if impl is not None and impl not in te.TRANSFORMER_IMPLS:
        raise ConfigError(f"model.transformer_impl={impl!r}: valid are null, "
                          f"{', '.join(te.TRANSFORMER_IMPLS)} "
                          f"(the layer implementation the recipe targets; the dry run's attention)")


def check_choices(choices: dict) -> None:
    """``experiment=NAME`` names a file of ``conf/experiment`` (the group is optional, so Hydra
    skips an unknown name without a word)."""
    name = choices.get("experiment")
    if name is None:
        return
    valid = _group_options("experiment")
    if valid is not None and name not in valid:
        near = difflib.get_close_matches(str(name), valid, n=1)
        hint = f"did you mean experiment={near[0]}? " if near else ""
        raise ConfigError(f"experiment={name} does not exist: {hint}valid are {valid} "
                          f"(conf/experiment/*.yaml)")


def _schema_fields(schema) -> dict:
    return {f.name: f for f in fields(schema)}


def check_keys(cfg) -> None:
    """Every key of ``cfg`` is a field of its schema: ``+train.trian_iters=12`` (Hydra's own
    hint for a key it does not know) adds a key that nothing reads.

    Raises:
        ConfigError: naming the key and the nearest field.
    """
    unknown = _unknown_keys(cfg, Config, "")
    if not unknown:
        return
    key = unknown[0]
    parent, _, leaf = key.rpartition(".")
    schema = _schema_at(Config, parent)
    names = list(_schema_fields(schema)) if schema is not None else []
    near = [f"{parent}.{n}" if parent else n
            for n in difflib.get_close_matches(leaf, names, n=1, cutoff=0.6)]
    if not near:  # the right name in another group (train.micro_batch_size -> data.)
        everywhere = [f"{g}.{n}" for g, n in _all_fields()]
        near = [k for k in everywhere if k.rsplit(".", 1)[1] == leaf] or \
            difflib.get_close_matches(key, everywhere, n=1, cutoff=0.6)
    hint = (f"did you mean {near[0]}? (an existing field is set without '+': {near[0]}=...)"
            if near else f"valid keys of {parent or 'the config'}: {names}")
    raise ConfigError(f"{key} is not a config field (nothing reads it): {hint}")


def _all_fields():
    for group, schema in {**GROUPS, "train": TrainConfig}.items():
        for name in _schema_fields(schema):
            yield group, name


def _schema_at(schema, dotted: str):
    for part in filter(None, dotted.split(".")):
        f = _schema_fields(schema).get(part)
        schema = _field_schema(f) if f is not None else None
        if schema is None:
            return None
    return schema


def _field_schema(f):
    if f.name in GROUPS:
        return GROUPS[f.name]
    if f.default_factory is not None and is_dataclass(f.default_factory):  # type: ignore[misc]
        return f.default_factory
    return None


def _unknown_keys(node, schema, prefix: str) -> list[str]:
    from omegaconf import DictConfig

    out = []
    known = _schema_fields(schema)
    for key in node.keys() if isinstance(node, DictConfig) else node:
        name = f"{prefix}{key}"
        if key not in known:
            out.append(name)
            continue
        sub = _field_schema(known[key])
        value = node[key] if isinstance(node, DictConfig) else node.get(key)
        if sub is not None and hasattr(value, "keys"):
            out += _unknown_keys(value, sub, name + ".")
    return out


def check_checkpoint_format(cfg) -> None:
    """Refuse a ``checkpoint.format`` that is not one of :data:`ckpt.format.records.CHECKPOINT_FORMATS`,
    and one that disagrees with its old name ``gtp.checkpoint_layout`` (both typed, with
    different values: the config holds either one's value in both, ``recipes.config.schema``).

    Raises:
        ConfigError: naming both keys and the valid values.
    """
    new = cfg.checkpoint.get("format", "logical")
    old = cfg.gtp.get("checkpoint_layout", new)
    if new != old:
        raise ConfigError(f"checkpoint.format={new!r} and its old name gtp.checkpoint_layout={old!r} "
                          f"disagree: give one of them (checkpoint.format={old!r} or {new!r})")
    if new not in CHECKPOINT_FORMATS:
        raise ConfigError(f"checkpoint.format={new!r} (gtp.checkpoint_layout={old!r}): valid are "
                          f"{CHECKPOINT_FORMATS}")


def clamp_warmup(cfg, resume_settled: bool = False) -> None:
    """``optim.lr_warmup_iters`` at or past the decay length (``optim.lr_decay_iters``, default
    ``train.train_iters``; megatron's OptimizerParamScheduler asserts warmup < decay) is clamped
    to decay - 1 with a note. Before ``resume_settled`` it is left alone for a resume that takes
    its lr schedule from the checkpoint (``recipes.checkpoint.policy.prepare_resume`` sets it, then
    this runs again with ``resume_settled=True`` on the values that will run)."""
    from omegaconf import open_dict

    o, t = cfg.optim, cfg.train
    if not resume_settled and cfg.checkpoint.get("load") is not None and \
            not o.get("override_opt_param_scheduler", False):
        return
    if not isinstance(t.train_iters, int) or t.train_iters < 1:
        return  # validate names it
    decay = o.lr_decay_iters or t.train_iters
    if o.lr_warmup_iters < decay or decay < 1:
        return
    what = ("optim.lr_decay_iters" if o.lr_decay_iters else "train.train_iters") + f"={decay}"
    with open_dict(cfg):
        old, o.lr_warmup_iters = o.lr_warmup_iters, decay - 1
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"> note: optim.lr_warmup_iters={old} is not below {what} (megatron's lr scheduler "
              f"needs warmup < decay): warmup clamped to {decay - 1}; set "
              f"optim.lr_warmup_iters=N below {decay} to choose", flush=True)


def check_tokenizer(cfg) -> None:
    """``data.tokenizer`` builds (a path names a readable ``tokenizer.json``), and with image
    captions (``data.source=shapes``) ``model.seq_length`` holds the longest in its tokens."""
    from recipes.data import build_tokenizer, images

    try:
        tokenizer = build_tokenizer(cfg.data)
        if cfg.data.source == "shapes":
            images.check_seq_length(tokenizer, cfg.model.seq_length)
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError(str(exc)) from None


def _wandb_host() -> str:
    return urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or ""


def check_wandb(cfg) -> None:
    """``logger.mode=online`` has credentials: ``WANDB_API_KEY`` or a ``~/.netrc`` entry for the
    wandb host (what ``wandb login`` writes)."""
    lg = cfg.logger
    if not lg.get("wandb", False) or lg.get("mode") != "online" or os.environ.get("WANDB_API_KEY"):
        return

    host = _wandb_host()
    try:
        if netrc.netrc(os.environ.get("NETRC")).authenticators(host):
            return
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        pass
    raise ConfigError(f"logger.mode=online needs wandb credentials: WANDB_API_KEY is not set and "
                      f"~/.netrc has no entry for {host}; export WANDB_API_KEY=<key> (or run "
                      f"`wandb login`), or use logger.mode=offline or logger=none")


def document_counts(data_cfg) -> list[tuple[str, int]]:
    """``(what, documents)`` of each prefix the run will read, counted without tokenizing: a
    non-empty ``.txt`` file is one document, a ``.jsonl`` file one per non-blank line (all text
    files make one prefix), an indexed prefix its ``.idx`` count. pydoc and mock: none listed."""
    from recipes.data.corpus import check_indexed_paths, check_text_paths, sequence_lengths

    if data_cfg.source == "text":
        files, n = check_text_paths(data_cfg), 0
        for path in files:
            if path.endswith(".txt"):
                n += os.path.getsize(path) > 0
            else:
                with open(path, "rb") as f:
                    n += sum(1 for line in f if line.strip())
        return [(", ".join(str(p) for p in data_cfg.paths), n)]
    if data_cfg.source == "indexed":
        return [(p, int(sequence_lengths(p).size)) for p in check_indexed_paths(data_cfg)]
    return []


def check_chat(cfg) -> None:
    """``data=chat``: every conversation file's lines and the tokenizer's chat template
    (:func:`recipes.data.chat.check_chat_data`), and packing only where each token can attend
    within its own conversation: megatron's local attention (it takes the mask), no context
    parallelism, no Mamba layers; without ``data.valid_paths``, ``data.split`` gives the train
    split (and, with ``train.eval_iters`` > 0, the validation split) a conversation. ``data=text``
    with a chat-shaped ``.jsonl``: names ``data=chat``."""
    data = cfg.data
    if data.source == "text":
        return _check_not_chat(data)
    if data.source != "chat":
        return
    if data.chat_packing:
        why = None
        if cfg.model.get("transformer_impl") == "transformer_engine":
            why = ("model.transformer_impl=transformer_engine (packed sequences there need THD "
                   "packed_seq_params with cu_seqlens, not implemented): use "
                   "model.transformer_impl=local")
        elif int(cfg.parallelism.get("context_parallel_size", 1) or 1) > 1:
            why = "parallelism.context_parallel_size > 1 (the mask is not split over cp ranks)"
        elif cfg.model.get("hybrid_layer_pattern"):
            why = "a hybrid model (Mamba layers take no attention mask)"
        if why:
            raise ConfigError(f"data.chat_packing=true is refused with {why}; or set "
                              f"data.chat_packing=false")
    if data.chat_packing and not cfg.train.get("calculate_per_token_loss", False):
        print("> note: data.chat_packing=true with train.calculate_per_token_loss=false: each "
              "micro-batch's loss is its mean over its own answer tokens, so a token weighs more "
              "in a micro-batch with fewer; train.calculate_per_token_loss=true weighs every "
              "answer token alike", flush=True)
    from recipes.data.chat import check_chat_data
    from recipes.data.datasets import check_split_documents

    try:
        counts = check_chat_data(data)
        if not data.valid_paths:  # data.split's shares of the conversations, as of documents
            check_split_documents(counts["paths"], data.split, cfg.train.get("eval_iters", 0) > 0,
                                  "data.paths (a conversation is a document)")
    except (ValueError, OSError) as exc:
        more = ", or data.valid_paths=[<file.jsonl>]" if "validation split" in str(exc) else ""
        raise ConfigError(f"{exc}{more}") from None


def _check_not_chat(data) -> None:
    """A ``.jsonl`` of ``data=text`` whose first record has no ``data.jsonl_key`` but
    conversation fields is chat data: say so before launch."""
    for path in data.paths:
        if not str(path).endswith(".jsonl") or not os.path.isfile(str(path)):
            continue
        with open(str(path), "rb") as f:
            for lineno, line in enumerate(f, start=1):
                if line.strip():
                    break
            else:
                continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if (isinstance(record, dict) and data.jsonl_key not in record
                and ("messages" in record or "prompt" in record)):
            raise ConfigError(f"{path}:{lineno}: a conversation ({sorted(record)}), not text "
                              f"under data.jsonl_key={data.jsonl_key!r}: train on chat data with "
                              f"data=chat data.tokenizer=<HF tokenizer dir>")


def check_split(cfg) -> None:
    """Each prefix gives the train split (and, with ``train.eval_iters`` > 0, the validation
    split) at least one document (:func:`recipes.data.datasets.check_split_documents`)."""
    from recipes.data.datasets import check_split as check_weights, check_split_documents

    validation = cfg.train.get("eval_iters", 0) > 0
    try:
        check_weights(cfg.data.split)
        for what, n in document_counts(cfg.data):
            check_split_documents(n, cfg.data.split, validation, what)
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError(str(exc)) from None


def check_saved_sizes(path, common: dict, now) -> list[tuple]:
    """Every size of the checkpoint's saved run config and of this ``model`` config (``now``, a
    dict or config node) within what its ``.metadata`` stores
    (:func:`ckpt.format.records.unbounded_size`), checked before any parameter shape is enumerated
    from either (and, with ``plan``, before :func:`check` validates anything). Returns the
    stored tensors' global shapes.

    Raises:
        CheckpointError: naming the field and its value (one line).
    """
    from omegaconf import OmegaConf

    from ckpt.format import safe_metadata

    if not isinstance(now, dict):
        now = OmegaConf.to_container(now, resolve=True)
    try:
        shapes = stored_shapes(safe_metadata.read_metadata(path))
    except Exception as exc:  # noqa: BLE001 - a torn .metadata: the load names it
        raise CheckpointError(f"{path}/.metadata cannot be read ({type(exc).__name__}: "
                              f"{exc}); load another checkpoint") from None
    for problem in (unbounded_size(common, shapes),
                    unbounded_size({"train_state": {"config": {"model": now}}}, shapes,
                                   "this config")):
        if problem:
            raise CheckpointError(f"{path}: {problem}; load another checkpoint, or "
                                  f"checkpoint.load=null to start from scratch")
    return shapes


def check_model_shape(cfg, plan=None) -> None:
    """The checkpoint to load holds this model's parameter shapes (vocabulary aside, which
    ``recipes.config.validate`` checks): compared on the logical shapes of both configs, so a change of
    layout never counts. ``plan``: its resolved ``ResumePlan`` (None: opened here). A changed
    shape field is named from the two configs alone; otherwise every size of both configs is
    bounded by the stored shapes (:func:`check_saved_sizes`) before any shape is enumerated,
    and equal shapes may hold no more elements than the stored tensors.

    Raises:
        CheckpointError: naming each changed field with the checkpoint's value and the override;
            a size of either config larger than any stored dim (the field and value), or
            (shapes equal) more parameter elements than the checkpoint stores.
    """
    from omegaconf import OmegaConf

    from ckpt.io.manager import ResumePlan
    from recipes.checkpoint.policy import is_rank0, spelled
    if plan is None:
        plan = ResumePlan.resolve(cfg.checkpoint, repair=is_rank0())
    path, common = plan.path, plan.common
    saved = ((common.get("train_state") or {}).get("config") or {}).get("model")
    if not saved:
        return
    now = OmegaConf.to_container(cfg.model, resolve=True)
    changed = changed_shape_fields(saved, now)  # the fields alone: nothing enumerated
    if changed:
        # The saved family: named, or (a config saved before model.family) implied.
        saved = {**saved, "family": family_name(saved)}
        fixes = " ".join(f"model.{f}={spelled(saved.get(f))}" for f in changed)
        diffs = ", ".join(f"model.{f}={now.get(f)!r} (checkpoint: {saved.get(f)!r})"
                          for f in changed)
        raise CheckpointError(
            f"{path} holds a differently shaped model: {diffs}; set {fixes} to resume it, or "
            f"checkpoint.load=null to start from scratch")
    stored = check_saved_sizes(path, common, now)
    merged = OmegaConf.merge(now, saved)

    def shapes(m):
        return {p.name: tuple(p.shape) for p in parameter_shapes(m, 64)}

    mine, theirs = shapes(OmegaConf.create(now)), shapes(merged)
    if mine == theirs:  # the model built next: no larger than what the checkpoint stores
        total = sum(math.prod(s) for s in theirs.values())
        elements = sum(math.prod(s) for s in stored)
        if total > elements:  # every parameter is stored (the vocabulary at 64 rows here)
            raise CheckpointError(
                f"{path}: its saved run config's model has {total} parameter elements, more "
                f"than all {len(stored)} stored tensors hold ({elements}): damaged or crafted; "
                f"load another checkpoint, or checkpoint.load=null to start from scratch")
        return
    # a field outside the families' shape fields: name the parameters instead
    differ = sorted(set(mine) ^ set(theirs) | {k for k in set(mine) & set(theirs)
                                               if mine[k] != theirs[k]})
    raise CheckpointError(
        f"{path} holds a differently shaped model: parameters {differ[:4]} differ from this "
        f"config's; resume with the checkpoint's model fields (its resolved_config.yaml), "
        f"or checkpoint.load=null to start from scratch")
