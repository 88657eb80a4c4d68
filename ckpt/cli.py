"""``python -m gtp``: inspect, compare and convert checkpoints whatever layout wrote them.

Commands (CKPT: a checkpoint root holding ``latest_checkpointed_iteration.txt``, or an
``iter_XXXXXXX`` dir)::

    python -m gtp inspect CKPT [--layout SPEC]
        Saving layout, format, and for each tensor: logical shape, stored shape, GTP rows
        (TP-local rows L, padding, column/row-parallel, gated) and whether it is stored in the
        stock padded format of megatron-core 0.19.2; the optimizer step, with a warning when it
        is not the iteration minus the skipped iterations. Exit 0, or 2 when the checkpoint
        cannot be read exactly (the message says what is ambiguous).

    python -m gtp verify CKPT [--all]
        Read every byte of the checkpoint (the tracker's iteration of a root, every complete
        iteration with ``--all``) and check it (:mod:`ckpt.verify`): sizes, the CRC-32 of every
        record's zip entries, ``.metadata`` consistency, the common state, the tracker. Exit 0
        intact, 1 damaged (one line per problem, naming the file and the item), 2 error.

    python -m gtp compare CKPT_A CKPT_B [--layout-a SPEC] [--layout-b SPEC]
        Compare the logical tensors (model and optimizer; stock ones reconstructed), the
        iteration and the optimizer step bit for bit. Exit 0 equal, 1 different (names the first
        differing tensor and row), 2 error.

    python -m gtp convert SRC DST [--layout SPEC]
        Write SRC as a logical checkpoint under the root DST (loads at any layout, also into
        stock megatron-core without GTP). Exit 0, or 2 on error.

    python -m gtp export CKPT OUT [--layout SPEC] [--force]
        Write CKPT as a Hugging Face transformers model directory OUT, new or empty unless
        --force (which removes the weight files there first) (config.json +
        model.safetensors): GPT models as GPT2LMHeadModel, Llama-family ones as
        LlamaForCausalLM, MoE ones as MixtralForCausalLM or (with qk_layernorm)
        Qwen3MoeForCausalLM, hybrid Mamba ones as NemotronHForCausalLM (:mod:`ckpt.hf.hf_export`;
        the classes: :mod:`ckpt.families`). Needs the ``hf`` extra. Exit 0, or 2 on error.

    python -m gtp import HF_DIR OUT
        Write a Hugging Face model directory (GPT-2 or Llama family, safetensors) as a logical
        checkpoint under the root OUT, with the run config it implies (:mod:`ckpt.hf.hf_import`);
        train from it with ``train.py checkpoint.pretrained=OUT``. Exit 0, or 2 on error.

SPEC gives the saving layout of a checkpoint that does not record it, e.g.
``tp=2,gtp=2,pad=16,hidden_size=72,ffn_hidden_size=200,swiglu=false,padded_vocab_size=320``
(keys: :data:`ckpt.stock.LAYOUT_KEYS`).

Runs in one process without torchrun: reading tensor data needs ``torch.distributed``, so the
commands start (and end) a 1-process gloo group when none exists.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from pathlib import Path

from ckpt.hf import hf_export, hf_import
from ckpt.format import safe_objects
from ckpt import stock, verify
from ckpt.format.records import TRACKER, saved_layout
from mcore_compat import lazy_compile

EQUAL, DIFFERENT, ERROR = 0, 1, 2


def _quiet() -> None:
    """megatron / torch warn at import about optional GPU packages; keep the output readable."""
    for module in ("megatron", "torch", "torch.distributed", "torch.utils.cpp_extension"):
        warnings.filterwarnings("ignore", module=module)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    for name in ("megatron", "torch.utils.cpp_extension", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def _fmt_shape(shape) -> str:
    return str(tuple(int(d) for d in shape))


def _gtp_text(info) -> str:
    spec = info.gtp
    if spec is None:
        return "-"
    kind = "row-parallel" if spec.tp_axis == 1 else "column-parallel"
    extra = ", gated" if spec.gated else ""
    extra += ", singleton _w/_v" if spec.singleton_local_shards else ""
    return f"GTP {kind} L={spec.L}{extra}"


def cmd_inspect(args, out=sys.stdout) -> int:
    analysis = stock.analyze(args.ckpt, args.layout)
    common = analysis.common
    print(f"checkpoint: {analysis.path}", file=out)
    print(f"iteration: {common.get('iteration')}", file=out)
    print(f"format: {analysis.describe()}", file=out)
    rec = saved_layout(common)
    if rec is not None:
        print(f"recorded layout: {rec}", file=out)
        print(f"parallelism: {describe_parallelism(rec)}", file=out)
        print(f"optimizer: {describe_optimizer(rec, common)}", file=out)
    conv = common.get(stock.CONVERTED_KEY)
    if conv:
        print(f"converted by {conv.get('converted_by')} from {conv.get('source')} "
              f"(saved at {conv.get('saved_layout')})", file=out)
    if analysis.layout is not None and analysis.layout.g > 1 and analysis.layout.pad_for_alignment:
        print(f"padding: pad_for_alignment={analysis.layout.pad_for_alignment} "
              f"(alignment {analysis.layout.pad_for_alignment * analysis.layout.g} rows)", file=out)
    for note in analysis.notes:
        print(f"note: {note}", file=out)
    for line in describe_step(common):
        print(line, file=out)
    rows = []
    for key in _ordered(analysis.tensors):
        info = analysis.tensors[key]
        if info.stock:
            flag = f"STOCK stored {_fmt_shape(info.stored_shape)}"
        elif info.gtp is not None and analysis.format == "stock" and analysis.layout \
                and analysis.layout.g > 1:
            flag = "stock, same rows as logical"
        else:
            flag = "-"
        rows.append((key, _fmt_shape(info.logical_shape), _gtp_text(info), flag))
    widths = [max(len(r[i]) for r in rows + [("tensor", "logical shape", "GTP rows", "stock")])
              for i in range(4)]
    header = ("tensor", "logical shape", "GTP rows", "stock")
    for r in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip(), file=out)
    n_stock = sum(i.stock for i in analysis.tensors.values())
    print(f"{len(rows)} tensors, {n_stock} stored in the stock padded format", file=out)
    return 0


def describe_parallelism(rec: dict) -> str:
    """``tp2 x pp2 (vpp -) x gtp2 (pad 16) x dp1, world 4`` from a recorded layout (records
    written before pipeline parallelism lack pp/vpp: pp1), with ``+sp`` after tp under sequence
    parallelism, `` x cp2`` under context parallelism and ``; experts ep2 x etp1 x egtp2``
    when experts are laid out otherwise than the dense weights (records written before MoE lack
    those keys: none shown)."""
    g = rec.get("gtp_remat_size", 1)
    gtp = f"gtp{g} (pad {rec.get('pad_for_alignment', 0)})" if g > 1 else "gtp1"
    vpp = rec.get("virtual_pipeline_model_parallel_size")
    tp = rec.get("tensor_model_parallel_size", "?")
    sp = "+sp" if rec.get("sequence_parallel") else ""
    ep, etp = rec.get("expert_model_parallel_size", 1), rec.get("expert_tensor_parallel_size", tp)
    egtp = rec.get("expert_gtp_remat_size", 1)
    epad = f" (pad {rec.get('pad_for_alignment', 0)})" if egtp > 1 and g == 1 else ""
    experts = (f"; experts ep{ep} x etp{etp} x egtp{egtp}{epad}"
               if (ep, etp, egtp) != (1, tp, 1) else "")
    cp = rec.get("context_parallel_size", 1)
    return (f"tp{tp}{sp} x pp{rec.get('pipeline_model_parallel_size', 1)} (vpp {vpp or '-'}) x "
            f"{gtp}{f' x cp{cp}' if cp > 1 else ''} x dp{rec.get('data_parallel_size', '?')}, "
            f"world {rec.get('world_size', '?')}{experts}")


def optimizer_format(common: dict) -> str | None:
    """The distributed optimizer's checkpoint sharding type in ``common`` (``param_state_sharding_type``),
    None for megatron's non-distributed optimizer."""
    node = common.get("optimizer") or {}
    if node and all(isinstance(k, int) for k in node):
        node = node[min(node)]
    return node.get("param_state_sharding_type") if isinstance(node, dict) else None


