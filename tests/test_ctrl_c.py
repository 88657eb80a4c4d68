"""Ctrl-C ends each worker with one line and no traceback, also the rank that was still in a
collective (a save's gather) when the first rank left: its failed collective is its share of
the interrupt when its own SIGINT follows (``recipes.run.preemption.part_of_interrupt``)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from recipes.run import preemption, worker


def peer_left() -> RuntimeError:
    """What gloo raises in a collective when a peer's process is gone (torch 2.14)."""
    return RuntimeError("[gloo/transport/tcp/pair.cc:561] Connection closed by peer "
                        "[127.0.0.1]:51353")


@pytest.fixture
def sigint_raises():
    """SIGINT raises ``KeyboardInterrupt``, as in a worker (Python's default; pytest-xdist's
    workers ignore SIGINT)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _sigint_in(seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    return timer


def test_a_failed_collective_followed_by_sigint_is_the_interrupt(sigint_raises):
    started = time.monotonic()
    timer = _sigint_in(0.2)
    try:
        assert preemption.part_of_interrupt(peer_left(), grace_s=30)
    finally:
        timer.cancel()
    assert time.monotonic() - started < 10, "returns when the signal comes, not at the deadline"


def test_a_failed_collective_without_sigint_is_an_error():
    """A peer that crashed: the error stands, after the grace period."""
    started = time.monotonic()
    assert not preemption.part_of_interrupt(peer_left(), grace_s=0.3)
    assert time.monotonic() - started >= 0.3


def test_a_failed_collective_then_another_signal_is_an_error_at_once(monkeypatch):
    """The launcher's SIGTERM to the survivors of a crashed rank ends the wait; a SIGINT
    noted before the failure (``train.exit_signal=SIGINT``) is not this one."""
    noted = [signal.SIGINT]
    monkeypatch.setattr(preemption, "_received", noted)
    timer = threading.Timer(0.2, noted.append, (signal.SIGTERM,))
    timer.start()
    started = time.monotonic()
    try:
        assert not preemption.part_of_interrupt(peer_left(), grace_s=30)
    finally:
        timer.cancel()
    assert time.monotonic() - started < 10


def test_other_errors_are_errors_at_once_and_a_chained_interrupt_is_the_interrupt():
    started = time.monotonic()
    assert not preemption.part_of_interrupt(ValueError("bad shape"), grace_s=30)
    assert time.monotonic() - started < 5
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise peer_left()  # e.g. a cleanup's collective after this rank's own Ctrl-C
    except RuntimeError as exc:
        assert preemption.part_of_interrupt(exc, grace_s=0)


@pytest.fixture
def worker_raising(tmp_path, monkeypatch):
    """``recipes.run.worker.main`` on a config file, its run raising :func:`peer_left`."""
    (tmp_path / "resolved_config.yaml").write_text("{}\n")
    monkeypatch.delenv(worker.LAUNCHER_PID_ENV, raising=False)
    monkeypatch.setenv("RANK", "0")

    def run_or_refuse(cfg, launched):
        raise peer_left()

    monkeypatch.setattr(worker, "_run_or_refuse", run_or_refuse)
    monkeypatch.setattr(preemption, "_received", [])
    return [str(tmp_path / "resolved_config.yaml")]


def test_the_worker_prints_one_line_when_sigint_follows_its_failed_collective(worker_raising,
                                                                              capsys, monkeypatch,
                                                                              sigint_raises):
    monkeypatch.setattr(preemption, "PEER_INTERRUPT_GRACE_S", 30.0)  # a slow machine's timer
    timer = _sigint_in(0.2)
    try:
        with pytest.raises(SystemExit) as exit_:
            worker.main(worker_raising)
    finally:
        timer.cancel()
    assert exit_.value.code == 130 and exit_.value.__suppress_context__
    assert capsys.readouterr().err == "> rank 0: interrupted\n"


def test_the_worker_raises_a_failed_collective_that_no_sigint_follows(worker_raising,
                                                                     monkeypatch):
    monkeypatch.setattr(preemption, "PEER_INTERRUPT_GRACE_S", 0.2)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        worker.main(worker_raising)
