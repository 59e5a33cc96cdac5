"""Shared test helpers: the real default model (loaded once per test session)
and tiny random models for fast unit tests."""
import os
import signal
import sys
import threading

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
FIXTURES = os.path.join(ROOT, "tests", "fixtures")

from model import ModelConfig, Transformer, default_model_path, load_model  # noqa: E402

torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))


def tiny_config(**overrides) -> ModelConfig:
    """A 2-layer Llama small enough to run thousands of steps in a test."""
    base = dict(dim=64, n_layers=2, n_heads=6, n_kv_heads=2, head_dim=16, ffn_dim=128, vocab_size=512,
                rope_theta=10000.0, rms_eps=1e-5, tie_embeddings=True, max_seq_len=1024)
    base.update(overrides)
    return ModelConfig(**base)


def tiny_model(seed: int = 0, **overrides) -> Transformer:
    """Random weights, scaled so logits are far from uniform (ties would make
    greedy comparisons meaningless)."""
    torch.manual_seed(seed)
    model = Transformer(tiny_config(**overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.5 if "embed" in name else 0.2)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="session")
def real_path():
    return default_model_path()     # the first call converts the default model: see SLOW_FIXTURES


@pytest.fixture(scope="session")
def real_model(real_path):
    model, _ = load_model(real_path, device="cpu", dtype=torch.float32)
    return model


@pytest.fixture(scope="session")
def real_tokenizer(real_path):
    from tokenizer import Tokenizer
    return Tokenizer.from_pretrained(real_path)


def save_checkpoint(model, directory, tokenizer_from=None):
    """Write a model as a Hugging Face checkpoint directory (config.json +
    model.safetensors), with the default model's tokenizer files."""
    import json
    import shutil

    from safetensors.torch import save_file
    os.makedirs(directory, exist_ok=True)
    c = model.config
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.dim,
           "intermediate_size": c.ffn_dim, "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
           "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_eps,
           "rope_theta": c.rope_theta, "max_position_embeddings": c.max_seq_len, "vocab_size": c.vocab_size,
           "tie_word_embeddings": c.tie_embeddings, "eos_token_id": 2, "bos_token_id": 1}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    sd = {("" if k == "lm_head.weight" else "model.") + k: v.contiguous()
          for k, v in model.state_dict().items() if not (c.tie_embeddings and k == "lm_head.weight")}
    save_file(sd, os.path.join(directory, "model.safetensors"))
    src = tokenizer_from or default_model_path()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, name), directory)
    return str(directory)


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    """A tiny random Llama with SmolLM2's vocabulary and tokenizer: the engine
    runs it in milliseconds per step."""
    return save_checkpoint(tiny_model(seed=0, vocab_size=49152, max_seq_len=2048), tmp_path_factory.mktemp("tiny"))


# ----------------------------------------------------------------------------
# The assignments plugin (tests/assignments.py has the tool and the table)
# ----------------------------------------------------------------------------
# A test says what it grades and what it runs through:
#     @pytest.mark.assignment("sampler")
#     @pytest.mark.needs("engine", "copy-on-write")     # groups: assignments.GROUPS
# An assignment is unfinished while its NotImplementedError is in the source.
# A test that fails with the NotImplementedError of one of its OWN assignments
# is that assignment's work still to do ("todo": a failure). A test that fails
# while ANOTHER unfinished assignment raised (its message is in the traceback
# or in what the test printed: the engine prints a step's error, a server
# thread its traceback) or while one it needs() is unfinished, is reported
# as skipped "blocked by <name>": it cannot grade anything before that is done.
# At the end, one line per assignment: passed, failed, not attempted, blocked.

import json  # noqa: E402

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
    _watchdog_configure(config)
    UNFINISHED.update(assignments.unfinished(ROOT))
    _print_request_failures()


def _print_request_failures():
    """The engine fails a request alone: its output gets finish_reason "error"
    and the message, and the test sees only a wrong output. Print the message
    too, so that a NotImplementedError behind it shows in the test's captured
    output (for the plugin, and for the student reading the failure)."""
    import scheduler
    fail = scheduler.LLM._fail

    def _fail(self, req, message):
        print(f"nanoinfer: request {req.request_id} failed: {message}", file=sys.stderr)
        return fail(self, req, message)
    scheduler.LLM._fail = _fail