def describe_optimizer(rec: dict, common: dict) -> str:
    """``distributed Adam (DistributedOptimizer, format fully_reshardable)`` or ``Adam``."""
    fmt = optimizer_format(common)
    if fmt is None and not rec.get("use_distributed_optimizer"):
        return "Adam (megatron's non-distributed optimizer; moments per model tensor)"
    return f"distributed Adam (megatron's DistributedOptimizer, format {fmt})"


def _ordered(keys):
    model = sorted(k for k in keys if not k.startswith("optimizer."))
    opt = sorted(k for k in keys if k.startswith("optimizer."))
    return model + opt


_INT_VIEW = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _bits(t):
    import torch

    t = t.detach().contiguous()
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view(getattr(torch, _INT_VIEW[t.element_size()]))


def _where(index: tuple, shape: tuple) -> str:
    """Human text for an element index: (layer l,) row r[, column c]."""
    if len(shape) == 1:
        return f"element {index[0]}"
    parts = [f"axis{i} {v}" if len(shape) > 3 else f"layer {v}" for i, v in enumerate(index[:-2])]
    parts.append(f"row {index[-2]}")
    return ", ".join(parts)


def first_difference(a, b):
    """None when ``a`` and ``b`` are equal bit for bit, else a description of the first
    difference: ``(where, detail)``."""
    import torch

    if tuple(a.shape) != tuple(b.shape):
        return "shape", f"shapes differ: {_fmt_shape(a.shape)} vs {_fmt_shape(b.shape)}"
    if a.dtype != b.dtype:
        return "dtype", f"dtypes differ: {a.dtype} vs {b.dtype}"
    diff = _bits(a) != _bits(b)
    if not bool(diff.any()):
        return None
    index = tuple(int(i) for i in torch.nonzero(diff)[0])
    n = int(diff.sum())
    rows = int(diff.reshape(-1, a.shape[-1]).any(dim=1).sum()) if a.dim() >= 2 else n
    where = _where(index, tuple(a.shape))
    col = f", column {index[-1]}" if a.dim() >= 2 else ""
    detail = (f"first difference at {where}{col}: {a[index].item()!r} vs {b[index].item()!r} "
              f"({n} elements in {rows} rows differ)")
    return where, detail


