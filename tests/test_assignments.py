"""The assignments tool (tests/assignments.py) and its pytest plugin (conftest.py).

  * the markers are consistent: every assignment has regions in the source
    and tests that grade it, every file of the tour has one, the specs fit
    in a one-line message, and pytest collects the same mapping that the
    tool reads from the test files;
  * a generated student version holds no solution, no .git and no caches,
    compiles, collects without errors, and its failures are exactly the
    blanked assignments' tests, each with its own NotImplementedError (every
    other test passes or is reported blocked);
  * `check` passes on a few cheap assignments, and FAILS on a test that is
    not independent (one that hides another assignment's error, one that
    never reaches its own assignment's code).
The whole check (every assignment against the whole suite) is the slow run
the README documents; here it runs on a reduced selection.
"""
import json
import os
import subprocess
import sys

import pytest

import assignments
from assignments import ASSIGNMENTS, GROUPS, ROOT

pytestmark = pytest.mark.skipif(bool(assignments.unfinished(ROOT)),
                                reason="a student version: the tool's own tests need every solution")

# Fast files for the runs below (seconds each on 2 cores): the assignments
# they grade and some of their neighbours.
CHEAP = ["bpe", "ngram-drafter", "kv-cache-bytes"]
SELECTION = ["tests/test_tokenizer.py", "tests/test_speculative.py", "tests/test_cache.py",
             "-k", "not real_model and not ngram_greedy and not own_draft and not bad_draft and not rolls_back "
                   "and not forks and not accepted_tokens and not local_and_global and not mla_engine "
                   "and not logit_bias"]


def run(args, cwd, timeout=900):
    """A command in `cwd`: (exit code, stdout + stderr)."""
    p = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def pytest_in(copy, report, *args):
    """pytest inside a copy, with the plugin's JSON report: (exit code, output, results)."""
    code, out = run(["-m", "pytest", "-p", "no:cacheprovider", "--assignment-report", str(report), *args], copy)
    with open(report) as f:
        return code, out, json.load(f)


# ---------------------------------------------------------------- the markers

def test_every_assignment_has_regions_tests_and_a_one_line_spec():
    regions, tests = assignments.find_regions(), assignments.find_tests()
    assert len(ASSIGNMENTS) >= 12
    assert {r.name for r in regions} == set(ASSIGNMENTS), "an assignment without a region in the source"
    assert all(tests[name] for name in ASSIGNMENTS), [n for n in ASSIGNMENTS if not tests[n]]
    files = {r.path for r in regions}
    for lesson_file in ("model.py", "tokenizer.py", "cache.py", "scheduler.py", "sampler.py", "speculative.py",
                        "quantize.py", "kernels.py", "parallel.py", "serve.py"):
        assert lesson_file in files, f"no assignment in {lesson_file}: every lesson of the tour needs one"
    for name, a in ASSIGNMENTS.items():
        assert '"' not in a.spec and "\\" not in a.spec and "\n" not in a.spec, f"{name}: the spec goes in a string"
        assert assignments.message(name, tests).startswith(f"assignment {name}: ")
    assert all(m in ASSIGNMENTS for members in GROUPS.values() for m in members)
    assert assignments.expand(["engine", "sampler", "rmsnorm-rope"])[-1] == "sampler", "groups expand, no repeats"


def test_the_assignments_can_be_done_in_order():
    """A student doing the assignments in the order of the list never has a test blocked by a
    later one: every test runs through its own assignment and earlier ones only (a test that needs
    several is graded to the last of them)."""
    late = assignments.later_needs(ROOT)
    assert not late, "tests that need a later assignment:\n" + "\n".join(
        f"  {g}: {t} needs {', '.join(n)}" for g, t, n in late)
    graded = {t for tests in assignments.find_tests(ROOT).values() for t in tests}
    assert all(len(g) <= 1 for g, _ in assignments.test_needs(ROOT).values()), "one assignment per test"
    assert graded, "the tests were found"


def test_broken_markers_are_refused_with_their_line(tmp_path):
    (tmp_path / "tests").mkdir()
    for text, error in [("def f():\n    # assignment: nonsense\n    pass\n    # end assignment\n", "unknown assignment"),
                        ("def f():\n    # assignment: bpe\n    pass\n", "no '# end assignment'"),
                        ("def f():\n    pass\n    # end assignment\n", "without an '# assignment:'")]:
        (tmp_path / "m.py").write_text(text)
        with pytest.raises(SystemExit, match=f"m.py:[23]: .*{error}|{error}"):
            assignments.find_regions(str(tmp_path))


