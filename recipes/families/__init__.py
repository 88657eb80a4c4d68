"""Model families: one folder per family, registered once in :data:`FAMILIES` and chosen by
name (``model.family``).

A family folder holds everything that makes the family: its own ``model`` fields
(``schema.py``, merged into the run's ``model`` schema), its config fields -> megatron's
``TransformerConfig``, its layer specs, the megatron module it builds, its parameter table (hence
its GTP weights and their TP-local dims), its Hugging Face mapping both ways and its stock-format
name patterns (``formats.py``, given to ``ckpt/`` below). ``docs/model-families.md`` says how to
add one.
"""

from __future__ import annotations

import json

from omegaconf import DictConfig, OmegaConf

from ckpt import families as checkpoint_formats
from recipes.config.errors import ConfigError
from recipes.families import gpt, hybrid, llava, moe
from recipes.families.family import ModelFamily
from recipes.families.formats import padded_vocab_of_config
from recipes.model.shapes import ParamShape, count, getter, padded_vocab_size, tp_local_shape

# The registration: a family is chosen by its name (model.family) among these.
FAMILIES: tuple[ModelFamily, ...] = (gpt.FAMILY, moe.FAMILY, hybrid.FAMILY, llava.FAMILY)
NAMES: tuple[str, ...] = tuple(f.name for f in FAMILIES)
# Each family's formats (its formats.py), in the order of FAMILIES.
FORMATS = tuple(f.formats for f in FAMILIES)


def family_name(m) -> str:
    """The family a ``model`` config (a config node, dict or dataclass) names in ``family``.

    A model config saved before ``model.family`` existed (every checkpoint, resolved config and
    export written before it) has no ``family``: its family is then the one its fields imply,
    as the families were told apart then. This is the only place that infers a family; a new
    family always comes with ``family`` set, so it never needs adding here.
    """
    get = getter(m)
    named = get("family")
    if named is not None:
        return str(named)
    if get("vision_model_type") is not None:
        return "llava"
    if get("hybrid_layer_pattern") is not None:
        return "hybrid"
    if get("num_moe_experts") is not None:
        return "moe"
    return "gpt"


def with_family(config: dict) -> dict:
    """A saved run config (a checkpoint's ``train_state.config``) with its model's family named:
    a run saved before ``model.family`` existed gets the family its model fields imply
    (:func:`family_name`), which a resume takes with those fields."""
    model = config.get("model")
    if not isinstance(model, dict) or "family" in model:
        return config
    return {**config, "model": {**model, "family": family_name(model)}}


def family_of(m) -> ModelFamily:
    """The family a ``model`` config names (:func:`family_name`).

    Raises:
        ConfigError: a name that is no registered family's (names the valid ones).
    """
    name = family_name(m)
    for f in FAMILIES:
        if f.name == name:
            return f
    raise ConfigError(f"model.family={name!r} is not a model family: valid are {list(NAMES)}")


def check_family_fields(m) -> None:
    """The ``model`` config's fields agree with the family it names: each field another family
    ``requires`` is null (unless this family takes that family's fields,
    ``ModelFamily.takes_fields_of``: its ``check`` judges them), and each this family requires
    is set (the family's ``check`` judges its value). Runs before the family's ``check``, so no
    family's rules name the fields of a family it does not take.

    Raises:
        ConfigError: one line naming the field, the family named and the family that takes it.
    """
    get, family = getter(m), family_of(m)
    taken = family.takes_fields_of
    for other in FAMILIES:
        for key in other.requires:
            value = get(key)
            if other is family and value is None:
                raise ConfigError(
                    f"model.family={family.name!r} needs model.{key} (it is {value!r}): set it, "
                    f"or choose another family (valid are {list(NAMES)})")
            if other is not family and value is not None and other.name not in taken:
                raise ConfigError(
                    f"model.{key}={value!r} is a field of the {other.name!r} family, not of "
                    f"model.family={family.name!r}: set model.family={other.name} or "
                    f"model.{key}=null")


# ckpt/ reads and writes these families' checkpoints (stock reader, Hugging Face import and
# export): given to it here, as values, so that it never imports this package.
checkpoint_formats.install(FORMATS, run_config_vocab=padded_vocab_of_config,
                           family_name=family_name)


