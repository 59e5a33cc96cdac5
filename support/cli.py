"""support/cli.py -- the command line of prune.py (serve.py's is support/server.py's
serve_arguments, bench.py's experiments/cli.py): flags, defaults and help in one place, out of
the lesson's way. Standard library only."""
from __future__ import annotations

import argparse


def fraction(text: str) -> float:
    """A float in (0, 1]: a share of the parameters or of the cut."""
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 1]")
    return value


def prune_arguments(argv=None) -> argparse.Namespace:
    """python prune.py --out DIR [--model PATH] [--target-params 0.7] [--depth-share 0.5]
    [--steps 60] [--lr 1e-4] [--texts 32]"""
    ap = argparse.ArgumentParser(prog="prune.py", description="prune a checkpoint by calibration "
                                 "importance, distill it from the original, write it (Minitron)")
    ap.add_argument("--model", default=None, help="checkpoint (default: the default model)")
    ap.add_argument("--out", required=True, help="directory for the pruned checkpoint")
    ap.add_argument("--target-params", type=fraction, default=0.7, help="parameters kept")
    ap.add_argument("--depth-share", type=float, default=0.5,
                    help="share of the cut as whole layers (0: MLP channels only)")
    ap.add_argument("--steps", type=int, default=60, help="distillation steps (0: cut only)")
    ap.add_argument("--lr", type=float, default=1e-4, help="AdamW's learning rate")
    ap.add_argument("--texts", type=int, default=32, help="samples the original writes")
    args = ap.parse_args(argv)
    if not 0 <= args.depth_share <= 1 or args.steps < 0 or args.texts < 1 or args.lr <= 0:
        ap.error("--depth-share in [0, 1], --steps >= 0, --texts >= 1, --lr > 0")
    return args