def _marked(item, marker: str) -> list[str]:
    return [a for m in item.iter_markers(marker) for a in m.args]


def pytest_collection_modifyitems(config, items):
    _watchdog_limits(config, items)
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
    """A test that needs an unfinished assignment is not run at all: blocked
    (it could only fail, or wait for results that never come)."""
    needed = _blocking(item)
    if needed:
        pytest.skip("blocked by " + ", ".join(sorted(needed)))


def _blocking(item) -> set:
    """The unfinished assignments a test needs, other than those it grades: a
    test of scheduler-step that runs through the "engine" group (which holds
    scheduler-step) must fail with scheduler-step's raise, not be skipped."""
    return (set(assignments.expand(_marked(item, "needs"))) - set(_marked(item, "assignment"))) & UNFINISHED


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    report.assignment_status = ("passed" if report.passed else "skipped", [], False)
    needed = _blocking(item)
    if report.skipped and needed and call.when == "setup":    # skipped above, before it ran
        report.assignment_status = ("blocked", sorted(needed), True)
    if not report.failed:
        return
    own, text = set(_marked(item, "assignment")), _text(report)
    shown = assignments.raised(text, UNFINISHED)
    if own & shown:                                       # its own work, still to do
        report.assignment_status = ("todo", sorted(own & shown), True)
    elif shown or needed:                                 # waits for another assignment
        by = sorted(shown or needed)
        report.assignment_status = ("blocked", by, set(by) <= needed)
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] + 1, "blocked by " + ", ".join(by))
    else:
        report.assignment_status = ("failed", [], False)


def pytest_runtest_logreport(report):
    status, by, declared = getattr(report, "assignment_status", ("failed", [], False))
    r = RESULTS.setdefault(report.nodeid, {"test": report.nodeid.split("/")[-1], "status": "collected",
                                           "by": [], "assignments": [], "declared": False, "message": ""})
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
    if path:
        with open(path, "w") as f:
            json.dump(RESULTS, f, indent=1)


