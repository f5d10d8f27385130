"""The thread policy (``fedfeat.runs.threads``): the pure choice on hand cases, the user's choice winning, the
machine readings (cgroup quota, affinity, this process's part of the load), ``--threads`` reaching torch in a
run and its summary.json, and a launcher giving each job started on this host its share of the cores."""

from __future__ import annotations

import json
import math
import os
import sys
import types
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fedfeat.cli.app import app
from fedfeat.errors import FedfeatError
from fedfeat.runs import launch as la
from fedfeat.runs import threads as th

runner = CliRunner()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    out = tmp_path_factory.mktemp("th") / "s.zarr"
    r = runner.invoke(app, ["synth", "--out", str(out), "--dim", "16", "--train-per-class", "20",
                            "--test-per-class", "8", "--templates", "2", "--no-stats"])  # fmt: skip
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture
def no_env(monkeypatch):
    """No user choice in the environment (the test suite runs with OMP_NUM_THREADS=1)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(th.ENV, raising=False)


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


# ------------------------------------------------------------------------------------------ the pure choice
@pytest.mark.parametrize(
    "cores, jobs, load, cpus, want",
    [
        (8, 1, 0.0, None, 8),  # quiet, alone: every core
        (8, 4, 0.0, None, 2),  # 4 jobs started together: 8 // 4 each
        (8, 3, 0.0, None, 2),  # 8 // 3 = 2 (never more than the share)
        (2, 4, 0.0, None, 1),  # more jobs than cores: at least 1
        (2, 1, 0.2, None, 2),  # floor(2 - 0.2 + 0.25) = 2: a quiet machine's background keeps the core
        (2, 1, 0.3, None, 1),  # floor(2 - 0.3 + 0.25) = 1: busier than SLACK, the core is given up
        (2, 1, 1.1, None, 1),  # one core busy with other work: the other one
        (2, 1, 7.0, None, 1),  # overloaded: still 1
        (16, 2, 9.0, None, 7),  # share 8, but 16 - 9 + 0.25 -> 7 free
        (2, 1, 40.0, 64, 2),  # a 2-CPU quota on a 64-CPU host with 40 busy: 24 free host CPUs, the quota's 2
        (16, 1, None, None, 16),  # load unknown (no getloadavg, no /proc): the share
    ],
)
def test_choose_hand_cases(cores, jobs, load, cpus, want):
    t = th.choose(cores, jobs, load, {}, cpus=cpus)
    assert t.n == want and not t.explicit
    assert t.why.startswith(f"policy: {cores} usable core")


def test_choose_the_users_choice_wins():
    # --threads beats the environment, FEDFEAT_THREADS beats OMP_NUM_THREADS, either beats the policy
    assert th.choose(2, load=9.0, env={"OMP_NUM_THREADS": "2"}) == th.Threads(
        2, "OMP_NUM_THREADS=2 in the environment", True
    )
    env = {"OMP_NUM_THREADS": "3", th.ENV: "5"}
    assert th.choose(8, load=0.0, env=env) == th.Threads(5, "FEDFEAT_THREADS=5 in the environment", True)
    assert th.choose(8, load=0.0, env=env, requested=3) == th.Threads(3, "--threads 3", True)
    # FEDFEAT_THREADS=auto asks fedfeat's policy even where OMP_NUM_THREADS is set for other programs
    assert th.choose(4, load=0.0, env={th.ENV: "auto", "OMP_NUM_THREADS": "1"}).n == 4
    # OpenMP's nested list: its first level; a value OpenMP would not take is not a choice
    assert th.choose(8, load=0.0, env={"OMP_NUM_THREADS": "4,2"}).n == 4
    assert th.choose(8, jobs=2, load=0.0, env={"OMP_NUM_THREADS": "many"}).n == 4


def test_parse_and_bad_values():
    assert [th.parse(v) for v in (None, "auto", "AUTO", "0", 0, "", "3", 3)] == [None] * 6 + [3, 3]
    for bad in ("-1", "1.5", "two", True):
        with pytest.raises(FedfeatError, match=r"--threads must be a number of threads .* auto / 0"):
            th.parse(bad)
    with pytest.raises(FedfeatError, match=r"FEDFEAT_THREADS='lots' is not a thread count; .* or unset it"):
        th.choose(2, env={th.ENV: "lots"})


def test_bad_threads_flag_is_one_line(store, tmp_path):
    r = runner.invoke(app, ["train", "--store", str(store), "--threads", "x", "--out", str(tmp_path)])
    assert r.exit_code == 2
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --threads must be a number"), r.output


# ---------------------------------------------------------------------------------------- the machine
def test_cgroup_quota_v2_v1_and_none(tmp_path):
    assert th.parse_cpu_max("150000 100000") == 1.5
    assert th.parse_cpu_max("max 100000") is None
    assert th.parse_cpu_max("-1 100000") is None
    v2 = tmp_path / "v2"
    (v2 / "proc/self").mkdir(parents=True)
    (v2 / "proc/self/cgroup").write_text("0::/job/42\n")
    (v2 / "sys/fs/cgroup/job/42").mkdir(parents=True)
    (v2 / "sys/fs/cgroup/job/42/cpu.max").write_text("250000 100000\n")
    (v2 / "sys/fs/cgroup/cpu.max").write_text("max 100000\n")  # the root's: not this process's group
    assert th.cgroup_cpus(v2) == 2.5
    v1 = tmp_path / "v1"
    (v1 / "proc/self").mkdir(parents=True)
    (v1 / "proc/self/cgroup").write_text("4:cpu,cpuacct:/\n")
    (v1 / "sys/fs/cgroup/cpu").mkdir(parents=True)
    (v1 / "sys/fs/cgroup/cpu/cpu.cfs_quota_us").write_text("300000\n")
    (v1 / "sys/fs/cgroup/cpu/cpu.cfs_period_us").write_text("100000\n")
    assert th.cgroup_cpus(v1) == 3.0
    (v1 / "sys/fs/cgroup/cpu/cpu.cfs_quota_us").write_text("-1\n")
    assert th.cgroup_cpus(v1) is None
    assert th.cgroup_cpus(tmp_path / "nothing") is None


def test_usable_cores_is_affinity_cut_to_the_quota(monkeypatch):
    monkeypatch.setattr(th.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(th.os, "cpu_count", lambda: 64)  # the host's: never used as the answer
    monkeypatch.setattr(th, "cgroup_cpus", lambda: None)
    assert th.usable_cores() == 8
    monkeypatch.setattr(th, "cgroup_cpus", lambda: 2.5)
    assert th.usable_cores() == 2  # floor: a third thread on 2.5 CPUs of quota is throttled
    monkeypatch.setattr(th, "cgroup_cpus", lambda: 0.5)
    assert th.usable_cores() == 1


def test_own_part_of_the_load_average():
    # one CPU busy for the last 60 s: 1 - 1/e; two threads for 30 s, then idle for 30 s: 2 (e^-0.5 - e^-1)
    assert th.decayed_load([(0.0, 0.0), (60.0, 60.0)], 60.0) == pytest.approx(1 - math.exp(-1))
    got = th.decayed_load([(0.0, 0.0), (30.0, 60.0), (60.0, 60.0)], 60.0)
    assert got == pytest.approx(2 * (math.exp(-0.5) - math.exp(-1)))
    assert th.decayed_load([(0.0, 0.0), (6000.0, 6000.0)], 6000.0) == pytest.approx(1.0)  # held for ever


def test_busy_is_others_runnable_threads_now_else_the_load_average_less_ours(monkeypatch):
    monkeypatch.setattr(th.os, "getloadavg", lambda: (3.0, 0.0, 0.0))
    monkeypatch.setattr(th, "own_load", lambda: 1.0)
    monkeypatch.setattr(th, "_running_now", lambda: 0.5)
    assert th.busy_cpus() == 0.5  # runnable now: a job that ended a moment ago still weighs in the average
    monkeypatch.setattr(th, "_running_now", lambda: None)  # no /proc (macOS)
    assert th.busy_cpus() == 2.0  # the load average less our own part
    monkeypatch.setattr(th.os, "getloadavg", lambda: (0.5, 0.0, 0.0))
    assert th.busy_cpus() == 0.0  # never negative


def test_runnable_threads_of_others_from_proc(monkeypatch, tmp_path):
    # procs_running counts our own runnable threads too: 5 on the host, 2 of them ours -> 3 others
    stat = tmp_path / "stat"
    stat.write_text("cpu  1 2 3\nprocs_running 5\nprocs_blocked 0\n")
    tasks = tmp_path / "task"
    for i, state in enumerate("RRS"):
        (tasks / str(i)).mkdir(parents=True)
        (tasks / str(i) / "stat").write_text(f"{i} (py thon) {state} 1 2 3\n")
    real = th.Path
    where = {"/proc/stat": stat, "/proc/self/task": tasks}
    monkeypatch.setattr(th, "Path", lambda p: real(where.get(str(p), p)))
    assert th._running_now(samples=2, gap=0.0) == 3.0


def test_decide_reads_no_load_when_the_user_chose(monkeypatch):
    def boom():
        raise AssertionError("the load was read")

    monkeypatch.setattr(th, "busy_cpus", boom)
    assert th.decide(3, env={}).n == 3
    assert th.decide(None, env={"OMP_NUM_THREADS": "2"}).n == 2


# ------------------------------------------------------------------------------------------ in a process
def test_use_sets_torch_and_restores_and_refresh_follows_the_policy(monkeypatch, restore_threads):
    torch.set_num_threads(1)
    seq = iter([th.Threads(3, "policy: a"), th.Threads(2, "policy: b")])
    monkeypatch.setattr(th, "decide", lambda requested=None, jobs=1, env=None: next(seq))
    with th.use() as t:
        assert t.n == 3 and torch.get_num_threads() == 3 and th.current() == {"n": 3, "why": "policy: a"}
        assert th.refresh() == t  # younger than REFRESH_SECONDS: kept
        assert th.refresh(force=True).n == 2 and torch.get_num_threads() == 2
        assert th.current() == {"n": 2, "why": "policy: b"}
    assert torch.get_num_threads() == 1 and th.refresh() is None
    with th.use(plan=th.Threads(2, "--threads 2", True)):
        assert th.refresh(force=True).n == 2  # the user's choice is never re-decided


def test_threads_flag_reaches_torch_in_a_train_run_and_its_summary(store, tmp_path, monkeypatch, no_env,
                                                                   restore_threads):  # fmt: skip
    from fedfeat.runs import train as tr

    torch.set_num_threads(1)
    real, seen = tr.train, []

    def spy(*a, **k):
        seen.append(torch.get_num_threads())
        return real(*a, **k)

    monkeypatch.setattr(tr, "train", spy)
    args = ["train", "--store", str(store), "--method", "fedavg", "--clients", "4", "--rounds", "1",
            "--kernel", "torch", "--quiet", "--out", str(tmp_path)]  # fmt: skip
    r = runner.invoke(app, [*args, "--threads", "3", "--name", "a"])
    assert r.exit_code == 0, r.output
    assert seen == [3] and torch.get_num_threads() == 1  # during the run; restored after the command
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["env"]["threads"] == {"n": 3, "why": "--threads 3"}
    # the user's environment wins over the policy, the flag over the environment
    monkeypatch.setenv(th.ENV, "2")
    assert runner.invoke(app, [*args, "--name", "b"]).exit_code == 0
    assert seen[-1] == 2
    b = json.loads((tmp_path / "b" / "summary.json").read_text())["env"]["threads"]
    assert b == {"n": 2, "why": "FEDFEAT_THREADS=2 in the environment"}
    assert runner.invoke(app, [*args, "--name", "c", "--threads", "3"]).exit_code == 0
    assert seen[-1] == 3


# ------------------------------------------------------------------------------------------- launchers
SWEEP = ["--method", "fedavg", "--seed", "0-3", "--partition", "iid", "--clients", "4", "--rounds", "1",
         "--no-stack", "--quiet"]  # fmt: skip


def _machine(monkeypatch, cores: int, busy: float = 0.0):
    monkeypatch.setattr(th, "usable_cores", lambda: cores)
    monkeypatch.setattr(la, "usable_cores", lambda: cores)
    monkeypatch.setattr(th, "busy_cpus", lambda: busy)
    monkeypatch.setattr(th.os, "cpu_count", lambda: cores)


def _fake_run_sweep(monkeypatch) -> list:
    """run_sweep inside a job: records torch's threads, 'makes' each point."""
    inside: list = []

    def fake(points, **kw):
        inside.append(torch.get_num_threads())
        return [Path(f"/made/{p[0]['seed']}") for p in points]

    monkeypatch.setattr(la, "run_sweep", fake)
    monkeypatch.setattr("fedfeat.report.tables.report", lambda *a, **k: "")  # no closing table of fake runs
    return inside


