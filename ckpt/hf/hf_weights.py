"""The safetensors weights of a Hugging Face model directory, as :mod:`ckpt.hf.hf_import` reads them:
every file inside the directory, every size of ``config.json`` checked against the tensors.

* Paths: ``config.json``, ``model.safetensors``, ``model.safetensors.index.json`` and every file
  the index's ``weight_map`` names must resolve (symlinks followed) inside the given directory;
  an entry such as ``../x.safetensors`` or a link to a file elsewhere is refused, naming it.
* Sizes: :func:`check_sizes` compares each size the import takes from ``config.json`` (layers,
  hidden size, heads, query groups, feed-forward size, vocabulary, positions; routed experts and
  their width) with the shapes the safetensors headers give (no tensor data read), before
  anything is planned or allocated: a config claiming ``num_hidden_layers=1000000000`` is
  refused, naming the field and what the weights hold.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ckpt.hf import mapping


class HFImportError(ValueError):
    """The HF model cannot be imported exactly (names the config field, tensor or file)."""


def confined(hf_dir: Path, name: str, what: str) -> Path:
    """``hf_dir / name``, refused unless it resolves (symlinks followed) inside ``hf_dir``.

    Args:
        what: how the path was named, for the error (e.g. ``"model.safetensors.index.json
            weight_map['lm_head.weight']"``).

    Raises:
        HFImportError: ``name`` is no string, or the path lies outside ``hf_dir`` (names
            ``what``, the path and the dir).
    """
    if not isinstance(name, str):
        raise HFImportError(f"{what} = {name!r}: a file name (a string) in the model "
                            f"directory, not a {type(name).__name__}")
    root = Path(hf_dir).resolve()
    path = Path(hf_dir) / name
    target = path.resolve()
    if not isinstance(name, str) or Path(name).is_absolute() or not target.is_relative_to(root):
        raise HFImportError(f"{what} = {name!r} resolves to {target}, outside the model "
                            f"directory {root}: only files inside it are read")
    return path


class Weights:
    """The safetensors tensors of an HF dir, read one at a time (``safe_open``).

    Raises (constructor):
        HFImportError: no weights, a weight file or index entry outside ``hf_dir``, an index
            that is not ``{"weight_map": {tensor name: file name}}``.
    """

    def __init__(self, hf_dir: Path):
        hf_dir = Path(hf_dir)
        index = hf_dir / "model.safetensors.index.json"
        if index.is_file():
            index = confined(hf_dir, index.name, "the index file")
            loaded = json.loads(index.read_text())
            weight_map = loaded.get("weight_map") if isinstance(loaded, dict) else None
            if not isinstance(weight_map, dict):
                raise HFImportError(f"{index}: no weight_map object (tensor name -> file name)")
            self.files = {k: confined(hf_dir, f, f"{index.name} weight_map[{k!r}]")
                          for k, f in weight_map.items()}
        elif (hf_dir / "model.safetensors").is_file():
            from safetensors import safe_open

            path = confined(hf_dir, "model.safetensors", "the weight file")
            with safe_open(str(path), "pt") as f:
                self.files = {k: path for k in f.keys()}
        else:
            raise HFImportError(f"{hf_dir} holds neither model.safetensors nor "
                                f"model.safetensors.index.json (only safetensors weights are "
                                f"imported)")
        self._meta = {}

    def leave_out(self, names) -> None:
        """Forget the tensors ``names`` (not read, not planned, not checked)."""
        for name in names:
            self.files.pop(name, None)

    def names(self) -> set:
        """Every tensor name of the weights."""
        return set(self.files)

    def get(self, name: str):
        """Tensor ``name`` (read whole). Raises HFImportError when absent."""
        from safetensors import safe_open

        if name not in self.files:
            raise HFImportError(f"the weights lack tensor {name!r}")
        with safe_open(str(self.files[name]), "pt") as f:
            return f.get_tensor(name)

    def meta(self, name: str) -> tuple[tuple, object]:
        """(shape, torch dtype) of tensor ``name``, from its file's header (no data read)."""
        if name not in self._meta:
            from safetensors import safe_open

            if name not in self.files:
                raise HFImportError(f"the weights lack tensor {name!r}")
            with safe_open(str(self.files[name]), "pt") as f:
                sl = f.get_slice(name)
                shape = tuple(sl.get_shape())
                dtype = torch_dtype(sl.get_dtype())
            self._meta[name] = (shape, dtype)
        return self._meta[name]


def torch_dtype(name: str):
    """The torch dtype of a safetensors dtype name (``F32``, ``BF16``, ``F16``, ``F64``)."""
    import torch

    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
              "F64": torch.float64}
    if name not in dtypes:
        raise HFImportError(f"safetensors dtype {name}: importable are {sorted(dtypes)}")
    return dtypes[name]


