"""``fedfeat encode`` end to end on a tiny open_clip model (random weights saved to a file; no downloads).

The expected features are computed by open_clip itself (``create_model_and_transforms`` with the same weights
file, its eval transform, PIL images), independently of fedfeat's reader and encoder; the store holds float16,
so they must agree to 1e-3 relative.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers_clip import (
    REPO,
    TINY_CFG,
    TINY_NAME,
    cli_argv,
    cli_error_text,
    kill_after_first_chunk,
    make_tiny_clip,
    max_rel_err,
    read_only_bind,
    reference_image_features,
    reference_model,
    reference_text_features,
    run_cli,
    run_mounted,
    store_snapshot,
    subprocess_env,
    unshare_available,
    write_cifar10,
    write_cifar100,
    write_corrupt,
    write_imagefolder,
    write_listfile,
)

from fedfeat.encoders import backbones, weights
from fedfeat.encoders import openclip as clipcompat
from fedfeat.errors import FedfeatError
from fedfeat.store.featurestore import FeatureStore


@pytest.fixture(scope="module")
def tc(tmp_path_factory):
    return make_tiny_clip(tmp_path_factory.mktemp("tinyclip"))


@pytest.fixture(scope="module")
def ref(tc):
    return reference_model(tc)


@pytest.fixture(scope="module")
def c10(tmp_path_factory):
    return write_cifar10(tmp_path_factory.mktemp("data") / "cifar-10-batches-py")


def enc_args(dataset, root, tc, out, *extra, weights=None):
    return [
        "encode",
        "--dataset",
        dataset,
        "--root",
        root,
        "--backbone",
        tc.config,
        "--pretrained",
        weights or tc.weights,
        "--out",
        out,
        "--device",
        "cpu",
        "--chunk-rows",
        "16",
        "--batch-size",
        "8",
        *extra,
    ]


def encode_ok(args) -> Path:
    """Run ``fedfeat encode`` in-process; the store path is the last line of stdout."""
    r = run_cli(args)
    assert r.exit_code == 0, (r.output, r.exception)
    return Path(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def c10_store(tc, c10, tmp_path_factory):
    """One uninterrupted single-process encode of the CIFAR-10 fixture (reference for resume and torchrun)."""
    return encode_ok(enc_args("cifar10", c10.root, tc, tmp_path_factory.mktemp("ref")))


# ---------------------------------------------------------------------------------------- correctness
@pytest.mark.parametrize("fmt", ["cifar10", "cifar100", "cinic10", "imagefolder", "listfile"])
def test_each_format_matches_open_clip(fmt, tc, ref, tmp_path):
    """Stored image and text features equal open_clip's own (<= 1e-3 relative); labels and names carried."""
    model, preprocess, tokenizer = ref
    if fmt == "cifar10":
        fx = write_cifar10(tmp_path / "d", protocol=4)
    elif fmt == "cifar100":
        fx = write_cifar100(tmp_path / "d")
    elif fmt == "cinic10":
        fx = write_imagefolder(
            tmp_path / "d", {"train": 3, "valid": 2, "test": 2}, classes=("airplane", "automobile", "bird")
        )
    elif fmt == "imagefolder":
        fx = write_imagefolder(tmp_path / "pets")
    else:
        fx = write_listfile(tmp_path / "lt")
    path = encode_ok(enc_args(fmt, fx.root, tc, tmp_path / "cache", "--templates", "cifar"))
    name = {"imagefolder": "pets", "listfile": "lt"}.get(fmt, fmt)
    assert path == tmp_path / "cache" / name / f"{TINY_NAME}-tiny.zarr"
    st = FeatureStore.open(path)
    assert st.splits == list(fx.labels)
    assert st.class_names == fx.class_names
    for split, labels in fx.labels.items():
        np.testing.assert_array_equal(st.labels(split), labels)
        items = fx.images[split] if hasattr(fx, "images") else fx.paths[split]
        feats = st.features(split)  # [N, D] float16
        assert feats.dtype == np.float16 and feats.shape == (len(labels), 32)
        assert max_rel_err(feats, reference_image_features(model, preprocess, items)) <= 1e-3
    text = st.text_features()  # [T, K, D]
    assert text.shape == (18, len(fx.class_names), 32)
    assert max_rel_err(text, reference_text_features(model, tokenizer, st.templates, st.class_names)) <= 1e-3
    assert st.logit_scale == pytest.approx(50.0, rel=1e-6)  # model.logit_scale.exp() of the saved weights
    a = st.attrs
    assert (a["backbone"], a["pretrained"], a["precision"], a["skipped"]) == (
        TINY_NAME,
        "tiny.safetensors",
        "fp32",
        {},
    )
    assert a["fingerprint"]["weights"]["sha256"] == weights.sha256_file(tc.weights)


