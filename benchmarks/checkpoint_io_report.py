"""The checkpoint benchmark's figures from its launches' results (``benchmarks.checkpoint_io``):
medians and ratios over repeats (``summarize_save``, ``summarize_cross``) and the printed
tables [1]-[4] (``format_tables``)."""

from __future__ import annotations

import statistics

from benchmarks.checkpoint_io_setup import (TARGET_ASYNC_LOST_RATIO, TARGET_LOAD_RATIO,
                                            TARGET_PEAK_RATIO, TARGET_SAME_LOAD_EXTRA_MEMORY,
                                            TARGET_SAME_LOAD_RATIO, TARGET_SAVE_RATIO,
                                            TARGET_THROUGHPUT_FRACTION, TARGETS, describe)
from benchmarks.tables import table


def _per_rep(ranks: list[dict], *path: str) -> list[list[dict]]:
    """``[rep][rank] -> measurement`` for ``rank[path...]``."""
    series = []
    for r in ranks:
        node = r
        for key in path:
            node = node[key]
        series.append(node)
    return [list(x) for x in zip(*series)]


def _stats(ranks: list[dict], *path: str) -> dict:
    """Median over repeats of the slowest rank's seconds (barrier to barrier; ``call_*``: until
    the call returned); per rank: median peak RSS, RSS increase and bytes read/written
    (``/proc/self/io``)."""
    reps = _per_rep(ranks, *path)
    walls = [max(m["s"] for m in rep) for rep in reps]
    n_ranks = len(reps[0])

    def med(fn):
        return [statistics.median(fn(rep[i]) for rep in reps) for i in range(n_ranks)]

    calls = [max(m.get("call_s", m["s"]) for m in rep) for rep in reps]
    out = {"median_s": statistics.median(walls), "min_s": min(walls), "runs_s": walls,
           "call_median_s": statistics.median(calls), "call_min_s": min(calls), "call_runs_s": calls,
           "peak_rss_per_rank": med(lambda m: m["rss_peak"]),
           "rss_increase_per_rank": med(lambda m: m["rss_peak"] - m["rss_base"])}
    for key in ("rchar", "wchar", "read_bytes", "write_bytes"):
        if all(key in m for rep in reps for m in rep):
            out[f"{key}_per_rank"] = med(lambda m: m[key])
    return out


def _paired(a: dict, b: dict) -> float:
    """Median over repeats of a[rep] / b[rep] (measured next to each other)."""
    return statistics.median(x / y for x, y in zip(a["runs_s"], b["runs_s"]))


def _mib(x: float) -> str:
    return f"{x / 2**20:.0f}" if abs(x) >= 10 * 2**20 else f"{x / 2**20:.1f}"


def _per_rank(values) -> str:
    return " / ".join(_mib(v) for v in values) if values else "-"


def _verdict(value: float, limit: float, at_most: bool = True) -> str:
    ok = value <= limit if at_most else value >= limit
    return ("<= " if at_most else ">= ") + f"{limit:g}: " + ("met" if ok else "MISSED")


def _span(marks: list[tuple[float, float]]) -> float:
    """A collective's span over its ranks' ``(start, end)`` clock marks: from the last rank's
    start (on a loaded machine the ranks leave a barrier at different times; a rank that left
    early only waits inside) to the last rank's end."""
    return max(e for _, e in marks) - max(t for t, _ in marks)


