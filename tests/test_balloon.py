"""The beyond-RAM bench's balloon: it holds memory, keeps the floor, and stops."""

from __future__ import annotations

import pytest

from moestream.bench.balloon import CHUNK, Balloon, available


def test_balloon_refuses_to_take_the_machine_under_its_floor():
    with pytest.raises(ValueError, match="floor"):
        Balloon(leave=1 << 30, floor=4 << 30)


@pytest.mark.slow
def test_balloon_holds_memory_until_the_block_ends():
    before = available()
    if before < (6 << 30):
        pytest.skip("less than 6 GB available")
    with Balloon(leave=before - 3 * CHUNK, floor=4 << 30) as b:
        assert b.held >= 2 * CHUNK
        assert available() < before - CHUNK
        proc = b._proc
    assert proc.poll() is not None  # stopped, its memory returned
