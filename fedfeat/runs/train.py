"""Train one run (or a stack of runs) and write its run directory.

A run directory (``runs/<name>/``) holds:

* ``config.toml``   the resolved configuration; ``fedfeat train --config runs/<name>/config.toml`` replays it;
* ``metrics.jsonl`` one JSON object per round (round 0 = before training): test accuracy, per-class accuracy,
  many/medium/few-shot accuracy, pseudo-label accuracy (label-free methods), mean train loss, bytes up and
  down, seconds, the sampled clients;
* ``results.npz``   per-round per-class (and, with local test splits, per-client) accuracy and the last evaluated
  round's confusion matrix (``write_results``; read with ``fedfeat.report.load.load_results``);
* ``summary.json``  final and best accuracy, totals, the environment; written last;
* ``curve.png``     test accuracy vs round;
* ``weights.safetensors``  the final global parameters (safetensors: loading it cannot execute code); its sha256
  is ``summary.json``'s ``weights_sha256``, checked wherever it is read (``fedfeat.runs.run.read_weights``);
* ``{dataset}_{pretrained}_{model}_en_zeroshot_classification.json``  (``zeroshot`` runs) the result in
  CLIP_benchmark's schema (``fedfeat.report.clipbench``), from the logits of the method's ``benchmark_logits`` hook.

The directory is written under a temporary name and renamed when complete, so a crashed run never looks
finished."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

from fedfeat.engine.rounds import resolve_device, resolve_kernel
from fedfeat.errors import FedfeatError
from fedfeat.report import clipbench, rundir
from fedfeat.report.rundir import CHECKPOINT, read_metrics
from fedfeat.runs.config import RunConfig, config_toml, default_run_name, resolve_config
from fedfeat.runs.divergence import Watch
from fedfeat.runs.session import live_text, open_store, run_data, run_partition
from fedfeat.runs.writers import (  # what a run writes besides training, and the writers of its rows
    ClassGroups,
    Interrupts,
    Live,
    MetricsFile,
    domain_local,
    ProgressBar,
    Rows,
    StackShare,
    Startup,
    _run_info,
    _summary,
    _write_atomic,
    capture_predictions,
    compile_clock,
    default_thresholds,
    memory_figures,
    reset_device_peak,
    shot_groups,
    write_outputs,
)

# every 10 rounds: at the CIFAR-10 shape a checkpoint (safetensors + fsync + rename) costs 2-35 % of a round
# (fsync dominates a FedAvg head's 41 kB; FST-CBDG adds its [50000, 10] soft labels), so 10 rounds keep every
# method and participation measured at <= 3.5 % (`python bench/bench_checkpoint.py`, BENCHMARKS.md)
CHECKPOINT_EVERY = 10


# a method that needs no partition (``needs_partition = False``: zeroshot reads no training data) ignores these
# settings: they go back to their defaults, the run is named with this key and draws nothing
NO_PARTITION = "no-partition"


def uses_partition(cfg: RunConfig, method) -> bool:
    """Whether the run draws its partition: always, except for a method with ``needs_partition = False`` whose
    evaluation does not depend on it either (an open-vocabulary ``disjoint-classes`` split's query set,
    ``--local-test``'s per-client test rows and ``--imbalance-factor``'s many / medium / few groups do)."""
    if method.needs_partition:
        return True
    return (
        cfg.partition == "disjoint-classes"
        or bool(cfg.base_novel)  # base-to-novel: base / novel vocabularies (zeroshot scores each over its own)
        or cfg.local_test not in (None, "none")
        or cfg.imbalance_factor is not None
    )


def without_unused_partition(cfg: RunConfig, method) -> RunConfig:
    """``cfg`` with the partition settings a run ignores set back to their defaults (no error: a zeroshot row in a
    grid over partitions is one run), so its name and config.toml say nothing about a partition it never drew."""
    from fedfeat.runs.config import DEFAULTS
    from fedfeat.spec import drawn

    if uses_partition(cfg, method):
        return cfg
    return dataclasses.replace(cfg, **{k: DEFAULTS[k] for k in drawn()})


def method_partition(store, cfg: RunConfig, method, save: bool):
    """``run_partition``'s ``(key, Partition, stored)``, or, for a run that draws none, ``NO_PARTITION`` and one
    client without rows (nothing of the train split is loaded)."""
    if uses_partition(cfg, method):
        return run_partition(store, cfg, save)
    from fedfeat.partition.core import Partition

    return NO_PARTITION, Partition(NO_PARTITION, {"scheme": NO_PARTITION}, [np.zeros(0, np.int64)]), True


def _run_identity(cfg: RunConfig, method_params: dict, store, key: str) -> dict:
    """What defines a run, written into its checkpoints (``fedfeat.engine.checkpoint``) and checked on resume: the
    resolved settings and method hyperparameters, the store's fingerprint and the partition key; not where it is
    written (``out``, ``name``), the store's path (its fingerprint stands for it) or the device."""
    from fedfeat.spec import identity

    run = identity(cfg)
    return {"run": run, "params": method_params, "store_fingerprint": store.attrs.get("fingerprint_hash"),
            "partition": key}  # fmt: skip