def check_sizes(arch, model: dict, vocab_size, weights: Weights, prefix: str) -> None:
    """Compare every size :mod:`ckpt.hf.hf_import` takes from ``config.json`` with the weights'
    tensor shapes (headers only), before anything is planned or allocated.

    Args:
        arch: the architecture's :class:`ckpt.families.HFImport` (its ``size_fields``,
            ``table``'s dims and ``layer``); model: the implied ``model`` fields
            (``num_layers``, ``hidden_size``, ``num_attention_heads``, ``num_query_groups``,
            ``ffn_hidden_size``, ``seq_length``, ``share_embeddings_and_output_weights``, and
            for routed experts ``num_moe_experts``, ``moe_ffn_hidden_size``);
        vocab_size: ``config.json``'s; prefix: the HF names' prefix (``"model."``, ...).

    Raises:
        HFImportError: a size that is not a positive integer, a layer count other than the
            layers the weights hold, heads that do not divide the hidden size or are not a
            multiple of the query groups, or a tensor whose shape another size gives (each names
            the ``config.json`` field, both of a product such as heads x head_dim, its value and
            what the weights hold); a tensor of the table the weights lack (named, before any
            routed expert's name is made of a count the weights do not confirm).
    """
    fields = arch.size_fields
    sizes = {"layers": model["num_layers"], "hidden": model["hidden_size"],
             "heads": model["num_attention_heads"], "ffn": model["ffn_hidden_size"],
             "vocab": vocab_size, "positions": model["seq_length"],
             "groups": model["num_query_groups"] or model["num_attention_heads"],
             # routed experts and their width (MoE families; "{e}" in a name: each expert)
             "experts": model.get("num_moe_experts"),
             "expert_ffn": model.get("moe_ffn_hidden_size")}
    own = arch.sizes(model) if arch.sizes is not None else {}
    sizes.update(own)  # the architecture's own (multi-latent attention's ranks, ...)
    for key, field in fields.items():
        value = sizes[key]
        if value is None and key in own:  # a part the model does not have (no shared expert)
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise HFImportError(f"config.json {field}={value!r}: a positive integer")
    layer = re.compile(re.escape(prefix) + arch.layer)
    held = sorted({int(m.group(1)) for m in map(layer.match, weights.names()) if m})
    dense = held == list(range(len(held)))  # layers 0 to n - 1 (nothing sized by the config)
    if not dense or len(held) != sizes["layers"]:
        what = (f"layers 0 to {held[-1]} ({len(held)} layers)" if dense and held
                else f"layers {held[:10]}")
        raise HFImportError(f"config.json {fields['layers']}={sizes['layers']}: the weights hold "
                            f"{what}")
    if sizes["hidden"] % sizes["heads"] and not model.get("kv_channels"):
        raise HFImportError(f"config.json {fields['heads']}={sizes['heads']}: does not divide "
                            f"{fields['hidden']}={sizes['hidden']}")
    if "groups" in fields and sizes["heads"] % sizes["groups"]:  # grouped query attention
        raise HFImportError(f"config.json {fields['groups']}={sizes['groups']}: does not divide "
                            f"{fields['heads']}={sizes['heads']}")
    # An explicit head width (config.json head_dim: kv_channels) or hidden / heads.
    sizes["head_dim"] = model.get("kv_channels") or sizes["hidden"] // sizes["heads"]
    names = weights.names()
    for entry in arch.table(model):
        for pattern, dims in mapping.sizes([entry], prefix).items():
            _check_shapes(entry, pattern, dims, sizes, fields, weights, names)


def _check_shapes(entry, pattern: str, dims, sizes: dict, fields: dict, weights: Weights,
                  names: set) -> None:
    """Every layer's (and routed expert's) tensor of ``pattern`` present, of the shape ``dims``
    gives at ``sizes`` (:func:`check_sizes`)."""
    # "{e}": one name per routed expert (a generator: the router, listed before the experts, has
    # already checked their number against the weights, or is missing and refused, so a crafted
    # expert count is never counted through)
    layers = entry.layers if entry.layers is not None else range(sizes["layers"])
    layer_experts = ((i, e) for i in (layers if "{i}" in pattern else (0,))
                     for e in (range(sizes["experts"]) if "{e}" in pattern else (0,)))
    for i, e in layer_experts:
        name = pattern.format(i=i, e=e)
        if name not in names:
            raise HFImportError(f"the weights lack tensor {name!r} (needed for megatron's "
                                f"{entry.megatron})")
        shape = tuple(weights.meta(name)[0])
        want = mapping.shape(dims, sizes)
        if shape == want:
            continue
        at = next((d for d in range(len(want)) if d >= len(shape) or shape[d] != want[d]), None)
        if at is None:  # the sizes agree, the tensor has more dims: no config field is wrong
            raise HFImportError(f"tensor {name!r} has shape {shape}, a {len(want)}-dim tensor "
                                f"{want} expected")
        key, factor = dims[at]
        field = f"{fields.get(key, key)}={sizes[key]}"
        if isinstance(factor, str):  # e.g. heads x head_dim: either may be the wrong one
            field += f" x {fields.get(factor, factor)}={sizes[factor]}"
        raise HFImportError(f"config.json {field}: tensor {name!r} has shape {shape}, the "
                            f"config implies {want}")
