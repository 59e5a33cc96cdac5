"""Shared test helpers: the real default model (loaded once per test session)
and tiny random models for fast unit tests."""
import os
import sys

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
    return default_model_path()


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
    needed = set(assignments.expand(_marked(item, "needs"))) & UNFINISHED
    if needed:
        pytest.skip("blocked by " + ", ".join(sorted(needed)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    report.assignment_status = ("passed" if report.passed else "skipped", [], False)
    needed = set(assignments.expand(_marked(item, "needs"))) & UNFINISHED
    if report.skipped and needed and call.when == "setup":    # skipped above, before it ran
        report.assignment_status = ("blocked", sorted(needed), True)
    if not report.failed:
        return
    own, text = set(_marked(item, "assignment")), _text(report)
    shown = assignments.raised(text, UNFINISHED)
    needed = set(assignments.expand(_marked(item, "needs"))) & UNFINISHED
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