def dp_config(cfg: RunConfig, method=None):
    """The run's ``fedfeat.engine.privacy.DPConfig`` (``privacy.from_config``), checked against the method."""
    from fedfeat.engine.privacy import check_method, from_config

    dp = from_config(cfg)
    if method is not None:
        check_method(method, dp)
    return dp


def _resume_target(path: str | Path) -> tuple[Path, str]:
    from fedfeat.store.urls import local_path

    p = local_path(path, "--resume", "a local run directory")
    name = p.name[len(rundir.PARTIAL) :] if p.name.startswith(rundir.PARTIAL) else p.name
    return p.parent, name


def train(
    cfg: RunConfig | None,
    *,
    resume: str | Path | None = None,
    overwrite: bool = False,
    checkpoint_every: int | None = None,
    save_partition: bool = False,
    progress: bool = True,
    log=print,
    callbacks=None,
    unfinished: str = "refuse",
    _device=None,
    _stacked: StackShare | None = None,
) -> Path:
    """Run one configuration end to end and write its run directory (``fedfeat.report.rundir``). Returns it.

    ``resume``: a run directory (``OUT/NAME``, or its ``OUT/.partial-NAME``) whose run was interrupted; it goes
    on from its last checkpoint with its own config.toml, and ends with the metrics and weights of an
    uninterrupted run.

    ``callbacks``: objects called as the run goes (``fedfeat.runs.callbacks``: start, each round, end, failure),
    with the ones active around the call (``callbacks.use``).

    ``unfinished``: what to do with an unfinished run of this name (``OUT/.partial-NAME``, left by a kill) when not
    ``resume`` / ``overwrite``: ``"refuse"`` (``fedfeat train``: one line naming ``--resume`` and ``--overwrite``) or
    ``"finish"`` (sweeps: go on from it when it is this run's, ``fedfeat.report.rundir.take_unfinished``)."""
    from fedfeat.engine import checkpoint
    from fedfeat.methods import get_method
    from fedfeat.runs import callbacks as _callbacks

    if resume is not None:
        out, name = _resume_target(resume)
        rd = rundir.RunDir(out, name)
        rd.check_links()  # nothing is read back through a link out of OUT
        if not (rd.partial / "config.toml").is_file():
            if (rd.final / "summary.json").is_file():
                raise FedfeatError(f"run {rd.final} is finished; there is nothing to resume")
            raise FedfeatError(
                f"no unfinished run at {resume} (looked for {rd.partial}); `fedfeat report {out} --all` lists them"
            )
        cfg = resolve_config({}, rd.partial / "config.toml", None)
        cfg.out, cfg.name = str(out), name
    if unfinished not in ("refuse", "finish"):
        raise FedfeatError(f"unfinished must be 'refuse' or 'finish', got {unfinished!r}")
    if checkpoint_every is None:
        checkpoint_every = CHECKPOINT_EVERY
    if checkpoint_every < 0:
        raise FedfeatError(f"--checkpoint-every must be >= 0 (0: no checkpoints), got {checkpoint_every}")
    method = get_method(cfg.method, cfg.params)
    cfg = without_unused_partition(cfg, method)  # zeroshot: no partition drawn, its settings ignored
    method_params = dataclasses.asdict(method.p)
    method_defaults = dataclasses.asdict(type(method).Params())
    if (
        _device is None and int(os.environ.get("WORLD_SIZE", "1")) > 1
    ):  # torchrun: clients sharded across ranks
        return _train_sharded(cfg, method, resume, overwrite, checkpoint_every, save_partition, progress, log)
    device = _device if _device is not None else resolve_device(cfg.device)
    if _stacked is None:  # a stacked run's peak is its stack's: reset once by train_stacked
        reset_device_peak(device)
    dp = dp_config(cfg, method)  # before anything is written
    if dp is not None and dp.mode == "sample" and cfg.kernel == "fused":
        raise FedfeatError("--dp sample clips per-sample gradients in the torch program; use --kernel torch (or auto)")
    kernel = "torch" if dp is not None and dp.mode == "sample" else resolve_kernel(cfg.kernel, method, cfg.engine, device)
    store = open_store(cfg)
    key, part, stored = method_partition(store, cfg, method, save_partition)
    if dp is not None:  # delta, the calibration to --epsilon, adaptive clipping's room: one line, before the run dir
        from fedfeat.engine.privacy import prepare

        prepare(dp, part.sizes().tolist(), method, cfg.participation, cfg.rounds)
    name = cfg.name or default_run_name(cfg, method_params, method_defaults, store.attrs, key)
    out = rundir.check_out(cfg.out)
    rd = rundir.RunDir(out, name)
    rd.check_links()  # NAME, .partial-NAME (and its files), .old-NAME, .lock-NAME: no link out of OUT
    rd.lock.acquire()
    try:
        with rundir.interrupt_latch(), rundir.sigterm_as_exception(), _callbacks.use(callbacks):
            return _train_locked(
                cfg, method, method_params, device, kernel, store, key, part, stored, rd,
                resume is not None, overwrite, checkpoint_every, progress, log, checkpoint, _stacked, unfinished,
            )  # fmt: skip
    except (
        OSError
    ) as e:  # a full disk, a read-only or forbidden --out: the run's directory is already cleaned up
        where = f" ({e.filename})" if e.filename else ""
        raise FedfeatError(
            f"cannot write run {rd.final}: {e.strerror or e}{where}; free space or pass a writable --out, then run "
            "again"
            + (f" (or `fedfeat train --resume {rd.final}`)" if (rd.partial / CHECKPOINT).is_file() else "")
        ) from None
    finally:
        rd.lock.release()


