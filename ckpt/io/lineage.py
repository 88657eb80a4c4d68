"""Which saves of a checkpoint dir belong to one run's history: its lineage.

Every save records, in its ``train_state``, the chain of runs that led to it (``lineage``): a
list of ``[wandb run id, iteration it started from]``, oldest first. A run that continues the
tracker's save of its own save dir keeps the checkpoint's chain; a fresh run starts one; a
fork (another iteration, another dir) appends itself to the chain of the save it loaded. A save
lies on a run's history when its last run is in the run's chain and, for an ancestor, at or
before the iteration the next run of the chain forked from.

``checkpoint.load=auto`` follows the lineage of the save the tracker names, without a usable
tracker the newest complete save's (:meth:`ckpt.io.manager.ResumePlan.auto`): it
never takes another lineage's save. Each save's chain is also recorded beside the tracker
(:data:`RECORD`, written before the tracker names the save): a save whose own files are damaged
cannot erase which history it continues.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ckpt.io.files import ITER_NAME, iter_dir, write_durable

KEY = "lineage"
# Beside the tracker: {iteration: chain} of the dir's saves (hidden: never an iter dir).
RECORD = ".lineage.json"


def recorded(root) -> dict[int, list]:
    """The chains :func:`record` kept for the saves of ``root`` (``{iteration: chain}``); empty
    where there is no record or it cannot be read (a dir from before the record, a torn file)."""
    try:
        raw = json.loads((Path(root) / RECORD).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict):
        return {}
    found = {}
    for key, chain in raw.items():
        # each link [run id, iteration it started from]; anything else (hand-edited): no record
        if ITER_NAME.fullmatch(f"iter_{key}") and isinstance(chain, list) and chain and all(
                isinstance(c, list) and len(c) == 2 and isinstance(c[0], str)
                and isinstance(c[1], int) and not isinstance(c[1], bool) for c in chain):
            found[int(key)] = chain
    return found


def record(root, iteration: int, chain: list | None) -> None:
    """Record ``chain`` as the lineage of the save of ``iteration`` in ``root`` (global rank 0,
    before the tracker names it), dropping the entries of iter dirs no longer there."""
    if not chain:
        return
    kept = {it: c for it, c in recorded(root).items() if iter_dir(root, it).is_dir()}
    kept[int(iteration)] = [list(c) for c in chain]
    write_durable(Path(root) / RECORD,
                  json.dumps({f"{it:07d}": c for it, c in sorted(kept.items())}) + "\n")


def of_run(train_state: dict | None, iteration: int, plan: dict) -> list:
    """The chain this run's saves record: the loaded checkpoint's ``train_state`` chain kept
    when the run continues it (``plan["resume"]``, :func:`recipes.metrics.logger.plan_wandb_run`),
    else extended by ``[plan["run_id"], iteration]`` (a fresh run: the chain is that alone)."""
    chain = [list(c) for c in (train_state or {}).get(KEY) or []]
    if plan.get("resume") and chain and chain[-1][0] == plan["run_id"]:
        return chain
    return chain + [[plan["run_id"], int(iteration)]]


def on_path(chain: list | None, iteration: int, history: list | None) -> bool | None:
    """Whether the save of ``iteration`` recorded as ``chain`` lies on ``history`` (another
    save's chain); None where either records none (a save from before lineages)."""
    if not chain or not history:
        return None
    ids = [c[0] for c in history]
    if chain[-1][0] not in ids:
        return False
    k = ids.index(chain[-1][0])
    return k == len(history) - 1 or iteration <= int(history[k + 1][1])


def set_aside(path: Path) -> Path:
    """Rename a damaged iter dir to ``iter_NNNNNNN.damaged`` (``.damaged.2`` ... when taken):
    kept for inspection, never loaded, never pruned, never written over."""
    target = path.with_name(f"{path.name}.damaged")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.damaged.{n}")
    os.replace(path, target)
    return target
