"""
tests/assignments.py -- the tests are the assignments: list them, hand them
out, and prove that the suite grades each one on its own.

    python tests/assignments.py list                      # one line per assignment
    python tests/assignments.py student OUT [--only a,b]  # the version to hand out
    python tests/assignments.py check [--only a,b] [-- PYTEST ARGS]
                                                          # prove the suite grades each alone
    python tests/assignments.py mutants [--only a,b]      # prove each catches its students' bugs

Where each thing lives (one place each, standard library only):

  * the REGION a student writes is marked in the source by two comment lines,
        # assignment: sampler
        ...the solution...
        # end assignment
    usually a function body after its docstring, so that the signature and
    the docstring stay as the specification. One assignment may have several
    regions, in one or several functions. The markers are comments: the
    code reads and runs the same with them.
  * its one-line SPEC and its LESSON (a row of the README's tour) are in the
    ASSIGNMENTS table below. The table holds no solution, so this file is
    copied into the student version unchanged: there it still lists the
    assignments, and `student` can still write their messages.
  * its TESTS carry pytest markers in tests/test_*.py:
        @pytest.mark.assignment("sampler")              # this test grades "sampler"
        @pytest.mark.needs("engine", "copy-on-write")   # ...and runs through these
    `list` and `student` read them by parsing the test files (no import);
    the pytest plugin in tests/conftest.py reads them at run time.

A student version replaces every chosen region by

        # assignment: sampler
        raise NotImplementedError("assignment sampler: <spec>; see tests/test_sampler.py::test_a, test_b")
        # end assignment

so the markers stay (the student writes between them) and an assignment is
unfinished exactly while its raise is in the source (see `unfinished`). The
plugin turns a failure caused by ANOTHER unfinished assignment into a skip
"blocked by <name>", and prints one line per assignment at the end of a run:
passed, failed, not attempted, or blocked.

`check` proves the suite is assignment-independent. First the unchanged
code must pass; then, for each assignment, a temporary copy blanks it ALONE
and pytest runs there: its own tests must fail with its NotImplementedError,
and every other test must pass or be reported "blocked by" it, never fail.

`mutants` proves the tests catch wrong answers, not only missing ones:
tests/mutants.py is a catalog of realistic student bugs (an off-by-one, a
swapped sign, a missing release...), each a small patch of the solution.
Each is applied ALONE to a temporary copy, that assignment's tests run there
(`pytest --assignment NAME -x`), and the test that caught it is printed, or
NOT CAUGHT: a grader that passes a wrong answer is worse than none.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------
# The assignments: what each one asks for (specifications, never solutions)
# ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Assignment:
    lesson: str     # the lesson of the README's tour it belongs to
    spec: str       # one line: what the code between the markers must do


# In the order to do them in (the tour's, but where a lesson needs another first): no assignment's
# tests need a later one (tests/test_assignments.py holds it).

ASSIGNMENTS = {
    "rmsnorm-rope": Assignment(
        "1. the model (model.py): RMSNorm and RoPE",
        "RMSNorm.forward (w * x / sqrt(mean(x^2) + eps), computed in float32), apply_rope (rotate each pair "
        "x[i], x[i + d/2] by its angle) and the Llama 3.1 rope scaling of rope_frequencies"),
    "gqa-attention": Assignment(
        "1. the model (model.py): grouped-query attention",
        "causal softmax attention over one sequence, the H query heads grouped over the n_kv K/V heads "
        "(view q as [N, n_kv, G, d], never copy k or v); scores, softmax and P.V in float32, the output in "
        "q's dtype, the mask made on q's device and applied before the softmax"),
    "bpe": Assignment(
        "2. text in, text out (tokenizer.py): byte-level BPE",
        "the merge loop of one piece: start from single bytes and merge the adjacent pair whose "
        "concatenation has the lowest rank until no pair is in the vocabulary"),
    "kv-cache-bytes": Assignment(
        "4. the KV cache (cache.py): its size",
        "bytes per token = 2 (K and V) * layers * kv_heads * head_dim * bytes per value (the dtype's bits "
        "// 8: an int), times the tokens; "
        "and how many whole blocks of block_size tokens a byte budget holds"),
    "block-allocation": Assignment(
        "5. paged attention (cache.py): blocks, ref counts, the free list",
        "take the least recently used free block (ref count 1), release to the most recently used end at "
        "ref count 0, grow a table in reserve, slot = block * block_size + offset, free a table tail first"),
    "prefix-caching": Assignment(
        "5. paged attention (cache.py): prefix caching",
        "allocate reuses the leading FULL blocks found by chained hashes (never the block of the last token) "
        "and counts hits; cache_full_blocks registers full, computed blocks, resuming where it stopped"),
    "copy-on-write": Assignment(
        "5. paged attention (cache.py): copy-on-write",
        "fork shares every block of the parent (ref counts up, nothing copied); reserve gives a sequence "
        "about to write a shared block a private copy, recorded in pending_copies"),
    "paged-attention": Assignment(
        "5. paged attention (cache.py): the reference",
        "each sequence's new queries attend, through its block table, to its own cached tokens at positions "
        "<= their own (query i sits at seq_len - query_len + i); masked before a float32 softmax, the "
        "output in q's dtype"),
    "decode-attention": Assignment(
        "5. paged attention (kernels.py): a whole step's attention at once",
        "one padded, masked attention for a batch of sequences over their paged KV: one gather through the "
        "block tables, a position mask, GQA without copying k or v"),
    "scheduler-step": Assignment(
        "6. continuous batching (scheduler.py): the step",
        "decodes first (preempting the newest running sequence while the pool is short), then prefill chunks, "
        "then FCFS admissions within seats and the token budget; preempt requeues at the front; a request still "
        "scoring its prompt (prompt_logprobs) is admitted with allocate(..., use_prefix_cache=False)"),
    "sliding-window": Assignment(
        "6. continuous batching over a window (model.py, cache.py): sliding-window attention",
        "in_window: the query at position q sees key position k iff q - W < k (Mistral); reserve frees the "
        "blocks wholly before the window of its first new position (newest first, down to one freed before), "
        "each entry then pointing at the null block, which holds one more reference"),
    "mla-absorb": Assignment(
        "4. the KV cache (model.py): multi-head latent attention, absorbed",
        "LatentAttention.absorbed: fold each head's W_UK (kv_b_proj's first qk_nope_head_dim rows of the "
        "head) into its query, attend through ctx.attend to ONE KV head [normed latent ; rotated shared key] "
        "(V: its first r values) at the heads' scale 1/sqrt(nope + R), then apply W_UV (the head's next "
        "v_head_dim rows) to the weighted sum, in the model's dtype"),
    "stop-strings": Assignment(
        "6. continuous batching (sampler.py): stop strings",
        "Knuth-Morris-Pratt over streamed text with the given failure tables: feed returns (end, length) of "
        "the first stop string completed (the longest of those ending there), partial the longest match still open"),
    "sampler": Assignment(
        "6. continuous batching (sampler.py): the sampler",
        "temperature, then min-p, top-k, top-p per row; vLLM's repetition/presence/frequency penalties (verification "
        "row j counting drafts 0..j-1); an inverse-CDF draw with one uniform per row; "
        "counter-based uniform noise from (key, position, stream)"),
    "ngram-drafter": Assignment(
        "7. speculative decoding (speculative.py): prompt lookup",
        "propose the k tokens that followed the most recent earlier occurrence of the longest suffix n-gram, "
        "trying n from n_max down to n_min"),
    "rejection-sampling": Assignment(
        "7. speculative decoding (speculative.py): the rejection rule",
        "accept draft i with probability min(1, q/p), resample the first rejection from normalize(max(q - p, 0)), "
        "add a bonus token from q when every draft is accepted; one sequence and batched"),
    "int8": Assignment(
        "8. int8 weights (quantize.py)",
        "symmetric absmax int8 along one axis (round, clamp to +-127, scale 1 for an all-zero slice), its "
        "inverse, and Int8Linear.forward computing F.linear on the dequantized weight"),
    "int4": Assignment(
        "8. int4 weights (quantize.py)",
        "asymmetric int4 per group of inputs (range widened to hold 0, float16 scale (max - min) / 15 >= 1e-5, "
        "integer zero point, levels 0..15), two levels a byte (column 2j in the low nibble) and back, "
        "and (q - zero) * scale"),
    "awq": Assignment(
        "8. int4 weights with AWQ scales (quantize.py)",
        "AWQ's grid search: s = mean|x|^alpha per input channel (clamped, normalised to sqrt(max * min) = 1) "
        "for the alpha of the grid whose int4 layer (W * s quantized, / s) errs least on the calibration "
        "outputs"),
    "tensor-parallel": Assignment(
        "10. tensor parallelism (parallel.py)",
        "column-parallel keeps rank r's output rows, row-parallel its input columns and all-reduces before "
        "adding the bias once; the vocab-parallel embedding zeroes other ranks' ids and all-reduces"),
    "sse-stream": Assignment(
        "12. serving (serve.py): streaming",
        "server-sent events: a 200 text/event-stream response, one data: chunk per delta (chat names the "
        "role first), a last chunk with usage, then data: [DONE]"),
    "pruning": Assignment(
        "14. pruning + distillation (prune.py): the surgery",
        "cut: for each kept layer (in its original order) the kept MLP channels' gate and up rows and "
        "down_proj columns, the kept KV groups' q rows (the group's heads), k and v rows and o_proj "
        "columns, so that the small model equals the original with the cut units zeroed"),
    "roofline": Assignment(
        "3 and 13. the roofline, counted (model.py)",
        "FLOPs per token: 2 per weight of every matmul the model has (q, k, v, o, gate, up, down, the LM "
        "head; k, v only in the layers that make K/V under CLA; MLA's own projections) plus attention's "
        "QK^T and PV over the context (MLA: absorbed, over the latent)"),
}

# Names a test's needs(...) marker may use for a whole path through the code.
GROUPS = {
    # the dense path: Transformer(ids, positions) with no cache (model.generate)
    "model": ("rmsnorm-rope", "gqa-attention"),
    # a greedy LLM.generate: the pool, the blocks, the step, the batched attention
    "engine": ("rmsnorm-rope", "kv-cache-bytes", "block-allocation", "prefix-caching", "scheduler-step",
               "decode-attention"),
}


def expand(names) -> list[str]:
    """Assignment names with the groups among them replaced by their members."""
    out = []
    for n in names:
        out += [m for m in GROUPS.get(n, (n,)) if m not in out]
    return out


# ----------------------------------------------------------------------------
# Regions in the source
# ----------------------------------------------------------------------------

BEGIN = re.compile(r"^(?P<indent>[ \t]*)# assignment: (?P<name>\S+)\s*$")
END = re.compile(r"^[ \t]*# end assignment\s*$")
RAISE = re.compile(r'raise NotImplementedError\("assignment (?P<name>[a-z0-9-]+): ')


@dataclass
class Region:
    name: str
    path: str          # relative to the repository root
    begin: int         # 0-based index of the "# assignment:" line
    end: int           # 0-based index of the "# end assignment" line
    indent: str        # the markers' indentation: the raise gets the same
    function: str      # "Class.method" around the region


def source_files(root: str) -> list[str]:
    """The engine's files: flat, at the repository root (tests/ are not regions)."""
    return sorted(f for f in os.listdir(root) if f.endswith(".py"))