def test_list_names_every_assignment_with_its_files_lesson_and_tests():
    code, out = run(["tests/assignments.py", "list"], ROOT)
    lines = out.splitlines()
    assert code == 0 and [line.split()[0] for line in lines] == list(ASSIGNMENTS)
    assert "cache.py:BlockManager.reserve, BlockManager.fork " in lines[list(ASSIGNMENTS).index("copy-on-write")]
    assert all(" | lesson " in line and "test_" in line for line in lines)


# ---------------------------------------------------------------- a student version

@pytest.fixture(scope="module")
def student(tmp_path_factory):
    out = tmp_path_factory.mktemp("student") / "repo"
    regions = assignments.write_copy(ROOT, str(out), set(ASSIGNMENTS))
    return out, regions


def test_student_version_holds_no_solution(student):
    out, regions = student
    files = assignments.repo_files(str(out))
    assert files == assignments.repo_files(ROOT), "the same files as the repository (its tracked ones)"
    assert not any(part in (".git", "__pycache__", ".pytest_cache") for f in files for part in f.split(os.sep))
    assert not os.path.exists(out / ".git")
    assert assignments.leaks(ROOT, str(out), regions) == []
    assert assignments.unfinished(str(out)) == set(ASSIGNMENTS)
    blanked = assignments.find_regions(str(out))             # the markers stay, around one raise each
    assert [(r.path, r.name) for r in blanked] == [(r.path, r.name) for r in regions]
    assert all(r.end == r.begin + 2 for r in blanked)
    with open(out / "cache.py") as f:
        text = f.read()
    assert "popitem(last=False)" not in text and "ref_count[block] -= 1" not in text
    code, listed = run(["tests/assignments.py", "list"], out)
    assert code == 0 and len(listed.splitlines()) == len(ASSIGNMENTS), "the tool still works there"


@pytest.mark.timeout(600)
def test_student_version_collects_with_the_same_markers(student, tmp_path):
    out, _ = student
    code, text, results = pytest_in(out, tmp_path / "report.json", "--collect-only", "-q")
    assert code == 0 and "error" not in text.lower().split("collected")[-1], text[-3000:]
    collected = {name: sorted({nodeid.split("[")[0] for nodeid, r in results.items() if name in r["assignments"]})
                 for name in ASSIGNMENTS}
    parsed = {name: sorted(t) for name, t in assignments.find_tests(ROOT).items()}
    assert collected == parsed, "the markers pytest sees differ from those tests/assignments.py reads"
    assert len(results) > 300, "the whole suite collects"


@pytest.mark.timeout(600)
def test_student_version_fails_exactly_the_blanked_assignments_tests(student, tmp_path):
    out, _ = student
    code, text, results = pytest_in(out, tmp_path / "report.json", *SELECTION)
    assert code == 1 and results, text[-3000:]
    for nodeid, r in results.items():
        if r["assignments"]:          # an assignment's test: its own NotImplementedError, or blocked by another
            assert r["status"] in ("todo", "blocked"), f"{nodeid}: {r}"
            assert r["status"] != "todo" or set(r["by"]) <= set(r["assignments"]), f"{nodeid}: {r}"
        else:                         # any other test passes, or waits for an assignment
            assert r["status"] in ("passed", "skipped", "blocked"), f"{nodeid}: {r}"
    failed = sorted(line.split()[1] for line in text.splitlines() if line.startswith("FAILED "))
    assert failed == sorted(n for n, r in results.items() if r["status"] == "todo"), "failures are the todo ones"
    assert all(r["message"].startswith(f"NotImplementedError: assignment {r['by'][0]}: ")
               for r in results.values() if r["status"] == "todo")
    todo = {b for r in results.values() if r["status"] == "todo" for b in r["by"]}
    assert {"bpe", "kv-cache-bytes", "rejection-sampling", "ngram-drafter"} <= todo
    summary = text.split("= assignments =")[1]
    assert "bpe" in summary and "not attempted" in summary and "blocked by" in text


@pytest.mark.timeout(600)
def test_the_grade_is_the_same_on_two_processes(student, tmp_path):
    """README's `python -m pytest -n 2` (pytest-xdist): the workers send each test's assignments
    and status to the controller with the report, so its grade and JSON report are the serial run's."""
    out, _ = student
    runs = [pytest_in(out, tmp_path / f"{n}.json", "tests/test_cache.py", "-n", n) for n in ("0", "2")]
    (_, serial, r0), (_, parallel, r2) = runs
    assert r2 == r0, "the JSON report differs on two processes"
    grade = [text.split("= assignments =")[1].split("\n=")[0] for text in (serial, parallel)]
    assert grade[0] == grade[1] and "blocked by kv-cache-bytes" in grade[0], grade


# ---------------------------------------------------------------- check

