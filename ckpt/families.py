"""The model families ckpt/ reads and writes, as the package above it gives them.

``ckpt/`` knows no family by name: what a family's Hugging Face formats look like (both ways) and
which of its stock-format checkpoint keys are GTP weights is a :class:`FamilyFormats` that the
package defining the family passes to :func:`install` (gtp-recipes does when
``recipes.families`` is imported), with the reader of a saved run config's padded vocab and the
reader of the family a recorded ``model`` config names. :mod:`ckpt.hf.hf_import`, :mod:`ckpt.hf.hf_export` and
:mod:`ckpt.stock` look them up here, so ``ckpt/`` never imports the package above it.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from ckpt.hf.hf_weights import HFImportError

# What install() was given: the families by name, the run-config vocab reader (or None) and the
# reader of a model config's family name (or None).
_GIVEN: dict = {"families": (), "run_config_vocab": None, "family_name": None}


class ExportError(ValueError):
    """The checkpoint cannot be exported (names what is missing or which architecture)."""


@dataclass(frozen=True)
class HFImport:
    """How :mod:`ckpt.hf.hf_import` reads one Hugging Face architecture.

    Attributes:
        fields: transformers config -> the ``model`` config dict (megatron field names); raises
            HFImportError naming the config field it cannot map exactly.
        table: ``model dict -> [entry, ...]`` (:mod:`ckpt.hf.mapping`), every tensor of the
            model (``lm_head`` included unless the embedding is shared): the import plan and
            the sizes checked (:func:`ckpt.hf.hf_weights.check_sizes`) are derived from it.
        prefixes: the HF names' prefix: the first that some tensor name starts with, else the
            first (``("transformer.", "")``: GPT-2 saved with or without its LM head).
        size_fields: ``{size key: config.json field}`` for the keys ``layers``, ``hidden``,
            ``heads``, ``ffn``, ``vocab`` and optionally ``positions``, ``groups`` (grouped
            query attention: heads must be a multiple of it), ``experts`` and ``expert_ffn``
            (routed experts: ``num_moe_experts``, ``moe_ffn_hidden_size``); the size keys of
            the table's dims.
        layer: regex after the prefix whose group 1 is a layer number (``r"h\\.(\\d+)\\."``).
        buffers: name endings of saved tensors that are not weights (skipped).
        sizes: ``model dict -> {size key: value}``, the architecture's size keys beyond the
            ones above (multi-latent attention's ranks, a shared expert's width), each also a
            key of ``size_fields``; None: none.
        left_out: ``transformers config -> n``: the weights may hold ``n`` layers after the
            decoder's (multi-token prediction layers, numbered from ``num_layers``) that the
            transformers class ignores on load and the import leaves out; None: none.
        left_out_names: ``weight names -> names``: more weights the import leaves out, by name
            (Qwen3-Next's ``mtp.*``, which transformers ignores on load); recorded in the
            checkpoint's import record; None: none.
    """

    fields: Callable[[Any], dict]
    table: Callable[[dict], list]
    prefixes: tuple[str, ...]
    size_fields: Mapping[str, str]
    layer: str
    buffers: tuple[str, ...] = ()
    sizes: Optional[Callable[[dict], dict]] = None
    left_out: Optional[Callable[[Any], int]] = None
    left_out_names: Optional[Callable[[set], list]] = None


@dataclass(frozen=True)
class HFArchitecture:
    """One Hugging Face architecture of a family.

    Attributes:
        model_type: config.json's ``model_type`` (``"llama"``), also the architecture's name.
        hf_class: the transformers class an export writes (``"LlamaForCausalLM"``).
        embedding: the exported state dict's name of the input embedding: its dtype is the
            model's, and a shared output layer (``lm_head``) is it.
        build: ``(tensors, model dict, vocab, token ids) -> (transformers config, state dict)``
            from the full logical tensors (per-layer ones stacked on dim 0), the unpadded vocab
            size and the bos/eos/pad ids; raises KeyError naming a missing tensor
            (:func:`ckpt.hf.mapping.builder` derives one from the import's table).
        imports: how it is imported, None when only exported.
        notes: ``model dict -> dict`` that an export records under ``notes`` in
            ``gtp_recipes_export.json`` (e.g. a config setting it had to write, and why);
            None: nothing to note.
        output_gate: its ``build`` maps the gate rows of gated attention
            (``attention_output_gate``); other architectures refuse such a model.
    """

    model_type: str
    hf_class: str
    embedding: str
    build: Callable[[dict, dict, int, dict], tuple]
    imports: Optional[HFImport] = None
    notes: Optional[Callable[[dict], dict]] = None
    output_gate: bool = False


@dataclass(frozen=True)
class FamilyFormats:
    """What gtp knows of one model family's formats.

    Attributes:
        name: the family (``"gpt"``).
        architectures: its Hugging Face architectures.
        architecture: ``model dict -> model_type`` of the architecture that computes a model of
            this family exactly (None: the model is not this family's); raises ExportError
            naming the setting no architecture of the family computes.
        gtp_patterns: ``(regex, kind)`` per GTP-sharded weight of its stock-format checkpoints
            (kinds ``vocab``, ``qkv``, ``proj``, ``fc1``, ``fc2``:
            :func:`ckpt.stock.specs.spec_for`).
        stored_logical: regexes of the keys its stock-format checkpoints store at their logical
            shape although they are not norms or biases (which the reader knows): weights
            megatron gathers over GTP before it saves them (Mamba's ``in_proj`` components),
            and params GTP never shards (Mamba's ``conv1d``, ``A_log``, ``D``, ``dt_bias``).
        sub_models: the key prefixes of a model made of sub-models with model dims of their own
            (LLaVA's ``language_model.``, ``vision_model.``, ``vision_projection.``): the stock
            reader gives each prefix's keys their own dims, from :attr:`sub_model_dims` where
            the checkpoint records the model config and from that prefix's tensors otherwise.
        sub_model_dims: ``recorded model config dict -> {prefix: dims}`` with the stock reader's
            dim names (``hidden_size``, ``ffn_hidden_size``, ``swiglu``,
            ``num_attention_heads``, ``num_query_groups``, ``kv_channels``: those that shape
            the GTP weights under that prefix); None for a model that is not this family's.
        sizes: ``recorded model config dict -> [(setting, value)]``: the family's fields that
            size a stored tensor or count stored tensors, where the config uses them (each
            bounded by the stored shapes before anything is enumerated from the config:
            :func:`ckpt.format.records.unbounded_size`); None: none beyond the shared ones.
    """

    name: str
    architectures: tuple[HFArchitecture, ...]
    architecture: Callable[[dict], Optional[str]]
    gtp_patterns: tuple[tuple[re.Pattern, str], ...] = ()
    stored_logical: tuple[re.Pattern, ...] = ()
    sub_models: tuple[str, ...] = ()
    sub_model_dims: Optional[Callable[[Mapping], Optional[dict]]] = None
    sizes: Optional[Callable[[Mapping], list]] = None


def install(formats, run_config_vocab: Optional[Callable[[Mapping, int], Optional[int]]] = None,
            family_name: Optional[Callable[[Mapping], str]] = None) -> None:
    """Give ckpt/ the model families it reads and writes: ``formats``, FamilyFormats (kept by
    name), ``run_config_vocab``, ``(saved run config mapping, tp) -> padded vocab rows or
    None``, through which :mod:`ckpt.stock` learns the vocab of a checkpoint that records only
    its run config (None: such a vocab stays unknown), and ``family_name``, ``recorded model
    config -> the name of its family``, which picks the family that exports a model (None:
    :func:`for_export` refuses). Replaces what was given before.

    Raises:
        TypeError: an entry that is not a FamilyFormats (names it).
    """
    found = []
    for formats_ in formats:
        if not isinstance(formats_, FamilyFormats):
            raise TypeError(f"{formats_!r} is a {type(formats_).__name__}, not a "
                            f"ckpt.families.FamilyFormats")
        found.append(formats_)
    _GIVEN.update(families=tuple(sorted(found, key=lambda f: f.name)),
                  run_config_vocab=run_config_vocab, family_name=family_name)
    gtp_patterns.cache_clear()
    stored_logical_patterns.cache_clear()


def families() -> tuple[FamilyFormats, ...]:
    """The families given to :func:`install`, by name.

    Raises:
        RuntimeError: :func:`install` was not called (a reader without the families would
            misread every family's keys and names).
    """
    if not _GIVEN["families"]:
        raise RuntimeError("no model families were given to ckpt/ (ckpt.families.install; "
                           "gtp-recipes gives them when recipes.families is imported)")
    return _GIVEN["families"]


def given_families() -> tuple[FamilyFormats, ...]:
    """The families given to :func:`install`, by name; () before it was called."""
    return _GIVEN["families"]


def run_config_vocab() -> Optional[Callable[[Mapping, int], Optional[int]]]:
    """The reader of a saved run config's padded vocab given to :func:`install`, or None."""
    return _GIVEN["run_config_vocab"]


def importable() -> list[str]:
    """The model_types :mod:`ckpt.hf.hf_import` reads, sorted."""
    return sorted(a.model_type for f in families() for a in f.architectures if a.imports)


def for_model_type(model_type: str) -> HFArchitecture:
    """The importable architecture of config.json's ``model_type``.

    Raises:
        HFImportError: no registered family imports it (names the importable types).
    """
    for f in families():
        for a in f.architectures:
            if a.model_type == model_type and a.imports is not None:
                return a
    raise HFImportError(f"config.json model_type={model_type!r}: importable are {importable()}")


def for_export(model: dict) -> HFArchitecture:
    """The architecture that computes the recorded ``model`` config exactly.

    Raises:
        ExportError: gated attention (``attention_output_gate``) for an architecture that does
            not map its gate rows (:attr:`HFArchitecture.output_gate`); the family the model
            names refuses a setting (its message), or is not registered, or no family-name
            reader was given.
    """
    if _GIVEN["family_name"] is None:
        raise ExportError("no reader of a model config's family was given to ckpt/ "
                          "(ckpt.families.install's family_name; gtp-recipes gives it when "
                          "recipes.families is imported)")
    name = _GIVEN["family_name"](model)  # the family the model names exports it
    family = next((f for f in families() if f.name == name), None)
    if family is None:
        raise ExportError(f"model.family={name!r} is not a registered model family: valid are "
                          f"{[f.name for f in families()]}")
    arch = family.architecture(model)
    if arch is None:
        raise ExportError(f"model.family={name!r}: the family exports no model of these fields "
                          f"(its own fields are unset)")
    found = next(a for a in family.architectures if a.model_type == arch)
    if model.get("attention_output_gate") and not found.output_gate:
        raise ExportError(f"model.attention_output_gate=True: no export maps the gate rows of the "
                          f"attention projection (gated attention) to {found.hf_class}")
    return found


@functools.cache
def gtp_patterns() -> tuple[tuple[re.Pattern, str], ...]:
    """Every family's ``(regex, kind)`` of GTP-sharded stock-format keys, in family order."""
    return tuple(p for f in families() for p in f.gtp_patterns)


@functools.cache
def stored_logical_patterns() -> tuple[re.Pattern, ...]:
    """Every family's regexes of stock-format keys stored at their logical shape
    (:attr:`FamilyFormats.stored_logical`)."""
    return tuple(p for f in families() for p in f.stored_logical)


def sub_model_dims(model_keys, model: Optional[Mapping]) -> dict:
    """``{prefix: recorded dims}`` of the sub-models of a checkpoint (:attr:`FamilyFormats.
    sub_models`) whose prefix some of ``model_keys`` (checkpoint model keys, strings) starts
    with; ``{}`` for a model of one set of dims. A prefix's dims are ``{}`` when ``model`` (the
    recorded ``model`` config dict, None when not recorded) does not give them.

    Raises:
        whatever a family's ``sub_model_dims`` raises for a malformed model config.
    """
    keys = list(model_keys)
    out: dict = {}
    for f in families():
        used = [p for p in f.sub_models if any(k.startswith(p) for k in keys)]
        if not used:
            continue
        recorded = (f.sub_model_dims(dict(model)) if f.sub_model_dims and model else None) or {}
        out.update({p: dict(recorded.get(p) or {}) for p in used})
    return out
