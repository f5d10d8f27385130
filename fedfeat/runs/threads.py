"""The thread policy: how many CPU threads a fedfeat process gives torch's intra-op pool.

torch takes every core by default, in every process. When several jobs share a machine (``fedfeat sweep
--launcher ray|slurm --jobs N``, several terminals, other people's work) their threads outnumber the cores, and
torch's OpenMP regions wait for threads the kernel has descheduled: on a 2-core machine loaded by other jobs one
round of creff took 28.1 s at torch's default and 1.9 s on one thread (clip2fl 31.4 vs 2.4 s, fedclip 43.9 vs
20.2 s; issue 35). On the same machine when quiet, the default was the faster (creff 0.61 vs 0.76 s per round):
one thread too few costs ~1.25x, one too many up to 15x. So fedfeat chooses (``choose``, pure):

1. ``--threads N`` (``N >= 1``) of ``train``, ``sweep`` and ``reproduce``, if given;
2. else ``FEDFEAT_THREADS`` or ``OMP_NUM_THREADS`` from the environment, if the user set one (the user's choice
   wins; ``FEDFEAT_THREADS=auto`` asks for the policy);
3. else the policy: ``share = max(1, cores // jobs)``, where ``cores`` are the usable ones (the process's CPU
   affinity, cut to a cgroup CPU quota where there is one; never ``os.cpu_count()`` alone) and ``jobs`` the
   fedfeat jobs sharing this host: the larger of what a launcher starts at once and the jobs in this user's
   register of running fedfeat commands (``register``, ``live_jobs``: jobs started together count each other
   before any of them keeps a CPU busy); then fewer if other work keeps CPUs
   busy: ``n = clamp(floor(cpus - busy + SLACK), 1, share)``, where ``busy`` is how many CPUs other processes use
   now (``busy_cpus``: the runnable threads of other processes, ``/proc/stat``'s ``procs_running`` less this
   process's own, averaged over ~50 ms) and ``cpus`` the CPUs they are counted over (the host's).

Why the runnable threads now and not the 1-minute load average: the average lags by a minute both ways. Jobs
started at the same moment (a launcher's, a shell loop's ``&``) do not see each other in it yet, and a job that
ended a moment ago is still there: 16 threads that stopped 5 s ago read 16 x exp(-5/60) = 14.7, so a job started
right after a previous one (``make demo-clip2fl``'s loop, a bench's next cell) would take one thread of 16 idle
cores. The load average, less this process's own part (``own_load``), is used only where ``/proc`` is missing
(macOS).

The choice is applied once, early, by the command (``use``: ``torch.set_num_threads``; torch's inter-op pool is
left alone: fedfeat never uses it), recorded in each run's ``summary.json`` (``env.threads``: the count and why),
and taken again between the runs of a sweep (``refresh``, at most every ``REFRESH_SECONDS``), so that a long sweep
gives cores back when another job starts. The fused CPU kernels (``fedfeat.engine.kernels``, numba
``parallel=True`` with numba's own work queue) take their worker count from torch's at the start of a run
(``engine.rounds.run_federated`` passes it as ``ctx.threads`` and sets numba's count per call), so the one setting
covers both. The kernels give each client to one thread, so their results do not depend on the count (issue 35
measured creff, clip2fl and fedclip identical at one thread and at torch's default).
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from fedfeat.errors import FedfeatError

ENV = "FEDFEAT_THREADS"
# How much of a CPU other work may keep busy before the policy gives that CPU up. Small on purpose: a thread too
# many costs up to 15x, one too few at most ~1.25x (issue 35's measurements, above); a quarter of a core is the
# background of a quiet machine (daemons, a shell, the sampling's own noise).
SLACK = 0.25
# Between the runs of a sweep the policy is taken again at most this often (ours: a sweep of many tiny runs should
# not pay the ~50 ms of sampling per run; a job that starts beside it is seen within one run or 10 s).
REFRESH_SECONDS = 10.0
LOAD_WINDOW = 60.0  # seconds: the 1-minute load average's time constant (Linux: exp(-5/60) every 5 s)


@dataclass(frozen=True)
class Threads:
    """A decision: ``n`` threads, ``why`` (one line, for summary.json), ``explicit``: the user's (flag or
    environment), not the policy's."""

    n: int
    why: str
    explicit: bool = False

    def record(self) -> dict:
        return {"n": self.n, "why": self.why}


