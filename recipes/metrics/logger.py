"""Per-iteration metrics on rank 0: a local JSONL file, wandb, and a progress line.

Names follow Megatron-LM: ``lm loss``, ``grad-norm``, ``learning-rate``, ``iteration-time``
(seconds), ``num-zeros``, ``tokens-per-sec``, ``consumed-samples``, ``lm loss validation`` and
``lm loss validation ppl`` (on validation iterations); the step is ``iteration``.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import string
import time
from pathlib import Path

from ckpt.io import tracked, write_durable

METRICS_FILE = "metrics.jsonl"
# wandb run modes ``logger.mode`` may take.
LOGGER_MODES = ("offline", "online", "disabled")


def new_run_id() -> str:
    """A fresh wandb-compatible run id (8 lowercase alphanumerics), the same on every rank
    (drawn on rank 0 and broadcast: it is part of the checkpoint's common state)."""
    import torch

    alphabet = string.ascii_lowercase + string.digits
    box = ["".join(secrets.choice(alphabet) for _ in range(8))]
    if torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


# Beside the checkpoints: the last wandb step each run id logged, so a continued run resumes
# its step counter past rows logged after the last save (a crash loses no point).
WANDB_STEPS_FILE = "wandb_steps.json"


def _same_dir(a, b) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)


def plan_wandb_run(cfg, train_state: dict | None, loaded_iteration: int | None) -> dict:
    """Decide which wandb run this job writes; the same answer on every rank (collective under
    torch.distributed: rank 0 decides and broadcasts).

    * no checkpoint loaded: a new run;
    * the latest checkpoint of ``checkpoint.load`` loaded and saved on into the same directory
      (``checkpoint.save``): the checkpoint's run continues (same id);
    * otherwise (``checkpoint.load_iteration`` before the latest, another save directory, every
      sweep job with its own output dir): a fork, a new run whose parent is the checkpoint's run
      at ``loaded_iteration``.

    Args:
        cfg: the run config (``checkpoint``).
        train_state: the loaded checkpoint's train state (``wandb_run_id``, ``wandb_step``), None
            when nothing was loaded.
        loaded_iteration: the iteration loaded, None when nothing was loaded.

    Returns:
        ``{"run_id": str, "resume": bool, "parent": None | {"run_id", "iteration", "step"}}``
        (a continued run also carries ``saved_step``, its wandb step at the checkpoint);
        ``parent["step"]`` is the parent's wandb step at that iteration (None if unknown).
    """
    import torch

    plan = None
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        parent_id = (train_state or {}).get("wandb_run_id")
        plan = {"run_id": None, "resume": False, "parent": None}
        if parent_id is not None:
            ck = cfg.checkpoint
            # No usable tracker (checkpoint.load_iteration=N of a dir without one): a fork.
            if _same_dir(ck.load, ck.save) and loaded_iteration == tracked(ck.load):
                plan.update(run_id=parent_id, resume=True,
                            saved_step=train_state.get("wandb_step"))
            else:
                plan["parent"] = {"run_id": parent_id, "iteration": loaded_iteration,
                                  "step": train_state.get("wandb_step")}
    if torch.distributed.is_initialized():
        box = [plan]
        torch.distributed.broadcast_object_list(box, src=0)
        plan = box[0]
    if plan["run_id"] is None:
        plan["run_id"] = new_run_id()
    return plan


