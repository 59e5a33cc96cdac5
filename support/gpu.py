"""support/gpu.py -- Triton where it is installed, stand-ins where it is not.

The Triton kernels of the tour (kernels.py, quantize.py) run on CUDA only. A CPU-only
install (the course machines, CI) may lack the triton package: there the kernels are
still defined, by decorators that keep the plain function, and never launched.
"""
try:
    import triton
    import triton.language as tl
    jit, autotune = triton.jit, triton.autotune
except ImportError:  # pragma: no cover (depends on the install)
    triton = tl = None

    def jit(fn):
        return fn

    def autotune(**_):
        return jit


def configs(*shapes, names=("BLOCK_N", "BLOCK_K")) -> list:
    """triton.Config of each (value, ..., num_warps[, num_stages]) tuple ([] without Triton)."""
    if triton is None:  # pragma: no cover (depends on the install)
        return []
    n = len(names)
    return [triton.Config(dict(zip(names, c[:n])), *c[n:]) for c in shapes]
