"""`make bench`: run every benchmark in bench/ and assemble BENCHMARKS.md from bench/results/*.md.

    python bench/run_all.py            # engine + encode benchmarks on this machine, then BENCHMARKS.md
    python bench/run_all.py --assemble # only rebuild BENCHMARKS.md from the results already there

Results of other machines (e.g. a GPU run, `bench/results/*-gpu.md`) are kept and included.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

HEADER = """# Benchmarks

Figures measured with the project's own bench commands (`make bench`, or the command printed under each table),
on the machine named in each section. Speed is measured here, never asserted by a test. Timings on shared
2-core machines are noisy (up to 2x): each time is a median, and ratios are taken within one run. The engine
table gives three readings of the distance to the machine's floor: the best round against the floor at the best
ceilings (best against best, the one quoted), the median round against the floor at the median ceilings, and the
median round against the best-ceilings floor (the strictest mix).
"""


def assemble() -> None:
    parts = [HEADER]
    for f in sorted(RESULTS.glob("*.md")):
        parts.append(f.read_text().rstrip() + "\n")
    (ROOT / "BENCHMARKS.md").write_text("\n".join(parts))
    print(f"wrote {ROOT / 'BENCHMARKS.md'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--assemble", action="store_true", help="only rebuild BENCHMARKS.md")
    args = ap.parse_args()
    if not args.assemble:
        for script in (
            "bench_engine.py",
            "bench_clip2fl.py",
            "bench_encode.py",
            "bench_checkpoint.py",
            "bench_openvocab.py",
            "bench_prompt.py",
            "bench_round.py",
            "bench_fedcopl.py",
            "bench_sweep.py",
            "bench_plugin.py",
            "bench_memory.py",
            "bench_scale.py",
            "bench_startup.py",
            "bench_domain.py",
            "bench_canon.py",
            "bench_prefix.py",
            "bench_feed.py",
            "bench_dp.py",
        ):
            path = ROOT / "bench" / script
            if path.exists():
                print(f"== {script}", flush=True)
                # the server loops of bench_clip2fl are tiny ops: one OpenMP thread avoids hand-off stalls
                env = dict(os.environ, OMP_NUM_THREADS="1") if script == "bench_clip2fl.py" else None
                subprocess.run([sys.executable, str(path)], check=True, cwd=ROOT, env=env)
    assemble()


if __name__ == "__main__":
    main()