@pytest.mark.timeout(1800)
def test_check_passes_on_cheap_assignments():
    cheap = [a for a in CHEAP if a != "ngram-drafter"]          # two suffice, on two files: faster
    files = [f for f in SELECTION if f != "tests/test_speculative.py"]
    code, out = run(["tests/assignments.py", "check", "--only", ",".join(cheap), "--", *files], ROOT,
                    timeout=1800)
    assert code == 0, out
    lines = out.splitlines()
    assert "(nothing blanked)" in lines[1] and " ok " in lines[1]
    for name, line in zip(cheap, lines[2:]):
        assert line.startswith(name) and " ok " in line and "own tests fail with its NotImplementedError" in line
    assert lines[-1].startswith("check: ok")


# A catalog of three: a real bug (caught), a harmless edit no test can see
# (NOT CAUGHT) and a patch whose old text is gone (NOT APPLIED).
CATALOG = '''
from mutants import Bug
BUGS = [
    Bug("kv-cache-bytes", "cache.py", "forgets the factor 2",
        "return 2 * cfg.kv_layers * cfg.n_kv_heads", "return cfg.kv_layers * cfg.n_kv_heads"),
    Bug("kv-cache-bytes", "cache.py", "rewords a docstring",
        "How many blocks of `block_size` tokens fit in `budget_bytes`.", "Blocks that fit."),
    Bug("kv-cache-bytes", "cache.py", "patches code that is not there", "return 3 * cfg.n_layers", "return 0"),
]
'''


@pytest.mark.timeout(600)
def test_mutants_reports_caught_not_caught_and_not_applied(tmp_path):
    catalog = tmp_path / "catalog.py"
    catalog.write_text(CATALOG)
    env_path = os.pathsep.join([os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "tests/assignments.py", "mutants", "--only", "kv-cache-bytes",
                        "--catalog", str(catalog)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": env_path})
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    lines = [line for line in out.splitlines() if line.startswith("kv-cache-bytes")]
    assert len(lines) == 3, out
    assert " caught " in lines[0] and "forgets the factor 2: by tests/test_cache.py::test_" in lines[0], lines[0]
    assert " NOT CAUGHT " in lines[1] and "rewords a docstring" in lines[1], lines[1]
    assert " NOT APPLIED " in lines[2] and "found 0 times" in lines[2], lines[2]
    assert out.splitlines()[-1].startswith("mutants: 1 of 3 caught"), out


def test_catalog_has_three_bugs_per_assignment_that_apply():
    """Every assignment has at least 3 catalogued bugs, each patching text
    that occurs exactly once (the whole run is the slow one the README names)."""
    bugs = assignments.load_bugs(os.path.join(ROOT, "tests", "mutants.py"))
    assert all(sum(b.assignment == n for b in bugs) >= 3 for n in ASSIGNMENTS), "3 bugs per assignment"
    for b in bugs:
        with open(os.path.join(ROOT, b.file), encoding="utf-8") as f:
            assert f.read().count(b.old) == 1, f"{b.assignment}: {b.mistake}: old text not found exactly once"
        assert b.old != b.new and b.mistake


NOT_INDEPENDENT = '''
import pytest
import torch
from helpers import tiny_config

from cache import kv_cache_bytes


def bytes_or_none():
    try:
        return kv_cache_bytes(tiny_config(), torch.float32)
    except NotImplementedError:        # the message of the blanked assignment is lost
        return None


def test_hides_the_error_of_another_assignment():
    assert bytes_or_none() == 2 * 2 * 2 * 16 * 4


@pytest.mark.needs("kv-cache-bytes")
def test_declares_what_it_needs():
    assert bytes_or_none() == 2 * 2 * 2 * 16 * 4


@pytest.mark.assignment("kv-cache-bytes")
def test_never_reaches_its_assignment():
    assert tiny_config().n_layers == 2
'''


@pytest.mark.timeout(600)
def test_check_fails_on_a_test_that_is_not_independent(tmp_path):
    repo = tmp_path / "repo"
    assignments.write_copy(ROOT, str(repo), set())
    (repo / "tests" / "test_zz_not_independent.py").write_text(NOT_INDEPENDENT)
    code, out = run(["tests/assignments.py", "check", "--only", "kv-cache-bytes", "--no-baseline", "--",
                     "tests/test_zz_not_independent.py"], repo)
    assert code == 1 and "check: FAILED" in out, out
    assert "test_hides_the_error_of_another_assignment: failed" in out
    assert "test_never_reaches_its_assignment: passed, but as a test of kv-cache-bytes it must fail" in out
    assert "test_declares_what_it_needs" not in out, "a declared need is reported blocked, not failed"
    assert "1 blocked" in out