def enclosing(tree: ast.AST, lineno: int) -> str:
    """Dotted name of the innermost class/function around a (1-based) line."""
    names, node = [], tree
    while True:
        inner = [c for c in ast.iter_child_nodes(node)
                 if isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                 and c.lineno <= lineno <= c.end_lineno]
        if not inner:
            return ".".join(names) or "<module>"
        node = inner[0]
        names.append(node.name)


def find_regions(root: str = ROOT) -> list[Region]:
    """Every marked region of every source file, checked: known names, begin
    and end paired, nothing nested. A broken marker stops the tool with its line."""
    regions = []
    for rel in source_files(root):
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            text = f.read()
        lines, tree, open_ = text.splitlines(), ast.parse(text, rel), None
        for i, line in enumerate(lines):
            where = f"{rel}:{i + 1}"
            m = BEGIN.match(line)
            if m:
                if open_:
                    raise SystemExit(f"{where}: '# assignment:' inside the region opened at line {open_.begin + 1}")
                if m["name"] not in ASSIGNMENTS:
                    raise SystemExit(f"{where}: unknown assignment {m['name']!r}; add it to ASSIGNMENTS in "
                                     f"tests/assignments.py or use one of: {', '.join(ASSIGNMENTS)}")
                open_ = Region(m["name"], rel, i, -1, m["indent"], enclosing(tree, i + 1))
            elif END.match(line):
                if not open_:
                    raise SystemExit(f"{where}: '# end assignment' without an '# assignment:' line before it")
                open_.end = i
                regions.append(open_)
                open_ = None
        if open_:
            raise SystemExit(f"{rel}:{open_.begin + 1}: region {open_.name!r} has no '# end assignment'")
    return regions