def test_torch_save_checkpoint_gives_the_same_features(tc, c10, c10_store, tmp_path):
    path = encode_ok(enc_args("cifar10", c10.root, tc, tmp_path, weights=tc.weights_pt))
    assert path.name == f"{TINY_NAME}-tiny.zarr"
    np.testing.assert_array_equal(
        FeatureStore.open(path).features("train"), FeatureStore.open(c10_store).features("train")
    )


def test_templates_combine_and_rerun_rules(tc, c10, tmp_path):
    """Several --templates concatenate; an identical re-run does nothing; other settings need --force."""
    tfile = tmp_path / "mine.txt"
    tfile.write_text("a photo of a {}\na low resolution photo of a {}.\n")
    args = enc_args(
        "cifar10",
        c10.root,
        tc,
        tmp_path / "cache",
        "--templates",
        "a photo of a {}",
        "--templates",
        "cifar",
        "--templates",
        tfile,
    )
    path = encode_ok(args)
    st = FeatureStore.open(path)
    assert st.templates[:2] == ["a photo of a {}", "a photo of a {}."] and len(st.templates) == 20
    assert st.text_features().shape == (20, 10, 32)

    meta = path / "zarr.json"
    before = (meta.stat().st_mtime_ns, meta.read_bytes())
    r = run_cli(args)
    assert r.exit_code == 0 and "is complete and matches" in r.output and "nothing to do" in r.output
    assert (meta.stat().st_mtime_ns, meta.read_bytes()) == before

    msg = cli_error_text(run_cli(enc_args("cifar10", c10.root, tc, tmp_path / "cache")))
    assert "different settings (templates differ)" in msg and "--force" in msg
    path2 = encode_ok(enc_args("cifar10", c10.root, tc, tmp_path / "cache", "--force"))
    assert path2 == path and FeatureStore.open(path).templates == ["a photo of a {}."]


def test_workers_and_bf16(tc, c10, c10_store, tmp_path, monkeypatch):
    """DataLoader workers change nothing. bf16 (weights cast) stays within 2% of fp32; on a CPU without native
    bf16 kernels (~100x slower than fp32 there) it is refused with one line. Both branches are forced here:
    the tiny model is cheap even on the slow kernels."""
    path = encode_ok(enc_args("cifar10", c10.root, tc, tmp_path / "w", "--workers", "2"))
    assert store_snapshot(path) == store_snapshot(c10_store)
    args = enc_args("cifar10", c10.root, tc, tmp_path / "b", "--precision", "bf16")
    monkeypatch.setattr(clipcompat, "cpu_has_fast_bf16", lambda: False)
    assert "no native bf16 kernels" in cli_error_text(run_cli(args))
    monkeypatch.setattr(clipcompat, "cpu_has_fast_bf16", lambda: True)
    st, st32 = FeatureStore.open(encode_ok(args)), FeatureStore.open(c10_store)
    assert st.attrs["precision"] == "bf16"
    assert max_rel_err(st.features("train"), st32.features("train").astype(np.float32)) < 0.02
    assert st.attrs["fingerprint_hash"] != st32.attrs["fingerprint_hash"]


def test_skip_bad_records_unreadable_images(tc, tmp_path):
    """A corrupt image fails with its path; --skip-bad resumes the same store: zero row, label -1, listed."""
    fx = write_imagefolder(tmp_path / "pets", {"train": 6, "test": 2})
    write_corrupt(tmp_path / "pets" / "train" / "dog" / "003.png")
    args = enc_args("imagefolder", fx.root, tc, tmp_path / "cache")
    msg = cli_error_text(run_cli(args))
    assert (
        f"cannot read image {tmp_path / 'pets' / 'train' / 'dog' / '003.png'}" in msg and "--skip-bad" in msg
    )
    path = encode_ok(args + ["--skip-bad"])
    st = FeatureStore.open(path)
    row = 6 + 3  # cat 0..5, then dog 000..005
    assert st.labels("train")[row] == -1 and not st.features("train")[row].any()
    assert (np.delete(st.labels("train"), row) == np.delete(fx.labels["train"], row)).all()
    assert st.attrs["skipped"] == {"train": ["train/dog/003.png"]}