def test_ray_started_here_gives_each_task_its_share(store, tmp_path, monkeypatch, no_env, restore_threads):
    _machine(monkeypatch, cores=8)
    inside = _fake_run_sweep(monkeypatch)
    made: dict = {"remote": [], "plans": []}

    class Ref:  # hashable, as Ray's object refs
        def __init__(self, value):
            self.value = value

    fake = types.ModuleType("ray")
    state = {"up": False}
    fake.is_initialized = lambda: state["up"]
    fake.init = lambda **kw: state.update(up=True)

    def remote(fn=None, **kw):
        made["remote"].append(kw)

        def wrap(f):
            def run(*a):
                made["plans"].append(a[4])
                return Ref(f(*a))

            return types.SimpleNamespace(remote=run)

        return wrap(fn) if fn is not None else wrap

    fake.remote = remote
    fake.wait = lambda refs, num_returns=1: (refs[:num_returns], refs[num_returns:])
    fake.get = lambda ref: ref.value
    monkeypatch.setitem(sys.modules, "ray", fake)
    args = ["sweep", "--store", str(store), *SWEEP, "--out", str(tmp_path / "r"), "--launcher", "ray"]
    r = runner.invoke(app, [*args, "--jobs", "4"])
    assert r.exit_code == 0, r.output
    # 8 cores, 4 tasks started together: 2 threads each, 2 CPUs reserved each, 2 threads inside each job
    assert made["remote"] == [{"num_cpus": 2}] and [p.n for p in made["plans"]] == [2] * 4
    assert inside == [2] * 4 and not made["plans"][0].explicit
    made["plans"].clear()
    inside.clear()
    state["up"] = False
    r = runner.invoke(app, [*args, "--jobs", "2", "--overwrite"])
    assert r.exit_code == 0, r.output
    assert [p.n for p in made["plans"]] == [4] * 2 and inside == [4] * 2  # 2 tasks: 4 each


