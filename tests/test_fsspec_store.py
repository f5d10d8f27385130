"""Stores at fsspec URLs: ``memory://`` (fsspec's in-process filesystem, through zarr's ``FsspecStore``) and
``file://`` (the local path). A synthetic store copied under ``memory://`` trains end to end through the CLI and
the Python API, ``info`` and ``partition`` read it; ``encode --out memory://...`` writes a store equal to a local
encode and resumes one; s3/gs without their packages fail in one line naming them."""

import importlib.util
import json
import shutil
import uuid

import fsspec
import numpy as np
import pytest
from helpers_clip import make_tiny_clip, run_cli, store_snapshot, write_cifar10

import fedfeat
from fedfeat.errors import FedfeatError
from fedfeat.store.featurestore import FeatureStore, copy_store
from fedfeat.store.lock import StoreLock
from fedfeat.store.synth import SynthParams, write_synthetic_store
from fedfeat.store.urls import is_store, store_location

MEM = fsspec.filesystem("memory")
SMALL = [
    "--classes",
    "3",
    "--dim",
    "8",
    "--train-per-class",
    "20",
    "--test-per-class",
    "5",
    "--templates",
    "2",
]
TRAIN = [
    "--method",
    "fedavg",
    "--partition",
    "iid",
    "--clients",
    "3",
    "--participation",
    "1",
    "--rounds",
    "2",
]


@pytest.fixture
def mem():
    """A fresh ``memory://`` prefix, removed afterwards (the memory filesystem is process-wide)."""
    root = f"/fedfeat-test-{uuid.uuid4().hex[:8]}"
    yield f"memory://{root.lstrip('/')}"
    if MEM.exists(root):
        MEM.rm(root, recursive=True)


@pytest.fixture(scope="module")
def local_store(tmp_path_factory):
    p = tmp_path_factory.mktemp("synth") / "s.zarr"
    params = SynthParams(classes=3, dim=8, train_per_class=20, test_per_class=5, templates=2)
    write_synthetic_store(p, params, stats=False, log=lambda *a: None)
    return p


def test_store_location_parses_paths_and_urls(tmp_path):
    assert store_location(f"file://{tmp_path}/a.zarr") == tmp_path / "a.zarr"
    assert store_location("memory://x/a.zarr/") == "memory://x/a.zarr"
    assert store_location(str(tmp_path / "a.zarr")) == tmp_path / "a.zarr"


@pytest.mark.parametrize("url,pkg", [("s3://bucket/c.zarr", "s3fs"), ("gs://bucket/c.zarr", "gcsfs")])
def test_cloud_url_without_its_package_is_one_line(url, pkg):
    if importlib.util.find_spec(pkg) is not None:
        pytest.skip(f"{pkg} is installed")
    with pytest.raises(FedfeatError, match=rf"needs the optional package {pkg}.*pip install {pkg}") as e:
        FeatureStore.open(url)
    assert "\n" not in str(e.value)
    r = run_cli(["info", url])
    assert r.exit_code == 2 and f"pip install {pkg}" in r.output and len(r.output.strip().splitlines()) == 1


def test_unknown_protocol_is_one_line():
    with pytest.raises(FedfeatError, match="nosuchfs"):
        FeatureStore.open("nosuchfs://a/b.zarr")


def test_memory_store_info_partition_train(mem, local_store, tmp_path):
    url = f"{mem}/s.zarr"
    r = run_cli(["synth", "--out", url, *SMALL, "--no-stats"])  # written locally, then copied under memory://
    assert r.exit_code == 0 and r.output.strip().endswith(f"store: {url}"), r.output
    assert (
        FeatureStore.open(url).attrs["fingerprint_hash"]
        == FeatureStore.open(local_store).attrs["fingerprint_hash"]
    )
    r = run_cli(["synth", "--out", url, *SMALL, "--no-stats"])
    assert r.exit_code == 0 and "nothing to do" in r.output, r.output
    assert is_store(url) and not is_store(f"{mem}/none.zarr")
    r = run_cli(["info", url])
    assert r.exit_code == 0, r.output
    assert "complete" in r.output and "60 x 8" in r.output
    r = run_cli(["info", url, "--json", "--verify"])
    doc = json.loads(r.output)
    assert doc["path"] == url and doc["bytes_on_disk"] > 0 and doc["verified"]["rows"] == 75

    r = run_cli(["partition", url, "--scheme", "iid", "--clients", "3"])
    assert r.exit_code == 0, r.output
    assert FeatureStore.open(url).partition_keys() == ["iid-c3-s19940817"]  # saved into the memory store

    r = run_cli(["train", "--store", url, *TRAIN, "--out", tmp_path / "runs", "--quiet"])
    assert r.exit_code == 0, r.output
    (run,) = (tmp_path / "runs").iterdir()
    assert f'store = "{url}"' in (run / "config.toml").read_text()  # the URL survives into the run config
    mem_summary = json.loads((run / "summary.json").read_text())

    # the same run on the local copy gives the same numbers; so does the Python API on the URL
    r = run_cli(["train", "--store", local_store, *TRAIN, "--out", tmp_path / "local", "--quiet"])
    assert r.exit_code == 0, r.output
    (lrun,) = (tmp_path / "local").iterdir()
    assert json.loads((lrun / "summary.json").read_text())["final_acc"] == mem_summary["final_acc"]
    api = fedfeat.train(store=url, method="fedavg", partition="iid", clients=3, participation=1.0, rounds=2,
                        out=str(tmp_path / "api"))  # fmt: skip
    assert api["final_acc"] == mem_summary["final_acc"]
    st = fedfeat.open_store(url)
    assert st.path == url and st.features("train").shape == (60, 8)