def unfinished(root: str = ROOT) -> set[str]:
    """Assignments whose NotImplementedError is still in the source: not done yet."""
    names = set()
    for rel in source_files(root):
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            names |= {m["name"] for m in RAISE.finditer(f.read())}
    return names


def raised(text: str, names) -> set[str]:
    """Which of `names` have their NotImplementedError in `text` (a traceback,
    an engine's error message, captured output of a server thread or worker)."""
    return {n for n in names if f"assignment {n}: " in text}


# ----------------------------------------------------------------------------
# Tests of each assignment: the markers in tests/test_*.py, read without importing
# ----------------------------------------------------------------------------

def marker_args(decorator: ast.AST, marker: str) -> list[str]:
    """The string arguments of a decorator written @pytest.mark.<marker>(...)."""
    if isinstance(decorator, ast.Call) and ast.unparse(decorator.func) == f"pytest.mark.{marker}":
        return [a.value for a in decorator.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    return []


def find_tests(root: str = ROOT) -> dict[str, list[str]]:
    """{assignment: ["tests/test_x.py::test_name", ...]}, in file order."""
    tests = {name: [] for name in ASSIGNMENTS}
    folder = os.path.join(root, "tests")
    for fname in sorted(f for f in os.listdir(folder) if f.startswith("test_") and f.endswith(".py")):
        with open(os.path.join(folder, fname), encoding="utf-8") as f:
            tree = ast.parse(f.read(), fname)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
                for name in {a for d in node.decorator_list for a in marker_args(d, "assignment")}:
                    if name not in ASSIGNMENTS:
                        raise SystemExit(f"tests/{fname}::{node.name}: unknown assignment {name!r}")
                    tests[name].append(f"tests/{fname}::{node.name}")
    return tests


def test_needs(root: str = ROOT) -> dict[str, tuple[list[str], list[str]]]:
    """{"tests/test_x.py::test_name": (assignments it grades, assignments it runs through)}, the
    needs expanded (groups, and the file's own pytestmark)."""
    out = {}
    folder = os.path.join(root, "tests")
    for fname in sorted(f for f in os.listdir(folder) if f.startswith("test_") and f.endswith(".py")):
        with open(os.path.join(folder, fname), encoding="utf-8") as f:
            tree = ast.parse(f.read(), fname)
        module = [a for node in tree.body if isinstance(node, ast.Assign)
                  and any(getattr(t, "id", "") == "pytestmark" for t in node.targets)
                  for v in (node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value])
                  for a in marker_args(v, "needs")]
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
                graded = [a for d in node.decorator_list for a in marker_args(d, "assignment")]
                needs = expand(module + [a for d in node.decorator_list for a in marker_args(d, "needs")])
                out[f"tests/{fname}::{node.name}"] = (graded, needs)
    return out


