"""How late a watched device wait notices the device got there (``Watch.poll``), with fake completions.

On a GPU the host blocks only where it reads what the device computed (the step's signals, the clock's last event,
ZeRO's norms); each such read waits under the watch (a hang gets a wait-for report). This measures how long after
the completion the wait returns: a fake CUDA event completes at a chosen time (``query()`` is True from then on and
``synchronize()`` returns then, as cudaEventSynchronize would), and the lateness is the time from that moment to
the return of ``poll``. Beside it, for comparison, a sleep-poll with a doubling pause capped at 10 ms (the wait
this replaced). The target is p99 <= 0.2 ms for the watch.

    python -m benchmarks.lateness [--waits 0.1 0.5 2 5 10 25] [--reps 200]

Timings only: run it on an idle machine and quote one run's figures.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch.distributed as dist

from pipeengine.runtime.faults import Watch


class FakeEvent:
    """A CUDA event the device reaches at ``at`` (perf_counter seconds). ``synchronize()`` sleeps (the GIL
    released, as torch's is) until then; the completion is when it returns (``done``: the driver's word), so a
    sleep's own overshoot is not counted against the wait."""

    def __init__(self, at: float) -> None:
        self.at = self.done = at

    def query(self) -> bool:
        return time.perf_counter() >= self.at

    def synchronize(self) -> None:
        time.sleep(max(0.0, self.at - time.perf_counter()))
        self.done = max(self.at, time.perf_counter())


def sleep_poll(event: FakeEvent) -> None:
    """The wait before: query, sleep a pause doubling from 0.1 ms to 10 ms, query again."""
    pause = 1e-4
    while not event.query():
        time.sleep(pause)
        pause = min(2 * pause, 0.01)


def lateness(wait: Callable[[FakeEvent], None], after: float, reps: int) -> list[float]:
    """Seconds each of ``reps`` waits returned after a completion ``after`` seconds away."""
    out = []
    for _ in range(reps):
        event = FakeEvent(time.perf_counter() + after)
        wait(event)
        out.append(time.perf_counter() - event.done)
    return sorted(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--waits", type=float, nargs="+", default=[0.1, 0.5, 2, 5, 10, 25],
                    help="how far away the completion is, in ms (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=200, help="waits per distance (default: %(default)s)")
    args = ap.parse_args()
    watch = Watch(dist.HashStore(), 0, 1)   # a one-rank watch: only its device wait is used
    watch.timeout = 60.0
    ways = {"watch (spin, then block on the event)": lambda e: watch.poll(e, "a device read", []),
            "sleep-poll, doubling pause to 10 ms": sleep_poll}
    print("| wait | completion in | lateness p50 | p99 | max |")
    print("|---|---:|---:|---:|---:|")
    worst = 0.0
    for name, wait in ways.items():
        for ms in args.waits:
            late = lateness(wait, ms / 1000.0, args.reps)
            p50, p99 = late[len(late) // 2], late[min(len(late) - 1, int(0.99 * len(late)))]
            if wait is not sleep_poll:
                worst = max(worst, p99)
            print(f"| {name} | {ms:g} ms | {p50 * 1e3:.3f} ms | {p99 * 1e3:.3f} ms | {late[-1] * 1e3:.3f} ms |")
    print(f"\nwatch: worst p99 {worst * 1e3:.3f} ms (target <= 0.2 ms); {watch.device_reads} device reads counted")
    watch.close()


if __name__ == "__main__":
    main()