def parse(value, what: str = "--threads") -> int | None:
    """``--threads`` / ``FEDFEAT_THREADS`` as given: ``None``, ``""``, ``auto`` or ``0`` -> None (the policy), a
    positive integer -> itself; anything else is a ``FedfeatError`` naming ``what``."""
    text = "" if value is None else str(value).strip().lower()
    if not isinstance(value, bool) and text in ("", "auto", "0"):
        return None
    if not isinstance(value, bool) and text.isdigit() and int(text) >= 1:
        return int(text)
    raise FedfeatError(
        f"{what} must be a number of threads (1, 2, ...) or auto / 0 for fedfeat's policy, got {value!r}"
    )


def from_env(env) -> Threads | None:
    """The user's thread count from the environment: ``FEDFEAT_THREADS`` first (``auto`` / ``0``: none), then
    ``OMP_NUM_THREADS`` (its first level, as OpenMP reads it; a value OpenMP would not take is ignored)."""
    v = env.get(ENV)
    if v is not None:
        try:
            n = parse(v)
        except FedfeatError:
            raise FedfeatError(
                f"{ENV}={v!r} is not a thread count; set it to a number (1, 2, ...) or auto for fedfeat's policy, "
                "or unset it"
            ) from None
        if n is not None:
            return Threads(n, f"{ENV}={n} in the environment", explicit=True)
        return None
    v = env.get("OMP_NUM_THREADS")
    first = (v or "").split(",")[0].strip()
    if first.isdigit() and int(first) >= 1:
        return Threads(int(first), f"OMP_NUM_THREADS={v} in the environment", explicit=True)
    return None