# ----------------------------------------------------------------------------
# The watchdog: a hang is a failure
# ----------------------------------------------------------------------------
# Every test runs under a time limit (pytest-timeout; the default is
# `timeout` in pytest.ini). Method "signal": at the limit a SIGALRM raises
# inside the test, which FAILS with the message below and a traceback showing
# where it was stuck; the run goes on to the next test and prints its
# summary (the "thread" method would end the whole run). So a student bug
# that stops the engine from making progress (a scheduler that never admits
# what waits, a stop-string matcher that never advances) fails its test
# instead of freezing the suite, and `tests/assignments.py mutants` reports
# such a bug as caught by that test.
#
# What a test's clock counts: the test and its function-scoped fixtures. A
# module- or session-scoped fixture is built once for many tests (the real
# model's reference outputs, a checkpoint), so whichever test happens to use
# it first must not pay for it: it sets up on a clock of its own
# (SHARED_FIXTURE_LIMIT, or SLOW_FIXTURES), and the test's clock resumes after.
#
# The limits come from `--durations` on the 2-core CPU VM (2026-11-23). Alone
# on it, the slowest ordinary test took 6 s and the slowest shared fixture
# 11 s; shared with other test runs (load average 3-8: torch's two threads
# then wait on each other), the same took 53 s and 148 s, and once a 3 s test
# took 115 s. Hence 120 s per test (pytest.ini) and 300 s per shared fixture;
# the entries below allow about 10x what they took under load (a cold
# torch.compile cache: 28 s); and a busier machine stretches every limit by
# its load (load_factor), so that slow is not mistaken for stuck (a hang is
# still caught, at most 8x later).
SHARED_FIXTURE_LIMIT = 300
SLOW_FIXTURES = {                   # "module.fixture" -> seconds of its own
    "conftest.real_path": 600,      # the first use on a fresh machine converts the default model
    "test_bench.run": 900,          # one quick run of every bench.py experiment (compiles, spawns)
}
# Tests slow by nature, with limits of their own (seconds): they compile,
# start processes (tensor-parallel workers, serve.py, pytest itself), or run
# the real model through the engine for many steps.
SLOW_TESTS = {
    "tests/test_assignments.py::test_check_passes_on_cheap_assignments": 1800,   # 4 pytest runs
    "tests/test_assignments.py::test_mutants_reports_caught_not_caught_and_not_applied": 600,
    "tests/test_assignments.py::test_student_version_fails_exactly_the_blanked_assignments_tests": 600,
    "tests/test_assignments.py::test_student_version_collects_with_the_same_markers": 300,
    "tests/test_assignments.py::test_check_fails_on_a_test_that_is_not_independent": 600,
    "tests/test_kernels.py::test_compiled_in_place_attention_equals_reference": 300,        # torch.compile
    "tests/test_kernels.py::test_compiled_int8_float32_step_is_float32_arithmetic": 300,
    "tests/test_kernels.py::test_compiled_int8_bf16_step_matches_eager": 300,
    "tests/test_kernels.py::test_compiled_step_pads_into_scratch_and_compiles_once": 300,
    "tests/test_kernels.py::test_compiled_engine_equals_eager_without_recompiling": 300,
    "tests/test_kernels.py::test_compiled_verification_gives_the_eager_tokens": 300,
    "tests/test_kernels.py::test_cuda_graph_steps_equal_eager": 300,     # the capture simulator
    "tests/test_kernels.py::test_cuda_graph_engine_gives_the_eager_tokens": 300,
    "tests/test_kernels.py::test_compiled_steps_through_aot_autograd_alone_equal_eager": 300,
    "tests/test_kernels.py::test_cuda_graph_simulator_catches_a_broken_decoder": 300,
    "tests/test_kernels.py::test_windowed_engine_gives_the_dense_windowed_tokens": 300,     # compiles
    "tests/test_kernels.py::test_windowed_engine_holds_a_long_sequence_in_17_blocks": 300,  # ~500 steps
    "tests/test_quantize.py::test_int8_linear_compiled_equals_linear_on_dequantized_weight": 300,
    "tests/test_parallel.py::test_real_model_n3_greedy_tokens_equal_unsharded": 300,       # worker processes
    "tests/test_parallel.py::test_engine_n2_equals_n1_batched_chunked_preempted": 300,
    "tests/test_parallel.py::test_unguarded_script_runs_tensor_parallel": 300,             # a user's script
    "tests/test_model.py::test_real_gguf_conversion_matches_transformers": 300,             # converts a GGUF
    "tests/test_speculative.py::test_ngram_greedy_is_exact_and_accepts_copies": 300,        # the real model,
    "tests/test_speculative.py::test_ngram_greedy_is_exact_under_preemption": 300,          # many steps
    "tests/test_speculative.py::test_target_as_its_own_draft_accepts_everything": 300,
    "tests/test_speculative.py::test_bad_draft_model_is_exact_and_rolls_back": 300,
    "tests/test_bench.py::test_a_new_user_runs_check_and_quick_to_the_end": 300,        # two bench.py processes
}


def load_factor() -> float:
    """How much slower than alone this machine runs now: the 1-minute load
    average per core, between 1 and 8 (with more runnable threads than
    cores, torch's threads wait on each other whenever one is descheduled)."""
    try:
        return min(8.0, max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1)))
    except (AttributeError, OSError):          # no load average on this platform
        return 1.0


