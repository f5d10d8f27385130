"""Sweeps beyond one process: ``fedfeat sweep --launcher local|slurm|ray``.

``local`` is the in-process sweep (``fedfeat.runs.sweep.run_sweep``). ``slurm`` submits jobs through submitit
(``submitit.AutoExecutor``; the ``slurm`` extra) and ``ray`` runs them as Ray tasks (the ``ray`` extra): we use these
launchers, not one of our own. Each job runs a chunk of the pending grid points through the very same
``run_sweep`` (its own session, stacking within the chunk), so its run directories are the ones ``--launcher
local`` writes: same names, same metrics, same weights (``tests/test_launch.py``). The launching process opens the
stores only to name the runs: runs already finished are skipped before anything is submitted (a re-launch does
what is missing), and the others are split into ``jobs`` chunks, runs that stack together kept together.

A job's failed runs come back as ``Failure`` records (they do not stop the job's other runs); a job that dies
(killed, out of time) fails all its runs with its one-line error. The launcher waits for every job, advancing the
progress display (``Display``) as jobs end.

Checked before anything is opened or submitted, each a one-line ``FedfeatError``: ``--slurm-time`` (minutes >= 1),
``--slurm-cluster`` (submitit's executors), a CUDA ``--device`` the machine lacks (local sweeps: once, not a failed
run each), and ``--ray-address`` / ``RAY_ADDRESS``: a TCP connection within ``RAY_CONNECT_TIMEOUT`` seconds, since
``ray.init`` retries an address where nothing listens for many minutes (``check_ray_address``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from fedfeat.errors import FedfeatError
from fedfeat.runs.sweep import Display, Failure, SweepFailed, one_line, run_sweep, same_runs
from fedfeat.runs.threads import Threads, decide, usable_cores
from fedfeat.runs.threads import use as use_threads

LAUNCHERS = ("local", "slurm", "ray")


def run_chunk(
    points: list,
    overwrite: bool = False,
    stack: bool = True,
    cwd: str | None = None,
    threads: Threads | None = None,
) -> list:
    """One job: ``run_sweep`` on a chunk of points, quietly, in the launching process's directory ``cwd`` (relative
    store and output paths mean the same there), on ``threads`` (the launcher's decision for jobs sharing its host;
    None: the job decides on its own machine, ``fedfeat.runs.threads``). Returns per point ``(path or None, error or
    None)`` as plain strings (picklable across processes)."""
    import contextlib
    import os

    failures: list = []
    with contextlib.chdir(cwd) if cwd else contextlib.nullcontext(), use_threads(plan=threads):
        paths = run_sweep(points, overwrite=overwrite, progress=False, log=lambda *a: None, stack=stack,
                          failures=failures)  # fmt: skip
        paths = [None if p is None else os.path.abspath(p) for p in paths]
    errs = {f.index: f.error for f in failures}
    return [(None if p is None else str(p), errs.get(i)) for i, p in enumerate(paths)]


def _chunks(pending: list[int], groups: dict[int, object], jobs: int) -> list[list[int]]:
    """``pending`` split into at most ``jobs`` chunks of near-equal size, runs of one stack group adjacent (so that a
    chunk mostly holds whole groups)."""
    order = sorted(pending, key=lambda i: (repr(groups[i]), i))
    jobs = max(1, min(jobs, len(order)))
    size, extra = divmod(len(order), jobs)
    out, at = [], 0
    for j in range(jobs):
        n = size + (j < extra)
        out.append(order[at : at + n])
        at += n
    return [c for c in out if c]


def _need(module: str, extra: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise FedfeatError(
            f"--launcher {extra} needs {module}: pip install fedfeat[{extra}] (or pip install {module})"
        ) from None


def launch(
    points: list[tuple[dict, dict]],
    *,
    launcher: str = "local",
    jobs: int = 4,
    overwrite: bool = False,
    stack: bool = True,
    log=print,
    display: Display | None = None,
    failures: list | None = None,
    slurm_partition: str | None = None,
    slurm_time: int = 60,
    slurm_cluster: str | None = None,
    folder: str | Path | None = None,
    ray_address: str | None = None,
    threads: int | None = None,
) -> list[Path | None]:
    """Run the grid ``points`` with ``launcher`` (module docstring); returns the run directories in the points'
    order (None for a failed run when ``failures`` is a list, which then receives the ``Failure`` records; without
    one, ``SweepFailed`` is raised after the other runs). ``jobs``: how many jobs (Slurm jobs / Ray tasks) the
    pending runs are split into. Slurm: ``slurm_partition``, ``slurm_time`` (minutes per job), ``slurm_cluster``
    (submitit's: None = Slurm where ``sbatch`` exists, else ``local``; ``debug`` runs in this process) and
    ``folder`` (submitit's logs; default OUT/.submitit). Ray: ``ray_address`` (None: a Ray started here, or the
    one already initialised; ``auto``: a running cluster).

    ``threads``: ``--threads`` (None: the environment's count or the thread policy, ``fedfeat.runs.threads``). Jobs
    started together on this host (submitit's ``local`` cluster, a Ray started here) share its cores: each gets
    ``decide(threads, jobs=number of jobs)``, and a Ray task reserves that many CPUs. Jobs on other machines (Slurm,
    a Ray cluster) decide on their own machine, or take ``threads`` when given (a Slurm job then asks for that many
    CPUs per task, a Ray task reserves them)."""
    if launcher not in LAUNCHERS:
        raise FedfeatError(f"unknown --launcher {launcher!r}; choose local, slurm or ray")
    if jobs < 1:
        raise FedfeatError(f"--jobs must be >= 1, got {jobs}")
    check_slurm(slurm_time, slurm_cluster)
    display = display or Display(0, quiet=True)
    if launcher == "local":
        check_devices(points)  # a device this machine lacks: one line before any run, not one failed run each
        return run_sweep(points, overwrite=overwrite, progress=False, log=log, stack=stack, failures=failures,
                         display=display)  # fmt: skip
    mod = _need("submitit" if launcher == "slurm" else "ray", launcher)
    if launcher == "ray" and not mod.is_initialized():  # before the stores are opened: one line, not a hang
        check_ray_address(ray_address)

    from fedfeat.runs.config import DEFAULTS, resolve_config
    from fedfeat.runs.grid import _applicable
    from fedfeat.runs.session import session
    from fedfeat.runs.train import run_name, stack_group
    from fedfeat.store.urls import local_path

    with session():  # name the runs (stores and partitions opened once), find the finished ones
        cfgs = []
        for settings, params in points:
            ps = _applicable(settings.get("method", DEFAULTS["method"]), params, lambda *a: None)
            cfgs.append(resolve_config(settings, None, [f"{k}={v}" for k, v in ps.items()]))
        for c in cfgs:
            local_path(c.out, "--out", "a local directory for run directories")
        names = [run_name(c) for c in cfgs]
        groups = {i: (stack_group(c) if stack else None) or ("one", i) for i, c in enumerate(cfgs)}
        same = same_runs(cfgs, names)  # as run_sweep: one run made once; colliding names refused
    paths: list = [None] * len(points)
    pending = []
    for i, path in enumerate(names):
        if i in same:
            log(f"[{i + 1}/{len(points)}] {path.name}: the same run as point {same[i] + 1}")
            display.advance()
        elif (path / "summary.json").is_file() and not path.is_symlink() and not overwrite:
            log(f"[{i + 1}/{len(points)}] {path.name}: finished already, skipped")
            paths[i] = path
            display.advance()
        else:
            pending.append(i)
    chunks = _chunks(pending, groups, jobs)
    failed: list[Failure] = []

    def collect(chunk: list[int], result=None, error: BaseException | None = None) -> None:
        for k, i in enumerate(chunk):
            p, err = (None, one_line(error)) if error is not None else result[k]
            if err is None and p is None:
                err = "the job returned no run directory"
            if err is None:
                paths[i] = Path(p)
                display.advance()
            else:
                failed.append(Failure(i, names[i].name, err))
                log(f"  {names[i].name}: failed: {err}")
                display.advance(failed=1)

    if chunks:
        log(f"{launcher}: {len(pending)} runs in {len(chunks)} job(s)")
        if launcher == "slurm":
            _slurm(mod, chunks, points, overwrite, stack, collect, slurm_partition, slurm_time, slurm_cluster,
                   Path(folder) if folder is not None else Path(cfgs[0].out) / ".submitit", threads)  # fmt: skip
        else:
            _ray(mod, chunks, points, overwrite, stack, collect, ray_address, threads)
    for i, j in same.items():
        paths[i] = paths[j]
    failed.sort(key=lambda f: f.index)
    if failed and failures is None:
        raise SweepFailed(failed)
    if failures is not None:
        failures.extend(failed)
    return paths


def _slurm(
    submitit, chunks, points, overwrite, stack, collect, partition, minutes, cluster, folder, threads
) -> None:
    """submitit jobs, one per chunk (``AutoExecutor``: Slurm where it exists; ``local``/``debug`` to try it)."""
    ex = submitit.AutoExecutor(folder=str(folder), cluster=cluster)
    opts: dict = {"timeout_min": int(minutes), "name": "fedfeat-sweep"}
    if partition:
        opts["slurm_partition"] = partition
    where = getattr(ex, "cluster", "slurm")
    if where == "slurm" and threads is not None:
        opts["cpus_per_task"] = threads  # the job's threads, allocated
    ex.update_parameters(**opts)
    # local: subprocesses here, all at once (they share its cores); debug: one after another in this process;
    # slurm: each job on its allocation, where it decides (or runs --threads)
    jobs_here = {"local": len(chunks), "debug": 1}.get(where)
    plan = decide(threads, jobs=jobs_here) if jobs_here else _explicit(threads)
    submitted = [
        (c, ex.submit(run_chunk, [points[i] for i in c], overwrite, stack, os.getcwd(), plan)) for c in chunks
    ]
    while submitted:
        rest = []
        for c, job in submitted:
            if not job.done():
                rest.append((c, job))
                continue
            try:
                collect(c, job.result())
            except Exception as e:  # noqa: BLE001 -- a job that died: its runs are recorded as failed
                collect(c, error=e)
        submitted = rest
        if submitted:
            time.sleep(0.5)


def _ray(ray, chunks, points, overwrite, stack, collect, address, threads) -> None:
    """Ray tasks, one per chunk (a Ray started here unless one is initialised or ``address`` names one)."""
    # a Ray of this host's cores, for these tasks (ray.init connects to RAY_ADDRESS's cluster where it is set)
    here = not ray.is_initialized() and address is None and not os.environ.get("RAY_ADDRESS")
    if not ray.is_initialized():
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as e:  # (a ConnectionError is not a full disk)
            where = address or os.environ.get("RAY_ADDRESS") or "a Ray started here"
            raise FedfeatError(
                f"ray: cannot connect to {where} ({one_line(e)}); check --ray-address / RAY_ADDRESS "
                "(ray status shows a running cluster's address)"
            ) from None
    # here: the tasks share this host's cores, each reserves its share; elsewhere a task runs on what Ray gives it
    # (Ray sets OMP_NUM_THREADS to its CPUs, one by default, which the task's own decision respects)
    plan = decide(threads, jobs=len(chunks)) if here else _explicit(threads)
    cpus = None if plan is None else min(plan.n, usable_cores()) if here else plan.n
    task = ray.remote(num_cpus=cpus)(run_chunk) if cpus and cpus > 1 else ray.remote(run_chunk)  # default: 1
    refs = {task.remote([points[i] for i in c], overwrite, stack, os.getcwd(), plan): c for c in chunks}
    while refs:
        ready, _ = ray.wait(list(refs), num_returns=1)
        for ref in ready:
            c = refs.pop(ref)
            try:
                collect(c, ray.get(ref))
            except Exception as e:  # noqa: BLE001 -- a task that died: its runs are recorded as failed
                collect(c, error=e)


SLURM_CLUSTERS = ("slurm", "local", "debug")  # submitit's executors (plugins may add more)
RAY_CONNECT_TIMEOUT = 10.0  # seconds to wait for a TCP connection to --ray-address before giving up


def check_slurm(minutes, cluster) -> None:
    """``--slurm-time`` (minutes >= 1) and ``--slurm-cluster`` (one of submitit's executors, or None): else one
    line naming the valid values."""
    if isinstance(minutes, bool) or not isinstance(minutes, int) or minutes < 1:
        raise FedfeatError(
            f"--slurm-time must be a whole number of minutes >= 1 (each Slurm job's time limit), got {minutes!r}; "
            "e.g. --slurm-time 60"
        )
    if cluster is None:
        return
    try:
        from submitit.core import plugins

        known = tuple(plugins.get_executors())
    except Exception:  # noqa: BLE001 -- submitit missing or broken: its three built-in executors
        known = SLURM_CLUSTERS
    if cluster not in known:
        raise FedfeatError(
            f"unknown --slurm-cluster {cluster!r}; choose {', '.join(known)} (or leave it out: slurm where sbatch "
            "exists, else local)"
        )


def check_devices(points: list) -> None:
    """Every CUDA ``device`` of the grid exists on this machine (``fedfeat.engine.rounds.resolve_device``: one line
    naming the device and the ones here); a value that is no device at all is the run specification's check."""
    from fedfeat.engine.rounds import resolve_device
    from fedfeat.runs.config import DEFAULTS

    for device in dict.fromkeys(str(s.get("device") or DEFAULTS["device"]) for s, _ in points):
        if device.startswith("cuda"):
            resolve_device(device)


def _host_port(address: str) -> tuple[str, int] | None:
    """``host:port``, ``[v6]:port`` or ``ray://host[:port]`` (Ray Client, port 10001 by default) as (host, port);
    None when it has none of these shapes."""
    client = address.startswith("ray://")
    rest = address[len("ray://") :] if client else address
    rest = rest.split("/", 1)[0]
    if rest.startswith("["):  # [v6]:port
        host, _, port = rest[1:].partition("]")
        port = port[1:] if port.startswith(":") else ""
    else:
        host, sep, port = rest.rpartition(":")
        if not sep:
            host, port = rest, ""
    if not port and client:
        port = "10001"
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def check_ray_address(address: str | None, timeout: float = RAY_CONNECT_TIMEOUT) -> None:
    """A Ray cluster at ``address`` (``--ray-address``, else ``RAY_ADDRESS``) accepts a TCP connection within
    ``timeout`` seconds: ``ray.init`` itself retries an address where nothing answers for many minutes (the GCS
    client's reconnects), which looked like a hang. Nothing given, or ``local``: a Ray started here, nothing to
    check; ``auto``: the cluster ``ray start`` made on this machine (none is one line)."""
    import socket

    flag = "--ray-address" if address is not None else "RAY_ADDRESS"
    given = address if address is not None else os.environ.get("RAY_ADDRESS")
    if not given or given == "local":
        return
    fix = "start Ray there (ray start --head) or leave --ray-address out to start Ray on this machine"
    target = given
    if given == "auto":
        try:
            from ray._private.services import canonicalize_bootstrap_address

            target = canonicalize_bootstrap_address("auto")
        except ConnectionError:
            raise FedfeatError(f"{flag} auto: no Ray cluster is running on this machine; {fix}") from None
        except Exception:  # noqa: BLE001 -- another Ray version's internals: ray.init decides
            return
        if not target:
            return
    hp = _host_port(target)
    if hp is None:
        raise FedfeatError(
            f"{flag} {given!r} is not an address; give HOST:PORT (e.g. 10.0.0.5:6379), ray://HOST:PORT or auto"
        )
    try:
        socket.create_connection(hp, timeout=timeout).close()
    except OSError as e:
        why = "nothing answered" if isinstance(e, TimeoutError) else (e.strerror or one_line(e))
        raise FedfeatError(
            f"{flag} {given}: no Ray cluster answers at {hp[0]}:{hp[1]} ({why}, waited up to {timeout:g} s); {fix}"
        ) from None


def _explicit(threads: int | None) -> Threads | None:
    """For jobs on other machines: ``--threads`` or the user's environment here (``FEDFEAT_THREADS``,
    ``OMP_NUM_THREADS``), else None (each job decides where it runs)."""
    t = decide(threads) if threads is not None else None
    if t is None:
        from fedfeat.runs.threads import from_env

        t = from_env(os.environ)
    return t


__all__ = ["LAUNCHERS", "check_devices", "check_ray_address", "check_slurm", "launch", "run_chunk"]
