"""Shared parts of the Python baselines: the frame loop, records, clocks, and guards.

Every baseline runs the same loop as the Rust suite (`bench/suite`, binary `bench_suite`): a
producer (this process) owns a ring of 4 frames of 3840x2160 RGBA (33,177,600 bytes); it fills frame i with a GPU
kernel, waits for it, takes t0 = CLOCK_MONOTONIC, hands the frame over, and reuses a slot only once
every consumer acknowledged it. A consumer process takes the frame (ready = now - t0), checks every
word of it with a GPU kernel, waits for its stream and acknowledges.

Two phases per session:
- idle: the producer waits for every acknowledgement, then for a gap, before it hands the next frame
  over, so the consumer is idle in its wait and the latency is the hand-off, not queueing;
- saturated: the producer hands frames over as fast as the ring lets it; frames/s is measured from
  the end of a warm-up to the last consumer's end.

Records have the same shape as the Rust suite's (see records.rs there): id, bench, impl, scenario,
metric, stat, value, unit, n, params. The consumer processes are started with the `spawn` method
(CUDA does not survive fork), die with the producer (PR_SET_PDEATHSIG) and stop waiting when it is
gone; every wait of the producer has a deadline.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import math
import os
import queue
import signal
import sys
import time
import traceback

WIDTH, HEIGHT = 3840, 2160
FRAME_BYTES = WIDTH * HEIGHT * 4
RING = 4
STEP_S = 30.0  # the longest any single wait may take before it counts as a hang


def now_ns() -> int:
    """CLOCK_MONOTONIC in ns: the clock the Rust suite uses, the same in every process."""
    return time.monotonic_ns()


def seed(i: int) -> int:
    """The fill value of frame i (a positive int32, different for consecutive frames)."""
    return (i * 2654435761 + 12345) & 0x7FFFFFFF


def die_with_parent() -> None:
    """Asks the kernel to SIGKILL this process when its parent dies (Linux prctl)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def percentile(v: list, p: float) -> float:
    """Nearest-rank percentile of sorted v (p in 0..1)."""
    if not v:
        return math.nan
    rank = math.ceil(p * len(v))
    return v[min(max(rank, 1), len(v)) - 1]


