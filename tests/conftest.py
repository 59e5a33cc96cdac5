"""Shared fixtures (the real default model, loaded once per test session; a
tiny random checkpoint), the assignments plugin, and the watchdog's one check.
The helpers the tests import are in tests/helpers.py."""
import importlib.util
import json
import os
import sys

# Before torch loads its OpenMP runtime: threads waiting at a barrier sleep instead of spinning. On
# 2 shared cores a spinning thread holds a core while its partner is descheduled: 8 greedy steps of
# the real model took 2 s alone, 10-23 s beside a busy process, 2 s PASSIVE (assignments.py inherits it).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

from helpers import ROOT, save_checkpoint, tiny_model  # noqa: F401  (ROOT on sys.path)
from model import default_model_path, load_model

# pytest-xdist's workers share the cores: a thread per core each (quantize + scheduler tests, -n 2: 3m43 -> 3m15)
torch.set_num_threads(max(1, min(4, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1)))))


@pytest.fixture(scope="session")
def real_path():
    return default_model_path()     # the first call converts the default model (~6 s)


@pytest.fixture(scope="session")
def real_model(real_path):
    model, _ = load_model(real_path, device="cpu", dtype=torch.float32)
    return model


@pytest.fixture(scope="session")
def real_tokenizer(real_path):
    from tokenizer import Tokenizer
    return Tokenizer.from_pretrained(real_path)


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    """A tiny random Llama with SmolLM2's vocabulary and tokenizer: milliseconds per engine step."""
    model = tiny_model(seed=0, vocab_size=49152, max_seq_len=2048)
    return save_checkpoint(model, tmp_path_factory.mktemp("tiny"))

# ----------------------------------------------------------------------------
# The assignments plugin (tests/assignments.py has the tool and the table). A test says what it
# grades and what it runs through:
#     @pytest.mark.assignment("sampler")
#     @pytest.mark.needs("engine", "copy-on-write")     # groups: assignments.GROUPS
# An assignment is unfinished while its NotImplementedError is in the source. A test failing with
# the raise of one of its OWN assignments is that work still to do ("todo": a failure). A test
# failing while ANOTHER unfinished assignment raised (in the traceback or the printed output: the
# engine prints a step's error, a server thread its traceback), or while one it needs() is
# unfinished, is skipped "blocked by <name>". At the end: one line per assignment.
import assignments  # noqa: E402  (tests/ is on sys.path: pytest puts this conftest's folder there)

UNFINISHED: set = set()    # assignments whose raise is in the source of this run
RESULTS: dict = {}         # nodeid -> status record (see assignments.grade)
RANK = {"collected": 0, "passed": 1, "skipped": 2, "blocked": 3, "todo": 4, "failed": 5}


def pytest_addoption(parser):
    group = parser.getgroup("assignments")
    group.addoption("--assignment", metavar="NAMES", default=None,
                    help="run only the tests of these assignments (comma-separated), e.g. --assignment sampler")
    group.addoption("--assignment-report", metavar="FILE", default=None,
                    help="write each test's assignment status to FILE as JSON (for tests/assignments.py check)")


def pytest_configure(config):
    _require_the_watchdog()
    UNFINISHED.update(assignments.unfinished(ROOT))
    _print_request_failures()


def _print_request_failures():
    """The engine fails a request alone (finish_reason "error"): print its message too, so that a
    NotImplementedError behind it shows in the test's output (for the plugin and the student)."""
    import engine
    fail = engine.LLM._fail

    def _fail(self, req, message):
        print(f"nanoinfer: request {req.request_id} failed: {message}", file=sys.stderr)
        return fail(self, req, message)
    engine.LLM._fail = _fail


def _marked(item, marker: str) -> list[str]:
    return [a for m in item.iter_markers(marker) for a in m.args]


def pytest_collection_modifyitems(config, items):
    known = set(assignments.ASSIGNMENTS) | set(assignments.GROUPS)
    for item in items:
        bad = [n for n in _marked(item, "assignment") + _marked(item, "needs") if n not in known]
        if bad or any(n in assignments.GROUPS for n in _marked(item, "assignment")):
            raise pytest.UsageError(f"{item.nodeid}: unknown assignment(s) {bad or _marked(item, 'assignment')} "
                                    f"in a marker; assignments: {', '.join(assignments.ASSIGNMENTS)}; "
                                    f"groups (needs only): {', '.join(assignments.GROUPS)}")
    only = config.getoption("--assignment")
    if only:
        wanted = set(assignments.chosen_names(only))
        keep = [i for i in items if wanted & set(_marked(i, "assignment"))]
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep


