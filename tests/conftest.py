"""Fixtures shared by several test modules, and how the suite runs under pytest-xdist (``-n auto``)."""
import os
import sys

import pytest

import torch

if os.environ.get("PYTEST_XDIST_WORKER"):  # one intra-op thread per worker: the workers share the cores
    torch.set_num_threads(1)
# Without CUDA the Triton kernel tests run under Triton's interpreter, which must be chosen before
# any kernel is built: set here, first, for the whole process, so that they run in this process
# whatever module imported Triton before them (not in a fresh one each, tests/_triton_run.py).
# Nothing else runs Triton on the CPU (inductor's CPU code is C++).
if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Under xdist (``--dist loadgroup``) the ``slow`` tests are handed out first, so that the short ones
    fill the workers' time at the end instead of one long test. (The distributed modules' tests share
    one worker, which starts one pair of gloo processes for all of them, :func:`dist_results`: their
    ``xdist_group`` marker.)"""
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and module.__name__ in DISTRIBUTED:
            assert item.get_closest_marker("xdist_group") is not None, f"{module.__name__}: mark it xdist_group"
    if os.environ.get("PYTEST_XDIST_WORKER"):  # (every worker sorts the same collection the same way)
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


#: test module -> (function running its distributed cases, seconds they may take on 2 loaded cores)
DISTRIBUTED = {"test_parallel_context": ("_all", 150), "test_parallel_fsdp": ("_all", 170),
               "test_parallel_gpt2": ("_all_cases", 150), "test_parallel_tp": ("_all_cases", 150)}


@pytest.fixture(scope="session")
def dist_results(request, tmp_path_factory):
    """``{module: [rank 0's results, rank 1's results]}`` for the ``CASES`` of every
    ``test_parallel_*`` module collected in this run, all computed by one pair of gloo processes.
    Under xdist the first worker that needs them computes them (its gloo pair busies both cores) and
    the others read them from the run's shared temporary folder: one pair of processes per run, even
    where the ``xdist_group`` marker does not keep these tests on one worker (pytest 9.2 ignores the
    group xdist 3.8 writes into a test's id)."""
    import pickle

    from _dist import run_modules, spawn

    modules = sorted({getattr(item.module, "__name__", "") for item in request.session.items
                      if getattr(item, "module", None) is not None} & set(DISTRIBUTED))

    def compute():
        jobs = [(m, DISTRIBUTED[m][0], sys.modules[m].CASES) for m in modules]
        ranks = spawn(run_modules, jobs, timeout=sum(DISTRIBUTED[m][1] for m in modules))
        return {m: [r[m] for r in ranks] for m in modules}

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return compute()
    from filelock import FileLock  # (a dependency of torch)

    shared = tmp_path_factory.getbasetemp().parent / f"dist_results_{'_'.join(modules)}.pkl"
    with FileLock(str(shared) + ".lock"):
        if shared.is_file():
            return pickle.loads(shared.read_bytes())
        results = compute()
        shared.write_bytes(pickle.dumps(results))
        return results

