"""Exit with a save: a signal (preemption, a time limit), a wall-clock budget or an iteration
count ends the run at an iteration boundary with a complete checkpoint, and exit status 0.

As Megatron-LM's ``--exit-signal-handler`` (``dist_signal_handler.DistributedSignalHandler``),
``--exit-duration-in-mins`` and ``--exit-interval`` (``training.checkpoint_and_decide_exit``):
every worker notes the signal in a flag; after each iteration the ranks agree on it (one
all-reduce), and the loop saves synchronously (after the background save in flight) and stops.

Handled signals: SIGTERM (Slurm's preemption and ``scancel``), ``train.exit_signal`` and, in a
task of a submitit job, submitit's own preemption/time-limit signal (USR2 unless
``SUBMITIT_PREEMPT_SIGNAL`` says otherwise), whose submitit handler (it requeues the job) runs
once the save is complete (:func:`after_exit`). Under ``train.py``'s local launch the launcher
passes these signals on to its workers and waits for them (:func:`forward_to_workers`).
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

from ckpt.io import iter_dir, saved_iterations

# What train.py's launch puts here: the command that continues the run (printed at the exit).
CONTINUE_ENV = "GTP_RECIPES_CONTINUE"
# Signals a run may be asked to exit with (train.exit_signal).
EXIT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGINT")

_received: list[int] = []  # signals received since install(), in order
_early: list[int] = []  # signals received between note_early() and install()
_previous: dict[int, object] = {}  # signum -> the handler note_early()/install() replaced
_forwarding: list[threading.Event] = []  # set to stop the launcher's forwarding threads
_started = time.time()


def exit_signals(train_cfg) -> list[int]:
    """The signals this process exits on: SIGTERM, ``train.exit_signal`` and, under submitit,
    submitit's preemption signal.

    Raises:
        ValueError: ``train.exit_signal`` is not one of :data:`EXIT_SIGNALS`.
    """
    name = train_cfg.get("exit_signal", "SIGTERM") or "SIGTERM"
    if name not in EXIT_SIGNALS:
        raise ValueError(f"train.exit_signal={name!r}: valid are {EXIT_SIGNALS}")
    found = [signal.SIGTERM, getattr(signal, name)]
    if any(k.startswith("SUBMITIT_") for k in os.environ):
        found.append(getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")))
    return list(dict.fromkeys(found))


def _note(signum, frame) -> None:
    _received.append(signum)


def _note_early(signum, frame) -> None:
    _early.append(signum)


def note_early() -> None:
    """The first thing a worker does (before it imports torch): note every signal of
    :data:`EXIT_SIGNALS` but SIGINT instead of dying of it, until :func:`install` knows which
    the run exits on. A signal at any moment of a worker's life is then kept."""
    for name in EXIT_SIGNALS:
        if name != "SIGINT":
            signum = getattr(signal, name)
            _previous[signum] = signal.signal(signum, _note_early)


def install(train_cfg) -> None:
    """Note :func:`exit_signals` instead of dying of them (in the main thread of a worker);
    the handlers replaced are kept for :func:`after_exit`. Resets the wall clock of
    ``train.exit_duration_in_mins``. Signals noted since :func:`note_early` count as received;
    one the run does not exit on takes its default action now."""
    global _started
    _started = time.time()
    _received.clear()
    signums = exit_signals(train_cfg)
    for signum in signums:
        replaced = signal.signal(signum, _note)
        if replaced is not _note_early:
            _previous[signum] = replaced
    early, _early[:] = list(_early), []
    _received.extend(s for s in early if s in signums)
    for signum in dict.fromkeys(s for s in early if s not in signums):
        signal.signal(signum, _previous.pop(signum, signal.SIG_DFL))
        os.kill(os.getpid(), signum)
    for signum in [s for s, h in _previous.items() if s not in signums]:
        if signal.getsignal(signum) is _note_early:  # noted early, not an exit signal here
            signal.signal(signum, _previous.pop(signum))


def before_training(train_cfg, iteration: int) -> str | None:
    """Whether a run stops before it trains iteration ``iteration + 1``: an exit signal any rank
    received so far (one all-reduce over the world). Returns the line to print (the signal, that
    no iteration was trained, the command that continues), or None to go on."""
    import torch

    flag = torch.tensor([received() or 0], dtype=torch.int64)
    if torch.distributed.is_initialized():
        from gtp.collectives import collective_device

        flag = flag.to(collective_device())
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    signum = int(flag.item())
    if not signum:
        return None
    how = os.environ.get(CONTINUE_ENV)
    return (f"> exit on {signal.Signals(signum).name} before iteration {iteration + 1}: no "
            f"iteration was trained, nothing to save" + (f"; continue with: {how}" if how else ""))