def _training_cost(ranks: list[dict]) -> dict:
    """What a save costs training, per repeat, then medians over repeats.

    ``lost_s``: the span of the save and the steps after it (async: and the wait for its write)
    minus the span of the same steps with no save, measured next to each other;
    ``steps_slower_s``: the steps' own part of it; ``ratio_over_sync_lost``: the async save's
    ``lost_s`` over the sync save's (both hold the steps' noise; None where the sync figure is
    not positive); ``ratio_over_sync_save``: over the sync save's own span.

    ``writer_cpu_s``: per rank, the median CPU seconds of the async save's forked writer (its
    rank's children reaped by the wait); ``sync_save_cpu_s``: per rank, those of a sync save
    (the rank's own and its children's); ``writers_cpu_over_cores_s``: the writers' median CPU
    summed over ranks and divided by the cores the ranks run on: the training time the writers
    take when training keeps every core busy.
    """
    reps = {k: _per_rep(ranks, "saves", f"train_{k}") for k in ("plain", "async", "sync")}

    def whole(rep):
        return _span([(m["t_start"], m["t_end"]) for m in rep])

    def part(rep, name):
        return _span([tuple(m["parts"][name]) for m in rep])

    out: dict = {"train_steps": ranks[0].get("train_steps"), "lost_s": {}, "steps_slower_s": {}}
    for k in ("async", "sync"):
        pairs = list(zip(reps[k], reps["plain"]))
        out["lost_s"][k] = statistics.median(whole(a) - whole(p) for a, p in pairs)
        out["steps_slower_s"][k] = statistics.median(
            part(a, "steps") - part(p, "steps") for a, p in pairs)
    out["sync_save_s"] = statistics.median(part(r, "save") for r in reps["sync"])
    n_ranks = len(ranks)
    out["writer_cpu_s"] = [statistics.median(rep[i]["children_cpu_s"] for rep in reps["async"])
                           for i in range(n_ranks)]
    sync_saves = _per_rep(ranks, "saves", "logical")
    out["sync_save_cpu_s"] = [
        statistics.median(rep[i]["cpu_s"] + rep[i]["children_cpu_s"] for rep in sync_saves)
        for i in range(n_ranks)]
    out["cores"] = ranks[0]["cores"]
    out["writers_cpu_over_cores_s"] = sum(out["writer_cpu_s"]) / out["cores"]
    lost = out["lost_s"]
    out["ratio_over_sync_lost"] = lost["async"] / lost["sync"] if lost["sync"] > 0 else None
    out["ratio_over_sync_save"] = lost["async"] / out["sync_save_s"]
    return out


def summarize_save(res: dict) -> dict:
    """Save, same-layout load and write-throughput figures of one save launch."""
    ranks = res["ranks"]
    s = {k: _stats(ranks, "saves", k) for k in ("logical", "stock")}
    asyncs = {k: _stats(ranks, "saves", k) for k in ("async_stall", "async_rest",
                                                     "async_first_stall", "train_plain",
                                                     "train_async", "train_sync")}
    training = _training_cost(ranks)
    raw = {k: _stats(ranks, "raw", k) for k in ("parallel", "single")}
    nbytes = res["checkpoint_bytes"]
    t = {
        "checkpoint_bytes": nbytes,
        "save_logical_Bps": nbytes / s["logical"]["median_s"],
        "stock_checkpoint_bytes": res["bytes_by_layout"]["stock"],
        "save_stock_Bps": res["bytes_by_layout"]["stock"] / s["stock"]["median_s"],
        "raw_parallel_Bps": nbytes / raw["parallel"]["median_s"],
        "raw_single_Bps": nbytes / raw["single"]["median_s"],
        "raw": raw,
    }
    t["raw_best_Bps"] = max(t["raw_parallel_Bps"], t["raw_single_Bps"])
    t["fraction_logical_of_raw_best"] = t["save_logical_Bps"] / t["raw_best_Bps"]
    return {
        "layout": res["layout"], "label": res["label"], "gtp_format": res["gtp_format"],
        "save": {**s,
                 "time_ratio_logical_over_stock": s["logical"]["median_s"] / s["stock"]["median_s"],
                 "paired_time_ratio_logical_over_stock": _paired(s["logical"], s["stock"]),
                 "peak_rss_ratio_logical_over_stock_per_rank": [
                     a / b for a, b in zip(s["logical"]["peak_rss_per_rank"],
                                           s["stock"]["peak_rss_per_rank"])],
                 "rss_increase_diff_logical_minus_stock_per_rank": [
                     a - b for a, b in zip(s["logical"]["rss_increase_per_rank"],
                                           s["stock"]["rss_increase_per_rank"])]},
        "same_layout_load": {k: _stats(ranks, "loads", k) for k in ("logical", "stock")},
        "rank_bytes": res["rank_bytes"],
        # The stall: barrier to barrier, as every figure here: a collective right after the save
        # (training's next) also waits for ranks that share their cores with the writers. Until
        # save_checkpoint returned on the slowest rank: beside it, for information.
        "async_save": {**asyncs,
                       "stall_ratio_over_sync_logical":
                           asyncs["async_stall"]["median_s"] / s["logical"]["median_s"],
                       "paired_stall_ratio": _paired(asyncs["async_stall"], s["logical"]),
                       "call_ratio_over_sync_logical":
                           asyncs["async_stall"]["call_median_s"] / s["logical"]["median_s"],
                       **training},
        "throughput": t,
    }