def _watchdog_configure(config):
    """pytest-timeout must be there (a hang would freeze the suite without
    it), and the tables must name tests and fixtures that exist: a renamed
    one would fall back to the default limit without a word."""
    import importlib.util
    if importlib.util.find_spec("pytest_timeout") is None:
        raise pytest.UsageError("the tests run under a watchdog (pytest-timeout), which is not installed: "
                                "pip install -r requirements.txt")
    config.pluginmanager.register(SharedFixtureClock(), "nanoinfer-shared-fixture-clock")
    stale = []
    for key in list(SLOW_TESTS) + [f"tests/{k.split('.')[0]}.py::{k.split('.')[1]}" for k in SLOW_FIXTURES]:
        path, name = key.split("::")
        try:
            with open(os.path.join(ROOT, path), encoding="utf-8") as f:
                stale += [] if f"def {name}(" in f.read() else [key]
        except OSError:
            stale.append(key)
    if stale:               # a warning, in the summary: such a test still runs, under the default limit
        config.issue_config_time_warning(pytest.PytestConfigWarning(
            "tests/conftest.py: SLOW_TESTS/SLOW_FIXTURES name what no longer exists (rename the entries "
            "with their tests): " + ", ".join(stale)), stacklevel=2)


def _watchdog_limits(config, items):
    if config.getoption("timeout", None) == 0:    # --timeout 0: the watchdog is off for every test
        return
    for item in items:      # keyed on the path from the repository root, whatever pytest's rootdir
        name = f"{os.path.relpath(str(item.path), ROOT)}::{getattr(item, 'originalname', item.name)}"
        seconds = SLOW_TESTS.get(name.replace(os.sep, "/"))
        if seconds and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(seconds))


WATCHED: dict = {}      # the clock running now: {"item", "limit", "fixture", "factor"}


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    """pytest-timeout's "signal" method, with a message that names the test
    and says what a timeout means here. Other methods: pytest-timeout's own."""
    if settings.method != "signal" or threading.current_thread() is not threading.main_thread():
        return None
    import pytest_timeout

    def expired(signum, frame):
        __tracebackhide__ = True
        if not settings.disable_debugger_detection and pytest_timeout.is_debugging():
            return                                  # a breakpoint is not a hang
        if threading.active_count() > 1:            # where the other threads are (an engine thread...)
            terminal = item.config.get_terminal_writer()
            terminal.sep("+", title=f"Timeout: {item.nodeid}")
            pytest_timeout.dump_stacks(terminal)
        fixture, limit, factor = WATCHED.get("fixture"), WATCHED.get("limit"), WATCHED.get("factor", 1)
        pytest.fail(f"Timeout: {item.nodeid} ran past its {limit:.0f} s limit"
                    + (f" ({limit / factor:g} s x {factor:.2f} for the machine's load)" if factor > 1 else "")
                    + (f" while setting up the fixture {fixture}" if fixture else "")
                    + ": the code stopped making progress (an endless loop? a request that is never scheduled?);"
                      " the traceback shows where it was (limits: pytest.ini, tests/conftest.py)")

    def cancel():
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        WATCHED.clear()

    item.cancel_timeout = cancel
    factor = load_factor()
    WATCHED.update(item=item, limit=settings.timeout * factor, fixture=None, factor=factor)
    signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, WATCHED["limit"])
    return True


class SharedFixtureClock:
    """A plugin, registered in pytest_configure: pytest calls a conftest's
    pytest_fixture_setup only for fixtures of nodes below its folder, and a
    session fixture belongs to the session, at the repository root."""

    @staticmethod
    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(fixturedef, request):
        yield from _fixture_clock(fixturedef)


def _fixture_clock(fixturedef):
    """A shared fixture (or one of SLOW_FIXTURES) sets up on a clock of its
    own; the test's clock stops meanwhile and resumes where it was."""
    func = getattr(fixturedef, "func", None)
    own = SLOW_FIXTURES.get(f"{getattr(func, '__module__', '')}.{fixturedef.argname}")
    if own is None and fixturedef.scope != "function":
        own = SHARED_FIXTURE_LIMIT
    left = signal.getitimer(signal.ITIMER_REAL)[0] if own and WATCHED else 0.0
    if not left:
        yield
        return
    outer = (WATCHED["limit"], WATCHED["fixture"])
    WATCHED.update(limit=own * WATCHED["factor"], fixture=fixturedef.argname)
    signal.setitimer(signal.ITIMER_REAL, WATCHED["limit"])
    try:
        yield
    finally:
        if WATCHED:                               # the test's clock is still set: resume it
            WATCHED["limit"], WATCHED["fixture"] = outer
            signal.setitimer(signal.ITIMER_REAL, left)
