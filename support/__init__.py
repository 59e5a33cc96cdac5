"""
support/ -- the plumbing the tour skips.

Nothing in this folder is a lesson of the inference lecture. It holds what a
serious engine needs and a student does not need in order to learn inference:
strict checkpoint loading and config validation, the `random:` presets, the
embedded default model's conversion and its cache, the tensor-parallel
process runtime, timing and validation helpers.

The rule: the tour files (model.py, scheduler.py, ...) may import support/,
and call into it only while something is BUILT (loading a model, constructing
the engine, starting the server or the workers), never on the path of an
engine step. support/ imports nothing of the tour, so imports run one way.
"""