def test_file_url_is_the_local_path(local_store, tmp_path):
    url = f"file://{local_store}"
    assert FeatureStore.open(url).path == local_store
    r = run_cli(["train", "--store", url, *TRAIN, "--out", tmp_path / "runs", "--quiet"])
    assert r.exit_code == 0, r.output
    (run,) = (tmp_path / "runs").iterdir()
    assert f'store = "{local_store}"' in (run / "config.toml").read_text()


def test_store_written_at_memory_url(mem):
    url = f"{mem}/w.zarr"
    lab = {"train": np.arange(10) % 2, "test": np.arange(4) % 2}
    kw = dict(backbone="synthetic", pretrained="none", embed_dim=4, logit_scale=100.0, class_names=["a", "b"],
              templates=["{}"], preprocessing={}, fingerprint={"x": 1}, labels=lab, chunk_rows=4)  # fmt: skip
    st = FeatureStore.create(url, **kw)
    with pytest.raises(FedfeatError, match="already exists"):
        FeatureStore.create(url, **kw)
    with pytest.raises(FedfeatError, match="incomplete"):
        FeatureStore.open(url)
    rng = np.random.default_rng(0)
    feats = {s: rng.standard_normal((len(v), 4)).astype(np.float16) for s, v in lab.items()}
    for s in lab:
        for i in range(st.n_chunks(s)):
            st.write_chunk(s, i, feats[s][st.chunk_slice(s, i)])
    st.write_text(np.ones((1, 2, 4)))
    st.mark_complete()
    back = FeatureStore.open(url)
    assert np.array_equal(back.features("train"), feats["train"]) and back.verify()["rows"] == 14
    MEM.rm(f"{url.split('://')[1]}/train/features/c/1/0")  # a lost chunk object is caught by its checksum
    with pytest.raises(FedfeatError, match="chunk 1"):
        FeatureStore.open(url).features("train")


def test_lock_at_memory_url(mem):
    url = f"{mem}/l.zarr"
    with StoreLock(url) as held:
        assert held.path == f"{url}.lock" and MEM.exists(f"{url.split('://')[1]}.lock")
        with pytest.raises(FedfeatError, match="being written by another"):
            StoreLock(url).acquire()
    assert not MEM.exists(f"{url.split('://')[1]}.lock")
    MEM.pipe_file(f"{url.split('://')[1]}.lock", json.dumps({"pid": 1, "host": "elsewhere.example"}).encode())
    with pytest.raises(FedfeatError, match=r"host elsewhere\.example.*remove"):
        StoreLock(url).acquire()


def test_encode_to_memory_equals_local_and_resumes(mem, tmp_path):
    tc = make_tiny_clip(tmp_path / "tiny")
    data = write_cifar10(tmp_path / "cifar-10-batches-py", n_train=40, n_test=12)
    args = ["encode", "--dataset", "cifar10", "--root", data.root, "--backbone", tc.config, "--pretrained",
            tc.weights, "--device", "cpu", "--chunk-rows", "16"]  # fmt: skip
    r = run_cli([*args, "--out", tmp_path / "cache"])
    assert r.exit_code == 0, r.output
    (local,) = (tmp_path / "cache" / "cifar10").glob("*.zarr")
    r = run_cli([*args, "--out", f"{mem}/cache"])
    assert r.exit_code == 0, r.output
    url = f"{mem}/cache/cifar10/{local.name}"
    assert r.output.strip().splitlines()[-1] == url
    assert not MEM.exists(f"{url.split('://')[1]}.lock")  # released

    mem_copy = tmp_path / "from-memory.zarr"
    MEM.get(url.split("://")[1], str(mem_copy), recursive=True)
    assert store_snapshot(mem_copy) == store_snapshot(local)

    st = FeatureStore.open(url, mode="r+")  # an interrupted encode: chunks pending again, store incomplete
    st.clear_chunks("train", [0, 2])
    r = run_cli([*args, "--out", f"{mem}/cache"])
    assert r.exit_code == 0 and "resuming" in r.output, r.output
    shutil.rmtree(mem_copy)
    MEM.get(url.split("://")[1], str(mem_copy), recursive=True)
    assert store_snapshot(mem_copy) == store_snapshot(local)
    r = run_cli([*args, "--out", f"{mem}/cache"])  # complete and matching: nothing to do
    assert r.exit_code == 0 and "nothing to do" in r.output


def test_copy_store_round_trip(mem, local_store, tmp_path):
    url = copy_store(local_store, f"{mem}/c.zarr")
    with pytest.raises(FedfeatError, match="already exists; pass --force"):
        copy_store(local_store, url)
    back = copy_store(url, tmp_path / "back.zarr")
    assert store_snapshot(back) == store_snapshot(local_store)
    MEM.rm(f"{url.split('://')[1]}/zarr.json")  # a copy cut short: no root metadata, so not a store
    assert not is_store(url)
    copy_store(local_store, url, overwrite=True)
    assert FeatureStore.open(url).complete
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("x")
    with pytest.raises(FedfeatError, match="not a fedfeat store"):  # never deletes what is not a store
        copy_store(url, tmp_path / "other", overwrite=True)
    assert (tmp_path / "other" / "keep.txt").exists()


def test_filesystem_errors_are_one_line():
    from fsspec.implementations.memory import MemoryFileSystem

    class NoCredentials(MemoryFileSystem):
        protocol = "fedfeat-nocreds"

        def exists(self, path, **kw):
            raise RuntimeError("Unable to locate credentials\nmore detail")

    fsspec.register_implementation("fedfeat-nocreds", NoCredentials, clobber=True)
    r = run_cli(["info", "fedfeat-nocreds://bucket/s.zarr"])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1
    assert "Unable to locate credentials" in r.output and "credentials" in r.output.split(";")[-1]