def received() -> int | None:
    """The first exit signal this process received since :func:`install`, or None."""
    return _received[0] if _received else None


def exit_reason(iteration: int, train_cfg) -> str | None:
    """Whether the run stops after ``iteration``, the same answer on every rank (one all-reduce
    over the world when a process group is up).

    Stops when any rank received an exit signal, when ``train.exit_duration_in_mins`` minutes
    passed on any rank since :func:`install` (Megatron-LM's ``--exit-duration-in-mins``), or when
    ``iteration`` is a multiple of ``train.exit_interval`` (``--exit-interval``).

    Returns:
        What stopped it (``"SIGTERM"``, ``"train.exit_duration_in_mins=30"``,
        ``"train.exit_interval=100"``), or None to go on.
    """
    import torch

    duration = train_cfg.get("exit_duration_in_mins")
    over = bool(duration) and (time.time() - _started) / 60.0 > duration
    flags = torch.tensor([received() or 0, int(over)], dtype=torch.int64)
    if torch.distributed.is_initialized():
        from gtp.collectives import collective_device

        flags = flags.to(collective_device())
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    signum, over = (int(x) for x in flags.tolist())
    if signum:
        return signal.Signals(signum).name
    if over:
        return f"train.exit_duration_in_mins={duration}"
    interval = train_cfg.get("exit_interval")
    if interval and iteration % interval == 0:
        return f"train.exit_interval={interval}"
    return None


def exit_message(reason: str, iteration: int, saved) -> str:
    """The one line a run that stopped early prints: why, the checkpoint it left (``saved``: its
    iter dir, or None) and the command that continues it (from :data:`CONTINUE_ENV`)."""
    where = (f"checkpoint of iteration {iteration} saved to {saved}" if saved is not None else
             "no checkpoint saved (checkpoint.save=null)")
    how = os.environ.get(CONTINUE_ENV)
    go_on = f"; continue with: {how}" if how and saved is not None else ""
    return f"> exit on {reason} after iteration {iteration}: {where}{go_on}"


def interrupted_message(signame: str, save_root) -> str:
    """The closing line of a run stopped by Ctrl-C (or another signal it does not exit on with
    a save): the last complete checkpoint of ``save_root`` and the command that continues."""
    saved = saved_iterations(save_root) if save_root and Path(save_root).is_dir() else []
    if not saved:
        return f"> interrupted ({signame}): no complete checkpoint was saved"
    how = os.environ.get(CONTINUE_ENV)
    return (f"> interrupted ({signame}): the last complete checkpoint is "
            f"{iter_dir(save_root, saved[-1])}" + (f"; continue with: {how}" if how else ""))


def after_exit() -> None:
    """After the run stopped on a signal and saved: run the handler that :func:`install`
    replaced for it, if it was a Python one (submitit's requeues the job and exits). Of several
    signals received, submitit's preemption signal wins (its handler requeues; submitit's
    SIGTERM handler only logs), else the first."""
    preempt = os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")
    preempt = getattr(signal, "SIG" + preempt, None) if any(
        k.startswith("SUBMITIT_") for k in os.environ) else None
    signum = preempt if preempt in _received else received()
    handler = _previous.get(signum) if signum is not None else None
    if callable(handler):
        handler(signum, None)


def continue_command(argv: list[str], output_dir: str) -> str:
    """The command line that continues this run: ``python train.py`` with ``argv``'s overrides,
    ``checkpoint.load=auto`` instead of any ``checkpoint.load``/``load_iteration``, and
    ``hydra.run.dir`` pinned to ``output_dir`` (where ``checkpoint.save`` defaults to) unless
    given."""
    keep = [a for a in argv[1:] if not a.startswith(("checkpoint.load=", "checkpoint.load_iteration=",
                                                    "+checkpoint.load", "++checkpoint.load"))]
    if not any(a.startswith(("hydra.run.dir=", "hydra.sweep.dir=")) for a in keep):
        keep.append(f"hydra.run.dir={output_dir}")
    keep.append("checkpoint.load=auto")
    return " ".join(shlex.quote(a) for a in ["python", argv[0], *keep])