def test_slurm_local_cluster_shares_this_host_and_a_real_cluster_asks(store, tmp_path, monkeypatch, no_env,
                                                                      restore_threads):  # fmt: skip
    _machine(monkeypatch, cores=8)
    inside = _fake_run_sweep(monkeypatch)
    seen: dict = {"params": [], "plans": []}

    class Executor:
        def __init__(self, folder, cluster=None):
            self.cluster = cluster

        def update_parameters(self, **kw):
            seen["params"].append(kw)

        def submit(self, fn, *a):
            seen["plans"].append(a[4])
            return types.SimpleNamespace(done=lambda: True, result=lambda v=fn(*a): v)

    monkeypatch.setitem(sys.modules, "submitit", types.SimpleNamespace(AutoExecutor=Executor))
    args = ["sweep", "--store", str(store), *SWEEP, "--launcher", "slurm", "--jobs", "4"]
    r = runner.invoke(app, [*args, "--slurm-cluster", "local", "--out", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    assert [p.n for p in seen["plans"]] == [2] * 4 and inside == [2] * 4  # 4 subprocesses here: 8 // 4
    seen["plans"].clear()
    inside.clear()
    # a Slurm cluster: each job decides on its own allocation, unless --threads says; then Slurm allocates them
    r = runner.invoke(app, [*args, "--slurm-cluster", "slurm", "--out", str(tmp_path / "b")])
    assert r.exit_code == 0, r.output
    assert seen["plans"] == [None] * 4 and "cpus_per_task" not in seen["params"][-1]
    seen["plans"].clear()
    r = runner.invoke(
        app, [*args, "--slurm-cluster", "slurm", "--threads", "3", "--out", str(tmp_path / "c")]
    )
    assert r.exit_code == 0, r.output
    assert [p.n for p in seen["plans"]] == [3] * 4 and seen["params"][-1]["cpus_per_task"] == 3


def test_jobs_started_together_count_each_other_through_the_register(tmp_path, monkeypatch):
    """The register of fedfeat jobs on this host: live entries count, entries of ended processes (or of a recycled
    pid: another start time) are dropped; ``decide`` divides the cores among the registered jobs (4 jobs started
    together on 16 idle cores each took 12-13 threads from the runnable-thread count alone; BENCHMARKS, Threads)."""
    import subprocess
    import sys

    reg = tmp_path / "reg"
    monkeypatch.setattr(th, "registry_dir", lambda: reg)
    monkeypatch.setattr(th, "_REGISTERED", [])
    monkeypatch.setattr(th, "SETTLE_SECONDS", 0.0)
    # three other jobs: two alive (sleeping children), one ended, one with a recycled pid
    kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) for _ in range(2)]
    try:
        reg.mkdir()
        for k in kids:
            (reg / str(k.pid)).write_text(th._start_ticks(k.pid) or "")
        done = subprocess.Popen([sys.executable, "-c", "pass"])
        done.wait()
        (reg / str(done.pid)).write_text("1")
        (reg / str(kids[0].pid + 100000)).write_text("1")  # no such process
        (reg / str(os.getppid())).write_text(
            "not-its-start-time"
        )  # a live pid, but not the registered process
        assert th.live_jobs(reg) == 2
        assert sorted(p.name for p in reg.iterdir()) == sorted(str(k.pid) for k in kids)
        monkeypatch.setattr(th, "usable_cores", lambda: 16)
        monkeypatch.setattr(th, "busy_cpus", lambda: 0.0)
        monkeypatch.setattr(th.os, "cpu_count", lambda: 16)
        t = th.decide(None, env={})  # this process joins: 3 jobs share 16 cores
        assert t.n == 5 and "3 jobs" in t.why and (reg / str(os.getpid())).exists()
        assert th.decide(None, jobs=8, env={}).n == 2  # a launcher's count, when larger, wins
        th.unregister()
        assert not (reg / str(os.getpid())).exists() and th.live_jobs(reg) == 2
    finally:
        for k in kids:
            k.kill()
            k.wait()
    assert th.live_jobs(reg) == 0 and not list(reg.iterdir())