_DIST: list = []  # this process's torchrun group (set up once, used by every run of the process)


def _train_sharded(cfg, method, resume, overwrite, checkpoint_every, save_partition, progress, log) -> Path:
    """``torchrun --nproc-per-node N -m fedfeat train ...``: every rank loads the data and trains its share of each
    round's clients (``engine.sharded_local``); rank 0 alone writes the run directory, exactly as one process
    would, and the other ranks write nothing. Results equal one process's (tested with gloo on CPU)."""
    from fedfeat.engine.distributed import init_dist
    from fedfeat.engine.rounds import run_federated

    if resume is not None:
        raise FedfeatError("--resume continues a run in one process; resume it without torchrun")
    if not type(method).__dict__.get("shardable", False):
        raise FedfeatError(
            f"method {method.name} cannot be sharded across processes (per-sample state updated in local "
            "training); run it in one process"
        )
    if not _DIST:
        _DIST.append(init_dist(True, cfg.device))
    dist_ctx, device = _DIST[0]
    kernel = resolve_kernel(cfg.kernel, method, cfg.engine, device)
    if dist_ctx.rank == 0:
        try:
            return train(cfg, overwrite=overwrite, checkpoint_every=checkpoint_every,
                         save_partition=save_partition, progress=progress, log=log, _device=device)  # fmt: skip
        finally:
            dist_ctx.barrier()
    store = open_store(cfg)
    _, part, _ = run_partition(store, cfg, False)
    data = run_data(store, part, "", cfg, device, method.centralized)
    if method.needs_live_text:
        data.live = live_text(store, cfg, device)
    centralized = method.centralized
    run_federated(method, data, rounds=cfg.rounds, participation=1.0 if centralized else cfg.participation,
                  seed=cfg.seed, engine=cfg.engine, kernel=kernel, device=device, eval_every=cfg.eval_every,
                  dp=dp_config(cfg, method))  # fmt: skip
    dist_ctx.barrier()
    return run_name(cfg)


