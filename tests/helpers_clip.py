"""Test helpers for the encode stage: a tiny open_clip model and fixture datasets in every supported format.

Nothing here downloads anything. The tiny model (a ViT of width 64, 2 layers, 32-px images, embed dim 32) is
built with random weights and saved to a file, which the tests pass as ``--pretrained FILE``.

Run as a script (``python tests/helpers_clip.py encode ...``), this module stands in for ``python -m fedfeat``
while ``fedfeat/cli/app.py`` does not exist yet.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from fedfeat.runs.standin import STANDIN_CFG  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TINY_NAME = "fedfeat-tiny-vit"
TINY_CFG = STANDIN_CFG  # the same tiny ViT as reproduce's live stand-ins (fedfeat.runs.standin)
CIFAR10_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


# ---------------------------------------------------------------------------------------- CLI access
def cli_app():
    """The ``fedfeat`` typer app."""
    from fedfeat.cli import app

    return app


def run_cli(args: list[str]):
    """Run the CLI in-process with ``typer.testing.CliRunner``; returns the click ``Result``."""
    from typer.testing import CliRunner

    return CliRunner().invoke(cli_app(), [str(a) for a in args])


def synth_store(
    out: Path, dim: int = 32, train_per_class: int = 60, test_per_class: int = 20, templates: int = 1
) -> Path:
    """A small synthetic store at ``out`` (``fedfeat synth``, no statistics pass); returns its path."""
    r = run_cli(["synth", "--out", out, "--dim", dim, "--train-per-class", train_per_class,
                 "--test-per-class", test_per_class, "--templates", templates, "--no-stats"])  # fmt: skip
    assert r.exit_code == 0, r.output
    return Path(out)


def cli_error_text(result) -> str:
    """The user-facing error of a failed CLI run: one line, exit status 2."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    return result.output


def cli_argv() -> list[str]:
    """argv prefix that runs the CLI in a fresh interpreter."""
    return [sys.executable, "-m", "fedfeat"]


def subprocess_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["HF_HUB_OFFLINE"] = "1"
    env.update(extra)
    return env