def choose(
    cores: int,
    jobs: int = 1,
    load: float | None = None,
    env=None,
    *,
    requested: int | None = None,
    cpus: int | None = None,
) -> Threads:
    """The thread count for a process (module docstring), from plain numbers: ``cores`` usable here, ``jobs``
    fedfeat jobs started together on this host, ``load`` = CPUs other work keeps busy (None: unknown), ``env`` the
    environment (a mapping; None: none), ``requested`` = ``--threads`` (None: not given), ``cpus`` = the CPUs the
    load is counted over (default ``cores``).

    >>> choose(8, jobs=4, load=0.0).n            # each of 4 jobs: a quarter of the cores
    2
    >>> choose(2, load=1.1).n                    # a core busy with other work: take the other one
    1
    >>> choose(2, load=0.1).n                    # a quiet machine: all cores
    2
    >>> choose(2, load=3.0, env={"OMP_NUM_THREADS": "2"}).n   # the user's choice wins
    2
    """
    if requested is not None:
        return Threads(requested, f"--threads {requested}", explicit=True)
    user = from_env(env or {})
    if user is not None:
        return user
    cores, jobs = max(1, int(cores)), max(1, int(jobs))
    share = max(1, cores // jobs)
    head = f"policy: {cores} usable core{'s' * (cores != 1)}" + (f" / {jobs} jobs" if jobs > 1 else "")
    if load is None:
        return Threads(share, f"{head} (load unknown)")
    busy = max(0.0, float(load))
    free = (cpus or cores) - busy
    n = max(1, min(share, math.floor(free + SLACK)))
    return Threads(n, f"{head}, {busy:.1f} CPUs busy with other work")


# ----------------------------------------------------------------------------------------------- the machine
def parse_cpu_max(text: str) -> float | None:
    """CPUs of a cgroup quota: v2 ``cpu.max`` (``"200000 100000"`` -> 2.0, ``"max 100000"`` -> None) or v1
    ``"<cfs_quota_us> <cfs_period_us>"`` (a quota of -1: None)."""
    parts = text.split()
    if len(parts) < 2 or parts[0] == "max":
        return None
    try:
        quota, period = float(parts[0]), float(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def cgroup_cpus(root: str | Path = "/") -> float | None:
    """The CPU quota of this process's cgroup in CPUs (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` /
    ``cpu.cfs_period_us``), None where there is none or it cannot be read. ``root``: for tests."""
    root = Path(root)
    own = ""
    with contextlib.suppress(OSError):
        for line in (root / "proc/self/cgroup").read_text().splitlines():
            hier, ctrl, path = (line.split(":", 2) + ["", ""])[:3]
            if hier == "0" and ctrl == "":
                own = path.strip("/")
    cg = root / "sys/fs/cgroup"
    for d in dict.fromkeys([cg / own, cg]):  # v2: the own group, then the namespace's root
        with contextlib.suppress(OSError):
            return parse_cpu_max((d / "cpu.max").read_text())
    for d in (cg / "cpu", cg / "cpu,cpuacct"):  # v1
        with contextlib.suppress(OSError):
            q = (d / "cpu.cfs_quota_us").read_text().strip()
            return parse_cpu_max(f"{q} {(d / 'cpu.cfs_period_us').read_text().strip()}")
    return None


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (``os.sched_getaffinity``; taskset, Slurm's cpusets),
    cut to a cgroup CPU quota (containers), at least 1."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS, Windows
        n = os.cpu_count() or 1
    quota = cgroup_cpus()
    if quota is not None:
        n = min(n, max(1, math.floor(quota)))
    return max(1, n)


def _proc_start() -> float:
    """``time.monotonic()`` at this process's start (``/proc/self/stat``'s start time; else now)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.monotonic() - max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    return time.monotonic()


_SAMPLES: list[tuple[float, float]] = [(_proc_start(), 0.0), (time.monotonic(), time.process_time())]


def decayed_load(samples: list[tuple[float, float]], now: float) -> float:
    """A process's part of the 1-minute load average at time ``now`` from ``samples`` ``(time, CPU seconds so
    far)`` in time order (the last one at ``now``): each interval's CPU rate weighted as the load average decays
    it, ``rate * (exp(-(now - end) / 60) - exp(-(now - start) / 60))``; a rate of 1 held for the last minute gives
    ``1 - 1/e``, held for ever 1."""
    load = 0.0
    for (ta, ca), (tb, cb) in zip(samples, samples[1:]):
        if tb > ta:
            rate = max(0.0, cb - ca) / (tb - ta)
            load += rate * (math.exp(-(now - tb) / LOAD_WINDOW) - math.exp(-(now - ta) / LOAD_WINDOW))
    return load


def own_load() -> float:
    """This process's part of the 1-minute load average (``decayed_load``): its CPU time, all threads, between
    the samples taken so far (process start, this module's import, each call)."""
    now, cpu = time.monotonic(), time.process_time()
    load = decayed_load([*_SAMPLES, (now, cpu)], now)
    _SAMPLES.append((now, cpu))
    del _SAMPLES[1:-32]  # the process start stays; older intervals merge (their weight is ~0 after 5 min)
    return load


def _running_now(samples: int = 10, gap: float = 0.005) -> float | None:
    """Runnable threads of other processes now (``/proc/stat``'s ``procs_running`` less this process's threads in
    state R), the mean of ``samples`` readings ``gap`` seconds apart (~50 ms: a thread that waits between parallel
    regions is counted by its share of the time); None off Linux."""
    seen = []
    for i in range(samples):
        if i:
            time.sleep(gap)
        try:
            text = Path("/proc/stat").read_text()
            total = next(int(ln.split()[1]) for ln in text.splitlines() if ln.startswith("procs_running"))
        except (OSError, StopIteration, ValueError, IndexError):
            return None
        mine = 0
        for task in Path("/proc/self/task").iterdir():
            with contextlib.suppress(OSError, IndexError):
                mine += (task / "stat").read_text().rsplit(")", 1)[1].split()[0] == "R"
        seen.append(max(0, total - max(1, mine)))
    return float(statistics.fmean(seen))


def busy_cpus() -> float | None:
    """How many CPUs other work keeps busy now: ``_running_now``; where there is no ``/proc``, the 1-minute load
    average less ``own_load`` (module docstring); None where neither exists (Windows)."""
    now = _running_now()
    if now is not None:
        return now
    try:
        return max(0.0, os.getloadavg()[0] - own_load())
    except (AttributeError, OSError):
        return None


# ------------------------------------------------------------------------------------ the jobs on this host
# Every fedfeat command that applies the policy registers itself here while it runs (one empty-ish file per process,
# named by its pid, holding the pid's start time), so that jobs started at the same moment count each other: the
# runnable threads of ``busy_cpus`` cannot see a job that is still importing torch. Measured on 16 cores (BENCHMARKS,
# "Threads"): 4 creff jobs started together each took 12-13 threads from ``busy_cpus`` alone (2.2 s per round where
# one thread each ran 1.3 s); counting the registered jobs gives each a quarter of the cores.
SETTLE_SECONDS = 0.2  # after registering, before counting: jobs started by one shell loop or launcher see each other
_REGISTERED: list[Path] = []


def registry_dir() -> Path:
    """``$TMPDIR/fedfeat-jobs-<uid>``: the register of this user's fedfeat jobs on this host."""
    import tempfile

    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"fedfeat-jobs-{uid}"


def _start_ticks(pid: int) -> str | None:
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    return None


def _alive(pid: int, ticks: str) -> bool:
    """Is the registered process still that process (a recycled pid has another start time)?"""
    now = _start_ticks(pid)
    if now is not None:
        return now == ticks
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return Path("/proc").is_dir() is False  # no /proc (macOS): the pid answers; with /proc it would have a stat


def register(root: Path | None = None) -> bool:
    """Put this process in the register (once); False where the register cannot be written (then it is not
    counted, and counts no one)."""
    if _REGISTERED:
        return True
    d = root or registry_dir()
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        f = d / str(os.getpid())
        f.write_text(_start_ticks(os.getpid()) or "")
    except OSError:
        return False
    _REGISTERED.append(f)
    import atexit

    atexit.register(unregister)
    return True


def unregister() -> None:
    while _REGISTERED:
        with contextlib.suppress(OSError):
            _REGISTERED.pop().unlink()


def live_jobs(root: Path | None = None) -> int:
    """How many registered fedfeat jobs run on this host now (this one included if registered); entries of ended
    processes are removed."""
    d = root or registry_dir()
    n = 0
    with contextlib.suppress(OSError):
        for f in d.iterdir():
            if not f.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                if _alive(int(f.name), f.read_text().strip()):
                    n += 1
                else:
                    f.unlink()
    return n


def decide(requested: int | None = None, *, jobs: int = 1, env=None) -> Threads:
    """``choose`` on this machine now: ``usable_cores``; the jobs sharing it, the larger of ``jobs`` (a launcher's)
    and the fedfeat jobs registered on this host (``register``: this process joins the register first, and waits
    ``SETTLE_SECONDS`` the first time, so that jobs started together count each other); ``busy_cpus`` counted over
    ``os.cpu_count()`` CPUs (the runnable threads are the host's); ``env`` (default ``os.environ``). The register
    and the load are only read when neither ``requested`` nor the environment decides."""
    env = os.environ if env is None else env
    explicit = requested is not None or from_env(env) is not None
    cores = usable_cores()
    load = None
    if not explicit:
        if not _REGISTERED and register():
            time.sleep(SETTLE_SECONDS)
        jobs = max(jobs, live_jobs())
        load = busy_cpus()
    return choose(cores, jobs, load, env, requested=requested,
                  cpus=max(cores, os.cpu_count() or cores))  # fmt: skip


# -------------------------------------------------------------------------------------------- applying it
_ACTIVE: list[list] = []  # [Threads, jobs, monotonic time of the decision] of each ``use`` in force


@contextlib.contextmanager
def use(requested: int | None = None, *, jobs: int = 1, plan: Threads | None = None):
    """Apply a decision (``plan``, else ``decide(requested, jobs=jobs)``) to torch for the body, restoring torch's
    count after it; yields the ``Threads``. ``current`` reports it, ``refresh`` takes it again."""
    import torch

    t = plan if plan is not None else decide(requested, jobs=jobs)
    before = torch.get_num_threads()
    torch.set_num_threads(t.n)
    entry = [t, jobs, time.monotonic()]
    _ACTIVE.append(entry)
    try:
        yield t
    finally:
        _ACTIVE.remove(entry)
        torch.set_num_threads(before)
        if not _ACTIVE:
            unregister()


def refresh(force: bool = False) -> Threads | None:
    """Between runs: the policy again, if the decision in force is the policy's and is ``REFRESH_SECONDS`` old
    (``force``: whatever its age); torch's count follows. Returns the decision in force (None outside ``use``)."""
    if not _ACTIVE:
        return None
    entry = _ACTIVE[-1]
    t, jobs, when = entry
    if t.explicit or (not force and time.monotonic() - when < REFRESH_SECONDS):
        return t
    import torch

    new = decide(None, jobs=jobs)
    entry[0], entry[2] = new, time.monotonic()
    torch.set_num_threads(new.n)
    return new


def current() -> dict:
    """The threads of the run being written, for summary.json's ``env.threads``: ``{"n", "why"}``."""
    if _ACTIVE:
        return _ACTIVE[-1][0].record()
    import torch

    return {
        "n": torch.get_num_threads(),
        "why": "torch's own count (the fedfeat commands apply the thread policy)",
    }


__all__ = ["ENV", "SLACK", "Threads", "busy_cpus", "choose", "current", "decide", "parse", "refresh", "usable_cores",
           "use"]  # fmt: skip