def summarize_cross(res: dict, name: str, source_same_layout_s: float) -> dict:
    """Per-load statistics (seconds, across ranks) of one cross-layout load case, with its
    ratio to the source's same-layout load ``source_same_layout_s``."""
    if "error" in res:
        return {"error": res["error"]}
    loads = {k: _stats(res["ranks"], "loads", k) for k in res["ranks"][0]["loads"]}
    n = loads["native"]
    return {
        "layout": res["layout"], "world": len(res["ranks"]),
        "label": f"{describe(*TARGETS[name][:3])} (world {len(res['ranks'])})",
        **loads,
        "controls": [k for k in loads if k not in ("cross", "native")],
        "ratio_over_native": {k: v["median_s"] / n["median_s"] for k, v in loads.items()},
        "paired_ratio_over_native": {k: _paired(v, n) for k, v in loads.items()},
        "ratio_cross_over_native": loads["cross"]["median_s"] / n["median_s"],
        "ratio_cross_over_source_same_layout": loads["cross"]["median_s"] / source_same_layout_s,
        "native_bytes": res.get("native_bytes"),
    }


CONTROL_LABEL = "tp2, gtp off (world 2)"


def format_tables(summary: dict, head: dict) -> str:
    """The printed tables of a checkpoint benchmark run: saves, then loads at each layout."""
    saves = summary["saves"]
    main = saves[head["source_name"]]
    reps = head["repeats"]
    parts = [f"[1] save (world 4), {reps} interleaved repeats (logical and stock in turn, raw, raw, ...); "
             f"checkpoint {_mib(main['throughput']['checkpoint_bytes'])} MiB. s: median (min); "
             f"vs stock: ratio of medians (median of per-repeat ratios)"]
    rows, notes = [], []
    for name, x in saves.items():
        s = x["save"]
        for kind, label in (("logical", "logical (gtp/ on)"), ("stock", "stock 0.19.2 (gtp/ off)")):
            m = s[kind]
            ratio = m["median_s"] / s["stock"]["median_s"]
            rows.append([x["label"], label, f"{m['median_s']:.2f} ({m['min_s']:.2f})",
                         f"{ratio:.2f} ({_paired(m, s['stock']):.2f})",
                         _verdict(ratio, TARGET_SAVE_RATIO) if kind == "logical" else "",
                         _per_rank(m["peak_rss_per_rank"]), _per_rank(m["rss_increase_per_rank"])])
        worst = max(s["peak_rss_ratio_logical_over_stock_per_rank"])
        notes.append(f"{x['label']}: peak RSS logical / stock, worst rank {worst:.3f} (target "
                     f"{_verdict(worst, TARGET_PEAK_RATIO)}); RSS increase logical - stock per "
                     f"rank {_per_rank(s['rss_increase_diff_logical_minus_stock_per_rank'])} MiB")
    parts.append(table(["saved at", "format written", "s", "vs stock", "target",
                         "peak RSS MiB per rank", "RSS increase MiB per rank"], rows))
    parts += notes

    parts.append("")
    parts.append(f"[2] load, {reps} interleaved repeats: each cross-layout load alternates (A B, B A, "
                 f"...) with a same-layout load at its target layout (a file saved there) in one launch. "
                 f"s: median (min); vs same-layout: ratio of medians (median of per-repeat ratios)")
    rows = []
    for name, x in saves.items():
        sl = x["same_layout_load"]
        for kind, label in (("logical", "same-layout, logical file"),
                            ("stock", "same-layout, stock file")):
            m = sl[kind]
            ratio = m['median_s'] / sl['stock']['median_s']
            vs = f"{ratio:.2f} ({_paired(m, sl['stock']):.2f}) of stock"
            rows.append([f"{x['label']} (world 4)", label,
                         f"{m['median_s']:.2f} ({m['min_s']:.2f})",
                         vs, _verdict(ratio, TARGET_SAME_LOAD_RATIO) if kind == "logical" else "",
                         _per_rank(m["peak_rss_per_rank"]),
                         _per_rank(m["rss_increase_per_rank"]), _per_rank(m.get("rchar_per_rank"))])
    for name, c in summary["cross_layout_load"].items():
        if "error" in c:
            rows.append([f"-> {name}", "error: " + c["error"], "", "", "", "", "", ""])
            continue
        control_labels = {
            "control": f"control: from {CONTROL_LABEL}",
            "stock_file": f"control: from {main['label']}, stock file, stock megatron",
            "torch_reader": f"control: from {main['label']}, logical file, torch's reader",
        }
        kinds = [("native", "same-layout (saved there)"),
                 ("cross", f"from {main['label']}, logical file"),
                 *[(k, control_labels.get(k, k)) for k in c["controls"]]]
        for which, label in kinds:
            m = c[which]
            ratio = c["ratio_over_native"][which]
            control = max((c["ratio_over_native"][k] for k in c["controls"] if k == "control"),
                          default=None)
            verdict = ""
            if which == "cross":
                verdict = _verdict(ratio, TARGET_LOAD_RATIO)
                if control is not None:
                    verdict += f"; control {control:.2f}: " + (
                        "no worse" if ratio <= control else "WORSE")
            rows.append([f"-> {c['label']}", label, f"{m['median_s']:.2f} ({m['min_s']:.2f})",
                         f"{ratio:.2f} ({c['paired_ratio_over_native'][which]:.2f})", verdict,
                         _per_rank(m["peak_rss_per_rank"]), _per_rank(m["rss_increase_per_rank"]),
                         _per_rank(m.get("rchar_per_rank"))])
        if "stock_file" not in c["controls"]:
            rows.append([f"-> {c['label']}", f"from {main['label']}, stock file", "n/a",
                         "", "", "", "", ""])
    for name, x in saves.items():
        sl = x["same_layout_load"]
        extra = [a - b for a, b in zip(sl["logical"]["rss_increase_per_rank"],
                                       sl["stock"]["rss_increase_per_rank"])]
        frac = max(e / max(b, 1) for e, b in zip(extra, x["rank_bytes"]))
        rows.append([f"{x['label']} (world 4)", "same-layout: logical RSS increase - stock's, "
                     "of the rank's checkpoint bytes", f"{frac:.3f}", "",
                     _verdict(frac, TARGET_SAME_LOAD_EXTRA_MEMORY), "", _per_rank(extra), ""])
    parts.append(table(["load to", "file", "s", "vs same-layout", "target",
                         "peak RSS MiB per rank", "RSS increase MiB per rank",
                         "MiB read per rank"], rows))
    parts.append("n/a: stock megatron-core 0.19.2 cannot load its GTP file at another GTP layout "
                 "(the bug gtp/ fixes), so those cross-layout loads are of the logical file only.")
    used = {k for c in summary["cross_layout_load"].values() for k in c.get("controls", [])}
    if "control" in used:
        parts.append(f"control from {CONTROL_LABEL}: megatron's own cross-TP resharding, no GTP "
                     f"on either side.")
    if "stock_file" in used:
        parts.append(f"control from the stock file: {main['label']} pads no row of this model, "
                     f"so its stock file holds the logical rows and stock megatron (gtp/ off) "
                     f"reads it into a non-GTP model (with padding rows it cannot).")
    cross = {n: c for n, c in summary["cross_layout_load"].items() if "error" not in c}
    if cross:
        parts.append(f"cross-layout load / same-layout load at {main['label']}: " + ", ".join(
            f"{c['label']} {c['ratio_cross_over_source_same_layout']:.2f}x" for c in cross.values())
            + " (other world size or bytes per rank; for information)")

    parts.append("")
    steps = next(iter(saves.values()))["async_save"]["train_steps"]
    parts.append(f"[4] asynchronous save (checkpoint.async_save=true), {reps} repeats interleaved "
                 f"with [1]. Training time lost to a save: the save and {steps} training steps "
                 f"right after it (for an async save its write goes on during them; then the "
                 f"wait for its write to be finalized), minus the same steps with no save, per "
                 f"repeat, each timed from the last rank's start to the last rank's end; the "
                 f"target is judged on the async figure over the sync one (both hold the steps' "
                 f"noise; over the sync save's own time: beside it). Steps slower: the steps' "
                 f"own part. Stall: barrier to barrier around save_checkpoint (until it "
                 f"returned on the slowest rank: beside it); the first async save of a run (it "
                 f"plans and validates; later saves reuse its plan) is timed apart; "
                 f"write+finalize: the wait after an async save with no training")
    rows = []
    for name, x in saves.items():
        a = x["async_save"]
        st, lost, slower = a["async_stall"], a["lost_s"], a["steps_slower_s"]
        ratio = a["ratio_over_sync_lost"]
        rows.append([x["label"], f"{a['sync_save_s']:.2f}",
                     f"{lost['sync']:.2f} / {lost['async']:.2f}",
                     "n/a" if ratio is None else f"{ratio:.2f}",
                     "n/a: no sync cost above the noise" if ratio is None
                     else _verdict(ratio, TARGET_ASYNC_LOST_RATIO),
                     f"{a['ratio_over_sync_save']:.2f}",
                     f"{a['train_plain']['median_s']:.2f}",
                     f"{slower['sync']:+.2f} / {slower['async']:+.2f}",
                     f"{st['median_s']:.3f} ({a['stall_ratio_over_sync_logical']:.2f}x)",
                     f"{st['call_median_s']:.3f}",
                     f"{a['async_first_stall']['median_s']:.3f}",
                     f"{a['async_rest']['median_s']:.2f}",
                     f"{statistics.median(a['sync_save_cpu_s']):.2f} / "
                     f"{statistics.median(a['writer_cpu_s']):.2f}",
                     f"{a['writers_cpu_over_cores_s']:.2f}"])
    cores = max(x["async_save"]["cores"] for x in saves.values())
    parts.append(table(["saved at", "sync save s", "training lost s: sync / async",
                        "async / sync lost", "target", "async lost / sync save",
                        f"{steps} steps s, no save", "steps slower s: sync / async",
                        "async stall s (of sync save)", "until returned s",
                        "first async save s", "write+finalize s",
                        "CPU s per rank: sync save / async writer",
                        f"writers' CPU over {cores} cores s"], rows))
    parts.append(f"CPU: user + system seconds, median over repeats, then over ranks; a sync "
                 f"save's are its rank's own and its children's, an async save's writer's are "
                 f"its rank's reaped children's. Over the cores: the writers' CPU summed over "
                 f"ranks and divided by the {cores} cores the ranks run on, the training time "
                 f"the writers take when training keeps every core busy (here "
                 f"{len(main['async_save']['writer_cpu_s'])} ranks on {cores} cores)")

    t = main["throughput"]
    parts.append("")
    parts.append(f"[3] write throughput at {main['label']} into {head['files']} "
                 f"({_mib(t['checkpoint_bytes'])} MiB each time, fsync'd; medians of "
                 f"{reps}, interleaved with the saves)")
    rows = []
    best = t["raw_best_Bps"]
    for key, label in (("raw_single_Bps", "raw write: 1 process, 1 file"),
                       ("raw_parallel_Bps", "raw write: each rank its own bytes, 1 file each"),
                       ("save_stock_Bps", "checkpoint save, stock"),
                       ("save_logical_Bps", "checkpoint save, logical")):
        frac = t[key] / best
        rows.append([label, f"{t[key] / 2**20:.0f}", f"{frac:.2f}",
                     _verdict(frac, TARGET_THROUGHPUT_FRACTION, at_most=False)
                     if key == "save_logical_Bps" else ""])
    parts.append(table(["write", "MiB/s", "of best raw", "target"], rows))
    return "\n".join(parts)
