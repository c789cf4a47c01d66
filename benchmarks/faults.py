"""Fault table: what a user of launch/pipe.sh sees for each fault, and how long until every process is gone.

    python -m benchmarks.faults            # about 3 minutes on 2 cores
    python -m benchmarks.faults --only sigstop nan

Run from the repository root. Each scenario starts ``launch/pipe.sh N cpus`` (or, for an exception
inside a layer, the ranks of ``tests/fault_worker.py`` without torchrun), injects the fault, and
records the first line the user sees that explains it, the exit status, and the seconds from the
fault until no process of the run is left. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, free_port, process_tree
EXPLAINS = re.compile(r"(error:|pipeengine: wait-for report|SIGINT:|SIGTERM:|pipe.sh: (?!\d+ ranks)|ChildFailedError|"
                      r"PeerFailed|Killed)")


def _tree(root: int) -> set[int]:
    """``root`` and every process below it, still alive."""
    return {p for p in process_tree(root) if _alive(p)}


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _workers(root: int) -> list[int]:
    out = []
    for pid in sorted(_tree(root)):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "pipeengine.train" in args and "torch.distributed.run" not in args:
            out.append(pid)
    return out


class Run:
    def __init__(self, cmd: list[str], env: dict[str, str] | None = None) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, text: str, limit: float = 120) -> None:
        deadline = time.monotonic() + limit
        while not any(text in ln for ln in self.lines):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"no {text!r}: " + "\n".join(self.lines[-20:]))
            time.sleep(0.05)

    def finish(self, t0: float, limit: float = 120, procs: set[int] | None = None) -> dict[str, Any]:
        """Wait until every process of the run (``procs``: taken before the fault) has exited."""
        procs = (procs or set()) | _tree(self.proc.pid)
        deadline = t0 + limit
        while any(_alive(p) for p in procs) and time.monotonic() < deadline:
            procs |= _tree(self.proc.pid) if self.proc.poll() is None else set()
            time.sleep(0.05)
        seconds = time.monotonic() - t0
        left = [p for p in procs if _alive(p)]
        for p in left:
            os.kill(p, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self._reader.join(timeout=5)
        seen = [ln for ln in self.lines if EXPLAINS.search(ln) and not ln.startswith("+ ")]
        first = re.sub(r"^\[default\d+\]:", "", seen[0]) if seen else "(nothing)"
        return {"status": self.proc.returncode, "seconds": seconds, "first": first, "left": len(left),
                "lines": len(self.lines)}


def pipe(n: int, *flags: str) -> list[str]:
    return ["bash", str(ROOT / "launch" / "pipe.sh"), str(n), "cpus", "--log-dir", LOGS, *flags]


MLP = ["--model", "mlp", "--steps", "100000", "--eval-interval", "0", "--log-interval", "1"]
LOGS = tempfile.mkdtemp(prefix="pe-faults-")


def bad_input(flags: list[str], n: int = 2) -> dict[str, Any]:
    t0 = time.monotonic()
    return Run(pipe(n, "--model", "mlp", *flags)).finish(t0)


def signal_worker(sig: int, *flags: str) -> dict[str, Any]:
    """Send ``sig`` to rank 1 of a pp2 x dp2 run after its fifth step."""
    r = Run(pipe(4, *MLP, *flags))
    r.wait_for("step 5/")
    procs = _tree(r.proc.pid)
    os.kill(_workers(r.proc.pid)[1], sig)
    return r.finish(time.monotonic(), procs=procs)


def kill_launcher() -> dict[str, Any]:
    r = Run(pipe(2, *MLP))
    r.wait_for("step 5/")
    torchrun = [p for p in _tree(r.proc.pid) if b"torch.distributed.run" in Path(f"/proc/{p}/cmdline").read_bytes()]
    procs = _tree(r.proc.pid)
    t0 = time.monotonic()
    os.kill(min(torchrun), signal.SIGKILL)
    return r.finish(t0, procs=procs)


def ctrl_c() -> dict[str, Any]:
    r = Run(pipe(2, *MLP, "--save-on-exit", "--save-dir", os.path.join(LOGS, "ck")))
    r.wait_for("step 5/")
    procs = _tree(r.proc.pid)
    t0 = time.monotonic()
    os.killpg(r.proc.pid, signal.SIGINT)
    return r.finish(t0, procs=procs)


def nan() -> dict[str, Any]:
    t0 = time.monotonic()
    return Run(pipe(2, "--model", "mlp", "--steps", "20", "--lr", "1e30", "--optimizer", "sgd", "--grad-clip",
                    "0")).finish(t0)


def layer_exception() -> dict[str, Any]:
    """Rank 1 raises in a layer's forward at step 2 and stays alive; no torchrun."""
    port = free_port()
    runs = [Run([sys.executable, "-m", "tests.fault_worker", str(r), "3", str(port), "raise"],
                env={"OMP_NUM_THREADS": "1"}) for r in range(3)]
    runs[0].wait_for("step 1")
    t0 = time.monotonic()
    out = [runs[r].finish(t0, limit=30) for r in (0, 2)]   # rank 1 stays alive on purpose (a user's launcher)
    runs[1].finish(t0, limit=0)
    return {**out[0], "seconds": max(o["seconds"] for o in out), "status": [o["status"] for o in out]}


SCENARIOS: dict[str, tuple[str, Any]] = {
    "timeout0": ("`--timeout 0`", lambda: bad_input(["--timeout", "0"])),
    "pp3": ("`--pp 3` on 4 processes", lambda: bad_input(["--pp", "3"], 4)),
    "data": ("`--data` missing", lambda: bad_input(["--model", "gpt", "--data", "/nonexistent.txt"])),
    "logdir": ("`--log-dir` not writable", lambda: bad_input(["--log-dir", "/proc/none"])),
    "sigstop": ("a worker stopped (SIGSTOP), `--timeout 10`, pp2 x dp2",
                lambda: signal_worker(signal.SIGSTOP, "--timeout", "10")),
    "kill": ("a worker killed (SIGKILL), pp2 x dp2", lambda: signal_worker(signal.SIGKILL)),
    "exception": ("an exception in rank 1's layer, the rank stays alive (no torchrun, 3 ranks)", layer_exception),
    "launcher": ("the launcher (torchrun) killed with SIGKILL", kill_launcher),
    "ctrlc": ("Ctrl-C (SIGINT to the process group), `--save-on-exit`", ctrl_c),
    "nan": ("loss goes NaN (`--lr 1e30 --optimizer sgd --grad-clip 0`)", nan),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=list(SCENARIOS), help="run only these scenarios")
    args = p.parse_args()
    print("| fault | what the user sees first | exit status | seconds until every process exited |")
    print("|---|---|---|---|")
    for key in args.only or SCENARIOS:
        name, fn = SCENARIOS[key]
        r = fn()
        left = f" ({r['left']} left, killed)" if r["left"] else ""
        first = r["first"].replace("|", "\\|")
        print(f"| {name} | `{first[:160]}` | {r['status']} | {r['seconds']:.1f}{left} |", flush=True)


if __name__ == "__main__":
    main()