class MetricLogger:
    """Writes ``<output_dir>/metrics.jsonl`` and, when ``logger.wandb``, one wandb run.

    Only construct it on global rank 0 (exactly one wandb run per job).

    wandb's x axis is the ``iteration`` field (``define_metric("*", step_metric="iteration")``),
    not wandb's own step: the step only counts rows and never goes back, so a run continued from
    its last checkpoint logs the iterations a crash repeated as new rows instead of rows a wandb
    server drops (it keeps only steps above the last it holds). The last step of each run id is
    kept in ``<checkpoint.save>/wandb_steps.json``; a fork starts its steps after the parent's
    branch point.

    Args:
        cfg: the run config (``logger``, ``checkpoint.save``, ``train.train_iters``).
        output_dir: the job's output dir.
        plan: from :func:`plan_wandb_run`.
        config: resolved config dict stored in the wandb run.
        resumed_from: the iteration of the checkpoint loaded (shown on the progress line).
    """

    def __init__(self, cfg, output_dir: str, plan: dict, config: dict,
                 resumed_from: int | None = None):
        self.train_iters = cfg.train.train_iters
        self.resumed_from = resumed_from
        self._start = time.perf_counter()
        self._first_iteration = resumed_from
        self.full_line = cfg.logger.get("console_line", "compact") == "full"
        # For the closing summary (recipes.metrics.console.format_summary).
        self.last: dict = {}
        self.best_validation: tuple[float, int] | None = None
        self.last_validation: tuple[float, int] | None = None
        self.path = Path(output_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)
        self.run = None
        self.wandb_offline_dir: str | None = None
        self.run_id = plan["run_id"]
        self._steps_path = Path(cfg.checkpoint.save) / WANDB_STEPS_FILE if cfg.checkpoint.save else None
        parent = plan["parent"]
        # The next wandb step: after this run id's last logged step, or after a fork's parent.
        self.step = 0
        if plan["resume"]:
            # At least past the checkpoint's own row, should wandb_steps.json be gone.
            saved = plan.get("saved_step")
            self.step = max(self._read_steps().get(self.run_id, -1),
                            -1 if saved is None else saved) + 1
        elif parent is not None and parent["step"] is not None:
            self.step = max(0, parent["step"] + 1)
        if cfg.logger.wandb:
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            kwargs = dict(project=cfg.logger.project, entity=cfg.logger.entity,
                          name=cfg.logger.run_name, id=self.run_id, mode=cfg.logger.mode,
                          dir=str(output_dir), config=config)
            if plan["resume"]:
                kwargs["resume"] = "allow"
            elif parent is not None:
                kwargs["config"] = {**config, "parent_run_id": parent["run_id"],
                                    "parent_iteration": parent["iteration"]}
                if parent["step"] is not None and parent["step"] >= 0:
                    kwargs["fork_from"] = f"{parent['run_id']}?_step={parent['step']}"
            try:
                self.run = wandb.init(**kwargs)
            except Exception as exc:  # noqa: BLE001 - a server without forking still gets the run
                if "fork_from" not in kwargs:
                    raise
                print(f"> wandb refused fork_from ({exc}); starting run {self.run_id} with "
                      f"parent_run_id/parent_iteration in its config only", flush=True)
                kwargs.pop("fork_from")
                self.run = wandb.init(**kwargs)
            self.run.define_metric("iteration")
            self.run.define_metric("*", step_metric="iteration")
            if cfg.logger.mode == "offline":  # what `wandb sync` uploads (its files' parent)
                self.wandb_offline_dir = str(Path(self.run.dir).parent)
            # Online, a resumed run's server knows its last step.
            self.step = max(self.step, int(self.run.step or 0))

    def _read_steps(self) -> dict:
        if self._steps_path is None or not self._steps_path.exists():
            return {}
        try:
            return json.loads(self._steps_path.read_text())
        except ValueError:
            return {}

    def _write_step(self, step: int) -> None:
        if self._steps_path is None:
            return
        steps = self._read_steps()
        steps[self.run_id] = step
        self._steps_path.parent.mkdir(parents=True, exist_ok=True)

        # As the tracker: a temp name per writer, fsync, rename (two writers never collide).
        write_durable(self._steps_path, json.dumps(steps))

    @property
    def last_step(self) -> int:
        """The wandb step of the last logged row (-1 before any)."""
        return self.step - 1

    def event(self, kind: str, **fields) -> None:
        """Record a non-metric event (``start``, ``resume``, ``save``) in the JSONL file."""
        self._file.write(json.dumps({"event": kind, **fields}) + "\n")

    def log(self, iteration: int, metrics: dict) -> None:
        """Record ``metrics`` at ``iteration`` and print a progress line."""
        self._file.write(json.dumps({"iteration": iteration, **metrics}) + "\n")
        if self.run is not None:
            self.run.log({**metrics, "iteration": iteration}, step=self.step)
            self._write_step(self.step)
        self.step += 1
        now = time.perf_counter()
        if self._first_iteration is None:
            self._first_iteration = iteration - 1
        done = iteration - self._first_iteration
        # The rest at the mean pace of this job's iterations so far (validation included).
        remaining = (now - self._start) / done * (self.train_iters - iteration) if done > 0 else None
        print(format_progress(iteration, self.train_iters, metrics, now - self._start, remaining,
                              self.resumed_from, full=self.full_line), flush=True)
        self.last = {"iteration": iteration, **metrics}
        if "lm loss validation" in metrics:
            print(format_validation(iteration, metrics), flush=True)
            loss = metrics["lm loss validation"]
            self.last_validation = (loss, iteration)
            if self.best_validation is None or loss < self.best_validation[0]:
                self.best_validation = (loss, iteration)

    def close(self) -> None:
        """Flush and finish the wandb run; on return its run file is complete on disk."""
        self._file.close()
        if self.run is not None:
            import wandb

            self.run.finish()
            # finish() only *informs* wandb's service process that the run is done: the service
            # closes (flushes) the offline run-<id>.wandb afterwards, so right after finish() the
            # file can still hold just its 7-byte header (no run record, no rows), and a process
            # killed then loses the run. teardown() waits for the service to close every stream
            # and exit; the next wandb.init() starts a new one.
            wandb.teardown()
            self.run = None


