"""``--backbone local-dir:PATH`` and ``hf-hub:ORG/REPO`` (open_clip's schemas) on a tiny model written by the test,
offline: the hub repo sits in a fake Hugging Face cache (``models--org--repo/{refs/main, blobs/, snapshots/REV/}``)
that huggingface_hub resolves without the network. Both encode features equal to the same model loaded the
existing way (JSON config + ``--pretrained`` file); the live text encoder is rebuilt from such a store; ``fedfeat
models`` lists what the cache holds."""

import hashlib
import json
import os
import shutil

import numpy as np
import pytest
from helpers_clip import TINY_CFG, make_tiny_clip, run_cli, write_cifar10

from fedfeat.encoders import backbones, weights
from fedfeat.encoders import openclip as clipcompat
from fedfeat.errors import FedfeatError
from fedfeat.store.featurestore import FeatureStore

REV = "0123456789abcdef0123456789abcdef01234567"
OPENAI_PP = {"mean": [0.48145466, 0.4578275, 0.40821073], "std": [0.26862954, 0.26130258, 0.27577711]}


@pytest.fixture(scope="module")
def tc(tmp_path_factory):
    return make_tiny_clip(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def c10(tmp_path_factory):
    return write_cifar10(tmp_path_factory.mktemp("data") / "cifar-10-batches-py", n_train=20, n_test=6)


@pytest.fixture(scope="module")
def model_dir(tc, tmp_path_factory):
    """A local-dir model folder: open_clip_config.json (model_cfg + preprocess_cfg) and the weights."""
    d = tmp_path_factory.mktemp("models") / "tiny-clip"
    d.mkdir()
    (d / "open_clip_config.json").write_text(json.dumps({"model_cfg": TINY_CFG, "preprocess_cfg": OPENAI_PP}))
    shutil.copy(tc.weights, d / "open_clip_model.safetensors")
    return d


def fake_hub_repo(cache, repo_id: str, files: dict) -> None:
    """``files`` (name -> source path) as huggingface_hub lays a downloaded repo out: content-addressed blobs,
    snapshot symlinks, ``refs/main`` naming the revision."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REV)
    (repo / "blobs").mkdir()
    snap = repo / "snapshots" / REV
    snap.mkdir(parents=True)
    for name, src in files.items():
        data = src.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snap), snap / name)


@pytest.fixture
def hub(model_dir, tmp_path, monkeypatch):
    """A fake HF cache (HF_HOME / HF_HUB_CACHE under tmp) with fedfeat/tiny-clip, offline."""
    import huggingface_hub.constants as C

    home = tmp_path / "hf"
    cache = home / "hub"
    fake_hub_repo(cache, "fedfeat/tiny-clip", {n: model_dir / n for n in ("open_clip_config.json",
                                                                          "open_clip_model.safetensors")})  # fmt: skip
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(C, "HF_HUB_CACHE", str(cache))  # huggingface_hub read the variables at import
    return cache


def encode(c10, out, backbone, *extra):
    r = run_cli(["encode", "--dataset", "cifar10", "--root", c10.root, "--backbone", backbone, "--device", "cpu",
                 "--out", out, *extra])  # fmt: skip
    assert r.exit_code == 0, r.output
    return FeatureStore.open(r.output.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def reference(tc, c10, tmp_path_factory):
    """The store made the existing way: the JSON config and --pretrained FILE."""
    return encode(c10, tmp_path_factory.mktemp("ref"), str(tc.config), "--pretrained", str(tc.weights))


def same_features(a: FeatureStore, b: FeatureStore) -> None:
    for s in ("train", "test"):
        assert np.array_equal(a.features(s), b.features(s)), s
    assert np.array_equal(a.text_features(), b.text_features())
    assert a.logit_scale == b.logit_scale == pytest.approx(50.0, rel=1e-5)


def test_local_dir_backbone_equals_config_plus_weights(model_dir, c10, reference, tmp_path):
    bb = backbones.resolve_backbone(f"local-dir:{model_dir}")
    assert bb.name == "tiny-clip" and bb.weights_file.name == "open_clip_model.safetensors"
    st = encode(c10, tmp_path, f"local-dir:{model_dir}")
    same_features(st, reference)
    assert st.attrs["pretrained"] == "open_clip_model.safetensors" and st.attrs["backbone"] == "tiny-clip"
    assert st.fingerprint["weights"]["sha256"] == reference.fingerprint["weights"]["sha256"]


def test_hf_hub_backbone_from_the_cache_offline(hub, c10, reference, tmp_path):
    bb = backbones.resolve_backbone("hf-hub:fedfeat/tiny-clip")
    assert bb.source == "hf-hub:fedfeat/tiny-clip" and bb.weights_file is not None
    st = encode(c10, tmp_path, "hf-hub:fedfeat/tiny-clip")
    same_features(st, reference)
    assert st.fingerprint["weights"]["hf_hub"] == "hf-hub:fedfeat/tiny-clip"

    # the live text encoder is rebuilt from the store, also when the recorded weights path is gone (another
    # machine): the repo's file is found in this machine's cache
    from fedfeat.encoders.live import load_live_text

    assert load_live_text(st).min_cosine >= 0.999
    FeatureStore.open(st.path, mode="r+").update_attrs(weights_file=str(tmp_path / "gone.safetensors"))
    assert load_live_text(FeatureStore.open(st.path)).min_cosine >= 0.999


def test_hf_hub_not_cached_offline_is_one_line(hub, c10, tmp_path):
    r = run_cli(["encode", "--dataset", "cifar10", "--root", c10.root, "--backbone", "hf-hub:fedfeat/absent",
                 "--device", "cpu", "--out", tmp_path])  # fmt: skip
    assert r.exit_code == 2
    assert len(r.output.strip().splitlines()) == 1
    assert "HF_HUB_OFFLINE is set" in r.output and "hf download fedfeat/absent" in r.output
    with pytest.raises(FedfeatError, match="expected hf-hub:ORG/REPO"):
        backbones.resolve_backbone("hf-hub:no-org")


def test_local_dir_errors(tmp_path, model_dir):
    with pytest.raises(FedfeatError, match="no folder"):
        backbones.resolve_backbone(f"local-dir:{tmp_path / 'nope'}")
    with pytest.raises(FedfeatError, match="open_clip_config.json not found"):
        backbones.resolve_backbone(f"local-dir:{tmp_path}")
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(model_dir / "open_clip_config.json", bare)
    bb = backbones.resolve_backbone(f"local-dir:{bare}")
    with pytest.raises(FedfeatError, match="no weights beside .*--pretrained"):
        weights.resolve_weights(bb)


def test_models_lists_local_weights(hub, model_dir, tmp_path):
    # a built-in tag's weights in the cache: RN50 / openai lives in timm/resnet50_clip.openai
    cfg = clipcompat.import_open_clip().get_pretrained_cfg("RN50", "openai")
    repo_id = cfg["hf_hub"].strip("/")
    fake_hub_repo(hub, repo_id, {"open_clip_model.safetensors": model_dir / "open_clip_model.safetensors"})
    r = run_cli(["models", "--json", "--all", "--dir", model_dir.parent])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    rn50 = next(a for a in doc["architectures"] if a["name"] == "RN50")
    assert [x["tag"] for x in rn50["local"]] == ["openai"] and "yfcc15m" in rn50["not_local"]
    assert not next(a for a in doc["architectures"] if a["name"] == "ViT-B-32")["local"]
    names = {m["name"]: m for m in doc["hf_hub"]}
    assert names["hf-hub:fedfeat/tiny-clip"]["weights"].endswith("open_clip_model.safetensors")
    assert doc["local_dir"] == [
        {
            "name": f"local-dir:{model_dir}",
            "config": str(model_dir / "open_clip_config.json"),
            "weights": str(model_dir / "open_clip_model.safetensors"),
        }  # fmt: skip
    ]
    r = run_cli(["models", "--local"])
    assert r.exit_code == 0, r.output
    assert "RN50" in r.output and "openai" in r.output and "hf-hub:fedfeat/tiny-clip" in r.output
    assert "ViT-B-32 " not in r.output
