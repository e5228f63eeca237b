"""The launch queue alone (``runtime/launch_order.py``), with stand-ins for ``torch.distributed`` work:
in order, an operation starts only once the one launched before it has completed, and a waiter
names what it is queued behind; a helper's reserved place keeps its order on both modes."""

from __future__ import annotations

import datetime
import threading
import time

import pytest

from megatron_pp_ext.runtime.launch_order import Launcher


class Work:
    """A stand-in for dist.Work that completes when ``done`` is set."""

    def __init__(self, done: threading.Event | None = None) -> None:
        self.done = done or threading.Event()
        if done is None:
            self.done.set()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if not self.done.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError("timed out")
        return True


def recorder(started: list[str], name: str, done: threading.Event | None = None):
    def start() -> Work:
        started.append(name)
        return Work(done)

    return start


def test_in_order_an_operation_waits_for_the_one_before_it_and_the_waiter_names_it() -> None:
    launcher = Launcher(rank=0, timeout_s=0.5, in_order=True)
    started: list[str] = []
    peer_posted = threading.Event()
    first = launcher(recorder(started, "SEND_F0:1>1", peer_posted), "SEND_F0:1>1")
    second = launcher(recorder(started, "RECV_B0:0<1"), "RECV_B0:0<1")
    with pytest.raises(RuntimeError, match=r"RECV_B0:0<1 is launched behind SEND_F0:1>1, which has not"):
        second.wait()
    assert started == ["SEND_F0:1>1"] and not second.is_completed()
    peer_posted.set()  # the send's receive is posted: both complete, in order
    assert first.wait() and second.wait()
    assert started == ["SEND_F0:1>1", "RECV_B0:0<1"] and launcher.launched == 2
    launcher.close()


def test_without_emulation_a_launch_starts_at_once() -> None:
    launcher = Launcher(rank=0, timeout_s=0.5)
    started: list[str] = []
    never = threading.Event()
    work = launcher(recorder(started, "a", never), "a")
    launcher(recorder(started, "b"), "b")
    assert started == ["a", "b"] and isinstance(work, Work) and launcher.launched == 0


@pytest.mark.parametrize("in_order", [False, True])
def test_a_helper_launches_into_the_place_reserved_for_it(in_order: bool) -> None:
    """The main thread reserves the helper's place, then launches on; the helper fills it later:
    the helper's operation starts first on both modes (without emulation the main thread's
    launch waits for it)."""
    launcher = Launcher(rank=0, timeout_s=5.0, in_order=in_order)
    started: list[str] = []
    slot = launcher.reserve("REDUCE_S reduce")

    def helper() -> None:
        time.sleep(0.2)
        slot.fill(recorder(started, "REDUCE_S reduce")).wait()

    thread = threading.Thread(target=helper)
    thread.start()
    launcher(recorder(started, "BCAST_DEMB"), "BCAST_DEMB").wait()
    thread.join()
    assert started == ["REDUCE_S reduce", "BCAST_DEMB"]
    launcher.close()


@pytest.mark.parametrize("in_order", [False, True])
def test_a_failed_helper_frees_its_place(in_order: bool) -> None:
    launcher = Launcher(rank=0, timeout_s=5.0, in_order=in_order)
    started: list[str] = []
    slot = launcher.reserve("REDUCE_S reduce")
    slot.cancel(ValueError("the statistics were wrong"))
    if in_order:
        with pytest.raises(RuntimeError, match="the statistics were wrong"):
            slot.item.wait()
    launcher(recorder(started, "BCAST_DEMB"), "BCAST_DEMB")
    if not in_order:
        assert started == ["BCAST_DEMB"]
    launcher.close()


def test_without_emulation_an_unfilled_place_ends_in_a_named_error() -> None:
    launcher = Launcher(rank=0, timeout_s=0.3)
    first = launcher.reserve("REDUCE_S reduce")
    second = launcher.reserve("REDUCE_S TP all-reduce")
    with pytest.raises(RuntimeError, match="filled out of the order"):
        second.fill(recorder([], "x"))
    with pytest.raises(RuntimeError, match="BCAST_DEMB waits to be launched after REDUCE_S reduce"):
        launcher(recorder([], "BCAST_DEMB"), "BCAST_DEMB")
    first.fill(recorder([], "REDUCE_S reduce"))
    second.fill(recorder([], "REDUCE_S TP all-reduce"))
    launcher(recorder([], "BCAST_DEMB"), "BCAST_DEMB")
