"""``python benchmarks/gpu_suite``: the suite's command line, also its ``--worker`` processes."""
import pathlib
import sys

if __name__ == "__main__":
    _PACKAGE = pathlib.Path(__file__).resolve().parent
    # this checkout's leanact first, then the package by its name from benchmarks/ (its folder, which
    # Python put first, is left out: its modules are no top-level modules)
    sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != _PACKAGE]
    sys.path[:0] = [str(_PACKAGE.parent.parent), str(_PACKAGE.parent)]

from gpu_suite.common import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