# ---------------------------------------------------------------------------------------- user errors
def test_offline_tag_fails_fast_naming_arch_and_tag(c10, tmp_path):
    r = run_cli(
        [
            "encode",
            "--dataset",
            "cifar10",
            "--root",
            c10.root,
            "--backbone",
            "RN50",
            "--out",
            tmp_path / "c",
            "--cache-dir",
            tmp_path / "empty-hf-cache",
        ]
    )
    msg = cli_error_text(r)
    assert "RN50 pretrained 'openai'" in msg and "HF_HUB_OFFLINE" in msg
    assert "--pretrained /path/to/checkpoint" in msg and "RN50-quickgelu" in msg
    assert not (tmp_path / "c").exists()


def test_offline_without_env_uses_a_bounded_probe(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    calls = []
    probe = lambda host, port, timeout: calls.append((host, timeout)) or (False, "probe failed")  # noqa: E731
    for mod in (weights, backbones):  # the tag's probe (weights) and the hub's (backbones)
        monkeypatch.setattr(mod, "network_reachable", probe)
    bb = backbones.resolve_backbone("ViT-B/32")
    with pytest.raises(
        FedfeatError, match=r"ViT-B-32 pretrained 'openai'.*probe failed.*--pretrained /path/to"
    ):
        weights.resolve_weights(bb, cache_dir=tmp_path, probe_timeout=1.5)
    assert calls == [("huggingface.co", 1.5)]


def test_probe_needs_a_tls_answer_not_just_an_open_port():
    # a loopback listener that accepts the TCP connection and never answers the TLS handshake: the probe
    # must give up (bounded by its timeout) and say so, instead of counting an open port as a network
    import socket

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        ok, reason = backbones.network_reachable("127.0.0.1", srv.getsockname()[1], timeout=0.5)
    assert not ok and "127.0.0.1" in reason, reason


def test_user_errors_are_one_line(tc, c10, tmp_path):
    cases = [
        (["--precision", "fp16"], "fp16 needs a CUDA device"),
        (["--distributed"], "--distributed needs the torchrun environment"),
        (["--batch-size", "0"], "--batch-size must be >= 1"),
    ]
    for extra, want in cases:
        msg = cli_error_text(run_cli(enc_args("cifar10", c10.root, tc, tmp_path, *extra)))
        assert want in msg and "\n" not in msg.strip()
    msg = cli_error_text(run_cli(enc_args("cifar10", c10.root, tc, tmp_path, weights="nope.safetensors")))
    assert "checkpoint file nope.safetensors not found" in msg
    bad = tmp_path / "bad.json"
    bad.write_text('{"embed_dim": 8}')
    args = enc_args("cifar10", c10.root, tc, tmp_path)
    args[args.index("--backbone") + 1] = bad
    assert "needs 'embed_dim', 'vision_cfg' and 'text_cfg'" in cli_error_text(run_cli(args))
    assert "unknown pretrained tag 'laion9b' for ViT-B-32" in cli_error_text(
        run_cli(
            [
                "encode",
                "--dataset",
                "cifar10",
                "--root",
                c10.root,
                "--backbone",
                "ViT-B/32",
                "--pretrained",
                "laion9b",
                "--out",
                tmp_path,
            ]
        )
    )


def test_cached_tag_loads_from_the_local_cache_without_network(tmp_path, monkeypatch):
    """A tag whose checkpoint sits in the Hugging Face cache resolves to that file, offline, with the tag's
    QuickGELU setting (OpenAI weights) — no probe, no download."""
    for mod in (weights, backbones):
        monkeypatch.setattr(mod, "network_reachable", lambda *a, **k: pytest.fail("probed the network"))
    repo = tmp_path / "hub" / "models--timm--resnet50_clip.openai"
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    (snap / "open_clip_model.safetensors").write_bytes(b"not really weights")
    w = weights.resolve_weights(backbones.resolve_backbone("RN50"), "openai", cache_dir=tmp_path / "hub")
    assert (w.kind, w.label, w.quick_gelu) == ("tag", "openai", True)
    assert w.file == snap / "open_clip_model.safetensors"
    assert w.fingerprint() == {"tag": "openai", "source": "hf-hub:timm/resnet50_clip.openai/"}


def test_open_clip_config_json_backbone(tmp_path):
    """An open_clip_config.json (model_cfg + preprocess_cfg) registers under its folder's name, and its
    preprocessing reaches the eval transform's settings."""
    d = tmp_path / "tiny-hf"
    d.mkdir()
    cfg = {"model_cfg": TINY_CFG, "preprocess_cfg": {"mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]}}
    (d / "open_clip_config.json").write_text(json.dumps(cfg))
    bb = backbones.resolve_backbone(str(d / "open_clip_config.json"))
    assert (bb.name, bb.embed_dim) == ("tiny-hf", 32)
    pp = clipcompat.preprocess_config(bb, weights.Weights(kind="file", label="x.pt"))
    assert (pp["mean"], pp["std"], pp["size"]) == ([0.5] * 3, [0.25] * 3, 32)


# ---------------------------------------------------------------------------------------- crash safety
def test_killed_encode_resumes_to_identical_store(tc, c10, c10_store, tmp_path):
    """SIGKILL mid-run (after the first chunk is recorded), then resume: byte-identical to an uninterrupted
    run.
    Until resumed, the store is refused by readers."""
    out = tmp_path / "cache"
    args = enc_args("cifar10", c10.root, tc, out)
    path = out / "cifar10" / f"{TINY_NAME}-tiny.zarr"
    kill_after_first_chunk(args, path)

    with pytest.raises(FedfeatError, match="incomplete.*re-run the same `fedfeat encode`"):
        FeatureStore.open(path)
    st = FeatureStore.open(path, allow_incomplete=True)
    assert 0 < sum(st.missing().values()) < 5  # 3 train chunks + 1 test chunk + text

    r = run_cli(args)
    assert r.exit_code == 0 and "resuming" in r.output, r.output
    assert store_snapshot(path) == store_snapshot(c10_store)


def test_train_refuses_incomplete_then_trains_zeroshot(tc, c10, c10_store, tmp_path):
    """`fedfeat train` refuses an unfinished store with one line, and trains zero-shot on a finished one
    (copies: training stores a partition, and the reference store must stay as encode left it)."""
    import shutil

    good, broken = tmp_path / "good.zarr", tmp_path / "broken.zarr"
    shutil.copytree(c10_store, good)
    shutil.copytree(c10_store, broken)
    FeatureStore.open(broken, mode="r+").update_attrs(complete=False)
    train = ["train", "--method", "zeroshot", "--partition", "iid", "--clients", "2", "--rounds", "1"]
    r = run_cli(train + ["--store", broken, "--out", tmp_path / "runs0"])
    assert r.exit_code == 2 and "incomplete" in r.output and len(r.output.strip().splitlines()) == 1
    r = run_cli(train + ["--store", good, "--out", tmp_path / "runs"])
    assert r.exit_code == 0, r.output


# ---------------------------------------------------------------------------------------- many processes
def test_torchrun_two_gloo_ranks_match_one_process(tc, c10, c10_store, tmp_path):
    """torchrun --nproc-per-node 2 (gloo on CPU): ranks split the chunks; same store as one process."""
    out = tmp_path / "cache"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    target = ["-m", "fedfeat"]
    proc = subprocess.run(
        launcher + target + [str(a) for a in enc_args("cifar10", c10.root, tc, out)],
        cwd=REPO,
        env=subprocess_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
    log = proc.stdout + proc.stderr
    assert (
        "[rank 0/2] encoded 24 images (2 chunks)" in log and "[rank 1/2] encoded 28 images (2 chunks)" in log
    ), log
    path = out / "cifar10" / f"{TINY_NAME}-tiny.zarr"
    got, want = store_snapshot(path), store_snapshot(c10_store)
    assert got.keys() == want.keys()
    for k in want:
        if k.endswith("features"):  # other thread counts may round differently: allow one float16 ulp
            a = np.frombuffer(got[k][2], np.float16).astype(np.float32)
            b = np.frombuffer(want[k][2], np.float16).astype(np.float32)
            np.testing.assert_allclose(a, b, rtol=2**-10, atol=1e-6)
        else:
            assert got[k] == want[k], k


# ---------------------------------------------------------------------------------------- trust: flags, locks, staleness
def test_bad_numeric_flags_create_nothing(tc, c10, tmp_path):
    for extra, want in [
        (["--workers", "-1"], "--workers must be >= 0"),
        (["--chunk-rows", "0"], "--chunk-rows must be >= 1"),
        (["--batch-size", "-3"], "--batch-size must be >= 1"),
    ]:
        msg = cli_error_text(run_cli(enc_args("cifar10", c10.root, tc, tmp_path / "out", *extra)))
        assert want in msg
        assert not (tmp_path / "out").exists()


def _lock_path(out) -> Path:
    return out / "cifar10" / f"{TINY_NAME}-tiny.zarr.lock"


def test_second_encode_refuses_while_the_lock_is_held_even_with_force(tc, c10, c10_store, tmp_path):
    import shutil
    import socket

    out = tmp_path / "cache"
    path = out / "cifar10" / f"{TINY_NAME}-tiny.zarr"
    shutil.copytree(c10_store, path)
    before = store_snapshot(path)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        lock = _lock_path(out)
        lock.write_text(json.dumps({"pid": holder.pid, "host": socket.gethostname(), "since": "2026-11-23T10:00:00+00:00",
                                    "command": "fedfeat encode"}))  # fmt: skip
        for extra in ([], ["--force"]):
            msg = cli_error_text(run_cli(enc_args("cifar10", c10.root, tc, out, *extra)))
            assert f"pid {holder.pid} on host {socket.gethostname()}, since 2026-11-23T10:00:00" in msg, msg
            assert f"remove {lock}" in msg
        assert store_snapshot(path) == before and lock.is_file()  # --force deleted nothing
    finally:
        holder.kill()
        holder.wait()
    r = run_cli(enc_args("cifar10", c10.root, tc, out))  # the holder is gone: its lock is stale
    assert r.exit_code == 0, r.output
    assert "taking over the stale lock" in r.output and f"pid {holder.pid}" in r.output
    assert "nothing to do" in r.output and not lock.exists()


def _flip_cifar_image(root: Path, batch: str, image: np.ndarray) -> None:
    """Edit one image inside a CIFAR batch file in place: same size, same names, other pixels."""
    f = root / batch
    data = f.read_bytes()
    row = image.transpose(2, 0, 1).reshape(3072).tobytes()
    at = data.find(row)
    assert at > 0 and data.count(row) == 1
    f.write_bytes(data[:at] + bytes(255 - b for b in row) + data[at + len(row) :])


def test_same_size_edit_of_a_dataset_file_re_encodes_its_chunks(tc, ref, tmp_path):
    """Fingerprints hash file contents: an in-place edit that keeps names and sizes is seen; only the chunks
    the edited file feeds are encoded again, and the result equals a fresh encode of the edited data."""
    model, preprocess, _ = ref
    fx = write_cifar10(tmp_path / "cifar-10-batches-py", protocol=4)
    path = encode_ok(enc_args("cifar10", fx.root, tc, tmp_path / "cache"))
    st = FeatureStore.open(path)
    old_train, old_test, old_fp = st.features("train"), st.features("test"), st.attrs["fingerprint_hash"]
    size = (fx.root / "data_batch_1").stat().st_size
    _flip_cifar_image(fx.root, "data_batch_1", fx.images["train"][3])
    assert (fx.root / "data_batch_1").stat().st_size == size
    r = run_cli(enc_args("cifar10", fx.root, tc, tmp_path / "cache"))
    assert r.exit_code == 0, r.output
    assert "1 dataset file(s) changed" in r.output and "data_batch_1" in r.output
    assert "re-encoding the 1 chunk(s)" in r.output and "nothing to do" not in r.output
    st = FeatureStore.open(path)
    new = st.features("train")
    edited = 255 - fx.images["train"][3]
    assert max_rel_err(new[3:4], reference_image_features(model, preprocess, [edited])) <= 1e-3
    assert not np.array_equal(new[3], old_train[3])
    np.testing.assert_array_equal(new[16:], old_train[16:])  # chunks 1 and 2 (other batch files) kept
    np.testing.assert_array_equal(st.features("test"), old_test)
    assert st.attrs["fingerprint_hash"] != old_fp and st.complete
    fresh = encode_ok(enc_args("cifar10", fx.root, tc, tmp_path / "fresh"))
    assert store_snapshot(path) == store_snapshot(fresh)


def test_fixing_a_corrupt_image_and_re_running_keeps_finished_chunks(tc, ref, tmp_path):
    """The advice "fix or replace the file and re-run the same command" works as written: no --force, and
    the chunks finished before the failure are not encoded again."""
    from PIL import Image

    model, preprocess, _ = ref
    fx = write_imagefolder(tmp_path / "pets", {"train": 6, "test": 2})
    bad = tmp_path / "pets" / "train" / "sea_lion" / "005.png"  # row 17: the second chunk of 16 rows
    good = bad.read_bytes()
    write_corrupt(bad)
    args = enc_args("imagefolder", fx.root, tc, tmp_path / "cache")
    msg = cli_error_text(run_cli(args))
    assert f"cannot read image {bad}" in msg and "fix or replace the file and re-run the same command" in msg
    path = tmp_path / "cache" / "pets" / f"{TINY_NAME}-tiny.zarr"
    st = FeatureStore.open(path, allow_incomplete=True)
    assert st.done_chunks("train").tolist() == [True, False]
    first = path / "train" / "features" / "c" / "0" / "0"
    kept = (first.stat().st_mtime_ns, first.read_bytes())
    bad.write_bytes(good)  # fixed
    r = run_cli(args)
    assert r.exit_code == 0, r.output
    assert "re-encoding" in r.output and "--force" not in r.output
    assert (first.stat().st_mtime_ns, first.read_bytes()) == kept
    st = FeatureStore.open(path)
    want = reference_image_features(model, preprocess, fx.paths["train"])
    assert max_rel_err(st.features("train"), want) <= 1e-3 and st.attrs["skipped"] == {}
    np.testing.assert_array_equal(st.labels("train"), fx.labels["train"])
    with Image.open(bad) as im:
        assert im.size[0] > 0


class _NanClip:
    """Wraps the loaded model: image ``row`` of the first batch comes out NaN."""

    def __init__(self, clip, row):
        self._clip, self._row, self._calls = clip, row, 0

    def __getattr__(self, k):
        return getattr(self._clip, k)

    def encode_images(self, images):
        out = self._clip.encode_images(images).clone()  # [B, D]
        self._calls += 1
        if self._calls == 1:
            out[self._row] = float("nan")
        return out


def test_non_finite_model_output_is_refused_or_skipped(tc, c10, tmp_path, monkeypatch):
    real = clipcompat.load_model
    monkeypatch.setattr(clipcompat, "load_model", lambda *a, **k: _NanClip(real(*a, **k), 2))
    args = enc_args("cifar10", c10.root, tc, tmp_path)
    msg = cli_error_text(run_cli(args))
    assert f"features of image {c10.root / 'data_batch_1[2]'} are not finite" in msg and "--skip-bad" in msg
    st = FeatureStore.open(encode_ok(args + ["--skip-bad"]))
    assert st.labels("train")[2] == -1 and not st.features("train")[2].any()
    assert st.attrs["skipped"] == {"train": ["data_batch_1[2]"]}


def test_full_disk_during_encode_is_one_line_and_resumable(tc, c10, c10_store, tmp_path, monkeypatch):
    import errno

    real, calls = FeatureStore.write_chunk, []

    def write_chunk(self, split, i, feats):
        calls.append(i)
        if len(calls) == 2:
            raise OSError(
                errno.ENOSPC, "No space left on device", str(self.path / f"{split}/features/c/{i}/0")
            )
        return real(self, split, i, feats)

    monkeypatch.setattr(FeatureStore, "write_chunk", write_chunk)
    out = tmp_path / "cache"
    msg = cli_error_text(run_cli(enc_args("cifar10", c10.root, tc, out))).strip().splitlines()
    path = out / "cifar10" / f"{TINY_NAME}-tiny.zarr"
    assert msg[-1].startswith(f"error: cannot finish encoding at {path}") and "Traceback" not in "".join(msg)
    assert "no space left on device" in msg[-1] and "re-run the same command" in msg[-1]
    assert not FeatureStore.open(path, allow_incomplete=True).complete and not _lock_path(out).exists()
    monkeypatch.undo()
    r = run_cli(enc_args("cifar10", c10.root, tc, out))
    assert r.exit_code == 0 and "resuming" in r.output, r.output
    assert store_snapshot(path) == store_snapshot(c10_store)


@pytest.mark.skipif(not unshare_available(), reason="needs `unshare -rm` for a read-only bind mount")
def test_encode_on_a_read_only_cache(tc, c10, c10_store, tmp_path):
    """A finished, matching store on a read-only mount is reused (no lock needed); anything that would write
    is one line naming the read-only filesystem."""
    import shutil

    out = tmp_path / "cache"
    path = out / "cifar10" / f"{TINY_NAME}-tiny.zarr"
    shutil.copytree(c10_store, path)
    argv = cli_argv() + [str(a) for a in enc_args("cifar10", c10.root, tc, out)]
    p = run_mounted(read_only_bind(out), argv)
    assert p.returncode == 0 and "nothing to do" in p.stderr and p.stdout.strip() == str(path), p.stderr
    p = run_mounted(read_only_bind(out), argv + ["--templates", "cifar"])
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "read-only file system" in lines[0], p.stderr
    assert store_snapshot(path) == store_snapshot(c10_store)
