"""VPT-deep on the tiny open_clip ViT (``fedfeat.encoders.vpt``): with no prompt depth it is ``encode_image``; prompts change
the output and only they receive gradients; a sample's output depends only on its own client's prompts."""

from __future__ import annotations

import pytest
import torch
from helpers_clip import make_tiny_clip, reference_model

from fedfeat.encoders.vpt import PromptedViT
from fedfeat.errors import FedfeatError


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    m, _, _ = reference_model(make_tiny_clip(tmp_path_factory.mktemp("tiny")))
    return m


def _images(n, seed=0):
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def test_depth_zero_is_encode_image_and_prompts_change_the_output(model):
    x = _images(4)
    with torch.no_grad():
        want = model.encode_image(x)
        plain = PromptedViT(model.visual, depth=0)
        got = plain.forward(x, torch.zeros(1, 0, 5, plain.width), torch.zeros(4, dtype=torch.int64))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        vpt = PromptedViT(model.visual)  # all but the last block (1 of the tiny ViT's 2), 5 tokens
        assert vpt.depth == 1
        pr = vpt.init_prompts(torch.Generator().manual_seed(0)).unsqueeze(0)
        out = vpt.forward(x, pr, torch.zeros(4, dtype=torch.int64))
    assert out.shape == want.shape and (out - want).abs().max() > 1e-4


def test_only_prompts_get_gradients_and_clients_do_not_mix(model):
    vpt = PromptedViT(model.visual, n_tokens=3)
    g = torch.Generator().manual_seed(1)
    prompts = torch.stack([vpt.init_prompts(g, std=0.5) for _ in range(3)]).requires_grad_(True)  # 3 clients
    x = _images(6, 2)
    owner = torch.tensor([0, 0, 1, 2, 2, 2])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = vpt.forward(x, prompts, owner)
    out.square().sum().backward()
    assert prompts.grad is not None and prompts.grad.abs().sum() > 0
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # each client alone (its samples, its prompts) gives the batched rows
    with torch.no_grad():
        for c in range(3):
            rows = (owner == c).nonzero(as_tuple=True)[0]
            alone = vpt.forward(x[rows], prompts[c : c + 1], torch.zeros(len(rows), dtype=torch.int64))
            torch.testing.assert_close(alone, out[rows].detach(), atol=1e-5, rtol=1e-5)
        # changing client 1's prompts moves only client 1's sample
        p2 = prompts.detach().clone()
        p2[1] += torch.randn(
            p2[1].shape, generator=torch.Generator().manual_seed(5)
        )  # (a constant: LayerNorm drops it)
        moved = vpt.forward(x, p2, owner)
        diff = (moved - vpt.forward(x, prompts.detach(), owner)).abs().amax(1)
    assert diff[2] > 1e-4 and float(diff[[0, 1, 3, 4, 5]].max()) == 0.0


def test_resnet_is_a_one_line_error():
    class FakeResNet(torch.nn.Module):
        pass

    with pytest.raises(FedfeatError, match="need a ViT image encoder.*FakeResNet.*ViT-B-32"):
        PromptedViT(FakeResNet())