def kill_after_first_chunk(args: list, store: Path, timeout: float = 60.0) -> None:
    """Run ``fedfeat ARGS`` (an encode) in a fresh interpreter, slowed after each chunk, and SIGKILL it once the
    first train chunk of ``store`` is recorded done."""
    import signal
    import time

    proc = subprocess.Popen(
        cli_argv() + [str(a) for a in args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=subprocess_env(FEDFEAT_TEST_CHUNK_SLEEP="0.5"),
    )
    done = Path(store) / "train" / "done" / "c"
    deadline = time.monotonic() + timeout
    while not (done.is_dir() and any(done.iterdir())):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "encode never wrote a chunk"
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL


def run_subprocess(args: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        cli_argv() + [str(a) for a in args],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        **kw,
    )


# ---------------------------------------------------------------------------------------- mount namespaces
def unshare_available() -> bool:
    """True where ``unshare -rm`` gives a user + mount namespace that may mount (read-only binds, tmpfs)."""
    import shutil

    if sys.platform != "linux" or shutil.which("unshare") is None:
        return False
    p = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs tmpfs /mnt"], capture_output=True)
    return p.returncode == 0


def run_mounted(mount: str, argv: list, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run ``argv`` in a private mount namespace after the shell command ``mount`` (e.g. a read-only bind of
    a store over itself: root ignores chmod, a read-only mount it does not; or a tiny tmpfs: a full disk)."""
    import shlex

    script = f"{mount} && exec {shlex.join(str(a) for a in argv)}"
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", script],
        cwd=REPO,
        env=subprocess_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_only_bind(path) -> str:
    """The mount command that makes ``path`` read-only (for ``run_mounted``)."""
    import shlex

    q = shlex.quote(str(path))
    return f"mount --bind -o ro {q} {q}"


# ---------------------------------------------------------------------------------------- tiny model
@dataclass(frozen=True)
class TinyClip:
    config: Path  # JSON model config (registered under TINY_NAME)
    weights: Path  # safetensors of its random weights
    weights_pt: Path  # the same weights via torch.save


def make_tiny_clip(d: Path) -> TinyClip:
    """Write the tiny config and random weights (seeded) under ``d``."""
    import torch
    from safetensors.torch import save_file

    from fedfeat.encoders.openclip import import_open_clip

    oc = import_open_clip()
    d.mkdir(parents=True, exist_ok=True)
    cfg = d / f"{TINY_NAME}.json"
    cfg.write_text(json.dumps(TINY_CFG))
    oc.add_model_config(cfg)
    torch.manual_seed(1234)
    model = oc.create_model(TINY_NAME)
    with torch.no_grad():  # a logit scale other than the init's, to see it stored
        model.logit_scale.fill_(np.log(50.0))
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(sd, str(d / "tiny.safetensors"))
    torch.save(sd, d / "tiny.pt")
    return TinyClip(cfg, d / "tiny.safetensors", d / "tiny.pt")


def reference_model(tc: TinyClip):
    """(model, eval transform, tokenizer) built by open_clip itself from the saved weights."""
    from fedfeat.encoders.openclip import import_open_clip

    oc = import_open_clip()
    oc.add_model_config(tc.config)
    model, _, preprocess = oc.create_model_and_transforms(TINY_NAME, pretrained=str(tc.weights))
    model.eval()
    return model, preprocess, oc.get_tokenizer(TINY_NAME)


# ---------------------------------------------------------------------------------------- CIFAR pickles
class _Py2Pickler(pickle._Pickler):
    """Writes pickles the way Python 2's cPickle wrote the CIFAR files: protocol 2, byte strings as BINSTRING
    (not Python 3's ``_codecs.encode`` calls), numpy's ``_reconstruct`` under ``numpy.core.multiarray``."""

    dispatch = pickle._Pickler.dispatch.copy()

    def save_py2_str(self, obj: bytes) -> None:
        n = len(obj)
        self.write(
            (pickle.SHORT_BINSTRING + bytes([n]) if n < 256 else pickle.BINSTRING + struct.pack("<i", n))
            + obj
        )
        self.memoize(obj)

    dispatch[bytes] = save_py2_str

    def save_global(self, obj, name=None):
        if getattr(obj, "__name__", "") == "_reconstruct":
            self.write(pickle.GLOBAL + b"numpy.core.multiarray\n_reconstruct\n")
            self.memoize(obj)
            return
        super().save_global(obj, name)


def _dump(obj, path: Path, protocol: int | str) -> None:
    with open(path, "wb") as f:
        if protocol == "py2":
            _Py2Pickler(f, protocol=2).dump(obj)
        else:
            pickle.dump(obj, f, protocol=protocol)


@dataclass
class CifarFixture:
    root: Path
    images: dict[str, np.ndarray]  # split -> [N, 32, 32, 3] uint8
    labels: dict[str, np.ndarray]  # split -> [N] int64
    class_names: list[str]


def write_cifar10(
    root: Path, n_train: int = 40, n_test: int = 12, protocol: int | str = "py2", seed: int = 0
):
    """A CIFAR-10 "python version" folder at ``root`` (5 train batches + test batch + batches.meta)."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    images = {
        "train": rng.integers(0, 256, (n_train, 32, 32, 3), dtype=np.uint8),
        "test": rng.integers(0, 256, (n_test, 32, 32, 3), dtype=np.uint8),
    }
    labels = {s: rng.integers(0, 10, len(x)).astype(np.int64) for s, x in images.items()}
    flat = {s: x.transpose(0, 3, 1, 2).reshape(len(x), 3072) for s, x in images.items()}
    parts = np.array_split(np.arange(n_train), 5)
    for b, idx in enumerate(parts, start=1):
        _dump(
            {
                b"batch_label": f"training batch {b} of 5".encode(),
                b"labels": [int(v) for v in labels["train"][idx]],
                b"data": flat["train"][idx],
                b"filenames": [f"img_{i}.png".encode() for i in idx],
            },
            root / f"data_batch_{b}",
            protocol,
        )
    _dump(
        {
            b"batch_label": b"testing batch 1 of 1",
            b"labels": [int(v) for v in labels["test"]],
            b"data": flat["test"],
            b"filenames": [f"t_{i}.png".encode() for i in range(n_test)],
        },
        root / "test_batch",
        protocol,
    )
    _dump(
        {
            b"num_cases_per_batch": 10000,
            b"label_names": [n.encode() for n in CIFAR10_NAMES],
            b"num_vis": 3072,
        },
        root / "batches.meta",
        protocol,
    )
    return CifarFixture(root, images, labels, list(CIFAR10_NAMES))


def write_cifar100(
    root: Path, n_train: int = 30, n_test: int = 10, protocol: int | str = "py2", seed: int = 1
):
    """A CIFAR-100 "python version" folder (train, test, meta) with 100 fine classes (a few with ``_``)."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    fine = [f"class_{k:02d}" for k in range(100)]
    fine[1] = "aquarium_fish"
    images = {
        "train": rng.integers(0, 256, (n_train, 32, 32, 3), dtype=np.uint8),
        "test": rng.integers(0, 256, (n_test, 32, 32, 3), dtype=np.uint8),
    }
    labels = {s: rng.integers(0, 100, len(x)).astype(np.int64) for s, x in images.items()}
    for s, x in images.items():
        _dump(
            {
                b"filenames": [f"{s}_{i}.png".encode() for i in range(len(x))],
                b"batch_label": s.encode(),
                b"fine_labels": [int(v) for v in labels[s]],
                b"coarse_labels": [int(v) // 5 for v in labels[s]],
                b"data": x.transpose(0, 3, 1, 2).reshape(len(x), 3072),
            },
            root / s,
            protocol,
        )
    _dump(
        {
            b"fine_label_names": [n.encode() for n in fine],
            b"coarse_label_names": [f"super_{k}".encode() for k in range(20)],
        },
        root / "meta",
        protocol,
    )
    return CifarFixture(root, images, labels, [n.replace("_", " ") for n in fine])


# ---------------------------------------------------------------------------------------- image files
@dataclass
class FilesFixture:
    root: Path
    paths: dict[str, list[Path]]  # split -> absolute image paths in dataset order
    labels: dict[str, np.ndarray]
    class_names: list[str]


def _png(path: Path, rng: np.random.Generator, size: tuple[int, int] = (40, 30)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path)


def write_imagefolder(
    root: Path, splits: dict[str, int] | None = None, classes=("cat", "dog", "sea_lion"), seed: int = 2
) -> FilesFixture:
    """``root/<split>/<class>/<i>.png`` with ``splits[split]`` images per class (sizes vary)."""
    rng = np.random.default_rng(seed)
    splits = splits or {"train": 4, "test": 2}
    paths: dict[str, list[Path]] = {}
    labels: dict[str, np.ndarray] = {}
    for split, per_class in splits.items():
        ps, ys = [], []
        for k, c in enumerate(sorted(classes)):
            for i in range(per_class):
                p = root / split / c / f"{i:03d}.png"
                _png(p, rng, (int(rng.integers(20, 48)), int(rng.integers(20, 48))))
                ps.append(p)
                ys.append(k)
        paths[split] = ps
        labels[split] = np.asarray(ys, dtype=np.int64)
    return FilesFixture(root, paths, labels, [c.replace("_", " ") for c in sorted(classes)])


def write_listfile(root: Path, seed: int = 3) -> FilesFixture:
    """ImageNet-LT-style lists: ``ImageNet_LT_train.txt`` / ``ImageNet_LT_test.txt`` with ``path label`` lines
    and ``classnames.txt`` with WordNet ids (``n01440764 tench``)."""
    rng = np.random.default_rng(seed)
    names = [("n01440764", "tench"), ("n01443537", "goldfish"), ("n01484850", "great white shark")]
    wn = {0: "n01440764", 1: "n01443537", 2: "n01484850"}
    root.mkdir(parents=True, exist_ok=True)
    (root / "classnames.txt").write_text("".join(f"{a} {b}\n" for a, b in names))
    paths: dict[str, list[Path]] = {}
    labels: dict[str, np.ndarray] = {}
    for split, ys in {"train": [0, 0, 0, 1, 1, 2, 0, 1], "test": [2, 1, 0]}.items():
        lines, ps = [], []
        for i, y in enumerate(ys):
            rel = f"{split}/{wn[y]}/{wn[y]}_{i}.JPEG"
            p = root / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (36, 44, 3), dtype=np.uint8)).save(
                p, format="JPEG", quality=90
            )
            lines.append(f"{rel} {y}\n")
            ps.append(p)
        (root / f"ImageNet_LT_{split}.txt").write_text("".join(lines))
        paths[split] = ps
        labels[split] = np.asarray(ys, dtype=np.int64)
    return FilesFixture(root, paths, labels, [b for _, b in names])


def write_corrupt(path: Path) -> Path:
    """A ``.png`` that is a truncated PNG (valid header, no image data)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    good = path.with_suffix(".tmp.png")
    Image.fromarray(np.zeros((16, 16, 3), dtype=np.uint8) + 100).save(good)
    path.write_bytes(good.read_bytes()[:40])
    good.unlink()
    return path


# ---------------------------------------------------------------------------------------- reference features
def reference_image_features(model, preprocess, images) -> np.ndarray:
    """open_clip's own features of PIL images or ``[32, 32, 3]`` uint8 arrays: ``[N, D]`` float32."""
    import torch

    pils = [Image.fromarray(x) if isinstance(x, np.ndarray) else Image.open(x).convert("RGB") for x in images]
    with torch.no_grad():
        batch = torch.stack([preprocess(im) for im in pils])  # [N, 3, H, W]
        return model.encode_image(batch).float().numpy()


def reference_text_features(model, tokenizer, templates: list[str], class_names: list[str]) -> np.ndarray:
    """``[T, K, D]`` float32 open_clip text features of every template x class."""
    import torch

    with torch.no_grad():
        out = [
            model.encode_text(tokenizer([t.replace("{}", c) for c in class_names])).float().numpy()
            for t in templates
        ]
    return np.stack(out)


def max_rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """max over rows of ||got - want|| / ||want||."""
    got = np.asarray(got, dtype=np.float64).reshape(-1, want.shape[-1])
    want = np.asarray(want, dtype=np.float64).reshape(-1, want.shape[-1])
    return float((np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1)).max())


def store_snapshot(path: Path, ignore_attrs=("created_at",)) -> dict:
    """Every array's bytes and every attribute (timestamps dropped) of a store, for equality checks."""
    import zarr

    g = zarr.open_group(str(path), mode="r")
    snap: dict = {"attrs": {k: v for k, v in dict(g.attrs).items() if k not in ignore_attrs}}

    def walk(grp, prefix=""):
        for k, arr in grp.arrays():
            snap[prefix + k] = (arr.dtype.str, arr.shape, arr[...].tobytes())
        for k, sub in grp.groups():
            snap[f"{prefix}{k}/attrs"] = dict(sub.attrs)
            walk(sub, prefix + k + "/")

    walk(g)
    return snap


def pixel_store(root: Path, n_train: int = 60, n_test: int = 20) -> Path:
    """Fake CIFAR-10 (``n_train`` / ``n_test`` images) encoded by the tiny open_clip model with ``--pixels`` under
    ``root``: the store the live-encoder methods (prompt learning, FedOTP's patches) read."""
    tc = make_tiny_clip(root / "tiny")
    fx = write_cifar10(root / "data" / "cifar-10-batches-py", n_train=n_train, n_test=n_test)
    r = run_cli(["encode", "--dataset", "cifar10", "--root", fx.root, "--backbone", tc.config, "--pretrained",
                 tc.weights, "--out", root / "px", "--device", "cpu", "--pixels"])  # fmt: skip
    assert r.exit_code == 0, (r.output, r.exception)
    return root / "px" / "cifar10" / f"{TINY_NAME}-tiny.zarr"


def tiny_encoded_store(
    root: Path, n_train: int = 120, n_test: int = 30, templates: str = "cifar", pixels: bool = False, tc=None
) -> Path:
    """Fake CIFAR-10 (``n_train`` / ``n_test`` images) encoded under ``root`` by the tiny open_clip model (``tc``, or
    one made there) through the real ``fedfeat encode``: the store the text-prompt tests train on (``pixels``: with
    the model inputs kept, for the methods that re-encode images)."""
    tc = tc or make_tiny_clip(root / "tiny")
    fx = write_cifar10(root / "data" / "cifar-10-batches-py", n_train=n_train, n_test=n_test)
    args = ["encode", "--dataset", "cifar10", "--root", fx.root, "--backbone", tc.config, "--pretrained", tc.weights,
            "--out", root / "c", "--device", "cpu", "--templates", templates] + ["--pixels"] * pixels  # fmt: skip
    r = run_cli(args)
    assert r.exit_code == 0, (r.output, r.exception)
    return root / "c" / "cifar10" / f"{TINY_NAME}-tiny.zarr"


def feature_and_prompt_stores(root: Path) -> dict:
    """Two small stores under ``root``: ``feature``, a synthetic store (4 classes, D = 16), and ``prompt``, fake
    CIFAR-10 encoded by the tiny open_clip model with pixels (the prompt methods' live encoders read it)."""
    feat = root / "s.zarr"
    r = run_cli(["synth", "--out", feat, "--classes", "4", "--dim", "16", "--train-per-class", "30",
                 "--test-per-class", "10", "--templates", "2", "--no-stats"])  # fmt: skip
    assert r.exit_code == 0, r.output
    tc = make_tiny_clip(root / "tiny")
    c10 = write_cifar10(root / "cifar-10-batches-py", n_train=40, n_test=20)
    r = run_cli(["encode", "--dataset", "cifar10", "--root", c10.root, "--backbone", tc.config, "--pretrained",
                 tc.weights, "--out", root / "cache", "--device", "cpu", "--templates", "cifar", "--pixels"])  # fmt: skip
    assert r.exit_code == 0, (r.output, r.exception)
    return {"feature": feat, "prompt": root / "cache" / "cifar10" / f"{TINY_NAME}-tiny.zarr", "root": root}


# ---------------------------------------------------------------------------------------- personalised prompt runs
def personal_data(store, live):
    """The tiny store's RunData with a 3-client Dirichlet-joint partition and its joint local test splits (the
    personalised prompt methods' batched = loop tests)."""
    from fedfeat.engine.data import load_run_data
    from fedfeat.partition.make import make_partition
    from fedfeat.store.featurestore import FeatureStore

    st = FeatureStore.open(store)
    part = make_partition(
        st.labels("train"), "dirichlet-joint", clients=3, alpha=0.5, test_labels=st.labels("test")
    )
    data = load_run_data(st, part, local_test="joint")
    data.live = live
    return data


def grab_setups(monkeypatch, classes) -> list:
    """The Context each of ``classes``' ``setup`` saw, in call order (``ctx.state`` / ``ctx.cache`` after a run)."""
    seen = []
    for cls in classes:
        orig = cls.setup

        def setup(self, ctx, _orig=orig):
            seen.append(ctx)
            return _orig(self, ctx)

        monkeypatch.setattr(cls, "setup", setup)
    return seen


def same_personal_runs(name, sets, data, seen, rounds=2):
    """Method ``name`` run batched and loop on ``data``: the weights, losses and local / test accuracies agree.
    Returns ``(method, weights, rows, context)`` of the batched run."""
    import pytest
    import torch

    from fedfeat.engine.rounds import run_federated
    from fedfeat.methods import get_method

    runs = {}
    for engine in ("batched", "loop"):
        m = get_method(name, sets)
        runs[engine] = (m, *run_federated(m, data, rounds=rounds, participation=1.0, seed=0, engine=engine))
    (mb, gb, rb), (_, gl, rl) = runs["batched"], runs["loop"]
    for k in gb:
        torch.testing.assert_close(gb[k], gl[k], atol=1e-5, rtol=1e-5)
    assert [r["train_loss"] for r in rb] == pytest.approx([r["train_loss"] for r in rl], abs=1e-5)
    for key in ("local_acc", "test_acc"):
        assert [r[key] for r in rb] == pytest.approx([r[key] for r in rl], abs=1e-9)
    return mb, gb, rb, seen[-2]  # the batched run's context


# ---------------------------------------------------------------------------------------- killed and resumed runs
class Killed(KeyboardInterrupt):
    """What ``train_killed`` raises at the run's fault point (an in-process kill that keeps the partial run)."""


def train_killed(cfg, every: int, kill: int | None = None, resume=None):
    """``fedfeat.runs.train.train`` with ``checkpoint_every=every``, killed after round ``kill`` (``Killed`` at the fault
    point ``after-round-N``; the partial run and its checkpoint stay), or to the end (``kill`` None); ``resume``: a
    run directory to go on from (with its own config). Returns the finished run's directory."""
    import pytest

    from fedfeat.report import rundir
    from fedfeat.runs.train import train

    def fault(name: str) -> None:
        if name == f"after-round-{kill}":
            raise Killed

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rundir, "fault_point", fault)
        go = dict(checkpoint_every=every, progress=False, log=lambda s: None)
        if kill is None:
            return train(None if resume else cfg, resume=resume, **go)
        with pytest.raises(Killed):
            train(None if resume else cfg, resume=resume, **go)


def fake_prompt_ctx(live, n_clients: int = 2, seed: int = 0):
    """A minimal method context on the tiny store's live text tower (five CIFAR-10 classes, their ``a photo of a
    {c}.`` text features): what the prompt methods' transcription tests hand their hooks."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    names = ["airplane", "automobile", "bird", "cat", "deer"]
    text = F.normalize(live.tower.encode([f"a photo of a {c}." for c in names]), dim=-1)
    return SimpleNamespace(
        device="cpu", live=live, class_names=names, rounds=2, open_vocab=None, seed=seed, n_clients=n_clients,
        state={}, cache={}, text=text, K=len(names), clip_logit_scale=100.0,
    )  # fmt: skip