def pytest_collection_finish(session):
    for item in session.items:     # the tests this run will run (so a report lists one that never did)
        RESULTS[item.nodeid] = {"test": item.nodeid.split("/")[-1], "status": "collected", "by": [],
                                "assignments": sorted(set(_marked(item, "assignment"))),
                                "declared": False, "message": ""}


def _text(report) -> str:
    """Everything a failed phase shows: the traceback and the captured output."""
    return "\n".join([report.longreprtext] + [content for _, content in report.sections])


def pytest_runtest_setup(item):
    """A test that needs an unfinished assignment is not run: blocked (it could only fail or wait)."""
    needed = _blocking(item)
    if needed:
        pytest.skip("blocked by " + ", ".join(sorted(needed)))


def _blocking(item) -> set:
    """The unfinished assignments a test needs, other than those it grades: a test of scheduler-step
    run through the "engine" group (which holds it) must fail with its raise, not be skipped."""
    return (set(assignments.expand(_marked(item, "needs"))) - set(_marked(item, "assignment"))) & UNFINISHED


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    # user_properties: what a pytest-xdist worker sends its controller along with the report
    report.user_properties.append(("assignments", sorted(set(_marked(item, "assignment")))))
    report.user_properties.append(("assignment_status", _status(item, call, report)))


def _status(item, call, report) -> tuple:
    """(status, the assignments it is due to, declared) of one phase; a test blocked by another
    assignment's raise becomes a skip."""
    needed = _blocking(item)
    if report.skipped and needed and call.when == "setup":    # skipped above, before it ran
        return ("blocked", sorted(needed), True)
    if not report.failed:
        return ("passed" if report.passed else "skipped", [], False)
    own, text = set(_marked(item, "assignment")), _text(report)
    shown = assignments.raised(text, UNFINISHED)
    if own & shown:                                       # its own work, still to do
        return ("todo", sorted(own & shown), True)
    if shown or needed:                                   # waits for another assignment
        by = sorted(shown or needed)
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] + 1, "blocked by " + ", ".join(by))
        return ("blocked", by, set(by) <= needed)
    return ("failed", [], False)


def pytest_runtest_logreport(report):
    props = dict(report.user_properties)
    status, by, declared = props.get("assignment_status", ("failed", [], False))
    r = RESULTS.setdefault(report.nodeid, {"test": report.nodeid.split("/")[-1], "status": "collected",
                                           "by": [], "assignments": props.get("assignments", []),
                                           "declared": False, "message": ""})
    if RANK[status] > RANK[r["status"]]:                  # a test's status: its worst phase
        crash = getattr(report.longrepr, "reprcrash", None)
        r.update(status=status, by=by, declared=declared,
                 message=(crash.message if crash else "").strip().split("\n")[0][:300])


def pytest_terminal_summary(terminalreporter):
    lines = assignments.summary_lines(RESULTS)
    if lines:
        terminalreporter.section("assignments")
        for line in lines:
            terminalreporter.write_line(line)
        if any(r["status"] in ("todo", "blocked") for r in RESULTS.values()):
            terminalreporter.write_line("(one assignment's tests: python -m pytest --assignment NAME; "
                                        "the order: python tests/assignments.py list)")


def pytest_sessionfinish(session):
    path = session.config.getoption("--assignment-report")
    if path and not hasattr(session.config, "workerinput"):   # (pytest-xdist: the controller writes)
        with open(path, "w") as f:
            json.dump(RESULTS, f, indent=1)


# ----------------------------------------------------------------------------
# The watchdog: a hang is a failure. pytest-timeout runs every test (setup included) under
# `timeout` in pytest.ini (300 s) or its own @pytest.mark.timeout(N); at the limit the test FAILS
# with the stacks of every thread and the run goes on. Without the plugin pytest ignores `timeout`.
def _require_the_watchdog():
    if importlib.util.find_spec("pytest_timeout") is None:
        raise pytest.UsageError("the tests run under a watchdog (pytest-timeout), which is not "
                                "installed: pip install -r requirements.txt")