def _train_locked(
    cfg, method, method_params, device, kernel, store, key, part, stored, rd, resuming, overwrite,
    checkpoint_every, progress, log, checkpoint, stacked=None, unfinished="refuse",
):  # fmt: skip

    from fedfeat.engine.rounds import run_federated

    rd.check_links()  # again, under the lock
    rd.recover()
    ckpt = rd.partial / CHECKPOINT
    start = None
    if not resuming:
        if rd.final.exists() and not overwrite:
            raise FedfeatError(
                f"run directory {rd.final} exists; pass --overwrite to replace it (atomically: the old run stays "
                "until the new one is complete) or --name for another name"
            )
        if rd.partial.exists() and unfinished == "finish" and not overwrite:  # a sweep run again after a kill
            resuming = rundir.take_unfinished(
                rd, config_toml(cfg, method_params), resumable=stacked is None, log=log
            )
        elif rd.partial.exists():
            if not overwrite:
                try:
                    at = checkpoint.read_meta(ckpt)["round"] if os.path.lexists(ckpt) else "none"
                except FedfeatError:
                    at = "unreadable"
                raise FedfeatError(
                    f"an unfinished run {rd.name} exists in {rd.out} (checkpointed round: {at}); resume it with "
                    f"`fedfeat train --resume {rd.final}` or pass --overwrite to start it again"
                )
            shutil.rmtree(rd.partial)
    elif rd.final.exists() and not overwrite:
        raise FedfeatError(
            f"run directory {rd.final} exists (a finished run of that name); pass --overwrite to let the resumed "
            "run replace it"
        )
    if resuming and (rd.partial / "summary.json").is_file():  # killed between its last write and the rename
        log(f"run {rd.name} had finished before it was interrupted; publishing it")
        rd.publish(overwrite)
        return rd.final
    from fedfeat.runs import callbacks as _callbacks

    cbs = _callbacks.for_run(None)  # live logging: the callbacks of train() and those active around it
    try:
        identity = _run_identity(cfg, method_params, store, key)
        if resuming:
            afresh = (
                f"to start it afresh, drop --resume and pass --overwrite: fedfeat train --config "
                f"{rd.partial / 'config.toml'} --out {rd.out} --name {rd.name} --overwrite"
            )
            mpath = rd.partial / "metrics.jsonl"
            try:
                old = read_metrics(mpath) if os.path.lexists(mpath) else []
            except FedfeatError as e:  # not a regular file (a FIFO would block), unreadable
                raise FedfeatError(f"cannot resume: {e}; {afresh}") from None
            if os.path.lexists(ckpt):  # checked: digest, run identity, round, the metric rows before it
                start = checkpoint.load(
                    ckpt, device, run=identity, rounds=cfg.rounds, rows=old, afresh=afresh
                )  # old: cut to the rows up to the checkpoint
        else:
            rd.partial.mkdir()
            (rd.partial / "config.toml").write_text(config_toml(cfg, method_params))
            if not stored:
                from fedfeat.partition.core import to_json

                to_json(part, rd.partial / "partition.json")  # computed here: kept with the run
        centralized = method.centralized
        data = run_data(store, part, key, cfg, device, centralized)
        if method.needs_live_text:  # prompt methods: the store's text encoder, checked
            data.live = live_text(store, cfg, device)
            log(
                f"live text encoder: {data.live.backbone} ({data.live.weights}) reproduces the store's text "
                f"features (min cosine {data.live.min_cosine:.6f})"
            )
        groups = shot_groups(
            data.train_counts.cpu().numpy(), cfg.shot_thresholds or default_thresholds(cfg, data)
        )
        test_counts = np.bincount(data.test_y.cpu().numpy(), minlength=len(data.class_names))
        # divergence (fedfeat.runs.divergence): one stderr line when it happens, summary.json's ``diverged``
        watch = Watch(rd.name, method, np.flatnonzero(test_counts).tolist(), prior=old if start else ())
        done = start[0] if start else 0
        # rows after the checkpoint are redone; checkpoint.load kept the rows up to its round (checked)
        kept = checkpoint.rows_text(old if start else []) if resuming else None
        mfile = MetricsFile(rd.partial / "metrics.jsonl", kept)
        if resuming:
            log(f"resuming {rd.name} after round {done} of {cfg.rounds}")
        cbs.run_start(_run_info(cfg, method_params, rd, done if resuming else None))
        last_pred = capture_predictions(method) if stacked is None else None  # for results.npz's confusion
        startup = Startup(first=stacked is None)
        # the one loop's writers, in order: what each row is written to (the engine calls them per round)
        rows = Rows([startup, ClassGroups(groups, test_counts), mfile, Live(cbs), watch,
                     ProgressBar(cfg, method, key, done) if progress else None, Interrupts()])  # fmt: skip
        ck_seconds = [0.0]

        def on_checkpoint(rnd: int, glob: dict, state: dict) -> None:
            t = time.perf_counter()
            mfile.sync()  # the metrics rows the checkpoint stands on are on disk first
            checkpoint.save(ckpt, rnd, glob, state, run=identity, rows=mfile.text)
            ck_seconds[0] += time.perf_counter() - t

        t0 = time.perf_counter()
        compiled = [0.0]
        try:
            if (
                stacked is not None
            ):  # this run's share of a stacked program: its rows written as they were made
                glob = stacked.weights
                for row in stacked.rows:
                    rows(dict(row))
            else:
                with compile_clock(compiled):
                    glob, _ = run_federated(
                        method,
                        data,
                        rounds=cfg.rounds,
                        participation=1.0 if centralized else cfg.participation,
                        seed=cfg.seed,
                        engine=cfg.engine,
                        kernel=cfg.kernel,
                        device=device,
                        on_round=rows,
                        on_checkpoint=on_checkpoint,
                        checkpoint_every=checkpoint_every,
                        eval_every=cfg.eval_every,
                        resume=start,
                        dp=dp_config(cfg),
                    )
        finally:
            rows.close()
        # numba's compile on first use (~25 s for the fused kernels, once per machine: cached on disk) is
        # recorded as compile_seconds and left out of seconds
        wall = time.perf_counter() - t0 - compiled[0] if stacked is None else stacked.seconds
        metrics = read_metrics(mfile.path)
        confusion = stacked.confusion if stacked is not None else (last_pred or {}).get("confusion")
        trained = write_outputs(rd.partial, cfg, method, key, glob, metrics, confusion)  # the weights' sha256
        summary = _summary(cfg, method, method_params, kernel, device, key, rd.name, metrics, wall, store)
        summary.update(domain_local(part, metrics))  # a domain partition's personal accuracy per domain
        summary["diverged"] = watch.final(metrics)  # {"round", "reason"} or None (healthy)
        summary.update(memory_figures(device))  # peak_rss_bytes, rss_bytes_at_end, peak_device_bytes (CUDA)
        summary["checkpoint_seconds"] = ck_seconds[0]
        summary["compile_seconds"] = compiled[0]  # numba's compiles on first use: not in ``seconds``
        if startup.seconds is not None:  # the first run of its process: start-up to training (BENCHMARKS.md)
            summary["startup_seconds"] = startup.seconds
        if not trained:
            summary["weights"] = (
                f"none written: {cfg.method} trains nothing (its head is the store's class text features)"
            )
        else:  # checked wherever the weights are read (fedfeat.runs.run.read_weights)
            summary["weights_sha256"] = trained
        bench = method.benchmark_logits  # zeroshot: its result in CLIP_benchmark's JSON
        if bench is not None:
            logits, y, dataset = bench(data=data, glob=glob, store=store)
            doc = clipbench.result(store, logits, y, dataset=dataset)
            summary["clip_benchmark"] = clipbench.write(rd.partial, doc).name
        if stacked is not None:
            summary["stacked_runs"] = (
                stacked.runs
            )  # made in one program with this many runs (fedfeat.runs.stack)
        if start:
            summary["resumed_after_round"] = done
        rundir.check_interrupt()  # an interrupt that something swallowed: no summary, nothing published
        ckpt.unlink(missing_ok=True)  # a finished run needs none
        _write_atomic(rd.partial / "summary.json", json.dumps(summary, indent=2))
        cbs.run_end(
            {**summary, "path": str(rd.final)}
        )  # before the rename: loggers close files inside the run
        rundir.fault_point("before-publish")
        with rundir.deferred_interrupts():  # never cut between the renames; an interrupt is raised after them
            rd.publish(overwrite)
    except BaseException as e:
        cbs.run_failed(e)
        if ckpt.is_file() and isinstance(e, (KeyboardInterrupt, rundir.Interrupted, OSError)):
            log(f"interrupted after a checkpoint; resume with: fedfeat train --resume {rd.final}")
        elif not resuming:  # nothing to resume: this process's partial directory goes
            shutil.rmtree(rd.partial, ignore_errors=True)
        raise
    accs = [r["test_acc"] for r in metrics if r["test_acc"] is not None]
    log(
        f"run: {rd.final}  (final acc {accs[-1]:.2f}%, best {max(accs):.2f}% at round {summary['best_round']}, "
        f"{wall:.1f} s)"
    )
    return rd.final