def parameter_shapes(m, padded_vocab: int) -> list[ParamShape]:
    """Every parameter of the model ``m`` describes, module by module, without building it: the
    family's table (``ParamShape``: name as ``named_parameters()``, full logical shape, the dim
    TP splits, whether GTP shards it, whether it is a routed expert's).

    The pre-launch GTP checks, the dry run and the published parameter counts of the presets
    read it; a multi-process test compares it with built models at several layouts.

    The last few tables are kept, by the model's fields: a dry run reads a table several times,
    and DeepSeek-V3's has 30,428 entries."""
    if not isinstance(m, DictConfig):
        return family_of(m).parameter_shapes(m, padded_vocab)
    key = (json.dumps(OmegaConf.to_container(m, resolve=True), sort_keys=True), padded_vocab)
    if key not in _TABLES:
        _TABLES[key] = tuple(family_of(m).parameter_shapes(m, padded_vocab))
        while len(_TABLES) > _TABLES_KEPT:
            _TABLES.pop(next(iter(_TABLES)))
    return list(_TABLES[key])


_TABLES: dict = {}
_TABLES_KEPT = 4


def parameter_counts(m, padded_vocab: int) -> tuple[int, int]:
    """``(total, active)`` parameters of the model: active counts, of each MoE layer's routed
    experts, the ``moe_router_topk`` a token goes through (``topk / num_moe_experts`` of them),
    and everything else whole. Dense models: ``(total, total)``."""
    shapes = parameter_shapes(m, padded_vocab)
    total, experts = count(shapes), count([p for p in shapes if p.expert])
    if not experts:
        return total, total
    get = getter(m)
    topk, experts_per_layer = int(get("moe_router_topk")), int(get("num_moe_experts"))
    return total, total - experts + experts * topk // experts_per_layer


def gtp_weight_dims(cfg, tensor_model_parallel_size: int) -> dict[str, int]:
    """``{parameter name: TP-local dim 0}`` of every weight megatron shards over the GTP group,
    read from the family's parameter table (:func:`parameter_shapes`, its ``gtp`` entries).

    megatron-core 0.19.2 wraps the ``weight`` of every ``VocabParallelEmbedding``,
    ``ColumnParallelLinear`` and ``RowParallelLinear`` (``megatron.core.tensor_parallel.layers``,
    its ``wrap_module_params_gtp`` calls); never biases, norms or the position embedding. GTP
    slices the TP-local dim 0:

    - ``embedding.word_embeddings`` / ``output_layer`` (vocab rows): padded vocab / tp; the output
      layer has no weight of its own when embeddings and output weights are shared;
    - ``linear_qkv`` (column-parallel): (heads + 2 * query groups) * kv_channels / tp, with
      ``attention_output_gate`` heads * kv_channels more (a gate head per query head);
    - ``linear_fc1`` (column-parallel): ffn / tp, twice that with SwiGLU (gate and up rows);
    - ``linear_proj``, ``linear_fc2`` (row-parallel, TP splits dim 1): hidden, whatever the TP;
    - routed experts' ``linear_fc1`` / ``linear_fc2`` only under expert GTP
      (``gtp.expert_gtp_remat_size > 1``; megatron shards them over the expert GTP group), as one
      expert-parallel rank holds them, with expert tensor parallelism instead of TP.

    Names are those of ``named_parameters()`` (``recipes.model.gtp_setup.after_model`` checks the built
    model against this table). The vocab rows are left out when the tokenizer cannot be built
    from the config (other checks report that).
    """
    from ckpt.adapt.vocab import VOCAB_KEYS  # loads torch
    from recipes.data import build_tokenizer  # the tokenizers' start-up cost, only when asked

    m, tp = cfg.model, tensor_model_parallel_size
    try:
        vocab = padded_vocab_size(build_tokenizer(cfg.data).vocab_size,
                                  m.make_vocab_size_divisible_by, tp)
    except ValueError:
        vocab = None
    shapes = parameter_shapes(m, vocab or tp)
    dense = {p.name: tp_local_shape(p, tp)[0] for p in shapes
             if p.gtp and not p.expert and (vocab is not None or p.name not in VOCAB_KEYS)}
    return {**dense, **_expert_gtp_weight_dims(cfg, shapes, tp)}


def _expert_gtp_weight_dims(cfg, shapes: list[ParamShape], tp: int) -> dict[str, int]:
    """Routed-expert entries of :func:`gtp_weight_dims`: only under expert GTP
    (``gtp.expert_gtp_remat_size > 1``), named as one EP rank holds them
    (``local_experts.0 .. num_moe_experts / ep - 1``), dim 0 after expert tensor parallelism."""
    par = cfg.parallelism
    if cfg.gtp.get("expert_gtp_remat_size", 1) <= 1 or not cfg.model.get("num_moe_experts"):
        return {}
    etp = par.get("expert_tensor_parallel_size") or tp
    local = int(cfg.model.num_moe_experts) // int(par.get("expert_model_parallel_size", 1))
    out = {}
    for p in shapes:
        if p.expert and p.gtp and int(p.name.split(".local_experts.")[1].split(".")[0]) < local:
            out[p.name] = tp_local_shape(p, etp)[0]
    return out
