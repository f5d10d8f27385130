"""``fedfeat encode`` end to end on a tiny open_clip model (random weights saved to a file; no downloads).

The expected features are computed by open_clip itself (``create_model_and_transforms`` with the same weights
file, its eval transform, PIL images), independently of fedfeat's reader and encoder; the store holds float16,
so they must agree to 1e-3 relative.
"""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers_clip import (
    REPO,
    TINY_CFG,
    TINY_NAME,
    cli_argv,
    cli_error_text,
    have_main_cli,
    make_tiny_clip,
    max_rel_err,
    reference_image_features,
    reference_model,
    reference_text_features,
    run_cli,
    store_snapshot,
    subprocess_env,
    write_cifar10,
    write_cifar100,
    write_corrupt,
    write_imagefolder,
    write_listfile,
)

from fedfeat import clipcompat
from fedfeat.errors import FedfeatError
from fedfeat.store import FeatureStore

HAVE_TRAIN = have_main_cli() and importlib.util.find_spec("fedfeat.methods") is not None
needs_train = pytest.mark.skipif(not HAVE_TRAIN, reason="`fedfeat train` (fedfeat.methods) not there yet")


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
    assert a["fingerprint"]["weights"]["sha256"] == clipcompat.sha256_file(tc.weights)


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
    monkeypatch.setattr(
        clipcompat,
        "network_reachable",
        lambda host, port, timeout: calls.append((host, timeout)) or (False, "probe failed"),
    )
    bb = clipcompat.resolve_backbone("ViT-B/32")
    with pytest.raises(
        FedfeatError, match=r"ViT-B-32 pretrained 'openai'.*probe failed.*--pretrained /path/to"
    ):
        clipcompat.resolve_weights(bb, cache_dir=tmp_path, probe_timeout=1.5)
    assert calls == [("huggingface.co", 1.5)]


def test_probe_needs_a_tls_answer_not_just_an_open_port():
    # a loopback listener that accepts the TCP connection and never answers the TLS handshake: the probe
    # must give up (bounded by its timeout) and say so, instead of counting an open port as a network
    import socket

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        ok, reason = clipcompat.network_reachable("127.0.0.1", srv.getsockname()[1], timeout=0.5)
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
    monkeypatch.setattr(clipcompat, "network_reachable", lambda *a, **k: pytest.fail("probed the network"))
    repo = tmp_path / "hub" / "models--timm--resnet50_clip.openai"
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    (snap / "open_clip_model.safetensors").write_bytes(b"not really weights")
    w = clipcompat.resolve_weights(clipcompat.resolve_backbone("RN50"), "openai", cache_dir=tmp_path / "hub")
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
    bb = clipcompat.resolve_backbone(str(d / "open_clip_config.json"))
    assert (bb.name, bb.embed_dim) == ("tiny-hf", 32)
    pp = clipcompat.preprocess_config(bb, clipcompat.Weights(kind="file", label="x.pt"))
    assert (pp["mean"], pp["std"], pp["size"]) == ([0.5] * 3, [0.25] * 3, 32)


# ---------------------------------------------------------------------------------------- crash safety
def test_killed_encode_resumes_to_identical_store(tc, c10, c10_store, tmp_path):
    """SIGKILL mid-run (after the first chunk is recorded), then resume: byte-identical to an uninterrupted
    run.
    Until resumed, the store is refused by readers."""
    out = tmp_path / "cache"
    args = enc_args("cifar10", c10.root, tc, out)
    path = out / "cifar10" / f"{TINY_NAME}-tiny.zarr"
    proc = subprocess.Popen(
        cli_argv() + [str(a) for a in args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=subprocess_env(FEDFEAT_TEST_CHUNK_SLEEP="0.5"),
    )
    done = path / "train" / "done" / "c"
    deadline = time.monotonic() + 60
    while not (done.is_dir() and any(done.iterdir())):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "encode never wrote a chunk"
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL

    with pytest.raises(FedfeatError, match="incomplete.*re-run the same `fedfeat encode`"):
        FeatureStore.open(path)
    st = FeatureStore.open(path, allow_incomplete=True)
    assert 0 < sum(st.missing().values()) < 5  # 3 train chunks + 1 test chunk + text

    r = run_cli(args)
    assert r.exit_code == 0 and "resuming" in r.output, r.output
    assert store_snapshot(path) == store_snapshot(c10_store)


@needs_train
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
    target = ["-m", "fedfeat"] if have_main_cli() else [cli_argv()[-1]]
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
