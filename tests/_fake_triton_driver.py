"""A Triton driver for a machine without a GPU: kernels compile for sm_90 (Triton's bundled ptxas)
and every launch is recorded instead of run.

:func:`install` makes it Triton's active driver in this process (call it before the first launch,
in a process of its own: it is never taken back). What :class:`Launches` records is exactly what
Triton's ``JITFunction.run`` passes to a compiled kernel's launcher (grid, stream, function,
metadata, hooks, then the arguments), so a test can compare two ways of launching a kernel, and a
benchmark can time the host's side of a launch (tests/test_triton_launch.py,
benchmarks/launch_host.py).
"""
from __future__ import annotations

import torch
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.driver import CudaDriver
from triton.runtime import driver

_SHARED = 232448  # an H100's shared memory per block (bytes)


class Launches(list):
    """The launcher calls made so far: one tuple of positional arguments each (none kept when
    ``keep`` is False: a benchmark's launches)."""

    keep = True

    def append(self, call):
        if self.keep:
            super().append(call)


class _Utils:
    def load_binary(self, name, kernel, shared, device):
        return 1, 2, 32, 0, 1024  # module, function, registers, spills, max threads

    def unload_module(self, module):
        pass

    def get_device_properties(self, device):
        return {"max_shared_mem": _SHARED, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32}


class _Driver(CudaDriver):
    def __init__(self, launches: Launches):
        self.utils = _Utils()
        self.launches = launches
        outer = self

        class Launcher:
            def __init__(self, src, metadata):
                pass

            def __call__(self, *args):
                outer.launches.append(args)

        self.launcher_cls = Launcher

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 7

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_device_capability(self, device=0):
        return 9, 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


def install(keep: bool = True) -> Launches:
    """Make the recording driver Triton's active one; returns the list its launcher appends to
    (``keep=False``: a list that stays empty)."""
    launches = Launches()
    launches.keep = keep
    driver.set_active(_Driver(launches))
    return launches