def stack_group(cfg: RunConfig) -> tuple | None:
    """Runs with equal groups can be made as one stacked program (``fedfeat.runs.stack``): a method that stacks
    (``Method.stacks``) with equal data-shaping hyperparameters, and every run setting equal that the run
    specification does not declare ``per_run`` (``fedfeat.spec.stack_key``: seed, participation, name and
    output directory may differ; a new setting keeps runs apart until declared so). None: this run is made on its
    own (a method that does not stack, a setting's ``unstack`` reason such as the loop engine or local test splits,
    torchrun)."""
    from fedfeat import spec
    from fedfeat.methods import get_method
    from fedfeat.runs.stack import stack_key

    if spec.unstack_reason(cfg) is not None:
        return None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun shards one run's clients instead
        return None
    method = get_method(cfg.method, cfg.params)
    return stack_key(method, spec.stack_key(cfg))


def train_stacked(
    cfgs: list[RunConfig], *, overwrite: bool = False, log=print, unfinished: str = "refuse"
) -> list:
    """Make runs of one ``stack_group`` as one program (``fedfeat.runs.stack.run_stacked``) and write each as an
    ordinary run directory. Returns per run its directory, or the ``FedfeatError`` that stopped it."""
    from fedfeat.methods import get_method
    from fedfeat.runs.stack import run_stacked

    groups = {stack_group(c) for c in cfgs}
    if None in groups or len(groups) != 1:
        raise FedfeatError("train_stacked: these runs cannot be stacked (see fedfeat.runs.train.stack_group)")
    cfg0 = cfgs[0]
    device = resolve_device(cfg0.device)
    reset_device_peak(
        device
    )  # each run's peak_device_bytes is the whole stack's (one program, one copy of data)
    store = open_store(cfg0)
    key, part, _ = run_partition(store, cfg0, False)
    data = run_data(store, part, key, cfg0, device, False)
    methods = [get_method(c.method, c.params) for c in cfgs]
    boxes = [capture_predictions(m) for m in methods]  # each run's last confusion (results.npz)
    t0 = time.perf_counter()
    res = run_stacked(methods, data, rounds=cfg0.rounds, participation=[c.participation for c in cfgs],
                      seeds=[c.seed for c in cfgs], device=device, eval_every=cfg0.eval_every,
                      kernel=cfg0.kernel, dps=[dp_config(c, m) for c, m in zip(cfgs, methods)])  # fmt: skip
    share = (time.perf_counter() - t0) / len(cfgs)
    out = []
    for c, r, box in zip(cfgs, res, boxes):
        if isinstance(r, FedfeatError):
            out.append(r)
            continue
        stacked = StackShare(r[0], r[1], share, len(cfgs), box.get("confusion"))
        try:  # one run that cannot be written (its name locked by a live writer, ...) is that run's failure
            out.append(
                train(
                    c, overwrite=overwrite, progress=False, log=log, unfinished=unfinished, _stacked=stacked
                )
            )
        except FedfeatError as e:
            out.append(e)
    return out


def run_name(cfg: RunConfig) -> Path:
    """The directory ``train(cfg)`` would publish (``OUT/NAME``), computed without writing anything."""
    from fedfeat.methods import get_method

    method = get_method(cfg.method, cfg.params)
    cfg = without_unused_partition(cfg, method)
    store = open_store(cfg)
    key, _, _ = method_partition(store, cfg, method, False)
    name = cfg.name or default_run_name(
        cfg, dataclasses.asdict(method.p), dataclasses.asdict(type(method).Params()), store.attrs, key
    )
    return Path(cfg.out) / name
