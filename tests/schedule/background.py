"""The schedule sweep in a process of its own, started when the suite is collected.

``test_every_builder_validates_and_simulates`` at pp 1..8 is about 25 s of single-threaded Python, while the
suite keeps two cores about 40% busy (most tests wait on processes they started): run in a background process
(at low priority) from the start of the session, its figures are ready when its tests come, and each test asserts
what the process found for its pp, the same checks as in-process. Run as a module it checks the pps given::

    python -m tests.schedule.background 4 5      # one JSON line per pp: {"pp": 4, "error": null}
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

__all__ = ["start", "result", "stop", "check"]

_state: dict[str, Any] = {}


def check(pp: int) -> None:
    """Every builder at ``pp`` (see test_builders.test_every_builder_validates_and_simulates)."""
    from tests.schedule.test_builders import SWEEP, _check_one, _microbatches
    for name, v in SWEEP:
        for m in _microbatches(name, pp):
            _check_one(name, pp, m, v)


def start(pps: list[int]) -> None:
    """Check ``pps`` in a background process (once per session)."""
    if _state or not pps:
        return
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tempfile.NamedTemporaryFile("w+", suffix=".jsonl", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "tests.schedule.background", *map(str, pps)], cwd=root,
                            stdout=out, stderr=subprocess.STDOUT, text=True, preexec_fn=lambda: os.nice(10))
    _state.update(proc=proc, out=out.name, pps=set(pps))


def result(pp: int, timeout: float) -> str | None | bool:
    """What the background process found at ``pp``: None (passed) or the failure's traceback; False if it does not
    check that pp, or has not within ``timeout`` seconds (a loaded machine: run it in-process)."""
    if pp not in _state.get("pps", ()):
        return False
    deadline = time.monotonic() + timeout
    while True:
        done = _state["proc"].poll() is not None
        with open(_state["out"]) as fh:
            text = fh.read()
        for line in text.splitlines():
            if line.startswith("{"):
                found = json.loads(line)
                if found["pp"] == pp:
                    return found["error"]   # type: ignore[no-any-return]
        if done:
            return f"the background sweep ended without a result for pp {pp}:\n{text[-3000:]}"
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def stop() -> None:
    if _state:
        if _state["proc"].poll() is None:
            _state["proc"].kill()
        _state["proc"].wait()
        os.unlink(_state["out"])
        _state.clear()


def main() -> None:
    for pp in map(int, sys.argv[1:]):
        try:
            check(pp)
            error = None
        except BaseException:   # (an assertion, or anything the builders raise)
            error = traceback.format_exc()
        print(json.dumps({"pp": pp, "error": error}), flush=True)


if __name__ == "__main__":
    main()
