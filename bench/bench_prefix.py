"""The shared-prefix text tower (issue 40): one PromptFL-style local step through CLIP's text tower -- text features
of every class from the CoOp contexts, forward and backward to the contexts -- with the shared prefix
(``PromptLearner(shared_prefix=True)``: the [SOS] + context positions once per client) and with the full path (every
class's whole prompt), beside an independent ceiling: open_clip's own ``encode_text`` on the same embedded prompts, the
contexts the only leaf (what a plain CoOp step costs: all 77 positions of every prompt; at 1,000 classes it needs
~27 GiB and is left out on a 24 GiB machine).

    python bench/bench_prefix.py       # a few minutes on 2 CPU cores; writes bench/results/prefix.md

open_clip's ViT-B-32 text tower with random weights (width 512, 12 layers), float32, n_ctx = 16, one client, K = 100
and 1,000 class names ("class 0", ...). Each cell in a fresh process (its peak RSS is the step's), medians of 3 steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import machine, write_table  # noqa: E402


def cell(path: str, K: int, n_ctx: int, steps: int) -> dict:
    """One process: the step's median seconds and the process's peak RSS growth over the step (MiB)."""
    import resource
    import time

    import torch

    from fedfeat.encoders.openclip import import_open_clip
    from fedfeat.encoders.prompt import PromptLearner, TextTower

    oc = import_open_clip()
    torch.manual_seed(0)
    model = oc.create_model("ViT-B-32", pretrained=None, device="cpu").eval()
    for p in model.parameters():
        p.requires_grad_(False)
    tower = TextTower.of(model, oc.get_tokenizer("ViT-B-32"))
    names = [f"class {k}" for k in range(K)]
    ctx = (torch.randn(1, n_ctx, tower.width) * 0.02).requires_grad_(True)
    if path == "ceiling":  # open_clip's encode_text on the prompts embedded with the context spliced in
        tokens = tower.tokenize([" ".join(["X"] * n_ctx) + f" {n}." for n in names])
        emb = tower.embed(tokens).detach()

        def step():
            x = torch.cat([emb[:, :1], ctx.expand(K, -1, -1), emb[:, 1 + n_ctx :]], 1)
            x = x + model.positional_embedding
            x = model.transformer(x, attn_mask=model.attn_mask)
            x = model.ln_final(x)
            f = x[torch.arange(K), tokens.argmax(-1)] @ model.text_projection
            f.sum().backward()
    else:
        pl = PromptLearner(tower, names, n_ctx, shared_prefix=path == "shared")

        def step():
            pl.features(ctx).sum().backward()

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
        ctx.grad = None
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    return {"seconds": statistics.median(times), "peak_mib": peak}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--classes", default="100,1000")
    ap.add_argument("--n-ctx", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cell", default="")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "prefix.md"))
    args = ap.parse_args()
    if args.cell:  # a child process: one cell
        path, K = args.cell.split(":")
        print(json.dumps(cell(path, int(K), args.n_ctx, args.steps)))
        return
    lines = [
        "## Prompt learning at 100 and 1,000 classes: the shared-prefix text tower (CPU)",
        "",
        f"Machine: {machine()}. Command: `python bench/bench_prefix.py` (open_clip ViT-B-32 text tower, random weights, "
        f"float32, n_ctx = {args.n_ctx}, one client; one forward + backward to the contexts; medians of "
        f"{args.steps} steps; peak RSS growth of a fresh process).",
        "",
        "| classes | path | s / step | peak MiB | full / shared (time) | full / shared (memory) |",
        "|---|---|---|---|---|---|",
    ]
    for K in (int(k) for k in args.classes.split(",")):
        got = {}
        # the plain CoOp step runs all 77 positions of every prompt: ~27 GiB at 1,000 classes, past this machine's 24
        paths = ("ceiling", "full", "shared") if K <= 200 else ("full", "shared")
        for path in paths:
            r = subprocess.run([sys.executable, __file__, "--cell", f"{path}:{K}", "--n-ctx", str(args.n_ctx),
                                "--steps", str(args.steps)], capture_output=True, text=True, check=True, cwd=ROOT)  # fmt: skip
            got[path] = json.loads(r.stdout.strip().splitlines()[-1])
        for path, label in (("ceiling", "plain CoOp step: open_clip's tower on the 77-token prompts"),
                            ("full", "fedfeat, full path (truncated after [EOS])"),
                            ("shared", "fedfeat, shared prefix")):  # fmt: skip
            if path not in got:
                continue
            g = got[path]
            ratio = ""
            if path == "shared":
                ratio = (f"{got['full']['seconds'] / g['seconds']:.2f}x | "
                         f"{got['full']['peak_mib'] / max(g['peak_mib'], 1e-9):.2f}x")  # fmt: skip
            else:
                ratio = "- | -"
            lines.append(f"| {K} | {label} | {g['seconds']:.3f} | {g['peak_mib']:.0f} | {ratio} |")
            print(lines[-1], flush=True)
    lines.append("")
    write_table(Path(args.out), lines)


if __name__ == "__main__":
    main()