def cmd_compare(args, out=sys.stdout) -> int:
    an_a, ta = stock.read_logical(args.ckpt_a, args.layout_a)
    an_b, tb = stock.read_logical(args.ckpt_b, args.layout_b)
    print(f"A: {an_a.path}: {an_a.describe()}", file=out)
    print(f"B: {an_b.path}: {an_b.describe()}", file=out)
    ta, tb = _main_params_alike(ta, tb)
    only_a, only_b = sorted(ta.keys() - tb.keys()), sorted(tb.keys() - ta.keys())
    if only_a or only_b:
        print(f"DIFFERENT: tensors only in A: {only_a[:10]}; only in B: {only_b[:10]}", file=out)
        return DIFFERENT
    for key in _ordered(ta):
        found = first_difference(ta[key], tb[key])
        if found is not None:
            where, detail = found
            print(f"DIFFERENT: first differing tensor {key} at {where}: {detail}", file=out)
            return DIFFERENT
    state = []
    for name, get in (("iteration", lambda c: c.get("iteration")),
                      ("optimizer step", lambda c: _step(c))):
        va, vb = get(an_a.common), get(an_b.common)
        if va != vb:
            print(f"DIFFERENT: tensors equal, but {name} {va!r} (A) != {vb!r} (B)", file=out)
            return DIFFERENT
        state.append(f"{name} {va}")
    n_opt = sum(k.startswith("optimizer.") for k in ta)
    print(f"EQUAL: {len(ta)} logical tensors ({len(ta) - n_opt} model, {n_opt} optimizer) bit for "
          f"bit; {', '.join(state)}", file=out)
    return EQUAL


MAIN_PARAM = "optimizer.state.param."  # megatron's DistributedOptimizer (fully_reshardable)
FP32_PARAM = "optimizer.state.fp32_param."  # megatron's non-distributed bf16 optimizer


def _main_params_alike(ta: dict, tb: dict) -> tuple[dict, dict]:
    """Name the fp32 main params alike whichever optimizer wrote them: ``fp32_param`` keys become
    ``param`` keys; when only one side has main params and the other was an fp32 run (its
    main params are its weights), the weights stand in for them."""
    import torch

    def renamed(t):
        return {(MAIN_PARAM + k[len(FP32_PARAM):] if k.startswith(FP32_PARAM) else k): v
                for k, v in t.items()}

    ta, tb = renamed(ta), renamed(tb)
    for one, other in ((ta, tb), (tb, ta)):
        for key in [k for k in other if k.startswith(MAIN_PARAM) and k not in one]:
            weight = one.get(key[len(MAIN_PARAM):])
            if weight is not None and weight.dtype == torch.float32:
                one[key] = weight
    return ta, tb


