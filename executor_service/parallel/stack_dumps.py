"""Where every rank is stuck, written to stderr: the first thing to know about a stalled tensor-parallel group.

Every rank dumps the Python stacks of all its threads on SIGUSR1 (`kill -USR1 PID`; `timeout -s USR1` does it
to a whole process group). Rank 0's watchdog does it to the followers and itself when it finds the group
stalled, so a test or a log that ends in "the executor can no longer run steps" says where each rank was.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

DUMP_SIGNAL = signal.SIGUSR1
DUMP_GRACE_S = 3.0  # for every rank to write its stacks before the kill


def dump_on_signal() -> None:
    """Dump this process's stacks on SIGUSR1 (only the main thread may install a handler: elsewhere, a no-op)."""
    if threading.current_thread() is threading.main_thread():
        faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True)


def dump_ranks(pids: list[int], header: str) -> None:
    """Rank 0's stacks now, and each living follower's (written by the follower to its own stderr)."""
    print(f"== {header}: Python stacks of rank 0 and of followers {pids}", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, DUMP_SIGNAL)


@dataclass
class Finished:
    """A command's outcome: `timed_out` with the stacks its processes dumped at the end of stderr."""

    returncode: int | None
    stdout: str
    stderr: str

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def run_or_dump(command: list[str], env: dict[str, str], timeout: float, cwd: str | None = None) -> Finished:
    """Run `command` (rank 0, which starts its followers) in its own process group; past `timeout` every process
    in it dumps its stacks (SIGUSR1), then all are killed. For benchmarks and tests that must not hang."""
    process = subprocess.Popen(
        command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
        return Finished(process.returncode, stdout, stderr)
    except subprocess.TimeoutExpired:
        native = native_stacks(process.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, DUMP_SIGNAL)
        time.sleep(DUMP_GRACE_S)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        return Finished(None, stdout, stderr + native)


def native_stacks(group: int) -> str:
    """py-spy's dump (Python and native frames) of every process in process group `group`, where py-spy is
    installed: it reads a process stuck in C code or in the interpreter's teardown, which SIGUSR1 may not."""
    spy = shutil.which("py-spy")
    if spy is None:
        return ""
    dumps = []
    for pid in _group_members(group):
        run = subprocess.run([spy, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
        dumps.append(f"== py-spy dump of pid {pid}\n{run.stdout}{run.stderr}")
    return "\n".join(dumps)


def _group_members(group: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError):
                if os.getpgid(int(entry)) == group:
                    members.append(int(entry))
    return sorted(members)


def main(argv: list[str] | None = None) -> int:
    """`python -m executor_service.parallel.stack_dumps SECONDS COMMAND...`: COMMAND's output; past SECONDS, with
    every process's stacks, and exit status 124 (as timeout(1))."""
    args = sys.argv[1:] if argv is None else argv
    finished = run_or_dump(args[1:], dict(os.environ), float(args[0]))
    sys.stdout.write(finished.stdout)
    sys.stderr.write(finished.stderr)
    return 124 if finished.returncode is None else finished.returncode


if __name__ == "__main__":
    sys.exit(main())
