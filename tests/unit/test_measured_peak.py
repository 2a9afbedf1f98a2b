"""The CPU peak measurement (shardlm/metrics/peak.py) that the planner's predictions are checked against:
the replay of the allocator's events, and a real profiled function whose allocations are known."""

from __future__ import annotations

import torch

from shardlm.metrics.peak import measure_peak, replay_allocations


def test_an_address_allocated_again_ends_its_unrecorded_block():
    """A block freed on an unprofiled thread (no free event) whose address the allocator hands out again is
    counted once, not twice: the plain running sum would give a peak of 250 and an end of 100."""
    a, b = 0x1000, 0x2000
    events = [(0, 100, a), (1, 50, b), (2, 100, a), (3, -100, a), (4, -50, b)]
    assert replay_allocations(events) == (0, 150)
    # a reused address with another size: the old block's bytes leave, the new block's come
    assert replay_allocations([(0, 100, a), (1, 40, a), (2, 30, b)]) == (70, 100)


def test_with_no_address_reused_the_replay_is_the_running_sum():
    """With no address allocated twice the replay is the plain running sum of the events, a free at an
    address the events never allocated included."""
    a, b, c = 0x1000, 0x2000, 0x3000
    events = [(0, -30, c), (1, 40, a), (2, 60, b), (3, -40, a), (4, 10, a)]
    running = [sum(e[1] for e in events[: i + 1]) for i in range(len(events))]
    assert replay_allocations(events) == (running[-1], max(0, *running)) == (40, 70)


def test_measured_peak_of_known_allocations():
    """Two buffers of 1 MiB and 512 KiB alive together, then freed: the measured peak is their sum over the
    start (to the byte) and the end is the start again."""
    def fn() -> None:
        x = torch.empty(1 << 20, dtype=torch.uint8)
        y = torch.empty(1 << 19, dtype=torch.uint8)
        del x, y
        z = torch.empty(1 << 10, dtype=torch.uint8)
        del z

    m = measure_peak(fn, torch.device("cpu"))
    assert m["peak"] - m["start"] == (1 << 20) + (1 << 19)
    assert m["end"] == m["start"]