def describe_step(common: dict) -> list[str]:
    """``optimizer step: ...`` and, when it is not the iteration minus the skipped iterations
    (``train_state.skipped_iterations``; 0 when not recorded), a ``warning:`` line: Adam's bias
    corrections then differ from an uninterrupted run's."""
    step = _step(common)
    if step is None:
        return []
    iteration = common.get("iteration")
    train_state = common.get("train_state") or {}
    skipped = train_state.get("skipped_iterations")
    expected = None if iteration is None else iteration - (skipped or 0)
    how = (f"iteration {iteration} - {skipped} skipped" if skipped is not None else
           f"iteration {iteration}, no skipped iterations recorded")
    lines = [f"optimizer step: {_fmt_step(step)} (expected {expected}: {how})"]
    steps = step if isinstance(step, list) else [step]
    if expected is not None and any(s != expected for s in steps):
        lines.append(f"warning: the optimizer step {_fmt_step(step)} is not the iteration minus "
                     f"the skipped iterations ({expected}): Adam's bias corrections differ from "
                     f"an uninterrupted run's from here on")
    return lines


def _fmt_step(step) -> str:
    if isinstance(step, list):
        return "differs between param groups: " + ", ".join(_fmt_step(s) for s in step)
    return str(int(step)) if isinstance(step, float) and step.is_integer() else str(step)


def _step(common):
    """The Adam ``step`` in the common state (a number, or a sorted list of the different
    values of a distributed optimizer's param groups); None when it holds none. A chained
    optimizer (a dict per index) gives the steps of all its optimizers."""
    opt = common.get("optimizer") or {}
    if opt and all(isinstance(k, int) for k in opt):
        steps = {s for k in sorted(opt) for s in _as_list(_one_step({"optimizer": opt[k]}))}
        steps.discard(None)
        return None if not steps else steps.pop() if len(steps) == 1 else sorted(steps)
    return _one_step(common)


def _as_list(step):
    return step if isinstance(step, list) else [step]


def _one_step(common):
    opt = common.get("optimizer") or {}
    if opt.get("param_state_sharding_type"):  # distributed optimizer: step in each param group
        steps = {_number(g.get("step"))
                 for g in opt.get("optimizer", {}).get("param_groups", [])}
        steps.discard(None)
        return None if not steps else steps.pop() if len(steps) == 1 else sorted(steps)
    if "state" not in opt:  # bf16: megatron's Float16 optimizer nests torch's state dict
        opt = opt.get("optimizer") or {}
    return _number((opt.get("state") or {}).get("common_step"))


def _number(step):
    import torch

    if isinstance(step, torch.Tensor):
        step = step.item()
    return None if step is None else float(step)


def cmd_verify(args, out=sys.stdout) -> int:
    dirs, problems = verify.iteration_dirs(args.ckpt, args.all)
    checked = []
    for path in dirs:
        report = verify.verify_iteration(path)
        problems += report.problems
        if not report.problems:
            checked.append(report)
    for report in checked:
        print(f"OK {report.summary()}", file=out)
    for problem in problems[:50]:
        print(f"DAMAGED {problem}", file=out)
    if problems:
        files = len({p.file for p in problems})
        print(f"{len(problems)} problem{'s' * (len(problems) > 1)} in {files} "
              f"file{'s' * (files > 1)}"
              + (" (the first 50 shown)" if len(problems) > 50 else ""), file=out)
        return DIFFERENT
    return EQUAL


def cmd_convert(args, out=sys.stdout) -> int:
    path = stock.convert(args.src, args.dst, args.layout)
    analysis = stock.analyze(path)
    print(f"wrote {path}: {analysis.describe()}", file=out)
    return 0


def cmd_export(args, out=sys.stdout) -> int:
    path = hf_export.export(args.ckpt, args.out, args.layout, force=args.force)
    meta = json.loads((path / "gtp_recipes_export.json").read_text())
    print(f"wrote {path}: {meta['architecture']}, vocab {meta['vocab_size']}, iteration "
          f"{meta['iteration']} of {meta['source']}", file=out)
    left = meta.get("not_exported")
    if left:
        print(f"note: {len(left['weights'])} weights not exported, {left['why']}", file=out)
    if not meta.get("tokenizer_files"):  # AutoTokenizer would fail, or build an unrelated one
        print(f"note: no tokenizer written: the run's data.tokenizer names no tokenizer.json "
              f"(external, or a path that is gone); copy the tokenizer its data was made with "
              f"into {path} before AutoTokenizer.from_pretrained", file=out)
    elif meta.get("chat_template_not_found"):  # else the tokenizer's own would pass for it
        print(f"note: the chat template the run trained with is not written: its "
              f"data.chat_template={meta['chat_template_not_found']!r} is not a file from here "
              f"(a relative path is read from where gtp export runs), so AutoTokenizer gets the "
              f"tokenizer's own template, if any; copy it to {path / 'chat_template.jinja'}, or "
              f"export from the run's directory", file=out)
    return 0