def later_needs(root: str = ROOT) -> list[tuple[str, str, list[str]]]:
    """(assignment, test, the LATER assignments it needs): a test its assignment's student cannot
    pass yet, however right, when doing the assignments in order. Empty: each can be done in order."""
    order = {name: i for i, name in enumerate(ASSIGNMENTS)}
    out = []
    for test, (graded, needs) in test_needs(root).items():
        for g in graded:
            later = sorted({n for n in graded + needs if order[n] > order[g]}, key=order.get)
            if later:
                out.append((g, test, later))
    return out


def message(name: str, tests: dict) -> str:
    """The NotImplementedError of a blanked region: what to do, where it is graded."""
    by_file = {}
    for t in tests.get(name, []):
        path, fn = t.split("::")
        by_file.setdefault(path, []).append(fn)
    see = "; ".join(f"{path}::{', '.join(fns)}" for path, fns in by_file.items()) or "(no test yet)"
    return f"assignment {name}: {ASSIGNMENTS[name].spec}; see {see}"


# ----------------------------------------------------------------------------
# list
# ----------------------------------------------------------------------------

def cmd_list(args) -> int:
    regions, tests = find_regions(), find_tests()
    width = max(map(len, ASSIGNMENTS))
    for name, a in ASSIGNMENTS.items():
        where = {}
        for r in regions:
            if r.name == name and r.function not in where.setdefault(r.path, []):
                where[r.path].append(r.function)
        files = "; ".join(f"{path}:{', '.join(fns)}" for path, fns in where.items()) or "NO REGION"
        shown = ", ".join(t.replace("tests/", "") for t in tests[name]) or "NO TEST"
        print(f"{name:<{width}}  {files}  | lesson {a.lesson} | {len(tests[name])} tests: {shown}")
    return 0


