"""services/step_timer.py: the step loop's phase clock, and how much of a span ran beside a
generation that was still in flight (one_step_off's sync beside the next step's generation)."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from services.step_timer import PhaseTimer, finished_at, seconds_beside


@pytest.mark.parametrize("span, ended_at, want", [
    ((10.0, 11.0), None, 1.0),    # still running when the sync ended: all of it beside
    ((10.0, 11.0), 10.25, 0.25),  # ended within the sync (a merging replica waited for it)
    ((10.0, 11.0), 9.0, 0.0),     # ended before the sync began
    ((10.0, 11.0), 12.0, 1.0),    # ended after the sync
    (None, 10.0, 0.0),            # no sync timed this step
])
def test_seconds_beside(span, ended_at, want):
    assert seconds_beside(span, ended_at) == pytest.approx(want)


def test_finished_at_reads_none_while_running_then_the_end():
    release = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(release.wait)
        ended = finished_at(fut)
        assert ended() is None
        timer = PhaseTimer()
        with timer("update_weights"):
            release.set()
            fut.result()
        start, end = timer.spans["update_weights"]
        assert start <= ended() <= end
        assert seconds_beside(timer.spans["update_weights"], ended()) == pytest.approx(ended() - start)
    done: Future = Future()
    done.set_result(1)
    assert finished_at(done)() is not None  # a future already done gets its time at once


def test_phase_timer_keeps_each_phases_last_span_and_refuses_unknown_names():
    timer = PhaseTimer()
    with timer("gen"):
        pass
    with timer("gen"):
        pass
    start, end = timer.spans["gen"]
    assert end >= start and timer.seconds["gen"] >= end - start
    with pytest.raises(ValueError, match="unknown phase 'sync'"):
        with timer("sync"):
            pass
