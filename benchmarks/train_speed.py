"""Training speed and per-rank memory at GTP degree g=1, g=2 and g=4, on CPU.

    python -m benchmarks.train_speed                          # tiny and gpt125m, g 1 2 4, 2 repeats
    python -m benchmarks.train_speed --quick                  # tiny only
    python -m benchmarks.train_speed --models tiny --g 1 2    # world size 2 (max g)
    python -m benchmarks.train_speed --repeats 3 --out outputs/bench

Every g runs at the same world size (``--world``, default the largest g) and the same global
batch, so g=1 is tp1 x dp<world> and g=2 is tp1 x gtp2 x dp<world/2>: the same math, GTP trading
parameter memory for an all-gather per weight in forward and backward and a reduce-scatter per
weight gradient. Each measurement is one launch of a worker group (torch's elastic launcher, as
``train.py``) that builds the model, optimizer and data through ``recipes.run.worker.setup``, runs
``--warmup`` untimed and ``--iters`` timed ``recipes.run.loop.train_step`` calls (barrier before and
after each), and reports every rank's parameter bytes (GTP shards include their padding rows),
Adam-state bytes and resident memory: ``ru_maxrss`` (the process's lifetime peak, imports
included: a fresh process per launch) and the RSS peak and increase during the timed steps
(sampled every 1 ms, ``benchmarks.memory``). glibc's default heap keeps most freed blocks, so
the step peak of those launches also counts memory that was used once and freed; with
``--memory`` (default) each g is launched once more per repeat with freed memory returned to
the OS (``benchmarks.memory.MALLOC_ENV``: slower steps, not timed) and that step peak, the
largest rank's, is the memory figure compared with g1. Each g > 1 also runs with megatron's
GTP overlap off (``--in-order``) and with gloo's own ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` in place of ``gtp.backend``'s point-to-point exchanges
(``--gloo-collectives``). Launches are interleaved (g1 g2 g4 g1 g2 g4 ...) so that drifting
machine load hits every case alike; the table shows medians over repeats of each launch's
median step time, and one line per target (g2 and g4 against g1).

Cases: ``tiny`` (2 layers, hidden 72; data=mock, micro batch 4, global batch 16) and ``gpt125m``
(12 layers, hidden 768, ffn 3072, byte vocab: ~85M parameters; seq 64, micro batch 1, global
batch = world size, so one micro-batch per rank). Figures depend on the machine and its load;
the targets are printed, not enforced. Output: the table and the target lines on stdout and
``<out>/results.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import sys
import time
import uuid
from pathlib import Path

from benchmarks import runs, tables
from benchmarks.memory import MALLOC_ENV

REPO = runs.REPO

# model case -> (config overrides, timed iterations, warmup iterations); {world} is filled in.
CASES: dict[str, tuple[list[str], int, int]] = {
    "tiny": (["model=tiny", "data=mock"], 10, 2),
    "gpt125m": (["model=gpt125m", "model.seq_length=64", "data=mock", "data.micro_batch_size=1",
                 "data.global_batch_size={world}"], 3, 1),
}
DEFAULT_PAD = 16


# --------------------------------------------------------------------------------------------
# Worker side: one rank of one launch.
# --------------------------------------------------------------------------------------------
def _worker(cfg_path: str, out_path: str) -> None:
    import torch
    from megatron.core import parallel_state
    from omegaconf import OmegaConf

    from recipes.data import build_train_iterator
    from recipes.run.loop import train_step
    from recipes.config.validate import validate
    from recipes.run.worker import init_distributed, setup

    from benchmarks.memory import PeakRSS, max_rss

    threads = int(os.environ.get("BENCH_THREADS", "0"))
    if threads > 0:
        torch.set_num_threads(threads)
    if os.environ.get("BENCH_GTP_COLLECTIVES") == "gloo":
        from gtp import backend

        backend.GLOO_PEER_EXCHANGE = False  # gloo's own all-gather and reduce-scatter
    cfg = OmegaConf.load(cfg_path)
    init_distributed()
    parallel_dims = validate(cfg, torch.distributed.get_world_size())
    tokenizer, model, optimizer, scheduler = setup(cfg, parallel_dims)
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    dp_rank, dp_size = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    data = build_train_iterator(cfg, 0, dp_rank, dp_size, tokenizer=tokenizer)
    num_micro = cfg.data.global_batch_size // (cfg.data.micro_batch_size * dp_size)
    times, losses = [], []
    sampler = PeakRSS()
    for i in range(cfg.bench.warmup + cfg.bench.iters):
        if i == cfg.bench.warmup:
            sampler.start()
        torch.distributed.barrier()
        start = time.perf_counter()
        metrics = train_step(model, optimizer, scheduler, data, num_micro, cfg)
        torch.distributed.barrier()
        times.append(time.perf_counter() - start)
        losses.append(metrics["lm loss"])
    sampler.stop()

    def nbytes(tensors):
        return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))

    from math import prod

    from megatron.core.tensor_parallel.generalized_tensor_parallelism import is_gtp_param

    # One torch optimizer, or megatron's chain (Muon + Adam; dense + experts): every state
    # tensor counts.
    inners = [getattr(o, "optimizer", o)
              for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    mine = {
        "rank": torch.distributed.get_rank(),
        "param_bytes": nbytes(model.parameters()),
        "param_numel": sum(p.numel() for p in model.parameters()),
        # Logical elements this rank's TP slice holds (GTP shards counted unsharded, unpadded):
        # at tp1 the model's parameter count.
        "logical_param_numel": sum(prod(p._unsharded_shape) if is_gtp_param(p) else p.numel()
                                   for p in model.parameters()),
        "optimizer_state_bytes": sum(nbytes(s.values()) for inner in inners
                                     for s in inner.state.values()),
        "step_times": times[cfg.bench.warmup:],
        "max_rss": max_rss(),
        "rss_before_steps": sampler.base,
        "rss_peak_steps": sampler.peak,
    }
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)
    if torch.distributed.get_rank() == 0:
        Path(out_path).write_text(json.dumps({
            "layout": parallel_dims.describe(), "ranks": every, "losses": losses,
            "tokens_per_step": cfg.data.global_batch_size * cfg.model.seq_length,
        }))
    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


# --------------------------------------------------------------------------------------------
# Launcher side.
# --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _environ(values: dict[str, str]):
    """Set ``values`` in os.environ (the launched workers inherit it) and restore it after."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def bench_config(overrides: list[str], run_dir: Path, cache: Path, iters: int, warmup: int):
    """The resolved run config of one benchmark case (Hydra compose, as train.py would build it):
    ``overrides`` plus no checkpoints, no logger, ``warmup + iters`` iterations without lr
    warmup, and a ``bench`` node with ``iters`` and ``warmup`` for the worker."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from recipes.config.schema import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[
            *overrides, "checkpoint=none", "logger=none", f"output_dir={run_dir}",
            f"data.cache_dir={cache}", f"train.train_iters={warmup + iters}",
            "optim.lr_warmup_iters=0",
        ])
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain["bench"] = {"iters": iters, "warmup": warmup}
    return OmegaConf.create(plain)


def prepare_run(parser, args, name: str) -> tuple[int, Path, int]:
    """``(world, out_dir, threads)`` of a GTP-degree benchmark's ``args`` (``--world``,
    ``--g``, ``--out``, ``--threads``): the out dir is created, and ``BENCH_THREADS``,
    ``PYTHONPATH`` and ``PYTHONWARNINGS`` are set for the launched ranks.

    Raises:
        SystemExit: (``parser.error``) a ``--g`` that does not divide the world size."""
    world = args.world or max(args.g)
    bad = [g for g in args.g if g < 1 or world % g]
    if bad:
        parser.error(f"--g {bad}: every GTP degree must divide the world size {world}")
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    return world, runs.prepare_out(args.out, name, threads), threads


def compose_config(model: str, g: int, world: int, pad: int, run_dir: Path, cache: Path,
                   overlap: bool = True, extra: tuple[str, ...] = ()):
    """The resolved run config of one case (:func:`bench_config`); ``overlap=False``:
    megatron's GTP prefetch and async reduce-scatter off (in order); ``extra``: more overrides,
    applied last (e.g. ``optim=muon``)."""
    overrides, iters, warmup = CASES[model]
    gtp = ["gtp=off"] if g == 1 else ["gtp=tp2_align16", f"gtp.gtp_remat_size={g}",
                                      f"gtp.pad_for_alignment={pad}"]
    if g > 1 and not overlap:
        gtp += ["gtp.weight_prefetch=false", "gtp.async_reduction=false"]
    return bench_config([*(o.format(world=world) for o in overrides), *gtp, "parallelism=dp2",
                         f"parallelism.nproc_per_node={world}", *extra],
                        run_dir, cache, iters, warmup)


def launch(cfg, run_dir: Path, world: int, module: str = "benchmarks.train_speed") -> dict:
    """Run one worker group of ``python -m MODULE --worker CONFIG RESULT``; return rank 0's
    result dict (or ``{"error": ...}``). Each launch is a fresh set of processes."""
    from omegaconf import OmegaConf
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from recipes.config.validate import validate

    validate(cfg, world)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path, out_path = run_dir / "config.yaml", run_dir / "result.json"
    cfg_path.write_text(OmegaConf.to_yaml(cfg))
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=str(uuid.uuid4()),
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.5,
        start_method="spawn",
    )
    log = run_dir / "log.txt"
    try:
        with open(log, "w") as f:
            sys.stdout.flush()
            sys.stderr.flush()
            old_out, old_err = os.dup(1), os.dup(2)
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
            try:
                elastic_launch(config, sys.executable)(
                    "-m", module, "--worker", str(cfg_path), str(out_path))
            finally:
                os.dup2(old_out, 1)
                os.dup2(old_err, 2)
                os.close(old_out)
                os.close(old_err)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        return {"error": f"rank {rank} failed (exit {failure.exitcode}); see {log}"}
    return json.loads(out_path.read_text())


def median_step(result: dict) -> float:
    return statistics.median(result["ranks"][0]["step_times"])


def launch_case(cfg, run_dir: Path, world: int, label: str) -> dict:
    """:func:`launch` one case of this worker and print ``  <label>: <median step or error>``;
    return its result."""
    result = launch(cfg, run_dir, world)
    what = result.get("error") or f"median step {1000 * median_step(result):.1f} ms"
    print(f"  {label}: {what}", flush=True)
    return result


# How a g > 1 case runs its GTP collectives: megatron's overlap on (the default), off, or on
# with gloo's own all-gather / reduce-scatter instead of gtp.backend's point-to-point exchanges.
MODES = {"overlapped": "overlapped", "in_order": "in order", "gloo": "gloo's collectives"}


def summarize(model: str, g: int, results: list[dict], mode: str = "overlapped",
              memory: list[dict] | None = None) -> dict:
    ok = [r for r in results if "error" not in r]
    if not ok:
        return {"model": model, "g": g, "mode": mode,
                "error": results[0]["error"] if results else "no run"}
    step = statistics.median(median_step(r) for r in ok)
    ranks = ok[0]["ranks"]
    return {
        "model": model, "g": g, "mode": mode, "layout": ok[0]["layout"],
        "runs": len(ok),
        "model_parameters": ranks[0].get("logical_param_numel"),
        "median_step_s": step, "tokens_per_sec": ok[0]["tokens_per_step"] / step,
        "step_s_per_run": [median_step(r) for r in ok],
        "param_bytes_per_rank": [r["param_bytes"] for r in ranks],
        "optimizer_state_bytes_per_rank": [r["optimizer_state_bytes"] for r in ranks],
        "peak_rss_bytes_per_rank": [r.get("max_rss") for r in ranks],
        # Median over launches of the largest rank's RSS peak during the timed steps; from the
        # speed launches (glibc's default allocator) and the memory launches (MALLOC_ENV).
        "rss_peak_during_steps": _median_peak(ok),
        "rss_peak_during_steps_returned": _median_peak(memory or []),
        "rss_increase_during_steps_per_rank": [
            r["rss_peak_steps"] - r["rss_before_steps"] if "rss_peak_steps" in r else None
            for r in ranks],
        "final_loss": ok[0]["losses"][-1],
    }


def _mib(values) -> str:
    return " / ".join(f"{v / 2**20:.3f}" if v < 2**20 * 10 else f"{v / 2**20:.1f}" for v in values)


def format_table(rows: list[dict]) -> str:
    head = ["model", "g", "collectives", "layout", "tokens/s", "step ms", "vs g1",
            "vs in order", "vs gloo's collectives", "param MiB per rank", "Adam state MiB per rank",
            "peak RSS MiB per rank", "RSS peak in steps MiB, max rank (vs g1)",
            "same, freed memory returned (vs g1)"]
    g1 = {r["model"]: r for r in rows if r.get("g") == 1 and "error" not in r}
    other_mode = {(r["model"], r["g"], r.get("mode")): r["tokens_per_sec"] for r in rows
                  if "error" not in r}

    def peak_cell(r, key):
        value, base = r.get(key), (g1.get(r["model"]) or {}).get(key)
        if not value:
            return "-"
        return f"{value / 2**20:.0f}" + (f" ({value / base:.2f}x)" if base else "")

    cells = []
    for r in rows:
        mode = "-" if r["g"] == 1 else MODES[r.get("mode", "overlapped")]
        if "error" in r:
            cells.append([r["model"], str(r["g"]), mode, "error: " + r["error"],
                          *[""] * (len(head) - 4)])
            continue
        base = g1.get(r["model"])
        ratio = r["tokens_per_sec"] / base["tokens_per_sec"] if base else None
        main = r.get("mode", "overlapped") == "overlapped"
        in_order = other_mode.get((r["model"], r["g"], "in_order")) if main else None
        gloo = other_mode.get((r["model"], r["g"], "gloo")) if main else None
        cells.append([
            r["model"], str(r["g"]), mode, r["layout"], f"{r['tokens_per_sec']:.0f}",
            f"{1000 * r['median_step_s']:.1f}", f"{ratio:.2f}x" if ratio else "-",
            f"{r['tokens_per_sec'] / in_order:.2f}x" if in_order else "-",
            f"{r['tokens_per_sec'] / gloo:.2f}x" if gloo else "-",
            _mib(r["param_bytes_per_rank"]), _mib(r["optimizer_state_bytes_per_rank"]),
            " / ".join(f"{v / 2**20:.0f}" for v in r["peak_rss_bytes_per_rank"] if v),
            peak_cell(r, "rss_peak_during_steps"), peak_cell(r, "rss_peak_during_steps_returned"),
        ])
    return tables.table(head, cells)


def _step_peak(result: dict) -> int | None:
    """The largest resident set any rank of one launch reached during the timed steps (bytes)."""
    values = [r.get("rss_peak_steps") for r in result.get("ranks", []) if r.get("rss_peak_steps")]
    return max(values) if values else None


def _median_peak(results: list[dict]) -> int | None:
    peaks = [p for p in (_step_peak(r) for r in results if "error" not in r) if p]
    return int(statistics.median(peaks)) if peaks else None


# The targets of the GTP speed and memory work (gpt125m), printed beside the figures (not
# enforced). g: (tokens/s vs g1 >=, peak RSS in steps vs g1 <=).
TARGET_MODEL = "gpt125m"
TARGETS = {2: (0.90, 0.75), 4: (0.85, None)}


def verdicts(rows: list[dict]) -> list[str]:
    """One line per (model, g) with a target: the overlapped run's tokens/s and the step RSS
    peak (from the memory launches, freed memory returned) as ratios of the same model's g1,
    each beside its target, met or missed; the default allocator's RSS ratio beside it."""
    lines = []
    g1 = {r["model"]: r for r in rows if r.get("g") == 1 and "error" not in r}
    for r in rows:
        base = g1.get(r["model"])
        if ("error" in r or r["model"] != TARGET_MODEL or r.get("mode") != "overlapped"
                or r["g"] not in TARGETS or base is None):
            continue
        speed_target, rss_target = TARGETS[r["g"]]
        speed = r["tokens_per_sec"] / base["tokens_per_sec"]
        parts = [f"tokens/s {speed:.2f}x of g1 (target >= {speed_target}: "
                 f"{'met' if speed >= speed_target else 'missed'})"]
        mine, theirs = r.get("rss_peak_during_steps_returned"), base.get(
            "rss_peak_during_steps_returned")
        if rss_target is not None and mine and theirs:
            ratio = mine / theirs
            parts.append(f"peak RSS in steps {ratio:.2f}x of g1 (target <= {rss_target}: "
                         f"{'met' if ratio <= rss_target else 'missed'})")
            if r.get("rss_peak_during_steps") and base.get("rss_peak_during_steps"):
                parts[-1] += (f", {r['rss_peak_during_steps'] / base['rss_peak_during_steps']:.2f}x"
                              " with glibc's default allocator (freed memory kept in its heap)")
        lines.append(f"{r['model']} g{r['g']}: " + "; ".join(parts))
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.train_speed",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--g", nargs="+", type=int, default=[1, 2, 4], help="GTP degrees")
    runs.add_run_args(parser, "tiny model only (2 repeats)",
                      repeats_help="launches per case (interleaved; default 2)")
    parser.add_argument("--world", type=int, default=None, help="processes (default: max g)")
    parser.add_argument("--pad", type=int, default=DEFAULT_PAD, help="pad_for_alignment at g>1")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per rank (default: CPU cores / world, at least 1)")
    parser.add_argument("--in-order", action=argparse.BooleanOptionalAction, default=True,
                        help="also run each g > 1 with megatron's GTP overlap off (weight "
                             "prefetch, async reduce-scatter), side by side (default on)")
    parser.add_argument("--gloo-collectives", action=argparse.BooleanOptionalAction, default=True,
                        help="also run each g > 1 with gloo's own all_gather_into_tensor and "
                             "reduce_scatter_tensor instead of gtp.backend's point-to-point "
                             "exchanges, side by side (default on)")
    parser.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True,
                        help="also launch each g once per repeat with freed memory returned to "
                             "the OS (benchmarks.memory.MALLOC_ENV) for the step RSS peak: "
                             "glibc's default heap keeps freed blocks (default on)")
    parser.add_argument("--worker", nargs=2, metavar=("CONFIG", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(*args.worker)
        return 0

    if args.quick and args.models == list(CASES):
        args.models = ["tiny"]
    args.repeats = args.repeats or 2
    world, out, threads = prepare_run(parser, args, "train_speed")
    print(f"> train_speed: models {args.models}, g {args.g}, world {world}, {threads} torch "
          f"thread(s) per rank, {args.repeats} interleaved repeats; writing {out}", flush=True)

    # (g, mode): every g overlapped, and each g > 1 in order (--in-order) and with gloo's own
    # collectives (--gloo-collectives) too;
    cases = [(g, "overlapped") for g in args.g]
    cases += [(g, "in_order") for g in args.g if g > 1 and args.in_order]
    cases += [(g, "gloo") for g in args.g if g > 1 and args.gloo_collectives]
    # and each g again for memory (--memory), overlapped, with MALLOC_ENV.
    cases = [(g, mode, False) for g, mode in cases]
    cases += [(g, "overlapped", True) for g in args.g if args.memory]
    raw: dict[tuple[str, int, str], list[dict]] = {}
    memory: dict[tuple[str, int], list[dict]] = {}
    for model in args.models:
        for rep in range(args.repeats):
            for g, mode, for_memory in cases:  # interleaved: g1 g2 g2-in-order g1-memory ...
                tag = (f"g{g}" + ("" if mode == "overlapped" else f"_{mode}")
                       + ("_memory" if for_memory else ""))
                run_dir = out / "runs" / f"{model}_{tag}_r{rep}"
                cfg = compose_config(model, g, world, args.pad, run_dir, out / "cache",
                                     overlap=mode != "in_order")
                env = {**(MALLOC_ENV if for_memory else {}),
                       "BENCH_GTP_COLLECTIVES": "gloo" if mode == "gloo" else "peer"}
                t0 = time.perf_counter()
                with _environ(env):
                    result = launch(cfg, run_dir, world)
                if for_memory:
                    memory.setdefault((model, g), []).append(result)
                else:
                    raw.setdefault((model, g, mode), []).append(result)
                what = result.get("error") or (
                    f"median step {1000 * median_step(result):.1f} ms, final loss "
                    f"{result['losses'][-1]:.4f}")
                print(f"  {model} {tag} run {rep + 1}/{args.repeats}: {what} "
                      f"({time.perf_counter() - t0:.0f}s with start-up)", flush=True)
    rows = [summarize(model, g, raw[(model, g, mode)], mode,
                      memory.get((model, g)) if mode == "overlapped" else None)
            for model in args.models for g, mode, for_memory in cases if not for_memory]
    table = format_table(rows)
    params = {r["model"]: r.get("model_parameters") for r in rows if r.get("model_parameters")}
    print(f"train_speed: {os.cpu_count()} CPU cores, world {world}, parameters "
          + ", ".join(f"{m} {n / 1e6:.2f}M" for m, n in params.items()), flush=True)
    print(table, flush=True)
    for line in verdicts(rows):
        print(line, flush=True)
    (out / "results.json").write_text(json.dumps({
        "benchmark": "train_speed", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "torch_threads_per_rank": threads},
        "command": " ".join(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv]),
        "model_parameters": params,
        "world_size": world, "pad_for_alignment": args.pad, "repeats": args.repeats,
        "summary": rows,
        "runs": {**{f"{m}_g{g}" + ("" if o == "overlapped" else f"_{o}"): v
                    for (m, g, o), v in raw.items()},
                 **{f"{m}_g{g}_memory": v for (m, g), v in memory.items()}},
    }, indent=2))
    (out / "table.txt").write_text(table + "\n")
    shutil.rmtree(out / "cache", ignore_errors=True)  # mock-data index cache, rebuilt per run
    print(f"> wrote {out / 'results.json'}", flush=True)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