# ----------------------------------------------------------------------------
# student: a copy of the repository with regions replaced by NotImplementedError
# ----------------------------------------------------------------------------

SKIPPED_DIRS = {".git", "__pycache__", ".pytest_cache"}


def repo_files(root: str) -> list[str]:
    """What a copy holds: git's tracked files as they are in the work tree
    (`git add` a new file first), never .git, caches or untracked notes.
    Outside git (a student version), every file but .git, caches and *.pyc."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout.decode()
        files = [f for f in out.split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for folder, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]
            files += [os.path.relpath(os.path.join(folder, n), root) for n in names if not n.endswith(".pyc")]
    return sorted({f for f in files if os.path.isfile(os.path.join(root, f))})


def blank(lines: list[str], regions: list[Region], tests: dict) -> list[str]:
    """The lines of one file with each given region's body replaced by its raise."""
    out, i = [], 0
    for r in sorted(regions, key=lambda r: r.begin):
        out += lines[i:r.begin + 1]                                      # up to the "# assignment:" line
        out.append(f'{r.indent}raise NotImplementedError("{message(r.name, tests)}")')
        i = r.end                                                        # the "# end assignment" line stays
    return out + lines[i:]


def write_copy(root: str, out: str, names: set[str]) -> list[Region]:
    """Copy the repository to `out` with the regions of `names` blanked;
    returns those regions. Every rewritten file must still compile."""
    if os.path.exists(out) and os.listdir(out):
        raise SystemExit(f"{out} exists and is not empty: choose a new folder")
    regions, tests = find_regions(root), find_tests(root)
    chosen = [r for r in regions if r.name in names]
    for rel in repo_files(root):
        src, dst = os.path.join(root, rel), os.path.join(out, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        mine = [r for r in chosen if r.path == rel]
        if not mine:
            shutil.copy2(src, dst)
            continue
        with open(src, encoding="utf-8") as f:
            text = "\n".join(blank(f.read().splitlines(), mine, tests)) + "\n"
        compile(text, rel, "exec")                   # a region that is not whole statements fails here
        with open(dst, "w", encoding="utf-8") as f:
            f.write(text)
        shutil.copymode(src, dst)
    return chosen


def leaks(root: str, out: str, regions: list[Region], run: int = 4) -> list[str]:
    """Places in the copy that still hold `run` consecutive lines of a blanked
    solution (a duplicate in another file, a comment quoting it). One line
    alone is not counted: `self.running.remove(seq)` is not a solution."""
    solution = {}
    for r in regions:
        with open(os.path.join(root, r.path), encoding="utf-8") as f:
            body = [s.strip() for s in f.read().splitlines()[r.begin + 1:r.end] if s.strip()]
        solution.update({tuple(body[i:i + run]): r.name for i in range(len(body) - run + 1)})
    found = []
    for rel in repo_files(out):
        try:
            with open(os.path.join(out, rel), encoding="utf-8") as f:
                lines = [(i, s.strip()) for i, s in enumerate(f.read().splitlines()) if s.strip()]
        except (UnicodeDecodeError, OSError):
            continue                                  # binary fixtures
        for j in range(len(lines) - run + 1):
            window = tuple(s for _, s in lines[j:j + run])
            if window in solution:
                found.append(f"{rel}:{lines[j][0] + 1}: {window[0]} ... (solution of {solution[window]})")
    return found


def chosen_names(only: str | None) -> list[str]:
    if not only:
        return list(ASSIGNMENTS)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in ASSIGNMENTS]
    if unknown:
        raise SystemExit(f"unknown assignment(s) {', '.join(unknown)}; known: {', '.join(ASSIGNMENTS)}")
    return names