class Key:
    """Names a group of records: benchmark, implementation, scenario, and how it was run."""

    def __init__(self, bench: str, impl: str, scenario: str, params: str):
        self.bench, self.impl, self.scenario, self.params = bench, impl, scenario, params

    def rec(self, metric: str, stat: str, value: float, unit: str, n: int) -> dict:
        ok = value is not None and math.isfinite(value)
        return {
            "id": f"{self.bench}.{self.impl}.{self.scenario}.{metric}.{stat}",
            "bench": self.bench,
            "impl": self.impl,
            "scenario": self.scenario,
            "metric": metric,
            "stat": stat,
            "value": round(value, 3) if ok else None,
            "unit": unit,
            "n": n,
            "params": self.params,
        }

    def dist_us(self, metric: str, samples_ns: list) -> list:
        """min, p10, p25, p50, p75, p90, p99, p99.9, max, mean of samples (ns) as records in us."""
        v = sorted(x for x in samples_ns if x is not None and math.isfinite(x))
        if not v:
            return []
        stats = [
            ("min", v[0]),
            ("p10", percentile(v, 0.10)),
            ("p25", percentile(v, 0.25)),
            ("p50", percentile(v, 0.50)),
            ("p75", percentile(v, 0.75)),
            ("p90", percentile(v, 0.90)),
            ("p99", percentile(v, 0.99)),
            ("p99.9", percentile(v, 0.999)),
            ("max", v[-1]),
            ("mean", sum(v) / len(v)),
        ]
        return [self.rec(metric, s, x / 1e3, "us", len(v)) for s, x in stats]


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def write_result(out_dir: str, name: str, records: list, info: dict, errors: list, env: dict) -> str:
    """Writes OUT/NAME.json (same top-level shape as bench_suite.json) and returns its path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    doc = {
        "suite": name,
        "schema": 1,
        "complete": True,
        "date_utc": utc_now(),
        "env": env,
        "frame": {"width_px": WIDTH, "height_px": HEIGHT, "bytes_per_pixel": 4,
                  "bytes": FRAME_BYTES, "ring": RING},
        "records": records,
        "info": info,
        "errors": errors,
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return path


# ----------------------------------------------------------------------------- consumer side

class TorchCheck:
    """The check, release and mismatch count that the PyTorch-based consumers share. A subclass's
    `start` sets `self.torch` (the module, imported there) and `self.bad` (a device int64 zero)."""

    def check(self, frame, i):
        self.bad += (frame != seed(i)).sum()

    def done(self, frame, idx):
        self.torch.cuda.current_stream().synchronize()

    def mismatches(self):
        n = int(self.bad.item())
        self.bad.zero_()
        return n


def consumer_loop(q, ack, res, c: int, ppid: int, handler) -> None:
    """Runs in a consumer process. `handler` has:
    take(i, idx, payload) -> frame   (returns once the frame is usable on this process's GPU)
    check(frame, i)                  (enqueues the check of every word)
    done(frame, idx)                 (waits for this process's GPU work and lets the frame go)
    mismatches() -> int              (mismatched words since the last call; may synchronise)
    Items: (i, idx, t0, payload) frames; ("end", phase) closes a phase; None stops."""
    die_with_parent()
    try:
        handler.start()
        res.put(("ready", c, None))
        lat, take, release = [], [], []
        received, out_of_order, t_done, expect = 0, 0, None, None
        while True:
            try:
                item = q.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != ppid:
                    return
                continue
            if item is None:
                return
            if isinstance(item[0], str):  # ("end", phase, warmup)
                _, phase, warmup = item
                res.put(("phase", c, {
                    "phase": phase, "lat_ns": lat[warmup:], "take_ns": take[warmup:],
                    "release_ns": release[warmup:], "received": received,
                    "out_of_order": out_of_order, "mismatches": handler.mismatches(),
                    "t_done_ns": t_done,
                }))
                lat, take, release = [], [], []
                received, out_of_order, t_done, expect = 0, 0, None, None
                continue
            i, idx, t0, payload = item
            if expect is not None and i != expect:
                out_of_order += 1
            expect = i + 1
            a = now_ns()
            frame = handler.take(i, idx, payload)
            t_ready = now_ns()
            del payload, item
            handler.check(frame, i)
            r = now_ns()
            handler.done(frame, idx)
            t_done = now_ns()
            del frame
            ack.put(idx)
            lat.append(t_ready - t0)
            take.append(t_ready - a)
            release.append(t_done - r)
            received += 1
    except Exception:  # reported to the producer, which fails the session with it
        res.put(("error", c, traceback.format_exc()))


# ----------------------------------------------------------------------------- producer side

class Session:
    """The producer's side: starts `n` consumer processes running `target(q, ack, res, c, ppid,
    cfg)` and drives phases of the frame loop through them."""

    def __init__(self, mp_ctx, target, n: int, cfg: dict, startup_s: float = 180.0):
        self.n = n
        self.qs = [mp_ctx.Queue() for _ in range(n)]
        self.ack = mp_ctx.Queue()
        self.res = mp_ctx.Queue()
        self.procs = [
            mp_ctx.Process(target=target, args=(self.qs[c], self.ack, self.res, c, os.getpid(), cfg),
                           daemon=True)
            for c in range(n)
        ]
        for p in self.procs:
            p.start()
        for _ in range(n):
            self._expect("ready", startup_s)

    def _expect(self, kind: str, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                msg = self.res.get(timeout=0.5)
            except queue.Empty:
                dead = [p.pid for p in self.procs if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"consumer process(es) {dead} died while waiting for {kind!r}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no {kind!r} from the consumers within {timeout_s} s")
                continue
            if msg[0] == "error":
                raise RuntimeError(f"consumer {msg[1]} failed:\n{msg[2]}")
            if msg[0] == kind:
                return msg

    def _collect_ack(self, pending: list, free: list) -> None:
        deadline = time.monotonic() + STEP_S
        while True:
            try:
                idx = self.ack.get(timeout=0.5)
                break
            except queue.Empty:
                try:
                    msg = self.res.get_nowait()
                    if msg[0] == "error":
                        raise RuntimeError(f"consumer {msg[1]} failed:\n{msg[2]}")
                except queue.Empty:
                    pass
                if any(not p.is_alive() for p in self.procs):
                    raise RuntimeError("a consumer process died")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no acknowledgement within {STEP_S} s")
        pending[idx] -= 1
        if pending[idx] == 0:
            free.append(idx)

    def run_phase(self, name: str, frames: int, warmup: int, gap_us: int, paced: bool,
                  prepare, publish) -> dict:
        """One phase of warmup + frames frames. prepare(i, idx) fills slot idx and waits for it;
        publish(i, idx) -> payload does the hand-off work and returns what the consumers get.
        Returns the consumers' results, the producer's publish-call times and t_start."""
        pending = [0] * RING
        free = list(range(RING))
        publish_ns = []
        t_start = now_ns()
        for i in range(warmup + frames):
            if i == warmup or paced:
                while any(pending):
                    self._collect_ack(pending, free)
                if i == warmup:
                    t_start = now_ns()
            while not free:
                self._collect_ack(pending, free)
            idx = free.pop(0)
            prepare(i, idx)
            if paced and gap_us:
                time.sleep(gap_us / 1e6)
            t0 = now_ns()
            payload = publish(i, idx)
            for q in self.qs:
                q.put((i, idx, t0, payload))
            pending[idx] = self.n
            if i >= warmup:
                publish_ns.append(now_ns() - t0)
            del payload
        while any(pending):
            self._collect_ack(pending, free)
        for q in self.qs:
            q.put(("end", name, warmup))
        results = [self._expect("phase", STEP_S)[2] for _ in range(self.n)]
        return {"consumers": results, "publish_ns": publish_ns, "t_start_ns": t_start}

    def close(self) -> None:
        for q in self.qs:
            try:
                q.put(None)
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=15)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def phase_records(key: Key, out: dict, frames: int, saturated: bool, lat_key: Key | None = None) -> tuple:
    """Records of one phase: hand-off latency (under `lat_key` when given), take and release times;
    with `saturated`, frames/s and GB/s. Returns (records, mismatched words, frames out of order)."""
    cons = out["consumers"]
    lat = [x for r in cons for x in r["lat_ns"]]
    recs = (lat_key or key).dist_us("ready", lat)
    recs += key.dist_us("take_call", [x for r in cons for x in r["take_ns"]])
    recs += key.dist_us("release_call", [x for r in cons for x in r["release_ns"]])
    recs += key.dist_us("publish_call", out["publish_ns"])
    mism = sum(int(r["mismatches"]) for r in cons)
    ooo = sum(int(r["out_of_order"]) for r in cons)
    if saturated:
        t_end = max(r["t_done_ns"] or 0 for r in cons)
        secs = (t_end - out["t_start_ns"]) / 1e9
        fps = frames / secs if secs > 0 else math.nan
        recs.append(key.rec("frames_per_s", "value", fps, "frames/s", frames))
        recs.append(key.rec("gb_per_s", "value", fps * FRAME_BYTES / 1e9, "GB/s", frames))
        recs.append(key.rec("consumer_read_gb_per_s", "value",
                            fps * FRAME_BYTES * len(cons) / 1e9, "GB/s", frames))
    recs.append(key.rec("mismatches", "value", mism, "words", frames * len(cons)))
    recs.append(key.rec("out_of_order", "value", ooo, "frames", frames * len(cons)))
    return recs, mism, ooo


def add_common_args(p) -> None:
    p.add_argument("--out", required=True, help="directory for the JSON result (created if missing)")
    p.add_argument("--quick", action="store_true", help="a smoke test with few frames")


def fail(out_dir: str, name: str, msg: str, env: dict) -> int:
    """Writes a result that holds only the error, prints it, and returns exit status 1."""
    print(f"{name}: {msg}", file=sys.stderr)
    write_result(out_dir, name, [], {}, [{"case": name, "error": msg}], env)
    return 1
