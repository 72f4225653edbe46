"""Where a process's time goes over a benchmark window, from Linux's own accounting: how
long its main thread (kvroute's event loop) ran on a core, how long it was ready to run
but waited for a core (its time on the run queue, `/proc/PID/task/PID/schedstat`), how
often the kernel took the core from it (involuntary context switches), and, over the same
window, the CPU of the benchmark's other processes and of the whole machine.

Why: a route answered late was either waiting behind kvroute's own work (the loop busy
with something else) or waiting for a core (the loop had something to do and was ready, but
another process held both cores). Run-queue time is only ever spent with work pending: a
thread blocked in `epoll_wait` is asleep, not queued. So the main thread's run-queue time in
a window is delay that kvroute's own code did not cause, and its time on a core is the most
its own work could have delayed anything.

Linux only (reads /proc); a sample costs a few file reads.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Sample", "cpu_seconds", "machine_major_faults", "major_faults", "sample", "threads",
           "threads_window", "window"]

TICK = os.sysconf("SC_CLK_TCK")
CORES = os.cpu_count() or 1


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (None once the process is gone):
    [9] major faults, [11] user time, [12] system time."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def cpu_seconds(pid: int) -> float:
    """A process's CPU time, all its threads, in seconds (0 once it is gone)."""
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / TICK if fields else 0.0


def major_faults(pid: int) -> int:
    """Page faults of a process that had to read the page back from disk (0 once it is
    gone). Where the kernel pages out memory it finds cold, a process that wakes after a
    quiet spell can stall on these for hundreds of milliseconds."""
    fields = _stat(pid)
    return int(fields[9]) if fields else 0


def machine_major_faults() -> int:
    """Major page faults of every process since boot (`pgmajfault` in /proc/vmstat)."""
    for line in Path("/proc/vmstat").read_text().splitlines():
        if line.startswith("pgmajfault "):
            return int(line.split()[1])
    return 0


def _machine_busy() -> float:
    """Seconds all cores together spent on anything but idle and I/O wait, since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]
    return (sum(values[:8]) - idle) / TICK  # user..steal; guest time is inside user


@dataclass(frozen=True)
class Sample:
    wall: float  # time.monotonic()
    run_ns: int  # the main thread on a core
    queued_ns: int  # the main thread runnable, waiting for a core
    nonvoluntary: int  # times the kernel took the core from the main thread
    process_cpu: float  # every thread of the process, seconds
    machine_busy: float  # every core, seconds
    others: dict[str, float] = field(default_factory=dict)  # CPU seconds by group name


def _schedstat(task: Path) -> tuple[int, int]:
    """One thread's (ns on a core, ns runnable waiting for one) so far."""
    run_ns, queued_ns, _ = (int(v) for v in (task / "schedstat").read_text().split())
    return run_ns, queued_ns


def threads(pid: int) -> dict[int, tuple[int, int]]:
    """`_schedstat` of every thread of process `pid`, by thread id; a thread that ends
    meanwhile is left out, and so is every one where the kernel keeps no schedstat."""
    times = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            times[int(task.name)] = _schedstat(task)
        except (OSError, ValueError):
            continue
    return times


def threads_window(first: dict[int, tuple[int, int]], last: dict[int, tuple[int, int]],
                   seconds: float, main: int) -> dict[str, float] | None:
    """What two `threads` of one process, `seconds` apart, say: the cores its threads ran
    on (`run`) and how many of them were runnable but waiting for a core (`waiting`), on
    average; its busy threads (on a core a tenth of the time or more); and its `main`
    thread's share of the time on a core and waiting. None without the kernel's figures.
    Where the scheduler shares the cores out by thread, a process with more runnable
    threads gets more of them."""
    if not first or not last:
        return None
    ran, waited = {}, {}
    for tid, (run_ns, queued_ns) in last.items():
        run_before, queued_before = first.get(tid, (0, 0))
        ran[tid] = (run_ns - run_before) / 1e9 / seconds
        waited[tid] = (queued_ns - queued_before) / 1e9 / seconds
    return {"run": sum(ran.values()), "waiting": sum(waited.values()),
            "busy_threads": sum(1 for share in ran.values() if share >= 0.1),
            "main_run": ran.get(main, 0.0), "main_waiting": waited.get(main, 0.0)}


def sample(pid: int, others: dict[str, list[int]] | None = None) -> Sample:
    """Now, for process `pid` and, by name, groups of other processes."""
    task = Path(f"/proc/{pid}/task/{pid}")
    run_ns, queued_ns = _schedstat(task)
    nonvoluntary = 0
    for line in (task / "status").read_text().splitlines():
        if line.startswith("nonvoluntary_ctxt_switches:"):
            nonvoluntary = int(line.split()[1])
    return Sample(wall=time.monotonic(), run_ns=run_ns, queued_ns=queued_ns,
                  nonvoluntary=nonvoluntary, process_cpu=cpu_seconds(pid),
                  machine_busy=_machine_busy(),
                  others={name: sum(cpu_seconds(p) for p in pids)
                          for name, pids in (others or {}).items()})


def window(first: Sample, last: Sample, routes: int) -> dict[str, float]:
    """What happened between two samples: shares are of the window's wall time (a core's
    worth is 1.0; the machine's busy share counts every core, up to CORES)."""
    wall = max(last.wall - first.wall, 1e-9)
    queued = (last.queued_ns - first.queued_ns) / 1e9
    shown = {
        "seconds": wall,
        "loop_on_core_share": (last.run_ns - first.run_ns) / 1e9 / wall,
        "loop_queued_share": queued / wall,
        "loop_queued_ms_per_route": 1000 * queued / max(routes, 1),
        "loop_preempted_per_s": (last.nonvoluntary - first.nonvoluntary) / wall,
        "process_cpu_share": (last.process_cpu - first.process_cpu) / wall,
        "machine_busy_cores": (last.machine_busy - first.machine_busy) / wall,
        "cores": CORES,
    }
    ours = shown["process_cpu_share"]
    for name, seconds in last.others.items():
        share = (seconds - first.others.get(name, 0.0)) / wall
        shown[f"{name}_cpu_share"] = share
        ours += share
    # Whatever else ran on the machine meanwhile (other users, the kernel's own threads).
    shown["rest_of_machine_cores"] = max(0.0, shown["machine_busy_cores"] - ours)
    return shown
