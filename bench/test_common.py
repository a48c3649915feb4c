#!/usr/bin/env python3
"""Tests of the baselines' frame loop (bench/common.py) without a GPU: a stand-in handler whose
"frames" are host values, so the producer/consumer protocol (ring, acknowledgements, phases,
several consumers, a consumer that fails, records) is checked on any machine.
Run: python3 bench/test_common.py"""

from __future__ import annotations

import multiprocessing
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

RING_VALUES = {}  # the producer's "GPU frames": slot -> value


class FakeHandler:
    """Frames are (slot, value) pairs; a frame is correct when its value is seed(i)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.bad = 0

    def start(self):
        if self.cfg.get("fail_at_start"):
            raise RuntimeError("made to fail")

    def take(self, i, idx, payload):
        return payload

    def check(self, frame, i):
        self.bad += frame[1] != common.seed(i)

    def done(self, frame, idx):
        pass

    def mismatches(self):
        n, self.bad = self.bad, 0
        return n


def fake_consumer_proc(q, ack, res, c, ppid, cfg):
    common.consumer_loop(q, ack, res, c, ppid, FakeHandler(cfg))


def run(consumers: int, cfg: dict, corrupt: bool = False) -> list:
    mp = multiprocessing.get_context("spawn")
    slots = {}

    def prepare(i, idx):
        slots[idx] = common.seed(i) + (1 if corrupt and i == 7 else 0)

    def publish(i, idx):
        return (idx, slots[idx])

    s = common.Session(mp, fake_consumer_proc, consumers, cfg, startup_s=60)
    try:
        idle = s.run_phase("idle", 20, 5, 100, True, prepare, publish)
        sat = s.run_phase("saturated", 200, 10, 0, False, prepare, publish)
    finally:
        s.close()
    recs, mism, ooo = common.phase_records(common.Key("throughput", "fake", f"c{consumers}", ""), sat, 200, True,
                                           lat_key=common.Key("handoff", "fake", "saturated", ""))
    irecs, imism, _ = common.phase_records(common.Key("handoff", "fake", "idle", ""), idle, 20, False)
    assert len(idle["consumers"]) == consumers and len(sat["consumers"]) == consumers
    for r in idle["consumers"]:
        assert len(r["lat_ns"]) == 20, len(r["lat_ns"])
        assert r["received"] == 25
    for r in sat["consumers"]:
        assert len(r["lat_ns"]) == 200 and r["out_of_order"] == 0
    assert ooo == 0
    return [recs, mism + imism, irecs]


def test_one_consumer_every_frame_correct() -> None:
    recs, mism, irecs = run(1, {})
    assert mism == 0
    ids = {r["id"] for r in recs + irecs}
    assert "throughput.fake.c1.frames_per_s.value" in ids
    assert "handoff.fake.saturated.ready.p50" in ids
    assert "handoff.fake.idle.ready.p99" in ids
    fps = [r for r in recs if r["metric"] == "frames_per_s"][0]["value"]
    assert fps > 0


def test_three_consumers_and_a_corrupt_frame_is_counted() -> None:
    recs, mism, _ = run(3, {}, corrupt=True)
    assert mism == 6, mism  # frame 7 of each phase is wrong; each of the 3 consumers sees both


def test_a_consumer_that_fails_fails_the_session_promptly() -> None:
    try:
        run(1, {"fail_at_start": True})
    except RuntimeError as e:
        assert "made to fail" in str(e), e
    else:
        raise AssertionError("the session should have failed")


if __name__ == "__main__":
    failed = 0
    tests = [v for k, v in sorted(globals().items()) if k.startswith("test_")]
    for t in tests:
        try:
            t()
            print(f"ok {t.__name__}")
        except Exception as e:
            failed += 1
            print(f"FAILED {t.__name__}: {type(e).__name__}: {e}")
    print(f"{len(tests) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)