def cmd_import(args, out=sys.stdout) -> int:
    path = hf_import.import_hf(args.hf_dir, args.out)
    from megatron.core import dist_checkpointing

    model = dist_checkpointing.load_common_state_dict(str(path))["train_state"]["config"]["model"]
    print(f"wrote {path}: {model['name']}, {model['num_layers']} layers, hidden "
          f"{model['hidden_size']}; train from it with checkpoint.pretrained={args.out}", file=out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gtp",
        description="Inspect, compare, convert and export megatron checkpoints across parallel layouts "
                    "(GTP stock padded checkpoints of megatron-core 0.19.2 included).")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="saving layout and logical shape of every tensor")
    p.add_argument("ckpt")
    p.add_argument("--layout", default=None, help="saving layout, e.g. tp=2,gtp=2,pad=16")
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("verify", help="check every byte of a checkpoint (exit 0 intact, "
                                      "1 damaged, 2 error)")
    p.add_argument("ckpt")
    p.add_argument("--all", action="store_true",
                   help="every complete iteration of a checkpoint root, not only the tracker's")
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("compare", help="compare two checkpoints' logical tensors bit for bit "
                                       "(exit 0 equal, 1 different, 2 error)")
    p.add_argument("ckpt_a")
    p.add_argument("ckpt_b")
    p.add_argument("--layout-a", default=None)
    p.add_argument("--layout-b", default=None)
    p.set_defaults(func=cmd_compare)
    p = sub.add_parser("convert", help="write a checkpoint in the logical format")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--layout", default=None)
    p.set_defaults(func=cmd_convert)
    p = sub.add_parser("export", help="write a Hugging Face transformers model directory")
    p.add_argument("ckpt")
    p.add_argument("out")
    p.add_argument("--layout", default=None)
    p.add_argument("--force", action="store_true",
                   help="write into a dir that is not empty (the weight files there go)")
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("import", help="write a Hugging Face model directory as a checkpoint")
    p.add_argument("hf_dir")
    p.add_argument("out")
    p.set_defaults(func=cmd_import)
    return parser


def _refuse_crafted_metadata(path) -> None:
    """Read the ``.metadata`` a command will read (``path`` an iteration dir, or a root whose
    tracker names one) with the restricted reader first: a crafted one is refused here, once,
    rather than inside torch's loader, which logs each failed read with its traceback.

    Raises:
        ckpt.format.safe_metadata.UnsafeMetadataError: as :func:`ckpt.format.safe_metadata.read_metadata`.
    """
    from ckpt.format import safe_metadata

    if path is None:
        return
    where = Path(path)
    if not (where / ".metadata").is_file() and (where / TRACKER).is_file():
        tracked = (where / TRACKER).read_text().strip()
        where = where / f"iter_{int(tracked):07d}" if tracked.isdigit() else where
    if (where / ".metadata").is_file():
        safe_metadata.read_metadata(where)


def main(argv=None, out=None) -> int:
    """Run the CLI; returns the exit code (errors: message on stderr, code 2)."""
    _quiet()

    lazy_compile.install_if_supported()  # before megatron is imported: start-up time
    out = out or sys.stdout
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: usage errors exit 2 already
        return int(exc.code or 0)
    # torch DCP's CheckpointException derives from BaseException, not Exception.
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        safe_objects.install()  # no pickle of a checkpoint read by any command runs code
        if args.func is not cmd_verify:  # verify reports a crafted file as damage itself
            for name in ("ckpt", "ckpt_a", "ckpt_b", "src"):
                _refuse_crafted_metadata(getattr(args, name, None))
        return args.func(args, out=out)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - an error exit with its reason
        refused = safe_objects.refusal(exc)  # a crafted object or a stray common.pt: the cause
        exc = exc if refused is None else refused
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return ERROR
