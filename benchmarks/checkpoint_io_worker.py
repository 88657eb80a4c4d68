"""The checkpoint benchmark's worker (one rank of a launch of ``benchmarks.checkpoint_io``):
builds its model, runs one training step, then measures the launch's phase (``bench.phase``):
``save`` (saves logical/stock, async saves and their training cost, raw writes, same-layout
loads), ``save_only`` (a checkpoint for another launch) or the cross-layout ``load``."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path

from benchmarks.checkpoint_io_setup import RAW_BLOCK, TRAIN_STEPS
from benchmarks.measure import barrier, in_turn, measure
from benchmarks.memory import max_rss


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _rank_bytes(iter_path: Path, rank: int) -> int:
    """Bytes of the tensor files this rank wrote (megatron names them ``__<rank>_<n>.distcp``)."""
    return sum(f.stat().st_size for f in Path(iter_path).glob(f"__{rank}_*.distcp"))


def _raw_write(path: Path, nbytes: int, block: bytes) -> None:
    """Plain sequential write of ``nbytes`` to ``path``, then fsync (as megatron's writer)."""
    view = memoryview(block)
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, len(view))
            f.write(view[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())


def _sharding_record(iter_path: Path) -> dict:
    from megatron.core import dist_checkpointing

    from ckpt.format.logical_format import SHARDING_RECORD_KEY

    return dist_checkpointing.load_common_state_dict(str(iter_path)).get(SHARDING_RECORD_KEY) or {}


def _gtp_format(iter_path: Path) -> str | None:
    return _sharding_record(iter_path).get("gtp_format")


def _param_count(iter_path: Path) -> dict:
    """Logical element counts from a checkpoint's metadata: model tensors and all tensors."""
    from math import prod

    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(str(iter_path))
    model = sum(prod(t.global_shape) for k, t in meta.items() if not k.startswith("optimizer."))
    total = sum(prod(t.global_shape) for t in meta.values())
    return {"model_parameters": int(model), "checkpoint_elements": int(total)}


def worker(cfg_path: str, out_path: str) -> None:
    """One rank of a benchmark launch: build the model of ``cfg_path``, time its saves and
    loads, write this rank's timings (seconds) as JSON to ``out_path``."""
    import torch
    from megatron.core import parallel_state

    from ckpt.format import dcp_reader, logical_format
    from ckpt import io as checkpoint
    from benchmarks.runs import start_rank, trained_model

    cfg, rank, world, parallel_dims = start_rank(cfg_path)
    bench = cfg.bench
    t_setup = time.perf_counter()
    model, optimizer, scheduler, step = trained_model(cfg, parallel_dims)  # Adam moments exist
    setup_s = time.perf_counter() - t_setup
    record = checkpoint.layout_record(parallel_dims)
    common = {"consumed_samples": cfg.data.global_batch_size, "wandb_run_id": None}
    root = Path(bench.files)
    mine: dict = {"rank": rank, "setup_and_step_s": setup_s,
                  "cores": len(os.sched_getaffinity(0)),
                  "local_param_numel": sum(p.numel() for p in model.parameters())}
    shared: dict = {"layout": parallel_dims.describe()}

    def save(kind: str, where: Path, iteration: int) -> None:
        logical_format.configure(kind)
        checkpoint.save_checkpoint(where, iteration, model, optimizer, scheduler, common, record)

    async_saves = checkpoint.AsyncSaves()

    def save_async(where: Path, iteration: int) -> None:
        """What training waits for in an asynchronous save (the write goes on after)."""
        logical_format.configure("logical")
        checkpoint.save_checkpoint(where, iteration, model, optimizer, scheduler, common, record,
                                   async_saves=async_saves)

    def load(kind: str, where: Path) -> None:
        logical_format.configure(kind)
        # Not verified first: these rows compare readers and layouts (bytes read included);
        # benchmarks.checkpoint_verify measures what the verification adds.
        checkpoint.load_checkpoint(where, model, optimizer, scheduler, record, verify=False)

    def drop(path: Path) -> None:
        barrier()
        if rank == 0 and path.exists():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        barrier()

    repeats = int(bench.repeats)
    if bench.phase == "save":
        root = root / bench.tag
        kinds = ("logical", "stock")
        for kind in kinds:  # untimed warm-up of each code path
            save(kind, root / f"warmup_{kind}", 1)
            if kind == "logical":
                my_bytes = _rank_bytes(checkpoint.iter_dir(root / "warmup_logical", 1), rank)
                every = [None] * world
                torch.distributed.all_gather_object(every, my_bytes)
                total_bytes = _dir_bytes(checkpoint.iter_dir(root / "warmup_logical", 1))
            drop(root / f"warmup_{kind}")
        # The first async save of a run plans and validates (later ones reuse its plan): timed
        # apart, not among the repeats.
        first_async = measure(lambda: save_async(root / "warmup_async", 1))
        async_saves.wait()
        drop(root / "warmup_async")
        block = os.urandom(RAW_BLOCK)
        raw_dir = root / "raw"
        if rank == 0:
            raw_dir.mkdir(parents=True, exist_ok=True)
        barrier()
        saves = {k: [] for k in kinds}
        saves["async_stall"], saves["async_rest"] = [], []
        saves["async_first_stall"] = [first_async]
        saves.update(train_plain=[], train_async=[], train_sync=[])
        train_steps = int(bench.get("train_steps", TRAIN_STEPS))
        mine["train_steps"] = train_steps

        def train() -> None:
            for _ in range(train_steps):
                step()
        raw = {"parallel": [], "single": []}
        for rep in range(repeats):
            it = rep + 1
            for kind in in_turn(kinds, rep):
                m = measure(lambda: save(kind, root / f"save_{kind}", it))
                if rank == 0:
                    m["bytes"] = _dir_bytes(checkpoint.iter_dir(root / f"save_{kind}", it))
                saves[kind].append(m)
                if rep:
                    drop(checkpoint.iter_dir(root / f"save_{kind}", it - 1))
            saves["async_stall"].append(measure(lambda: save_async(root / "save_async", it)))
            saves["async_rest"].append(measure(async_saves.wait))  # writing, then finalize
            if rep:
                drop(checkpoint.iter_dir(root / "save_async", it - 1))
            # What a save costs training: the same steps with no save before them, after a
            # synchronous save, and with an asynchronous save's write going on (then the wait
            # for it), the three in turn; each one measurement, its parts marked inside (a
            # barrier or collection between them would hide time the writer takes).
            for key in in_turn(("plain", "async", "sync"), rep):
                where = root / f"train_{key}"
                parts = {"plain": [("steps", train)],
                         "async": [("save", lambda: save_async(where, it)), ("steps", train),
                                   ("wait", async_saves.wait)],
                         "sync": [("save", lambda: save("logical", where, it)),
                                  ("steps", train)]}[key]
                marks: dict = {}

                def run_parts() -> None:
                    for part, fn in parts:
                        t0 = time.perf_counter()
                        fn()
                        marks[part] = (t0, time.perf_counter())

                saves[f"train_{key}"].append({**measure(run_parts), "parts": marks})
                if key != "plain":
                    drop(where)
            m = measure(lambda: _raw_write(raw_dir / f"parallel_{rank}.bin", my_bytes, block))
            raw["parallel"].append({**m, "bytes": my_bytes})
            drop(raw_dir)
            if rank == 0:
                raw_dir.mkdir(parents=True, exist_ok=True)
            m = measure(lambda: _raw_write(raw_dir / "single.bin", total_bytes, block)
                         if rank == 0 else None)
            raw["single"].append({**m, "bytes": total_bytes if rank == 0 else 0})
            drop(raw_dir)
            if rank == 0:
                raw_dir.mkdir(parents=True, exist_ok=True)
        drop(raw_dir)
        loads = {k: [] for k in kinds}
        for kind in kinds:  # warm-up
            load(kind, root / f"save_{kind}")
        for rep in range(repeats):
            for kind in in_turn(kinds, rep):
                loads[kind].append(measure(lambda: load(kind, root / f"save_{kind}")))
        logical_format.configure("logical")
        mine.update(saves=saves, raw=raw, loads=loads)
        if rank == 0:
            last = {k: checkpoint.iter_dir(root / f"save_{k}", repeats) for k in kinds}
            shared.update(
                rank_bytes=every, checkpoint_bytes=total_bytes,
                bytes_by_layout={k: _dir_bytes(p) for k, p in last.items()},
                gtp_format={k: _gtp_format(p) for k, p in last.items()},
                # padding rows per TP-local GTP weight (ckpt/format/logical_format.py's metadata)
                gtp_padding_rows={key: rec["pad"] for key, rec in
                                  _sharding_record(last["logical"]).get("tensors", {}).items()},
                **_param_count(last["logical"]),
                source=str(root / "save_logical"),
            )
    elif bench.phase == "save_only":  # a checkpoint for another launch to load
        save("logical", root / bench.tag, 1)
        shared.update(source=str(root / bench.tag))
    else:  # cross-layout load at this launch's layout
        native = root / f"native_{bench.target}"
        save("logical", native, 1)
        # "cross": the source's logical file; controls: other files (loaded with gtp/'s
        # patch installed, or with stock megatron when the key starts with "stock").
        # "torch_reader": the cross file again, read by torch's own read_data (whole chunks).
        paths = {"cross": Path(bench.source), "torch_reader": Path(bench.source),
                 **{k: Path(v) for k, v in (bench.get("controls") or {}).items()},
                 "native": native}

        def kind_of(key: str) -> str:
            return "stock" if key.startswith("stock") else "logical"

        def load_as(key: str, path: Path) -> None:
            with dcp_reader.disabled() if key == "torch_reader" else contextlib.nullcontext():
                load(kind_of(key), path)

        for key, path in paths.items():  # warm-up
            load_as(key, path)
        loads = {k: [] for k in paths}
        for rep in range(repeats):
            for key, path in in_turn(paths.items(), rep):
                loads[key].append(measure(lambda: load_as(key, path)))
        logical_format.configure("logical")
        mine.update(loads=loads)
        if rank == 0:
            shared.update(native_bytes=_dir_bytes(checkpoint.iter_dir(native, 1)),
                          native_gtp_format=_gtp_format(checkpoint.iter_dir(native, 1)))
    mine["max_rss"] = max_rss()
    every = [None] * world
    torch.distributed.all_gather_object(every, mine)
    if rank == 0:
        Path(out_path).write_text(json.dumps({**shared, "ranks": every}))
    barrier()
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
