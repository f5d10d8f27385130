"""Prompt learning through the frozen open_clip text tower, batched across clients (CoOp, Zhou et al. IJCV 2022).

``TextTower`` holds the text tower's own modules -- token embedding, positional embedding, transformer, final
LayerNorm, projection, EOT pooling -- taken from the open_clip model (``CLIP`` or ``CustomTextCLIP`` with a
``TextTransformer``), and runs them on *token embeddings* instead of token ids, which is what CoOp's
``TextEncoder`` does (``KaiyangZhou/CoOp`` ``trainers/coop.py``: ``x = prompts + positional_embedding``,
``transformer``, ``ln_final``, ``x[arange, tokens.argmax(-1)] @ text_projection``).

``PromptLearner`` builds CoOp's prompts ``[SOS] X X ... X {class}. [EOS]`` (``n_ctx`` placeholder tokens), keeps
the frozen token embeddings of ``[SOS]`` (prefix) and of ``{class}. [EOS] ...`` (suffix), and replaces the
placeholders by context vectors: unified ``[n, n_ctx, W]`` (one context per client, shared by all classes; CoOp's
default) or class-specific ``[n, K, n_ctx, W]`` (CoOp's ``CSC``). For ``n`` clients the tower runs **once** on the
``n x K`` prompts (the client axis folded into the batch); gradients reach only the contexts (the tower's
parameters are frozen, ``requires_grad=False``).

Two exact shortcuts, both documented switches:

* **Truncation** (``truncate=True``, default). With a causal attention mask (CLIP's text tower) the output at
  the EOT position depends only on positions ``<= EOT``: the prompts are cut after the longest prompt's EOT token
  (77 -> ~20 positions for CIFAR names with 16 contexts). The masked-out positions get ``exp(-inf) = 0``
  attention weight either way, so this is the same function; floating-point sums of different lengths make
  the result differ from the full-length forward by rounding only (~1e-7 relative, tested). Towers without a
  causal mask or with another pooling run at full length.
* **Blocks on a CPU.** The ``n x K`` prompts go through the tower in blocks of ``CPU_BLOCK`` (one autograd
  graph): the same arithmetic per prompt, a working set that stays in cache.
* **Shared prefix** (``shared_prefix=True``, off by default). With a unified context (one ``[n_ctx, W]`` per
  client, not CSC's per-class rows) the first ``1 + n_ctx`` positions ``[SOS] ctx_1 .. ctx_n`` are the same for
  every class of a client, and under the causal mask their hidden states depend on those positions only: the
  prefix runs through each block once per client, and only the class-dependent rest (class name, ``.``, ``[EOS]``)
  runs per class, its queries attending to the prefix's cached keys / values (as an LLM reuses a prompt's
  key/value cache) and causally to its own positions (``TextTower.forward_shared``). The same function (each
  block's own ``ln_1``, fused QKV projection, ``out_proj``, ``ln_2``, ``mlp``, ``ls_1`` / ``ls_2``; softmax over
  the same keys); float sums in another order (tested to 1e-9 in float64). The contexts' gradient flows through
  the cached keys / values. Towers whose blocks ``fedfeat.encoders.attention.plain`` does not reproduce, or
  without a causal mask, run the full path.
* **Pool, then LayerNorm.** The final LayerNorm is per token: applying it to the pooled EOT token only is the
  same as applying it to all tokens and pooling.

``TextTower.cast(torch.float16)`` is the tower as OpenAI's CLIP runs it in half precision (the prompt methods'
``precision="fp16"``): ``clip/model.py`` ``convert_weights`` halves the linear, attention and projection weights,
``TextEncoder.forward`` casts the token and positional embeddings to ``clip_model.dtype`` (fp16), and CLIP's
``LayerNorm`` subclass computes in float32 and casts back. ``PromptLearner.features(ctx, classes)`` encodes each
client's own class subset (``classes  # [n, Kc]`` ids) instead of every class (FedTPG's per-client vocabulary).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from fedfeat.data.templates import fill
from fedfeat.encoders.attention import block_forward, causal, plain
from fedfeat.errors import FedfeatError


@dataclass
class TextTower:
    """The frozen text tower of an open_clip model, run on token embeddings."""

    token_embedding: nn.Embedding
    positional_embedding: torch.Tensor  # [L, W]
    transformer: nn.Module  # batch-first [N, L, W] -> [N, L, W]
    ln_final: nn.Module
    text_projection: torch.Tensor | nn.Module | None  # [W, D] or nn.Linear
    attn_mask: torch.Tensor | None  # [L, L] additive causal mask
    pool_type: str  # "argmax" (EOT = highest token id) or "eos"
    eos_id: int | None
    tokenizer: object  # list[str] -> [N, L] int64

    @classmethod
    def of(cls, model: nn.Module, tokenizer) -> TextTower:
        """The text tower of ``model`` (``open_clip.CLIP`` or ``CustomTextCLIP`` with a ``TextTransformer``)."""
        t = getattr(model, "text", None)
        if t is None:  # CLIP: the text tower's modules sit on the model itself
            t, pool, eos = (
                model,
                getattr(model, "text_pool_type", "argmax"),
                getattr(model, "text_eos_id", None),
            )
        else:
            pool, eos = getattr(t, "pool_type", "argmax"), getattr(t, "eos_id", None)
            if getattr(t, "cls_emb", None) is not None or getattr(t, "use_pad_mask", False):
                raise FedfeatError(
                    f"the text tower of {type(model).__name__} appends a class token or pads with a mask; prompt "
                    "learning supports CLIP-style towers (causal mask, EOT pooling): use a CLIP backbone"
                )
        if not all(
            hasattr(t, a) for a in ("token_embedding", "positional_embedding", "transformer", "ln_final")
        ):
            raise FedfeatError(
                f"the text tower of {type(model).__name__} ({type(t).__name__}) is not an open_clip "
                "TextTransformer (a Hugging Face text tower?); prompt learning needs a CLIP-style text tower"
            )
        if pool not in ("argmax", "eos"):
            raise FedfeatError(
                f"the text tower pools with '{pool}'; prompt learning supports EOT pooling (argmax or eos)"
            )
        return cls(
            token_embedding=t.token_embedding,
            positional_embedding=t.positional_embedding,
            transformer=t.transformer,
            ln_final=t.ln_final,
            text_projection=getattr(t, "text_projection", None),
            attn_mask=getattr(t, "attn_mask", None),
            pool_type=pool,
            eos_id=eos,
            tokenizer=tokenizer,
        )

    @property
    def width(self) -> int:
        return int(self.positional_embedding.shape[1])

    @property
    def context_length(self) -> int:
        return int(self.positional_embedding.shape[0])

    @property
    def device(self) -> torch.device:
        return self.positional_embedding.device

    @property
    def dtype(self) -> torch.dtype:
        return self.positional_embedding.dtype

    def cast(self, dtype: torch.dtype) -> TextTower:
        """The tower computing in ``dtype`` as OpenAI's CLIP does in fp16 (``openai/CLIP`` ``clip/model.py``
        ``convert_weights`` + ``LayerNorm``): a copy whose weights are ``dtype`` except the LayerNorms', which compute
        in float32 and cast back; the positional embedding and the causal mask in ``dtype`` (CLIP casts both to the
        activations' type); the token embedding shared and cast on use (``embed``). Frozen like the original; the
        original is left as it is. ``dtype`` the tower's own: the tower itself."""
        if dtype == self.dtype:
            return self

        def conv(m):
            m = copy.deepcopy(m)
            for mod in m.modules():
                if isinstance(mod, nn.LayerNorm):
                    # its weights stay float32 (convert_weights leaves LayerNorms alone)
                    mod.__class__ = _LayerNormFp32
                    continue
                for t in mod.parameters(recurse=False):
                    t.data = t.data.to(dtype)
                for name, t in list(mod.named_buffers(recurse=False)):
                    if t.is_floating_point():
                        setattr(mod, name, t.to(dtype))
            for q in m.parameters():
                q.requires_grad_(False)
            return m

        proj = self.text_projection
        if isinstance(proj, nn.Module):
            proj = conv(proj)
        elif proj is not None:
            proj = proj.detach().to(dtype)
        mask = self.attn_mask
        return replace(
            self,
            positional_embedding=self.positional_embedding.detach().to(dtype),
            transformer=conv(self.transformer),
            ln_final=conv(self.ln_final),
            text_projection=proj,
            attn_mask=None if mask is None else mask.to(dtype),
        )

    def tokenize(self, prompts: list[str]) -> torch.Tensor:
        """``[N, L]`` int64 token ids on the tower's device."""
        return self.tokenizer(prompts).to(self.device)

    def eot_index(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[N]`` position of each prompt's pooled (EOT) token, as open_clip's ``text_global_pool``."""
        if self.pool_type == "argmax":
            return tokens.argmax(dim=-1)
        return (tokens == self.eos_id).int().argmax(dim=-1)

    @torch.no_grad()
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[N, L, W]`` of token ids ``[N, L]`` (frozen)."""
        return self.token_embedding(tokens).to(self.dtype)

    def can_truncate(self) -> bool:
        return self.attn_mask is not None

    def _fast_blocks(self, mask: torch.Tensor | None, L: int) -> bool:
        """Whether ``fedfeat.encoders.attention.block_forward`` reproduces the transformer (checked once per
        length): batch-first plain blocks, no checkpointing, the mask none or open_clip's causal one."""
        memo = self.__dict__.setdefault("_fast_memo", {})
        if L not in memo:
            t = self.transformer
            memo[L] = (
                getattr(t, "batch_first", False)
                and not getattr(t, "grad_checkpointing", False)
                and hasattr(t, "resblocks")
                and all(plain(b) for b in t.resblocks)
                and (mask is None or causal(mask, L))
            )
        return memo[L]

    def forward_embeddings(self, x: torch.Tensor, eot: torch.Tensor) -> torch.Tensor:
        """Text features ``[N, D]`` (unnormalised, as ``encode_text``) of prompt token embeddings ``x  # [N, L', W]``
        with ``L' <= L`` (a causal tower may get prompts cut after their EOT) and EOT positions ``eot  # [N]``."""
        L = x.shape[1]
        if L < self.context_length and not self.can_truncate():
            raise FedfeatError(
                "this text tower has no causal mask: prompts must keep the full context length"
            )
        x = x + self.positional_embedding[:L]
        mask = None if self.attn_mask is None else self.attn_mask[:L, :L]
        if self._fast_blocks(mask, L):  # the blocks without nn.MultiheadAttention's reshuffles (.attention)
            for blk in self.transformer.resblocks:
                x = block_forward(blk, x, is_causal=mask is not None)
        else:
            x = self.transformer(x, attn_mask=mask)
        return self._head(x[torch.arange(x.shape[0], device=x.device), eot])

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """The pooled EOT tokens ``[N, W]`` -> features ``[N, D]``: the per-token final LN, then the projection."""
        x = self.ln_final(x)
        p = self.text_projection
        if p is None:
            return x
        return p(x) if isinstance(p, nn.Module) else x @ p

    def can_share_prefix(self, L: int) -> bool:
        """Whether ``forward_shared`` runs for prompts of length ``L``: a causal mask and ``plain`` blocks."""
        mask = None if self.attn_mask is None else self.attn_mask[:L, :L]
        return mask is not None and self._fast_blocks(mask, L)

    def forward_shared(self, prefix: torch.Tensor, suffix: torch.Tensor, eot: torch.Tensor) -> torch.Tensor:
        """``forward_embeddings(cat([prefix[c], suffix[i]]), eot)`` for every prompt ``i`` of client ``c``, the
        prefix run once per client: ``prefix  # [n, P, W]`` (``[SOS]`` and the contexts), ``suffix  # [n * K, S,
        W]`` (client-major: client ``c``'s ``K`` prompts are rows ``c * K .. c * K + K - 1``), ``eot  # [n * K]``
        positions in the whole prompt (``>= P``). Per block, the prefix is causal self-attention of its own (its
        hidden states do not see the suffix), and each suffix position attends to the ``P`` prefix keys / values of
        its client and to the suffix positions up to itself. ``[n * K, D]``; a ``plain``-block causal tower only
        (``can_share_prefix``)."""
        n, P, W = prefix.shape
        NK, S = suffix.shape[0], suffix.shape[1]
        if NK % n or not self.can_share_prefix(P + S):
            raise FedfeatError(
                "the shared-prefix path needs a causal tower of plain blocks and K prompts per client"
            )
        K = NK // n
        pos = self.positional_embedding
        xp, xs = prefix + pos[:P], suffix + pos[P : P + S]
        # suffix query i (position P + i) sees every prefix key and suffix keys j <= i (True: attend, as SDPA)
        ones = torch.ones(S, S, dtype=torch.bool, device=xs.device)
        allow = torch.cat(
            [torch.ones(S, P, dtype=torch.bool, device=xs.device), ones.tril()], 1
        )  # [S, P + S]
        for blk in self.transformer.resblocks:
            xp, xs = _shared_block(blk, xp, xs, K, allow)
        return self._head(xs[torch.arange(NK, device=xs.device), eot - P])

    def encode(self, prompts: list[str], truncate: bool = True, batch_size: int = 256) -> torch.Tensor:
        """``[N, D]`` features of plain prompts through ``forward_embeddings`` (no gradient); equals the model's
        ``encode_text`` (tested)."""
        out = []
        with torch.no_grad():
            for s in range(0, len(prompts), batch_size):
                tok = self.tokenize(prompts[s : s + batch_size])
                eot = self.eot_index(tok)
                L = int(eot.max()) + 1 if truncate and self.can_truncate() else tok.shape[1]
                out.append(self.forward_embeddings(self.embed(tok)[:, :L], eot))
        return torch.cat(out) if out else torch.zeros(0, self.width)


class _LayerNormFp32(nn.LayerNorm):
    """CLIP's ``LayerNorm`` (``clip/model.py``): ``super().forward(x.type(torch.float32)).type(orig_type)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = None if self.weight is None else self.weight.float()
        b = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).to(x.dtype)


def _split_heads(x: torch.Tensor, k: int, H: int) -> tuple[torch.Tensor, ...]:
    """``[N, L, k * W]`` -> ``k`` tensors ``[N, H, L, W / H]`` (``nn.MultiheadAttention``'s head split)."""
    N, L, _ = x.shape
    return x.view(N, L, k, H, -1).permute(2, 0, 3, 1, 4).unbind(0)


def _attn_out(blk: nn.Module, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """The rest of an open_clip ``ResidualAttentionBlock`` after attention ``o  # [N, H, L, d]``: heads merged,
    ``out_proj``, ``ls_1`` residual, then ``x + ls_2(mlp(ln_2(x)))``."""
    N, H, L, d = o.shape
    a = blk.attn
    x = x + blk.ls_1(F.linear(o.transpose(1, 2).reshape(N, L, H * d), a.out_proj.weight, a.out_proj.bias))
    return x + blk.ls_2(blk.mlp(blk.ln_2(x)))


def _shared_block(
    blk: nn.Module, xp: torch.Tensor, xs: torch.Tensor, K: int, allow: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One ``plain`` block on a causal prompt split into a per-client prefix ``xp  # [n, P, W]`` and per-prompt
    suffixes ``xs  # [n * K, S, W]``: the prefix's keys / values computed once per client and shared by its ``K``
    prompts (``allow  # [S, P + S]``: which keys a suffix query sees)."""
    a = blk.attn
    H = a.num_heads
    n, P, _ = xp.shape
    qp, kp, vp = _split_heads(F.linear(blk.ln_1(xp), a.in_proj_weight, a.in_proj_bias), 3, H)  # [n, H, P, d]
    qs, ks, vs = _split_heads(F.linear(blk.ln_1(xs), a.in_proj_weight, a.in_proj_bias), 3, H)  # [nK, H, S, d]
    op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True)
    # the suffix queries against the client's prefix keys without copying them per prompt (a [n * K, H, P, d] copy
    # of the keys and of the values would be d / S times the scores' size): scores over [prefix | own suffix], one
    # softmax, the weighted prefix values summed per client (einsum over the client axis), SDPA's math
    NK, _, S, d = qs.shape
    q5 = qs.view(n, K, H, S, d)
    scale = 1.0 / math.sqrt(d)
    sp = torch.einsum("nkhsd,nhpd->nkhsp", q5, kp).reshape(NK, H, S, P) * scale
    ss = (qs @ ks.transpose(-1, -2)) * scale  # [nK, H, S, S]
    ss = ss.masked_fill(~allow[:, P:], float("-inf"))
    w = torch.softmax(torch.cat([sp, ss], -1), -1)
    wp, ws = w[..., :P], w[..., P:]
    os_ = torch.einsum("nkhsp,nhpd->nkhsd", wp.reshape(n, K, H, S, P), vp).reshape(NK, H, S, d) + ws @ vs
    return _attn_out(blk, xp, op), _attn_out(blk, xs, os_)


def phrase_tokens(tower: TextTower, phrase: str) -> torch.Tensor:
    """Token embeddings ``[n, W]`` of ``phrase`` without ``[SOS]`` / ``[EOS]`` (CoOp's ``ctx_init``)."""
    tok = tower.tokenize([phrase])
    eot = int(tower.eot_index(tok)[0])
    if eot <= 1:
        raise FedfeatError(
            f"context init phrase {phrase!r} has no tokens; e.g. --set ctx_init='a photo of a'"
        )
    return tower.embed(tok)[0, 1:eot]


# On a CPU the tower runs on at most this many prompts at a time: 10 clients x 100 classes in blocks of 384 ran
# ~12 % faster than in one batch on a 2-core EPYC (activations of a block stay in cache); a GPU takes all at once.
CPU_BLOCK = 384


class PromptLearner:
    """CoOp prompts ``[SOS] ctx_1 .. ctx_n {template filled with the class}`` for a fixed class list, batched over
    clients. ``template`` is the text after the contexts, ``"{}."`` for CoOp (class name and a full stop); with
    ``n_ctx = 0`` and a store's template it reproduces the store's text embeddings."""

    def __init__(
        self,
        tower: TextTower,
        class_names: list[str],
        n_ctx: int = 16,
        *,
        template: str = "{}.",
        truncate: bool = True,
        shared_prefix: bool = False,
    ):
        if n_ctx < 0:
            raise FedfeatError(f"n_ctx must be >= 0, got {n_ctx}")
        self.tower, self.n_ctx, self.K = tower, n_ctx, len(class_names)
        placeholder = " ".join(["X"] * n_ctx)
        prompts = [(placeholder + " " if n_ctx else "") + fill(template, c) for c in class_names]
        tokens = tower.tokenize(prompts)  # [K, L]
        eot = tower.eot_index(tokens)
        if bool((tokens[:, -1] != 0).any()):  # the tokenizer cut a prompt (CLIP pads with 0)
            longest = prompts[int(eot.argmax())]
            raise FedfeatError(
                f"prompt {longest!r} does not fit the text tower's {tower.context_length} tokens; "
                "use fewer context tokens (--set n_ctx=...)"
            )
        L = int(eot.max()) + 1 if truncate and tower.can_truncate() else tokens.shape[1]
        emb = tower.embed(tokens)[:, :L]  # [K, L, W]
        self.prefix = emb[:, :1].contiguous()  # [K, 1, W] the [SOS] token
        self.suffix = emb[:, 1 + n_ctx :].contiguous()  # [K, L - 1 - n_ctx, W] class name, ".", [EOS], ...
        self.eot = eot
        self.tokens = tokens
        # unified contexts run [SOS] + contexts once per client (TextTower.forward_shared) where the tower allows it
        self.shared_prefix = bool(shared_prefix) and tower.can_share_prefix(L)

    @property
    def width(self) -> int:
        return self.tower.width

    def init_context(
        self, generator: torch.Generator | None, csc: bool = False, phrase: str = "", std: float = 0.02
    ) -> torch.Tensor:
        """Initial contexts: ``N(0, std²)`` (CoOp's ``nn.init.normal_(ctx_vectors, std=0.02)``) drawn in float64
        from ``generator``, or the token embeddings of ``phrase`` (CoOp's ``CTX_INIT``; ``n_ctx`` must equal its
        token count). ``[n_ctx, W]``, or ``[K, n_ctx, W]`` with ``csc`` (every class starts alike from a phrase)."""
        shape = (self.K, self.n_ctx, self.width) if csc else (self.n_ctx, self.width)
        if phrase:
            v = phrase_tokens(self.tower, phrase)
            if v.shape[0] != self.n_ctx:
                raise FedfeatError(
                    f"context init {phrase!r} is {v.shape[0]} tokens but n_ctx = {self.n_ctx}; "
                    f"pass --set n_ctx={v.shape[0]}"
                )
            return v.expand(shape).clone()
        v = torch.randn(shape, generator=generator, dtype=torch.float64) * std
        return v.to(device=self.tower.device, dtype=self.tower.dtype)

    def prompts(self, ctx: torch.Tensor, classes: torch.Tensor | None = None) -> torch.Tensor:
        """Prompt embeddings ``[n * K, L', W]`` for contexts ``[n, n_ctx, W]`` (unified) or ``[n, K, n_ctx, W]``;
        with ``classes  # [n, Kc]`` (class ids) only those classes' prompts, ``[n * Kc, L', W]``."""
        n, W = ctx.shape[0], self.width
        if classes is None:
            K = self.K
            prefix, suffix = self.prefix.expand(n, K, 1, W), self.suffix.expand(n, K, -1, W)
        else:
            K = classes.shape[1]
            prefix, suffix = self.prefix[classes], self.suffix[classes]  # [n, Kc, 1 | L'', W]
            if ctx.dim() == 4:  # class-specific contexts: each client's rows of its classes
                ctx = torch.gather(ctx, 1, classes[:, :, None, None].expand(n, K, *ctx.shape[2:]))
        if ctx.dim() == 3:
            ctx = ctx.unsqueeze(1).expand(n, K, self.n_ctx, W)
        parts = [prefix, ctx.to(self.prefix.dtype), suffix]
        return torch.cat(parts, dim=2).reshape(n * K, -1, W)

    def features(self, ctx: torch.Tensor, classes: torch.Tensor | None = None) -> torch.Tensor:
        """Unnormalised class text features ``[n, K, D]`` of ``n`` clients' contexts in one tower forward (on a
        CPU, in blocks of ``CPU_BLOCK`` prompts: one autograd graph, cache-sized working sets); with ``classes  #
        [n, Kc]`` the features of each client's listed classes only, ``[n, Kc, D]``."""
        n = ctx.shape[0]
        if self.shared_prefix and ctx.dim() == 3:
            return self._features_shared(ctx, classes)
        x = self.prompts(ctx, classes)
        eot = self.eot.repeat(n) if classes is None else self.eot.to(classes.device)[classes].reshape(-1)
        block = CPU_BLOCK if x.device.type == "cpu" else x.shape[0]
        if x.shape[0] <= block:
            out = self.tower.forward_embeddings(x, eot)
        else:
            parts = [
                self.tower.forward_embeddings(x[s : s + block], eot[s : s + block])
                for s in range(0, x.shape[0], block)
            ]
            out = torch.cat(parts)
        return out.view(n, x.shape[0] // n, -1)

    def _features_shared(self, ctx: torch.Tensor, classes: torch.Tensor | None) -> torch.Tensor:
        """``features`` of unified contexts ``[n, n_ctx, W]`` with the prefix ``[SOS] ctx`` run once per client
        (``TextTower.forward_shared``); on a CPU in blocks of whole clients of about ``CPU_BLOCK`` prompts."""
        n, W = ctx.shape[0], self.width
        prefix = torch.cat(
            [self.prefix[:1].expand(n, 1, W), ctx.to(self.prefix.dtype)], 1
        )  # [n, 1 + n_ctx, W]
        if classes is None:
            K = self.K
            suffix = self.suffix.unsqueeze(0).expand(n, *self.suffix.shape)
            eot = self.eot.unsqueeze(0).expand(n, K)
        else:
            K = classes.shape[1]
            suffix, eot = self.suffix[classes], self.eot.to(classes.device)[classes]  # [n, Kc, S, W], [n, Kc]
        per = max(1, CPU_BLOCK // max(K, 1)) if ctx.device.type == "cpu" else n
        parts = [
            self.tower.forward_shared(
                prefix[s : s + per],
                suffix[s : s + per].reshape(-1, *suffix.shape[2:]),
                eot[s : s + per].reshape(-1),
            )
            for s in range(0, n, per)
        ]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out.view(n, K, -1)


__all__ = ["TextTower", "PromptLearner", "phrase_tokens"]
