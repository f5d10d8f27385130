"""The synthetic store: deterministic, real layout, CLIP-like statistics."""

import numpy as np
import torch

from fedfeat.store.featurestore import FeatureStore
from fedfeat.store.synth import SyntheticGenerator, SynthParams, synthetic_stats, write_synthetic_store

SMALL = SynthParams(classes=10, dim=256, train_per_class=300, test_per_class=100, templates=3)


def test_same_seed_same_store_different_seed_different(tmp_path):
    a = write_synthetic_store(tmp_path / "a.zarr", SMALL, stats=False, log=lambda *_: None)
    b = write_synthetic_store(tmp_path / "b.zarr", SMALL, stats=False, log=lambda *_: None)
    c = write_synthetic_store(
        tmp_path / "c.zarr", SynthParams(**{**SMALL.__dict__, "seed": 1}), stats=False, log=lambda *_: None
    )
    np.testing.assert_array_equal(a.features("train"), b.features("train"))
    np.testing.assert_array_equal(a.text_features(), b.text_features())
    assert not np.array_equal(a.features("train"), c.features("train"))
    assert FeatureStore.open(tmp_path / "a.zarr").complete
    assert a.features("train").shape == (3000, 256) and a.text_features().shape == (3, 10, 256)
    assert np.bincount(a.labels("test")).tolist() == [100] * 10


def test_existing_complete_store_is_reused(tmp_path):
    msgs = []
    write_synthetic_store(tmp_path / "a.zarr", SMALL, stats=False, log=msgs.append)
    write_synthetic_store(tmp_path / "a.zarr", SMALL, stats=False, log=msgs.append)
    assert "nothing to do" in msgs[-1]


def test_features_are_unit_norm_and_zero_shot_is_clearly_below_a_probe():
    """The generator's defining property: prompts are misaligned with class means, so zero-shot
    (argmax image . text) loses clearly to a supervised linear probe; cosines are CLIP-like."""
    p = SynthParams(classes=10, dim=1024, train_per_class=400, test_per_class=300)
    g = SyntheticGenerator(p)
    ytr = torch.arange(10).repeat_interleave(400)
    yte = torch.arange(10).repeat_interleave(300)
    xtr, xte = g.images(ytr.numpy()), g.images(yte.numpy())
    assert torch.allclose(xtr.norm(dim=1), torch.ones(len(ytr)), atol=1e-5)
    s = synthetic_stats(xtr, ytr, xte, yte, g.text, probe_steps=30)
    assert s["linear_probe_acc"] > s["zeroshot_acc_1_template"] + 0.08
    assert 0.55 < s["zeroshot_acc_1_template"] < 0.85
    assert 0.2 <= s["cos_image_own_prompt"] <= 0.35
    assert 0.02 < s["cos_image_own_prompt"] - s["cos_image_other_prompts"] < 0.1
    assert s["zeroshot_pred_share_max"] > 2 * s["zeroshot_pred_share_min"]  # class bias
