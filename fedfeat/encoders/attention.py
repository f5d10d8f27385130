"""open_clip's residual attention blocks run without ``nn.MultiheadAttention``'s reshuffles: the same weights and the
same function, less memory traffic in the backward the prompt methods run every step.

``nn.MultiheadAttention`` (what open_clip's ``ResidualAttentionBlock`` calls) splits its fused QKV projection with
``unflatten -> transpose -> contiguous`` and three ``select``s: in the backward each ``select`` allocates a zeroed
tensor of the whole projection and copies its third in (measured on the tiny text tower, 1,000 prompts, one CPU
thread: ``copy_`` + ``fill_`` + ``select_backward`` were ~30 % of a forward + backward). ``block_forward`` computes
``x + ls_1(out_proj(SDPA(q, k, v)))``, ``+ ls_2(mlp(ln_2(x)))`` with the block's own modules and weights, the heads
split by one ``view`` + ``permute`` + ``unbind`` (its backward is one ``stack``); a causal mask is SDPA's
``is_causal`` (the same ``-inf`` upper triangle open_clip builds).

``prompted_block_forward`` is VPT-deep's prompted block (``fedfeat.encoders.vpt``) without the work whose result is
thrown away: the prompt tokens appended to a sequence are stripped after the block, so only their keys and values
matter -- and those depend on the client's prompt alone (LayerNorm is per token), not on the sample. So the queries,
the output projection and the MLP run on the image tokens only, and the prompts' keys and values are computed once
per client (``[n, P, W]``) and gathered per sample. The same function as appending, running the block and
stripping (tested against it); float sums in another order.

``plain(block)``: whether a block is one these functions reproduce (open_clip's ``ResidualAttentionBlock`` with a
batch-first ``nn.MultiheadAttention``: one fused projection with biases, no key/value norm, no attention norm);
callers fall back to the module's own forward otherwise.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def plain(block: nn.Module) -> bool:
    a = getattr(block, "attn", None)
    return (
        isinstance(a, nn.MultiheadAttention)
        and a.batch_first
        and a._qkv_same_embed_dim
        and a.in_proj_bias is not None
        and a.out_proj.bias is not None
        and a.bias_k is None
        and not a.add_zero_attn
        and all(hasattr(block, m) for m in ("ln_1", "ln_2", "mlp", "ls_1", "ls_2"))
        and not hasattr(block, "ln_1_kv")
        and not isinstance(getattr(block, "ln_attn", nn.Identity()), nn.LayerNorm)
        and type(block).forward.__qualname__.startswith("ResidualAttentionBlock.")
    )


def causal(mask: torch.Tensor | None, L: int) -> bool:
    """``mask`` is open_clip's additive causal mask (0 on and below the diagonal, ``-inf`` above) for length ``L``."""
    if mask is None or mask.shape[-2:] != (L, L):
        return False
    m = mask.float()
    upper = torch.ones(L, L, dtype=torch.bool, device=m.device).triu(1)
    return bool((m[upper] == float("-inf")).all() and (m[~upper] == 0).all())


def _heads(x: torch.Tensor, k: int, H: int) -> tuple[torch.Tensor, ...]:
    """``[N, L, k * W]`` -> ``k`` tensors ``[N, H, L, W / H]`` (views)."""
    N, L, _ = x.shape
    return x.view(N, L, k, H, -1).permute(2, 0, 3, 1, 4).unbind(0)


def _out(blk: nn.Module, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    N, H, L, d = o.shape
    a = blk.attn
    x = x + blk.ls_1(F.linear(o.transpose(1, 2).reshape(N, L, H * d), a.out_proj.weight, a.out_proj.bias))
    return x + blk.ls_2(blk.mlp(blk.ln_2(x)))


def block_forward(blk: nn.Module, x: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """``blk(x)`` (batch-first ``[N, L, W]``; ``is_causal``: with open_clip's causal mask) for a ``plain`` block."""
    a = blk.attn
    q, k, v = _heads(F.linear(blk.ln_1(x), a.in_proj_weight, a.in_proj_bias), 3, a.num_heads)
    return _out(blk, x, F.scaled_dot_product_attention(q, k, v, is_causal=is_causal))


def prompted_block_forward(
    blk: nn.Module, x: torch.Tensor, prompts: torch.Tensor, owner: torch.Tensor
) -> torch.Tensor:
    """``blk(cat([x, prompts[owner]], 1))[:, :-P]`` for a ``plain`` block: ``x  # [B, T, W]``, one client's prompt
    tokens ``prompts  # [n, P, W]``, ``owner  # [B]`` each sample's client."""
    a = blk.attn
    W, H = x.shape[-1], a.num_heads
    q, k, v = _heads(F.linear(blk.ln_1(x), a.in_proj_weight, a.in_proj_bias), 3, H)
    kv = F.linear(blk.ln_1(prompts), a.in_proj_weight[W:], a.in_proj_bias[W:])  # [n, P, 2W] per client
    kp, vp = _heads(kv[owner], 2, H)  # [B, H, P, d]
    o = F.scaled_dot_product_attention(q, torch.cat([k, kp], 2), torch.cat([v, vp], 2))
    return _out(blk, x, o)


__all__ = ["plain", "causal", "block_forward", "prompted_block_forward"]
