"""
bench.py -- measuring it all: every lesson of the lecture as a number on your machine.

    python bench.py --check                  # on a GPU, FIRST: a verdict per GPU path (<= 3 min)
    python bench.py                          # every experiment on the best device (H100: ~10 min)
    python bench.py --quick                  # the same, fewer points (GPU <= 5 min; 2-core CPU ~1)
    python bench.py --plan --gpu h100-80gb   # per experiment: planned peak memory and time; no run
    python bench.py --only batching,compile --json results/x.json    # + pictures in results/x/
    python bench.py --check --device cpu --model random:smollm2-tiny  # check dry run (CI, < 30 s)
    python bench.py --configure --help       # the lecture's configurator: any model on any card

This file is the runner: the device and the scale, the plan, the run loop and --json (its flags
are in experiments/cli.py). The experiments are in experiments/, one file each (its docstring
lists them): the lecture's claim, the baseline measured in the same run, the workload, the table
and the picture. Each runs in isolation: one that raises reports its error in its table and JSON
entry, and the next one runs.

The scale. On a GPU with no --model the timing experiments run on the largest "random:" preset
(published shapes, random weights) whose planned run fits the free memory (Llama-3.1-8B on an 80 GB
card; a 135M model would leave the GPU idle), through the compiled engine with CUDA graphs, what a
GPU user runs; perplexity and speculative acceptance need trained weights: the default model's
(without it they say so). --model sets both. On a CPU both are the default model, eager.

--json merges into an existing results file (rerunning one experiment replaces only its entry; a
file that is not bench results is refused, never overwritten); the pictures go beside it
(results/x.json -> results/x/), drawn from the results alone: a results file re-plots anywhere.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import os
import platform
import sys
import time
import traceback

import torch

import kernels
from experiments import EXPERIMENTS, check, configure, write_plot
from experiments.cli import parse_args, plots_dir
from experiments.common import Bench, load_results, save_results, weights_label
from experiments.plan import CARDS, Card, Scale, card_for, describe, pick_timing_model, plan_run
from support.checkpoint import RANDOM_PREFIX


@functools.lru_cache(maxsize=None)
def quality_model() -> str:
    """The default model, or (not installed, no network) its shapes with random weights, said
    once."""
    from model import default_model_path
    try:
        return default_model_path()
    except (FileNotFoundError, ImportError) as e:
        print(f"bench: no default model ({e}); using random:smollm2-135m (its shapes, "
              "random weights)", file=sys.stderr)
        return RANDOM_PREFIX + "smollm2-135m"


def make_scale(args, gpu: bool, free_bytes: float | None = None) -> tuple[Scale, str]:
    """The run's scale and why its timing model: --model, or on a GPU the largest preset that
    fits."""
    # Two models, because two kinds of figure: TIMINGS depend only on shapes and bytes (random
    # weights time exactly like trained ones), QUALITY (perplexity, acceptance) needs trained ones.
    quality = args.model or quality_model()     # perplexity, acceptance: trained weights only
    device = args.device if args.device.startswith("cuda:") and gpu else None   # cuda:N pins one
    scale = Scale(gpu, args.quick, quality, quality, args.dtype, device)
    # A CPU times the default model: an 8B step would take minutes
    if args.model or not gpu:
        return scale, "--model" if args.model else "the default model"
    # A GPU: the largest preset whose PLANNED run fits, since a 135M model leaves an H100 idle
    picked, why = pick_timing_model(EXPERIMENTS, scale, free_bytes)
    return Scale(gpu, args.quick, picked or quality, quality, args.dtype, device), why


def plan_text(args, gpu: bool, card_name: str, card: Card, free: float | None = None) -> str:
    """The plan of this run (--quick, --check, --only) on `card`; on a GPU, the three runs'
    totals."""
    # Why plan at all: a rented GPU is paid by the minute and an 80 GB card has no spare 10 GB.
    # Memory is counted on the meta device (no byte allocated) and time as counted steps x
    # their roofline step time: a run that cannot fit says so before it builds anything.
    this, plans = "check" if args.check else "quick" if args.quick else "full", {}
    for mode in ("full", "quick", "check") if gpu else (this,):
        scale, why = make_scale(argparse.Namespace(**{**vars(args), "quick": mode == "quick"}), gpu,
                                card.memory if free is None else free)
        names = args.only.split(",") if args.only and mode == this else EXPERIMENTS
        plans[mode] = (plan_run({"check": check} if mode == "check"
                                else {n: EXPERIMENTS[n] for n in names}, scale, card), scale, why)
    return describe(plans, this, card_name, card, gpu)


@contextlib.contextmanager
def strict_sdpa(on: bool):
    """--strict-sdpa: kernels.STRICT_SDPA on for the run (an SDPA math fallback raises)."""
    # Why: SDPA silently falls back to its math backend (the whole score matrix in memory) when
    # a fused kernel refuses its arguments; a benchmark would then time the slow path unawares.
    old, kernels.STRICT_SDPA = kernels.STRICT_SDPA, on or kernels.STRICT_SDPA
    try:
        yield
    finally:
        kernels.STRICT_SDPA = old


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--configure" in argv:        # arithmetic over a shape and a card: no device, no run
        return configure.main([a for a in argv if a != "--configure"])
    ap, args = parse_args(argv)
    names = list(EXPERIMENTS) if not args.only else [n.strip() for n in args.only.split(",")]
    # A typo must fail now, not after minutes of the experiments before it
    unknown = [n for n in names if n not in EXPERIMENTS]
    if unknown:
        ap.error(f"unknown experiment(s) {unknown}; choose from {list(EXPERIMENTS)}")
    if args.plan:                    # memory and time from counted bytes and steps: no GPU needed
        print(plan_text(args, True, args.gpu, CARDS[args.gpu]))
        return {}
    # Read first: a file that is not bench results stops the run before any work.
    results = load_results(args.json) if args.json else {}
    device = torch.device(args.device if args.device != "auto"
                          else "cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    # The card's name and roofs: every GPU figure is read against them (fraction of the bound)
    card = card_for(device) if gpu else None                # its bandwidth: the roofline's slope
    scale, why = make_scale(args, gpu, card[1].memory if gpu else None)
    # One Bench for the run: an 8B engine costs ~30 s to build and compile, so experiments that
    # want the same engine share it; one that needs another frees the kept one first
    b = Bench(args, scale)           # the engines, built once and shared by the experiments
    meta = {"device": card[0] if gpu else f"CPU ({platform.processor() or platform.machine()}, "
                                          f"{torch.get_num_threads()} threads)",
            "dtype": args.dtype, "torch": torch.__version__,
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "model": scale.path,
            "timing_model": scale.path, "quality_model": scale.quality_path, "scale": why,
            "quick": args.quick,     # every figure carries how it was made: reproducible
            "command": " ".join(["python", "bench.py"] + argv)}
    print(f"# nanoinfer bench\n\n{meta['device']}, torch {meta['torch']}, dtype {args.dtype}, "
          f"{meta['date']}\n"
          f"Timing model {scale.path} ({weights_label(scale.path)}; {why}); quality model "
          f"{os.path.basename(scale.quality_path)} ({weights_label(scale.quality_path)}).\n")
    try:                                 # the plan first (the roofline assignment unfinished: none)
        print(plan_text(args, gpu, meta["device"], card[1] if gpu else CARDS["h100-80gb"]) + "\n",
              flush=True)
    except NotImplementedError as e:
        print(f"bench: no plan ({e})\n", file=sys.stderr)
    # Each experiment's entry keeps its own meta too: a merged file mixes runs (--only reruns)
    results["meta"] = meta                 # the latest run
    with strict_sdpa(args.strict_sdpa):
        if args.check:               # a verdict per GPU path: trust the engine before timing it
            def save(checks):
                results["check"] = {"checks": checks, "meta": meta}
                save_results(args.json, results)
            checks, text = check.run_checks(b, save)
            print(f"\n## check\n\n{text}\n", flush=True)
        else:
            run_all(b, names, results, meta, plots_dir(args))
    return results


def run_all(b: Bench, names: list, results: dict, meta: dict, folder: str | None):
    """The experiments one after another (they never share the machine), each saved and drawn
    when done."""
    # A stock GPU image may lack matplotlib: the figures matter, the pictures are a bonus
    try:
        import matplotlib  # noqa: F401  (the pictures)
    except ImportError:
        if folder:
            print("bench: matplotlib is not installed: tables only, no pictures "
                  "(pip install matplotlib)", file=sys.stderr, flush=True)
        folder = None
    start = time.perf_counter()          # progress on stderr: a rented GPU's minutes are counted
    for i, name in enumerate(names, 1):
        print(f"bench: [{i}/{len(names)}] {name} ... (elapsed {time.perf_counter() - start:.0f} s)",
              file=sys.stderr, flush=True)
        t0, b.used = time.perf_counter(), {}
        fig, text = run_experiment(b, name)      # one at a time: two would share the bandwidth
        fig["wall_seconds"] = time.perf_counter() - t0   # against its plan: is the plan honest?
        fig["models"], fig["meta"] = dict(b.used), meta     # which weights every figure came from
        if folder:
            try:
                fig["plot"] = write_plot(name, fig, folder)
            except Exception as e:                # noqa: BLE001 (a picture never costs the figures)
                fig["plot_error"] = f"{type(e).__name__}: {e}"
        results[name] = fig
        # The table names its weights: random ones time honestly, but their text is noise
        models = "; ".join(f"{p} ({label})" for p, label in b.used.items())
        picture = f"\n\nPicture: {fig['plot']}" if fig.get("plot") else ""
        print(f"\n## {name}\n\n" + (f"Model: {models}.\n\n" if models else "")
              + f"{text}{picture}\n", flush=True)
        status = "FAILED" if "error" in fig else "skipped" if "skipped" in fig else "done"
        print(f"bench: [{i}/{len(names)}] {name} {status} in {fig['wall_seconds']:.0f} s",
              file=sys.stderr, flush=True)
        # after every experiment: a cut-short run keeps what it measured
        save_results(b.args.json, results)
    # the end of a long log says it again
    for key, said in (("skipped", "skipped"), ("error", "FAILED")):
        if any(key in results[n] for n in names):
            print(f"bench: {said}: " + "; ".join(f"{n} ({results[n][key]})" for n in names
                                                 if key in results[n]),
                  file=sys.stderr, flush=True)


def run_experiment(b: Bench, name: str) -> tuple[dict, str]:
    """One experiment in isolation: one that raises reports its error (its table and its JSON entry)
    and frees what it held, and the next experiment runs."""
    # Why isolate: on a rented GPU a crash in experiment 3 must not cost the minutes of 4 to 13
    try:
        return EXPERIMENTS[name].run(b)
    except Exception as e:                    # noqa: BLE001 (KeyboardInterrupt still stops the run)
        tb = traceback.format_exc()
        print(tb, file=sys.stderr)
        b.release()                                  # the failed experiment's engines hold memory
        return ({"error": f"{type(e).__name__}: {e}", "traceback": tb},
                f"**Failed**: {type(e).__name__}: {e} (the traceback is in the JSON and on "
                "stderr).")
    finally:
        b.done()


def failed(results: dict) -> bool:
    """Whether an experiment or a check of THIS run (not one merged from the file) failed: the
    exit status."""
    meta = results.get("meta")
    # Identity, not equality: an entry merged from an older run carries an equal-looking meta
    mine = [r for k, r in results.items()
            if k != "meta" and isinstance(r, dict) and r.get("meta") is meta]
    return any("error" in r or r.get("failed") for r in mine) or any(  # failed: a table's row
        c["verdict"] == check.FAIL for r in mine for c in r.get("checks", {}).values())


if __name__ == "__main__":
    sys.exit(1 if failed(main()) else 0)
