"""bench/bench_gpu.py's parts e and f at tiny sizes on a CPU: the device-feed column with a stand-in preprocess (the
path ``device_feed_batch`` takes once ``fedfeat.encoders.feed`` is wired up), the cell text where the feed is absent,
and the PromptFL step with the shared prefix off and on. The whole script runs in CI (``scripts/ci_demos.sh``)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bg():
    spec = importlib.util.spec_from_file_location("bench_gpu_under_test", ROOT / "bench" / "bench_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _args(**kw):
    base = dict(quick=True, enc_batch=8, enc_forward=1, enc_images=8, enc_workers=0)
    return SimpleNamespace(**{**base, **kw})


def _torch_feed(images_uint8, cfg, dev):
    """A stand-in batch preprocess: uint8 [B, 3, H, W] -> resized, normalised float32 [B, 3, S, S] on ``dev``."""
    s = cfg["size"] if isinstance(cfg["size"], int) else cfg["size"][0]
    x = torch.nn.functional.interpolate(images_uint8.to(dev).float() / 255, size=(s, s), mode="bilinear")
    mean, std = (torch.tensor(cfg[k], device=dev).view(1, 3, 1, 1) for k in ("mean", "std"))
    return (x - mean) / std


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


def _measured(cell: str) -> bool:
    """A cell holds a measured figure (a finite number; its size is the benchmark's, not a test's)."""
    try:
        return math.isfinite(float(cell.replace(",", "")))
    except ValueError:
        return False


def test_feed_absent_cells(bg, monkeypatch, tmp_path):
    monkeypatch.setattr(bg, "FEED_MODULE", "fedfeat.encoders.no_such_feed_module")
    assert bg.feed_status() == bg.FEED_NA
    row = bg.encode_row(_args(), torch.device("cpu"), "tiny", tmp_path, bg.feed_sources(True))
    cells = _cells(row)
    assert len(cells) == 10, row
    assert cells[7] == cells[8] == bg.FEED_NA  # "device feed: not available in this checkout"
    assert _measured(cells[3]) and _measured(cells[5]), row


def test_device_feed_column(bg, monkeypatch, tmp_path):
    monkeypatch.setattr(bg, "_feed_fn", lambda: _torch_feed)
    assert bg.feed_status() is None
    row = bg.encode_row(_args(), torch.device("cpu"), "tiny", tmp_path, bg.feed_sources(True))
    cells = _cells(row)
    assert len(cells) == 10, row
    for c in cells[5:9]:  # PIL feed and device feed, both sources: images/s
        assert _measured(c), row


def test_prompt_step_shared_and_full(bg):
    model, tok, _ = bg.text_model(SimpleNamespace(quick=True), torch.device("cpu"))
    full = bg.prompt_step(model, tok, 7, False, torch.float32, torch.device("cpu"), 1)
    shared = bg.prompt_step(model, tok, 7, True, torch.float32, torch.device("cpu"), 1)
    assert shared["shared"] and not full["shared"]
    assert math.isfinite(full["sec"]) and math.isfinite(shared["sec"]) and full["peak"] is None