def cmd_student(args) -> int:
    names = chosen_names(args.only)
    regions = write_copy(ROOT, args.out, set(names))
    os.remove(os.path.join(args.out, "tests", "mutants.py"))   # the bug catalog quotes solution lines
    print(f"wrote {args.out}: {len(names)} assignments blanked ({len(regions)} regions): {', '.join(names)}")
    for line in leaks(ROOT, args.out, regions):
        print(f"warning: the solution is still in the copy at {line}")
    print(f"grade it: cd {args.out} && python -m pytest   (the last section lists every assignment)")
    return 0


# ----------------------------------------------------------------------------
# The grade of a run: the plugin's per-test statuses, summed up per assignment
# ----------------------------------------------------------------------------
# The plugin (tests/conftest.py) gives every test a status:
#   passed | skipped                 as pytest says
#   todo     failed with the NotImplementedError of one of its own assignments
#   blocked  failed because another unfinished assignment raised (or one it
#            needs() is unfinished): reported as a skip "blocked by <name>"
#   failed   any other failure
# with "by": the assignments that raised (todo, blocked) or it needs (blocked).

def grade(name: str, results: dict) -> tuple[str, str] | None:
    """(status, details) of one assignment over the tests that ran, or None."""
    mine = [r for r in results.values() if name in r["assignments"] and r["status"] != "collected"]
    if not mine:
        return None
    count = lambda s: sum(r["status"] == s for r in mine)                       # noqa: E731
    todo = sum(r["status"] == "todo" and name in r["by"] for r in mine)
    blocked = [r for r in mine if r["status"] == "blocked" or (r["status"] == "todo" and name not in r["by"])]
    by = sorted({b for r in blocked for b in r["by"]})
    failing = [r["test"] for r in mine if r["status"] == "failed"]
    details = f"{count('passed')} of {len(mine)} tests passed"
    details += f", {todo} raise its NotImplementedError" if todo else ""
    details += f", {len(blocked)} blocked by {', '.join(by)}" if blocked else ""
    details += f", {count('skipped')} skipped" if count("skipped") else ""
    if failing:
        return "failed", details + f", {len(failing)} failed: " + ", ".join(failing[:3]) + \
            (" ..." if len(failing) > 3 else "")
    if todo:
        return ("failed" if count("passed") else "not attempted"), details
    if blocked:
        return "blocked", details
    return ("passed", details) if count("passed") else ("skipped", details)


def summary_lines(results: dict) -> list[str]:
    width = max(map(len, ASSIGNMENTS))
    return [f"{name:<{width}}  {g[0]:<13}  {g[1]}" for name in ASSIGNMENTS
            if (g := grade(name, results)) is not None]


# ----------------------------------------------------------------------------
# check: blank each assignment alone in a copy, run the suite there, judge
# ----------------------------------------------------------------------------