def forward_to_workers(signums: list[int], workers,
                       agent_signals: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT") -> str:
    """In train.py's local launch: pass ``signums`` on to the workers (``workers()``: their
    pids) instead of stopping them, so they save and exit 0; the launcher goes on waiting.

    torch's elastic agent turns the signals it handles into a teardown (``SignalException``):
    these are taken out of its list.

    Each signal reaches every worker once that worker handles it (``SigCgt`` of
    ``/proc/<pid>/status``: :func:`note_early` is its first act), and workers that start after
    it came get it too, from a thread that :func:`stop_forwarding` ends; a worker is never
    killed by a signal that arrived while it started.

    Returns:
        ``agent_signals`` (torch's ``LaunchConfig.signals_to_handle``) without ``signums``.
    """
    mine = {signal.Signals(s).name for s in signums}
    stop = threading.Event()
    _forwarding.append(stop)

    def deliver(signum) -> None:
        sent: set[int] = set()
        while not stop.is_set():
            pids = workers()
            for pid in pids:
                if pid not in sent and _catches(pid, signum):
                    try:
                        os.kill(pid, signum)
                    except ProcessLookupError:
                        pass
                    sent.add(pid)
            if sent and set(pids) <= sent:
                return
            stop.wait(0.02)

    def forward(signum, frame) -> None:
        print(f"> {signal.Signals(signum).name} received: the workers save at the end of the "
              f"iteration in flight, then stop", file=sys.stderr, flush=True)
        threading.Thread(target=deliver, args=(signum,), daemon=True,
                         name=f"forward-{signum}").start()

    for signum in signums:
        signal.signal(signum, forward)
    return ",".join(s for s in agent_signals.split(",") if s.strip() and s.strip() not in mine)


def stop_forwarding() -> None:
    """End the forwarding threads of :func:`forward_to_workers` (its launch is over)."""
    while _forwarding:
        _forwarding.pop().set()


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (True where ``/proc`` says nothing:
    the signal is sent as it is)."""
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except OSError:
        return False
    return True


def child_pids(module: str, parent: int | None = None) -> list[int]:
    """Pids of the live children of ``parent`` (default: this process) running
    ``python -m module``, from ``/proc``."""
    parent = os.getpid() if parent is None else parent
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) != parent or fields[0] == "Z":
                continue
            args = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if module.encode() in args:
            out.append(int(stat.parent.name))
    return out


# How long a rank whose collective failed waits for its own Ctrl-C (train.py's launcher sends it
# to every worker at once; a rank still in a collective sees the first one leave before that).
PEER_INTERRUPT_GRACE_S = 3.0


def part_of_interrupt(exc: BaseException, grace_s: float | None = None) -> bool:
    """Whether the error ``exc`` that ends this worker is its share of a Ctrl-C.

    True when a ``KeyboardInterrupt`` is in ``exc``'s chain (every ``__cause__`` and
    ``__context__``), or when the chain holds a failed collective (``torch.distributed.DistError``,
    or a ``RuntimeError`` whose message says "by peer", as gloo's "Connection closed by peer")
    and this process receives SIGINT within ``grace_s`` seconds (waited for here; a SIGINT the run
    exits on counts once noted after this call starts). Any other error is not; nor is a failed
    collective followed by no signal (a peer that crashed) or first by another one (the
    launcher's SIGTERM to the survivors of a crash), which returns as soon as that signal comes.

    Args:
        exc: the exception that left the worker's run.
        grace_s: seconds to wait for SIGINT after a failed collective (default
            :data:`PEER_INTERRUPT_GRACE_S`).
    """
    noted = len(_received)
    chain, todo = [], [exc]
    while todo:  # by identity: an exception chain may loop
        seen = todo.pop()
        if seen is not None and not any(seen is e for e in chain):
            chain.append(seen)
            todo += [seen.__cause__, seen.__context__]
    if any(isinstance(e, KeyboardInterrupt) for e in chain):
        return True
    if not any(collective_failed(e) for e in chain):
        return False
    deadline = time.monotonic() + (PEER_INTERRUPT_GRACE_S if grace_s is None else grace_s)
    try:
        while time.monotonic() < deadline:
            if _received[noted:]:
                return _received[noted] == signal.SIGINT
            time.sleep(0.05)
    except KeyboardInterrupt:
        return True
    return False


def collective_failed(exc: BaseException) -> bool:
    """A collective that failed because a peer left: any backend's ``DistError``, or gloo's
    ``RuntimeError``, which names its transport's "closed/reset by peer"."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and isinstance(exc, getattr(distributed, "DistError", ())):
        return True
    return isinstance(exc, RuntimeError) and "by peer" in str(exc)
