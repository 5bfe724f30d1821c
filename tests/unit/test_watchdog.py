"""The engine watchdog names how the engine ended even when vLLM's own liveness monitor reaps it first."""

from __future__ import annotations

import os
import signal
import time

import pytest

from hscapture.errors import EngineDiedError
from hscapture.lifetime import Watchdog, describe_exit


class ReapedElsewhere:
    """An engine process another thread reaps: its status appears on the shared object a moment after its
    sentinel fires, as when vLLM's monitor wins ``waitpid`` (seen on vLLM 0.32, 2026-12-01)."""

    name = "EngineCore"
    pid = 4242

    def __init__(self, late_polls: int) -> None:
        self.sentinel, self._w = os.pipe()
        self._polls = late_polls

    def die(self) -> None:
        os.close(self._w)

    @property
    def exitcode(self) -> int | None:
        self._polls -= 1
        return None if self._polls >= 0 else -signal.SIGKILL

    def join(self, timeout: float) -> None:
        time.sleep(timeout)


def test_the_signal_is_named_when_another_thread_reaps_the_engine():
    engine = ReapedElsewhere(late_polls=20)
    with pytest.raises(EngineDiedError, match=r"EngineCore \(pid 4242\) was killed by SIGKILL"):
        with Watchdog([engine]):
            engine.die()
            time.sleep(10)
    os.close(engine.sentinel)


def test_exit_descriptions():
    assert describe_exit(None) == "is gone"
    assert describe_exit(-9) == "was killed by SIGKILL"
    assert describe_exit(3) == "exited with status 3"
