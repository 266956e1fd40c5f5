"""A generator waits out a service it cannot reach (a restart, a network partition) for
`generator.buffer_patience_s`, the buffer and the weight-sync service alike, then gives up naming it."""

from __future__ import annotations

import pytest

from actors.generator import _Patience


def test_a_silent_service_is_waited_for_within_patience_then_named():
    def silent():
        raise TimeoutError("weight-sync service at tcp://10.213.1.1:5600 did not answer Poll within 10.0s")

    p = _Patience(300.0, "weight-sync service")
    assert p.call(silent) is None and p.call(silent) is None  # within patience: the loop goes on
    assert p.call(lambda: "answer") == "answer" and p.since is None  # an answer starts it afresh
    strict = _Patience(0.0, "weight-sync service")
    assert strict.call(silent) is None  # (the first silence starts the clock)
    with pytest.raises(TimeoutError, match="^weight-sync service silent for"):
        strict.call(silent)
