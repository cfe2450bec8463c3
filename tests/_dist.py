"""Run a function on N CPU processes with the gloo backend (for the leanact.parallel tests).

``spawn(fn, *args, world_size=2, timeout=60)`` starts ``world_size`` processes
(``torch.multiprocessing`` spawn), each with a gloo process group whose collectives time out
after ``timeout`` seconds, calls ``fn(rank, world_size, *args)`` and returns the list of the
ranks' return values (anything ``torch.save`` can write). A rank that raises, hangs or dies
fails the caller with the rank's traceback; every process is killed after ``timeout`` seconds.
``fn`` must be importable (module level). The same code runs under torchrun with NCCL:
only the backend and device differ.

``run_modules(rank, world_size, jobs)`` runs several test modules' cases in the same processes
(``jobs``: ``(module, function, cases)``): starting processes and importing torch and transformers
cost most of a distributed test's time on a small machine, so the ``dist_results`` fixture
(tests/conftest.py) starts one pair of processes for every ``test_parallel_*`` module of a run.
"""
from __future__ import annotations

import datetime
import importlib
import os
import socket
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, fn, args, world_size, port, timeout, outdir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        result = fn(rank, world_size, *args)
        torch.save({"ok": result}, os.path.join(outdir, f"{rank}.pt"))
    except BaseException:
        torch.save({"error": traceback.format_exc()}, os.path.join(outdir, f"{rank}.pt"))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn, *args, world_size: int = 2, timeout: float = 60.0):
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(_worker, args=(fn, args, world_size, _free_port(), timeout, outdir),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{fn.__name__} on {world_size} ranks did not finish in {timeout} s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException):
            pass  # the rank's own traceback is reported below
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results = []
        for rank in range(world_size):
            path = os.path.join(outdir, f"{rank}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {rank} of {fn.__name__} exited without a result")
            out = torch.load(path, weights_only=False)
            if "error" in out:
                raise RuntimeError(f"rank {rank} of {fn.__name__} failed:\n{out['error']}")
            results.append(out["ok"])
        return results


def run_modules(rank: int, world_size: int, jobs: list[tuple[str, str, list]]) -> dict:
    """``{module: function(rank, world_size, cases) or {"error": traceback}}`` for each job: one
    module's failure is reported to that module's tests only."""
    out = {}
    for module, function, cases in jobs:
        try:
            out[module] = getattr(importlib.import_module(module), function)(rank, world_size, cases)
        except Exception:
            out[module] = {"error": traceback.format_exc()}
    return out


def distributed_results(dist_results, module: str) -> list:
    """One module's results from :func:`dist_results`; a rank's error fails that module's tests."""
    for rank, r in enumerate(dist_results[module]):
        if isinstance(r, dict) and set(r) == {"error"}:
            raise RuntimeError(f"rank {rank} of {module}'s distributed cases failed:\n{r['error']}")
    return dist_results[module]
