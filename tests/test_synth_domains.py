"""The synthetic domain-shift stand-in: rows per domain, names, fingerprints of stores without domains unchanged,
zero-shot harder in some domains, checks that count domains x rows."""

import dataclasses

import numpy as np
import pytest
import zarr

from fedfeat.errors import FedfeatError
from fedfeat.store.featurestore import FeatureStore, fingerprint_hash
from fedfeat.store.synth import PRESETS, SynthParams, _params_record, synth_fingerprint, write_synthetic_store

QUIET = dict(stats=False, log=lambda *_: None)
SMALL = SynthParams(classes=5, dim=32, train_per_class=12, test_per_class=4, templates=2, domains=3)

# SynthParams' fields before domains (and train_min, dropped at 0) existed: what a store without domains records
OLD_FIELDS = ["classes", "dim", "train_per_class", "test_per_class", "templates", "seed", "a", "b", "s", "sigma",
              "rho", "a_t", "m", "b_t", "eta", "bias_sd", "tnoise"]  # fmt: skip


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return write_synthetic_store(tmp_path_factory.mktemp("dom") / "d.zarr", SMALL, **QUIET)


def test_rows_per_domain_and_names(small):
    st = FeatureStore.open(small.path)
    assert st.domain_names == ["domain 0", "domain 1", "domain 2"]
    for split, per in (("train", 12), ("test", 4)):
        dom, lab = st.domains(split), st.labels(split)
        assert len(dom) == len(lab) == 3 * 5 * per == st.features(split).shape[0]
        for d in range(3):
            assert np.bincount(lab[dom == d], minlength=5).tolist() == [per] * 5
    assert st.attrs["synth_params"]["domains"] == 3 and st.fingerprint["domains"] == 3
    st.verify()
    assert st.attribute_problems(deep=True) == []


def test_names_from_params_are_recorded_and_fingerprinted(tmp_path):
    p = dataclasses.replace(SMALL, domain_names="photo,art,sketch")
    st = write_synthetic_store(tmp_path / "n.zarr", p, **QUIET)
    assert st.domain_names == ["photo", "art", "sketch"]
    assert synth_fingerprint(p)["domain_names"] == "photo,art,sketch"
    assert fingerprint_hash(synth_fingerprint(p)) != fingerprint_hash(synth_fingerprint(SMALL))
    with pytest.raises(FedfeatError, match="domain_names must be 3"):
        write_synthetic_store(tmp_path / "x.zarr", dataclasses.replace(SMALL, domain_names="a,b"), **QUIET)
    with pytest.raises(FedfeatError, match="set without domains"):
        write_synthetic_store(tmp_path / "y.zarr", SynthParams(classes=3, dim=8, domain_shift=0.5), **QUIET)


def test_no_domains_records_exactly_what_it_did_before():
    for p in (SynthParams(), PRESETS["caltech101-vitl14"], SynthParams(classes=3, dim=8, seed=4)):
        old = {k: v for k, v in dataclasses.asdict(p).items() if k in OLD_FIELDS}
        assert _params_record(p) == old
        assert synth_fingerprint(p) == {"generator": "fedfeat.store.synth", **old}
    # the hashes stores written before domains existed carry
    assert fingerprint_hash(synth_fingerprint(PRESETS["cifar10-rn50"])) == "64cd5913445069b1"
    assert fingerprint_hash(synth_fingerprint(PRESETS["caltech101-vitl14"])) == "bfaa1bc04829e8c4"


def test_domain_presets_are_consistent():
    for name in ("pacs-vitb32", "officehome-vitb32", "office-caltech10-vitb32", "domainnet-vitb32"):
        p = PRESETS[name]
        assert p.domains == len(p.domain_names.split(",")) == len(p.domain_signal.split(",")), name
        assert p.dim == 512 and synth_fingerprint(p)["domain_names"] == p.domain_names
    assert PRESETS["pacs-vitb32"].domain_names.split(",") == ["art_painting", "cartoon", "photo", "sketch"]


def test_zero_shot_differs_across_domains_as_documented(tmp_path):
    """The CIFAR-10 RN50 defaults with 4 domains: the ladder domain 0 (best) .. domain 3 (hardest), documented
    as 67.8 / 59.1 / 49.7 / 41.6 % (18 templates); here 2 templates, 150 test images per class and domain."""
    p = SynthParams(train_per_class=2, test_per_class=150, templates=2, domains=4)
    st = write_synthetic_store(tmp_path / "z.zarr", p, **QUIET)
    x = st.features("test").astype(np.float32)
    t = st.text_features().astype(np.float32).mean(0)
    t /= np.linalg.norm(t, axis=1, keepdims=True)
    hit = (x @ t.T).argmax(1) == st.labels("test")
    dom = st.domains("test")
    acc = [hit[dom == d].mean() for d in range(4)]
    assert acc[0] > acc[1] > acc[2] > acc[3], acc
    assert 0.6 < acc[0] < 0.75 and 0.18 < acc[0] - acc[3] < 0.34, acc


def test_checks_count_domains_times_rows(small, tmp_path):
    import shutil

    path = tmp_path / "lie.zarr"
    shutil.copytree(small.path, path)
    g = zarr.open_group(str(path), mode="r+", zarr_format=3)
    fp = {**g.attrs["fingerprint"], "domains": 2}
    g.attrs.update(fingerprint=fp, fingerprint_hash=fingerprint_hash(fp), synth_params={**g.attrs["synth_params"],
                   "domains": 2})  # fmt: skip
    problems = FeatureStore.open(path, allow_incomplete=True, check=False).attribute_problems(deep=True)
    assert any("splits.train = 180" in p and "2 domains" in p for p in problems), problems
