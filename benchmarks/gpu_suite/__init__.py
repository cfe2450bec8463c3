"""The GPU suite, run as ``python benchmarks/gpu_suite`` (see :mod:`gpu_suite.common`)."""
