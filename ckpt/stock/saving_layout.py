"""Stock checkpoints: resolve the saving layout and each GTP weight's row map.

The layout is the one recorded or given when ``tp``, ``gtp_remat_size`` and
``pad_for_alignment`` are all known; otherwise every layout of a small grid that explains every
stored shape, accepted only when they all read the same rows.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Mapping, Optional

from ckpt.families import families
from ckpt.stock.format import StockCheckpointError
from ckpt.stock.messages import (layout_help, explaining_layouts, fmt_dims, fmt_stored, layout_text,
                                missing_dims, safe_expected)
from ckpt.stock.rowmaps import candidate_Ls, expected_stored_rows, is_identity, row_map
from ckpt.stock.specs import (EXPERT_ITEMS, GRID_A, GRID_G, GRID_TP, Analysis, SavedLayout,
                             StoredCheckpoint, TensorInfo, TensorSpec, gtp_kind, is_routed_expert,
                             logical_rows_global, spec_for, split_key, strip_suffix)


def analyze_stock(ck: StoredCheckpoint) -> Analysis:
    """A stock checkpoint: resolve the saving layout, then each GTP weight's row map.

    Routed-expert weights are resolved on their own (:func:`_expert_view`): megatron splits them
    over the expert tensor parallel group and shards them over the expert GTP group, with the
    same ``pad_for_alignment``.
    """
    dense, experts = _dense_view(ck), _expert_view(ck)
    lay, source, plans, notes = _resolve(dense)
    expert_lay = None
    if experts.gtp_bases:
        try:
            expert_lay, esource, eplans, enotes = _resolve(experts)
        except StockCheckpointError as exc:
            raise StockCheckpointError(
                f"routed-expert weights (read with tp = expert_tensor_parallel_size (etp), gtp = "
                f"expert_gtp_remat_size (egtp), ffn_hidden_size = moe_ffn_hidden_size): {exc}"
            ) from None
        plans.update(eplans)
        notes += [f"routed experts: {n}" for n in enotes]
        if esource != source:
            source = f"{source}; routed experts: {esource}"
    infos, stock_any = _tensor_infos(ck.shapes, plans)
    if plans and not stock_any:
        notes.append("stored rows equal the logical rows (no padding, no gated GTP weight)")
    return Analysis(ck.path, ck.common, ck.format, lay, source, stock_any, infos, notes,
                    expert_lay)


def _dense_view(ck: StoredCheckpoint) -> StoredCheckpoint:
    """``ck`` without its routed-expert weights."""
    bases = {b: v for b, v in ck.gtp_bases.items() if not is_routed_expert(b)}
    return dataclasses.replace(ck, gtp_bases=bases)


def _expert_view(ck: StoredCheckpoint) -> StoredCheckpoint:
    """``ck``'s routed-expert weights, with the expert layout items and dims in the place of the
    dense ones (:data:`EXPERT_ITEMS`), so the dense machinery reads them."""
    bases = {b: v for b, v in ck.gtp_bases.items() if is_routed_expert(b)}
    items = {k: v for k, v in ck.items.items() if k not in EXPERT_ITEMS.values()}
    dims = {k: v for k, v in ck.dims.items() if k not in EXPERT_ITEMS.values()}
    for expert_key, dense_key in EXPERT_ITEMS.items():
        if expert_key in ck.items:
            items[dense_key] = ck.items[expert_key]
        if expert_key in ck.dims:
            dims[dense_key] = ck.dims[expert_key]
    # moe_ffn_hidden_size unset: megatron's experts are ffn_hidden_size wide
    dims.setdefault("ffn_hidden_size", ck.dims.get("ffn_hidden_size"))
    if dims["ffn_hidden_size"] is None:
        del dims["ffn_hidden_size"]
    # a record of the dense GTP weights does not describe the experts
    meta = ({**ck.meta, "tensors": {b: r for b, r in ck.meta_tensors.items() if b in bases}}
            if ck.meta else {})
    return dataclasses.replace(ck, gtp_bases=bases, items=items, dims=dims, meta=meta)


def _resolve(ck: StoredCheckpoint) -> tuple:
    """``(layout, source, {base: (spec, row map)}, notes)`` of the GTP weights of ``ck``."""
    notes: list[str] = []
    tp, g, a = (ck.items.get(k) for k in ("tensor_model_parallel_size", "gtp_remat_size",
                                          "pad_for_alignment"))
    if g is not None and g > 1 and ck.unknown:
        raise StockCheckpointError(
            f"{ck.path}: saved with GTP (gtp_remat_size={g}) and holds tensors ckpt.stock does not "
            f"know to be GTP-sharded or not: {ck.unknown[:5]}; read are the weights of the "
            f"registered model families ({', '.join(f.name for f in families())}: megatron's "
            f"local specs)")
    if g == 1 or (g is None and not ck.gtp_bases):
        return SavedLayout(tp or 1, 1, 0), ck.source, {}, notes

    if g is None and not ck.meta and _all_at_logical_size(ck):
        # Nothing says GTP was used and every GTP-able weight of known size is stored at its
        # logical size: nothing is padded, read as stored. (A gated fc1 written by stock GTP with
        # zero padding would look the same: pass the layout to rule that out.)
        notes.append("no layout recorded; every GTP-able weight of known size is stored at "
                     "its logical size: read as stored (assumed written without GTP)")
        return (SavedLayout(tp, 1, 0) if tp else None), ck.source + "; assumed no GTP", {}, notes

    if tp is not None and g is not None and a is not None:
        lay = SavedLayout(tp, g, a)
        source = ck.source
        plans = _plans_for_layout(ck, lay)
    else:
        candidates = [SavedLayout(t, gg, aa) for t, gg, aa in
                      itertools.product(GRID_TP if tp is None else (tp,),
                                        GRID_G if g is None else (g,),
                                        GRID_A if a is None else (a,))
                      if not (gg == 1 and aa)]
        viable = _viable_layouts(ck, candidates, tp)
        plans = _plans_agreed_by(ck, viable)
        lay = next(iter(viable))
        if len(viable) > 1:
            notes.append(f"layout not recorded; {len(viable)} layouts explain the stored shapes "
                         f"and all read the same rows (e.g. {layout_text(lay)})")
        source = f"inferred from the stored shapes ({len(viable)} equivalent layouts)"
    return lay, source, plans, notes


def _all_at_logical_size(ck: StoredCheckpoint) -> bool:
    """Some GTP-able weight has a known logical size, and every such weight is stored at it."""
    known_sizes = []
    for base, sub in ck.gtp_bases.items():
        kind = gtp_kind(base)
        rows = logical_rows_global(kind, ck.dims_for(base))
        if rows is None:
            continue
        want = ({"_w": rows // 2, "_v": rows // 2} if ("_w" in sub or "_v" in sub)
                else {"": rows})
        known_sizes.append({s: v[-2] for s, v in sub.items()} == want)
    return bool(known_sizes) and all(known_sizes)


def _options_for(ck: StoredCheckpoint, lay: SavedLayout) -> dict:
    """{base: (spec with L unset, kind, stored rows, [L explaining the stored rows])}."""
    opts = {}
    for base, sub in sorted(ck.gtp_bases.items()):
        stored_rows = {suf: shp[-2] for suf, shp in sub.items()}
        rec = ck.meta_tensors.get(base)
        if rec is not None:
            spec = TensorSpec(base, int(rec["L"]), int(rec["tp_axis"]), bool(rec["gated"]),
                              bool(rec.get("singleton_local_shards", False)), "meta")
            kind = gtp_kind(base)  # for messages only (None: not a known GPT weight)
        else:
            kind = gtp_kind(base)
            spec = spec_for(base, kind, ck.dims_for(base), lay.tp, "_w" in sub or "_v" in sub)
        Ls = [spec.L] if spec.L is not None else candidate_Ls(spec, lay, stored_rows)
        ok = []
        for L in Ls:
            try:
                if expected_stored_rows(spec, lay, L) == stored_rows:
                    ok.append(L)
            except ValueError:
                pass
        opts[base] = (spec, kind, stored_rows, ok)
    return opts


def _plans_for_layout(ck: StoredCheckpoint, lay: SavedLayout) -> dict:
    """{base: (spec, row map)} under the known saving layout ``lay``.

    Raises:
        StockCheckpointError: ``lay`` does not explain a weight's stored shape, or leaves its
            logical size open.
    """
    plans = {}
    for base, (spec, kind, stored_rows, ok) in _options_for(ck, lay).items():
        if len(ok) == 1:
            spec = dataclasses.replace(spec, L=ok[0])
            plans[base] = (spec, row_map(spec, lay)[0])
        elif not ok and spec.L is not None:
            expl = (explaining_layouts(spec, ck.dims_for(base), stored_rows, kind) if kind
                    else "")
            raise StockCheckpointError(
                f"{ck.path}: {base} is stored with shape {fmt_stored(base, ck.gtp_bases[base])}, "
                f"but the layout {lay.describe()} [{ck.source}] with its logical size (TP-local "
                f"dim 0 L={spec.L}{', gated' if spec.gated else ''}) gives dim 0 "
                f"{safe_expected(spec, lay)}. Layouts that explain this stored shape: "
                f"{expl or 'none in the searched grid'}; check the checkpoint's "
                f"layout record and run config, or {layout_help(ck.sub_dims)}")
        else:
            raise StockCheckpointError(
                f"{ck.path}: {base} is stored with shape {fmt_stored(base, ck.gtp_bases[base])}; "
                f"under {lay.describe()} [{ck.source}] its logical size is "
                f"{'ambiguous' if ok else 'unexplained'}: "
                f"TP-local dim 0 L could be any of {ok or 'none'}, and each reads different "
                f"rows. The checkpoint does not record {missing_dims(kind)}; "
                f"{layout_help(ck.sub_dims)}")
    return plans


def _viable_layouts(ck: StoredCheckpoint, candidates: list, tp: Optional[int]) -> dict:
    """{layout: its :func:`_options_for`} for each candidate that explains every GTP weight.

    Raises:
        StockCheckpointError: none does (names the weight the fewest candidates explain and the
            layouts explaining it).
    """
    options = {cand: _options_for(ck, cand) for cand in candidates}
    viable = {cand: opts for cand, opts in options.items() if all(o[3] for o in opts.values())}
    if not viable:
        # The weight that rules out the most candidates (none explain it where one rules out
        # all): the first in sorted order may be one every layout explains.
        explained = {b: sum(bool(opts[b][3]) for opts in options.values()) for b in ck.gtp_bases}
        base = min(sorted(ck.gtp_bases), key=explained.get)
        sub = ck.gtp_bases[base]
        kind = gtp_kind(base)
        spec = spec_for(base, kind, ck.dims_for(base), tp or 1, "_w" in sub or "_v" in sub)
        expl = explaining_layouts(spec, ck.dims_for(base), {s: v[-2] for s, v in sub.items()},
                                  kind)
        raise StockCheckpointError(
            f"{ck.path}: no layout explains every stored GTP weight (the saving layout is not "
            f"fully recorded; known from: {ck.source}; model dims "
            f"{fmt_dims(ck.dims_for(base))}). {base} is stored with shape "
            f"{fmt_stored(base, sub)}; layouts explaining it: "
            f"{expl or 'none in the searched grid'}. {layout_help(ck.sub_dims)}")
    return viable


def _plans_agreed_by(ck: StoredCheckpoint, viable: dict) -> dict:
    """{base: (spec, row map)} on which every viable layout agrees (those of the first one).

    Raises:
        StockCheckpointError: the viable layouts read different rows for a weight, or leave its
            logical size open.
    """
    names = [layout_text(c) for c in viable]
    listed = ", ".join(names[:10]) + (f" ... ({len(names) - 10} more)" if len(names) > 10 else "")
    first_lay = next(iter(viable))
    plans = {}
    for base in sorted(ck.gtp_bases):
        per = {c: opts[base] for c, opts in viable.items()}
        Ls = {L for (_, _, _, ok) in per.values() for L in ok}
        multi = any(len(o[3]) > 1 for o in per.values())
        maps = {}
        if not multi and len(Ls) == 1:
            for c, (spec, _, _, ok) in per.items():
                spec = dataclasses.replace(spec, L=ok[0])
                maps[c] = (spec, row_map(spec, c)[0])
            distinct = {repr(m[1]) for m in maps.values()}
            if len(distinct) == 1:
                plans[base] = maps[first_lay]
                continue
            other = next(c for c in maps if maps[c][1] != maps[first_lay][1])
            raise StockCheckpointError(
                f"{ck.path}: the saving layout (tp, gtp_remat_size, pad_for_alignment) is neither "
                f"recorded nor given ({ck.source}) and is ambiguous: "
                f"{base} stored with shape {fmt_stored(base, ck.gtp_bases[base])} is explained "
                f"by {len(viable)} layouts that read different rows for it: {listed} (e.g. "
                f"{layout_text(first_lay)} vs {layout_text(other)}); "
                f"{layout_help(ck.sub_dims)}")
        kind = next(iter(per.values()))[1]
        raise StockCheckpointError(
            f"{ck.path}: the saving layout (tp, gtp_remat_size, pad_for_alignment) is neither "
            f"recorded nor given ({ck.source}) and {base} stored with "
            f"shape {fmt_stored(base, ck.gtp_bases[base])} is ambiguous: its TP-local dim 0 L "
            f"could be any of {sorted(Ls)[:12]} under the layouts {listed}, and each reads "
            f"different rows. The checkpoint does not record {missing_dims(kind)}; "
            f"{layout_help(ck.sub_dims)}")
    return plans


def _tensor_infos(shapes: Mapping[str, tuple], plans: Mapping) -> tuple[dict, bool]:
    """A :class:`TensorInfo` per stored key, and whether any is stored in the stock format."""
    infos = {}
    stock_any = False
    for key, shape in shapes.items():
        prefix, model_key = split_key(key)
        base, suffix = strip_suffix(model_key)
        if base in plans:
            spec, rowmap = plans[base]
            identity = is_identity(rowmap)
            pre, cols = shape[:-2], shape[-1]
            if spec.singleton_local_shards:
                out_rows = len(rowmap[suffix])
                logical = (*pre, out_rows, cols)
            else:
                logical = (*pre, len(rowmap[""]), cols)
            info = TensorInfo(key, shape, logical, spec,
                              not identity or tuple(logical) != tuple(shape), rowmap, base)
            stock_any |= info.stock
            infos[key] = info
        else:
            infos[key] = TensorInfo(key, shape, shape)
    return infos, stock_any
