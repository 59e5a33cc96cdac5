"""
experiments/cli.py -- bench.py's command line: its flags (each explained in its help) and where
the pictures go. Plumbing, kept out of the runner so that bench.py reads as the run itself.
"""
from __future__ import annotations

import argparse
import os

from experiments import EXPERIMENTS
from experiments.plan import CARDS


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="nanoinfer bench: every lesson of the lecture as a number on your machine")
    ap.add_argument("--model", default=None, help="checkpoint directory or random:<preset> for "
                    "every experiment (default: the embedded SmolLM2-135M-Instruct; on a GPU, "
                    "timing on the largest preset that fits)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--only", default=None,
                    help="comma-separated experiments: " + ",".join(EXPERIMENTS))
    ap.add_argument("--quick", action="store_true", help="every experiment, fewer points")
    ap.add_argument("--json", default=None,
                    help="write every figure to this file (merged into it if it exists)")
    ap.add_argument("--draft", default=None,
                    help="a draft model directory for the speculative experiment")
    ap.add_argument("--plots", default=None, help="folder for the pictures (default: beside "
                    "--json, results/x.json -> results/x/; without --json ./bench-plots)")
    ap.add_argument("--no-plots", action="store_true", help="write no pictures")
    ap.add_argument("--check", action="store_true", help="a verdict per GPU path (<= 3 min on "
                    "one GPU): run it first on a GPU and report its output; --device cpu is its "
                    "dry run")
    ap.add_argument("--strict-sdpa", action="store_true", help="an SDPA call that would fall "
                    "back to the slow math backend raises instead (kernels.STRICT_SDPA)")
    ap.add_argument("--plan", action="store_true", help="print each experiment's planned peak "
                    "memory and time on --gpu, and run nothing (no model is built, no GPU needed)")
    ap.add_argument("--gpu", default="h100-80gb", choices=list(CARDS),
                    help="the card --plan plans for")
    ap.add_argument("--configure", action="store_true", help="the lecture's inference-system "
                    "configurator (its own flags: bench.py --configure --help); runs nothing")
    return ap, ap.parse_args(argv)


def plots_dir(args) -> str | None:
    """Where the pictures go: --plots, else beside --json (results/x.json -> results/x/), else
    ./bench-plots."""
    if args.no_plots:
        return None
    return args.plots or (os.path.splitext(args.json)[0] if args.json else "bench-plots")
