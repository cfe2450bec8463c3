"""FSDP2 (fully_shard) and DDP on leanact-patched HF models, 2 CPU ranks (gloo), with and without
recompute: a few optimizer steps equal the same steps of one process on the whole batch."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _dist import distributed_results  # noqa: E402
from test_parallel_tp import batch, build, full  # noqa: E402

# slow: the first test waits for every module's distributed cases (tests/conftest.py)
# one xdist worker for every distributed module: one pair of gloo processes (tests/conftest.py)
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow, pytest.mark.xdist_group("distributed")]

STEPS = 3
TOL = 1e-5


def _halves(family, world, rank):
    data = batch(family, b=4, s=12)
    return data, {k: v.chunk(world)[rank] for k, v in data.items()}


def _ref_steps(ref, family, world):
    """One process: the loss is the mean of the per-rank losses (DDP and FSDP average gradients).
    SGD, not Adam: Adam would turn the rounding noise of gradients that are 0 in exact arithmetic
    (key biases) into full-size steps."""
    opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    data, _ = _halves(family, world, 0)
    for _ in range(STEPS):
        loss = sum(ref(**{k: v.chunk(world)[r] for k, v in data.items()}).loss for r in range(world)) / world
        loss.backward()
        opt.step()
        opt.zero_grad()
    return ref


def _recompute(model, how):
    if how == "hf":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif how is not None:
        import leanact.strategies

        leanact.strategies.uniform(model, how).apply(model)
    return model


def _case(world, rank, wrapper, family, recompute):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    model = build(family)
    ref = _ref_steps(copy.deepcopy(model), family, world)
    _recompute(model, recompute)
    if wrapper == "ddp":
        run = DistributedDataParallel(model)
    else:
        layers = model.bert.encoder.layer if family == "bert" else model.model.layers
        for layer in layers:
            fully_shard(layer)
        run = fully_shard(model)
    opt = torch.optim.SGD(run.parameters(), lr=0.5, momentum=0.9)
    _, mine = _halves(family, world, rank)
    for _ in range(STEPS):
        run(**mine).loss.backward()
        opt.step()
        opt.zero_grad()
    refs = {k: v.detach() for k, v in ref.named_parameters()}
    # Key biases start at 0 and their gradient is 0 in exact arithmetic (softmax shift invariance):
    # they stay at rounding-noise size (~1e-9), so they are compared against the median norm.
    scale = torch.stack([v.norm() for v in refs.values()]).median()
    errs = {}
    for name, p in model.named_parameters():
        diff = (full(p.detach()) - refs[name]).norm()
        errs[name] = (diff / (refs[name].norm() if refs[name].norm() > 1e-6 * scale else scale)).item()
    dist.barrier()
    return errs


def _all(rank, world, cases):
    return {case: _case(world, rank, *case) for case in cases}


CASES = [("ddp", "bert", None), ("fsdp", "bert", None), ("fsdp", "llama", None), ("ddp", "bert", "hf"),
         ("fsdp", "bert", "hf"), ("ddp", "bert", "full"), ("fsdp", "bert", "full"), ("fsdp", "llama", "offload")]


@pytest.fixture(scope="module")
def results(dist_results):
    """All cases in one pair of processes, shared with the other distributed test modules
    (tests/conftest.py: starting processes and importing transformers cost most of the time)."""
    return distributed_results(dist_results, __name__)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_training_steps_match_single_process(results, case):
    for r in results:
        bad = {k: v for k, v in r[case].items() if v > TOL}
        assert not bad, bad
