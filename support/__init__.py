"""
support/ -- the plumbing the tour skips.

Nothing in this folder is a lesson of the inference lecture. It holds what a
serious engine needs and a student does not need in order to learn inference:
strict checkpoint loading and config validation, the `random:` presets, the
embedded default model's conversion and its cache, the tensor-parallel
process runtime, timing and validation helpers, and the HTTP server's
plumbing (server.py; schema.py, OpenAI's request bodies made from
SamplingParams). Things run by hand (the real clients' harness, the GPU run
scripts) are in scripts/, not here.

The rule: the tour files (model.py, engine.py, ...) may import support/,
and call into it only while something is BUILT (loading a model, constructing
the engine, starting the server or the workers), never on the path of an
engine step. support/ imports nothing of the tour, so imports run one way.
"""