def run_suite(copy: str, pytest_args: list[str], timeout: float) -> tuple[dict | None, float, str]:
    """pytest in a copy; returns (per-test results or None if it did not
    finish, seconds, path of its output)."""
    report, log = os.path.join(copy, "..", "report.json"), os.path.join(copy, "..", "pytest.log")
    # test_assignments.py runs `check` itself: inside a check it would recurse.
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--assignment-report", report,
           "--ignore=tests/test_assignments.py", *pytest_args]
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            subprocess.run(cmd, cwd=copy, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, time.perf_counter() - t0, log
    seconds = time.perf_counter() - t0
    if not os.path.exists(report):                    # collection failed, or pytest crashed
        return None, seconds, log
    with open(report) as f:
        return json.load(f), seconds, log


def short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def judge(results: dict, name: str | None) -> tuple[list[str], dict]:
    """Problems of a run that blanked `name` alone (None: nothing blanked), and counts."""
    problems, counts = [], {"own": 0, "passed": 0, "skipped": 0, "blocked": 0, "undeclared": 0}
    for nodeid, r in results.items():
        status, by, nodeid = r["status"], set(r["by"]), short(nodeid)
        if status == "collected":
            problems.append(f"{nodeid}: collected but never ran")
        elif name is not None and name in r["assignments"]:
            counts["own"] += 1
            if not (status == "todo" and name in by):
                problems.append(f"{nodeid}: {status}, but as a test of {name} it must fail with its "
                                f"NotImplementedError{': ' + short(r['message']) if r['message'] else ''}")
        elif status in ("passed", "skipped"):
            counts[status] += 1
        elif status == "blocked" and by == {name}:
            counts["blocked"] += 1
            counts["undeclared"] += not r["declared"]
        else:
            problems.append(f"{nodeid}: {status}{' by ' + ', '.join(sorted(by)) if by else ''}"
                            f"{': ' + short(r['message']) if r['message'] else ''}")
    if name is not None and not counts["own"]:
        problems.append(f"no test of {name} ran: mark its tests @pytest.mark.assignment({name!r}) "
                        "(and include them in the selection)")
    return problems, counts


def check_one(name: str | None, pytest_args: list[str], args) -> bool:
    """Blank `name` alone (None: nothing), run, judge, print one line (and the problems)."""
    label = name or "(nothing blanked)"
    tmp = tempfile.mkdtemp(prefix=f"check-{name or 'baseline'}-")
    try:
        write_copy(ROOT, os.path.join(tmp, "repo"), {name} if name else set())
        results, seconds, log = run_suite(os.path.join(tmp, "repo"), pytest_args, args.timeout)
        if results is None:
            with open(log) as f:
                tail = f.read()[-3000:]
            print(f"{label:<19} FAIL {seconds:6.0f} s  pytest did not finish (timeout or collection "
                  f"error); the end of its output:\n{tail}", flush=True)
            return False
        problems, c = judge(results, name)
        own = f"{c['own']} own tests fail with its NotImplementedError; " if name else ""
        undeclared = f" ({c['undeclared']} without needs())" if c["undeclared"] else ""
        print(f"{label:<19} {'ok  ' if not problems else 'FAIL'} {seconds:6.0f} s  {own}{c['passed']} passed, "
              f"{c['blocked']} blocked{undeclared}, {c['skipped']} skipped", flush=True)
        for p in problems[:args.max_problems]:
            print(f"    {p}")
        if len(problems) > args.max_problems:
            print(f"    ... and {len(problems) - args.max_problems} more")
        return not problems
    finally:
        if args.keep:
            print(f"    kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def cmd_check(args) -> int:
    names = chosen_names(args.only)
    pytest_args = [a for a in args.pytest_args if a != "--"]
    print(f"check: {len(names)} assignments, pytest {' '.join(pytest_args) or '(the whole suite)'}", flush=True)
    t0 = time.perf_counter()
    ok = args.no_baseline or check_one(None, pytest_args, args)
    for name in names:
        ok = check_one(name, pytest_args, args) and ok
    print(f"check: {'ok' if ok else 'FAILED'} in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0 if ok else 1


# ----------------------------------------------------------------------------
# mutants: apply each catalogued student bug alone, run its assignment's tests
# ----------------------------------------------------------------------------

def load_bugs(path: str) -> list:
    """The BUGS list of a catalog file (tests/mutants.py), imported by path
    so that a test can hand the tool a catalog of its own."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("mutants_catalog", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module               # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.BUGS


def apply_bug(repo: str, bug) -> str | None:
    """Patch one file of a copy; returns why it cannot be applied, or None.
    The old text must occur exactly once: a patch that silently matches
    nothing (the code moved on) or the wrong place would "pass" for free."""
    path = os.path.join(repo, bug.file)
    if not os.path.isfile(path):
        return f"no file {bug.file}"
    with open(path, encoding="utf-8") as f:
        text = f.read()
    n = text.count(bug.old)
    if n != 1:
        return f"old text found {n} times in {bug.file} (must be exactly once)"
    text = text.replace(bug.old, bug.new)
    try:
        compile(text, bug.file, "exec")           # a patch must leave valid Python
    except SyntaxError as e:
        return f"the patched {bug.file} does not compile: {e}"
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return None


def catcher(results: dict | None) -> str | None:
    """The first test of the run that failed (its node id), or None if none did."""
    for nodeid, r in (results or {}).items():
        if r["status"] in ("failed", "todo"):
            return nodeid
    return None


def mutant_one(bug, args) -> tuple[str, str]:
    """Apply `bug` alone to a fresh copy, run its assignment's tests, stop at the
    first failure. Returns (verdict, detail): caught / NOT CAUGHT / NOT APPLIED."""
    tmp = tempfile.mkdtemp(prefix=f"mutant-{bug.assignment}-")
    try:
        repo = os.path.join(tmp, "repo")
        write_copy(ROOT, repo, set())
        problem = apply_bug(repo, bug)
        if problem:
            return "NOT APPLIED", problem
        results, seconds, log = run_suite(repo, ["--assignment", bug.assignment, "-x", *args.pytest_args],
                                          args.timeout)
        if results is None and seconds >= args.timeout:    # a hang is no verdict: report it
            return "TIMEOUT", f"pytest ran past {args.timeout:.0f} s; see a test that hangs on this bug"
        if results is None:      # the patched code does not even import: no test can pass
            return "caught", f"pytest did not finish: a collection error ({seconds:.0f} s)"
        test = catcher(results)
        if test is None:
            ran = sum(r["status"] == "passed" for r in results.values())
            return "NOT CAUGHT", f"{ran} tests of {bug.assignment} passed ({seconds:.0f} s)"
        return "caught", f"by {test} ({seconds:.0f} s)"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def cmd_mutants(args) -> int:
    names = set(chosen_names(args.only))
    bugs = [b for b in load_bugs(args.catalog) if b.assignment in names]
    unknown = sorted({b.assignment for b in bugs} - set(ASSIGNMENTS))
    if unknown:
        raise SystemExit(f"the catalog names unknown assignment(s): {', '.join(unknown)}")
    args.pytest_args = [a for a in args.pytest_args if a != "--"]
    print(f"mutants: {len(bugs)} bugs of {len({b.assignment for b in bugs})} assignments, "
          f"each alone, against its assignment's tests", flush=True)
    t0, bad = time.perf_counter(), 0
    width = max(map(len, ASSIGNMENTS))
    for bug in bugs:
        verdict, detail = mutant_one(bug, args)
        bad += verdict != "caught"
        print(f"{bug.assignment:<{width}}  {verdict:<11}  {bug.mistake}: {detail}", flush=True)
    caught = len(bugs) - bad
    print(f"mutants: {caught} of {len(bugs)} caught ({100 * caught / max(len(bugs), 1):.0f}%) "
          f"in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0 if bad == 0 else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python tests/assignments.py", description=__doc__.split("\n")[1])
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="one line per assignment: its files and functions, lesson and tests")
    p = sub.add_parser("student", help="write a student version of the repository")
    p.add_argument("out", help="a new (or empty) folder")
    p.add_argument("--only", help="comma-separated assignments to blank (default: all)")
    p = sub.add_parser("check", help="prove each assignment is graded by its own tests alone")
    p.add_argument("--only", help="comma-separated assignments to check (default: all)")
    p.add_argument("--no-baseline", action="store_true", help="skip the run with nothing blanked")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per pytest run (default 3600)")
    p.add_argument("--keep", action="store_true", help="keep the temporary copies and their pytest.log")
    p.add_argument("--max-problems", type=int, default=20, help=argparse.SUPPRESS)
    p.add_argument("pytest_args", nargs="*", help="after --: the tests to run (default: the whole suite)")
    p = sub.add_parser("mutants", help="apply each catalogued student bug alone; its assignment's tests must fail")
    p.add_argument("--only", help="comma-separated assignments whose bugs to try (default: all)")
    p.add_argument("--catalog", default=os.path.join(ROOT, "tests", "mutants.py"),
                   help="the catalog file (default: tests/mutants.py)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per pytest run (default 600)")
    p.add_argument("pytest_args", nargs="*", help="after --: extra pytest arguments for every run")
    args = ap.parse_args(argv)
    return {"list": cmd_list, "student": cmd_student, "check": cmd_check,
            "mutants": cmd_mutants}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
