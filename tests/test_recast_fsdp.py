"""recast_weights under FSDP2 (fully_shard: parameters resharded after forward, gathered again in
backward) and DDP, 2 CPU ranks (gloo), bf16 autocast: a few SGD steps give bit-identical parameters
with and without the recast (the recast reads the gathered parameter in backward, unmodified)."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from _dist import spawn  # noqa: E402

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def _steps(rank, world, wrapper, recast):
    import leanact
    from leanact.memory import SavedTensorMeter
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel
    from test_parallel_tp import batch, build, full

    model = build("llama", patch=False)
    leanact.patch(model, recast_weights=recast)
    if wrapper == "ddp":
        run = DistributedDataParallel(model)
    else:
        for layer in model.model.layers:
            fully_shard(layer)
        run = fully_shard(model)
    opt = torch.optim.SGD(run.parameters(), lr=0.5, momentum=0.9)
    mine = {k: v.chunk(world)[rank] for k, v in batch("llama", b=4, s=12).items()}
    copies = []
    for _ in range(3):
        meter = SavedTensorMeter(model)
        with meter, torch.autocast("cpu", dtype=torch.bfloat16):
            loss = run(**mine).loss
        loss.backward()
        copies.append(meter.weight_copy_bytes)
        opt.step()
        opt.zero_grad()
    return {n: full(p.detach()).clone() for n, p in model.named_parameters()}, copies


def _cases(rank, world):
    return {(w, r): _steps(rank, world, w, r) for w in ("fsdp", "ddp") for r in (False, True)}


def test_fsdp2_and_ddp_steps_bit_identical_with_recast():
    for result in spawn(_cases, timeout=400):
        for wrapper in ("fsdp", "ddp"):
            (off, copies_off), (on, copies_on) = result[wrapper, False], result[wrapper, True]
            assert min(copies_off) > 0 and copies_on == [0, 0, 0], (wrapper, copies_off, copies_on)
            assert off.keys() == on.keys()
            for name in off:
                assert torch.equal(off[name], on[name]), (wrapper, name)