def add_to_each_step(optimizer, logger, clear, reduce) -> None:
    """Merge figures measured during each step into the metrics ``logger`` writes: ``clear()``
    runs when a step starts (``optimizer.zero_grad``), ``reduce() -> dict`` on every rank after
    the optimizer step (it may be collective), and its figures join the next ``logger.log``
    (rank 0's metrics.jsonl and wandb; ``logger`` None on the other ranks). Used by the MoE
    metrics and the MTP losses."""
    pending: dict = {}
    zero_grad, step = optimizer.zero_grad, optimizer.step

    def zero_grad_and_clear(*args, **kwargs):
        clear()
        return zero_grad(*args, **kwargs)

    def step_and_reduce(*args, **kwargs):
        out = step(*args, **kwargs)
        pending.update(reduce())
        return out

    optimizer.zero_grad, optimizer.step = zero_grad_and_clear, step_and_reduce
    if logger is not None:
        log = logger.log

        def log_with_step_figures(iteration, metrics):
            metrics = {**metrics, **pending}
            pending.clear()
            return log(iteration, metrics)

        logger.log = log_with_step_figures


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1 (B, KiB, MiB, GiB, TiB)."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while i < len(units) - 1 and abs(n) >= 1024:
        n /= 1024
        i += 1
    return f"{int(n)} B" if i == 0 else f"{n:.2f} {units[i]}"


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` for a duration in seconds (rounded down)."""
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


# The default console line fits this many columns (``logger.console_line=compact``).
CONSOLE_WIDTH = 160
# ``logger.console_line``: the compact line, or every figure Megatron-LM prints.
CONSOLE_LINES = ("compact", "full")
# The load-balancing losses an MoE run logs (recipes.model.moe.AUX_LOSS_NAMES' values).
_AUX_LOSSES = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss")


def timestamp(now: float | None = None) -> str:
    """Megatron-LM's ``[YYYY-MM-DD hh:mm:ss]`` (local time) that starts its iteration line."""
    return time.strftime("[%Y-%m-%d %H:%M:%S]", time.localtime(now))


def format_progress(iteration: int, total: int, m: dict, elapsed_s: float | None = None,
                    remaining_s: float | None = None, resumed_from: int | None = None,
                    full: bool = False, now: float | None = None) -> str:
    """One Megatron-style progress line, started by Megatron-LM's timestamp (``now``: epoch
    seconds, default the present).

    The compact line (default) holds at most :data:`CONSOLE_WIDTH` columns: the iteration,
    ``lm loss``, the MoE load-balancing loss, the ``skipped iterations`` (when not 0),
    ``grad norm``, the MTP losses (``mtp_1 loss``, ..., shown after the load-balancing loss),
    the learning rate, the estimate of the rest (``remaining_s``), ms per iteration, the
    iteration resumed from and tokens/s; what does not fit is dropped from the end of that
    list. ``full`` adds everything else (elapsed time, consumed samples, TFLOP/s per
    GPU, peak memory, num zeros) whatever its width. tokens/s counts the whole job's tokens (all
    data-parallel ranks); the throughput is per GPU (process), the peak memory the largest of
    any rank. metrics.jsonl and wandb hold every figure either way.
    """
    head = f" {timestamp(now)} iteration {iteration:6d}/{total}"
    resumed = f" (resumed from {resumed_from})" if resumed_from is not None else ""
    # The MoE load-balancing loss, then the MTP losses (recipes.model.mtp: "mtp_1 loss", ...) by layer.
    mtp = sorted((int(hit[1]), k) for k in m if (hit := re.fullmatch(r"mtp_(\d+) loss", k)))
    aux = [(k, m[k]) for k in _AUX_LOSSES if k in m] + [(k, m[k]) for _, k in mtp]
    skipped = int(m.get("skipped-iterations", 0) or 0)
    if full:
        return head + resumed + _full_rest(m, elapsed_s, remaining_s, aux, skipped)
    # (rank: kept before any field of a higher rank, text) in the order shown.
    fields = [(8, resumed)]
    if remaining_s is not None:
        fields.append((6, f" | remaining: {format_duration(remaining_s)}"))
    fields += [(7, f" | ms/iter: {1000 * m['iteration-time']:.1f}"),
               (9, f" | tokens/s: {m['tokens-per-sec']:.0f}"),
               (5, f" | lr: {m['learning-rate']:.3E}"),
               (0, f" | lm loss: {m['lm loss']:.4E}")]
    # The MTP losses give way after the learning rate, before grad norm: the last layer's first.
    fields += [(4.5 + i / 1000 if name.startswith("mtp_") else 1, f" | {name}: {value:.4E}")
               for i, (name, value) in enumerate(aux)]
    fields.append((4, f" | grad norm: {m['grad-norm']:.4g}"))
    if skipped:
        # Megatron-LM's "number of skipped iterations", shortened to leave room for grad norm.
        fields.append((3, f" | skipped iterations: {skipped}"))
    width = len(head) + sum(len(text) for _, text in fields)
    for rank, text in sorted(fields, key=lambda f: -f[0]):
        if width <= CONSOLE_WIDTH or rank == 0:
            break
        fields.remove((rank, text))
        width -= len(text)
    return head + "".join(text for _, text in fields)


def _full_rest(m: dict, elapsed_s, remaining_s, aux: list, skipped: int) -> str:
    timing = ""
    if elapsed_s is not None:
        timing = f"elapsed: {format_duration(elapsed_s)} | "
        if remaining_s is not None:
            timing += f"remaining: {format_duration(remaining_s)} | "
    perf = ""
    if "throughput" in m:  # Megatron-LM's model TFLOP/s per GPU (recipes.metrics.throughput)
        perf += f"throughput per GPU (TFLOP/s/GPU): {m['throughput']:.3g} | "
    if "peak-memory-bytes" in m:
        perf += f"peak memory per rank: {format_bytes(m['peak-memory-bytes'])} | "
    moe = "".join(f"{name}: {value:.6E} | " for name, value in aux)
    return (
        f" | {timing}consumed samples {m['consumed-samples']:8d} | "
        f"elapsed time per iteration (ms): {1000 * m['iteration-time']:8.1f} | {perf}"
        f"tokens/s (global): {m['tokens-per-sec']:9.0f} | learning rate: {m['learning-rate']:.4E} | "
        f"lm loss: {m['lm loss']:.6E} | {moe}grad norm: {m['grad-norm']:.4f} | "
        f"num zeros: {m['num-zeros']:.0f} | number of skipped iterations: {skipped}"
    )


def format_validation(iteration: int, m: dict) -> str:
    """Megatron-LM's validation line (``evaluate_and_print_results``), framed by dashes."""
    line = (f" validation loss at iteration {iteration} | lm loss value: "
            f"{m['lm loss validation']:.6E} | lm loss PPL: {m['lm loss validation ppl']:.6E} |")
    rule = "-" * len(line)
    return f"{rule}\n{line}\n{rule}"


def read_metrics(output_dir: str | os.PathLike) -> tuple[list[dict], list[dict]]:
    """Read a job's ``metrics.jsonl``: ``(metric rows, event rows)`` in file order."""
    rows, events = [], []
    with open(Path(output_dir) / METRICS_FILE) as f:
        for line in f:
            rec = json.loads(line)
            (events if "event" in rec else rows).append(rec)
    return rows, events
