"""leanact.plan(..., maximize="seq" | "batch"): the largest size whose whole step fits, checked
against a real measured step on the CPU."""
import pytest
import torch
import transformers

import leanact
from leanact.estimate import estimate, measure


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=172, vocab_size=256, max_position_embeddings=8192)
    return leanact.patch(transformers.LlamaForCausalLM(cfg).to(torch.bfloat16))


def _ids(b, s):
    ids = torch.randint(0, 256, (b, s))
    return dict(input_ids=ids, labels=ids)


@pytest.mark.slow
def test_longest_sequence_is_exact_and_measured():
    model = _llama()
    plan = leanact.plan(model, _ids(1, 64), "8MiB", maximize="seq", device="cpu", strategies=["lean", "full"])
    found = plan.maximized
    n = found.value
    assert found.what == "seq" and n % 128 == 0 and n > 0 and found.by_strategy["full"] >= found.by_strategy["lean"]
    assert plan.choices == [found.strategy] * 2 and found.estimate.peak <= 8 * 2**20
    strategy = None if found.strategy == "lean" else found.strategy
    assert estimate(model, _ids(1, n + 128), strategy, "cpu").peak > 8 * 2**20  # the next size does not fit
    real = measure(model, _ids(1, n), plan)  # the prediction holds for a real step
    assert abs(real.peak - found.estimate.peak) <= 0.05 * real.peak


@pytest.mark.slow
def test_largest_batch_and_errors():
    model = _llama()
    # on CUDA the step also holds two 32 MiB cuBLAS workspaces, and the search keeps a reserve free
    plan = leanact.plan(model, _ids(2, 64), "80MiB", maximize="batch", device="cuda", strategies=["lean"])
    found = plan.maximized
    b, limit = found.value, found.limit
    assert found.reserve == 10 * 2**20 and limit == 70 * 2**20  # an eighth of a budget this small
    assert b > 0 and estimate(model, _ids(2, 64), None, "cuda", batch=b).peak <= limit
    assert estimate(model, _ids(2, 64), None, "cuda", batch=b + 1).peak > limit
    with pytest.raises(ValueError, match="maximize='tokens'"):
        leanact.plan(model, _ids(2, 64), "4MiB", maximize="tokens")
    with pytest.raises(ValueError, match="unknown"):
        leanact.plan(model, _ids(2, 64), "4MiB", maximize="seq", strategies=["nope"])
    assert leanact.plan(model, _ids(2, 64), "1KiB", maximize="batch", strategies=["lean"]).maximized.value == 0
