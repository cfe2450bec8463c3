"""Tolerances derived from the dtype and the length of the reductions, never from one machine's rounding.

A sum of ``n`` terms in a floating-point format with unit roundoff ``u`` is off from the exact sum
by at most about ``n * u * sum|terms|`` (the classical worst-case bound, Higham's gamma_n). The
tests compare against a float64 "truth" computed from the same (rounded) inputs and bound the error
by ``n * u * magnitude``: the magnitude is the largest absolute value of the truth, and ``n`` the
length of the longest chain of roundings behind an element (the reduction lengths added up along
the computation). Real rounding errors sit one to two orders of magnitude below this worst case on
every CPU (the errors are random-walk-like, ~sqrt(n) u), while a wrong formula misses it by orders
of magnitude.
"""
import torch


def unit_roundoff(dtype):
    """u = eps / 2 of ``dtype`` (2^-24 for fp32, 2^-9 for bf16, 2^-11 for fp16)."""
    return torch.finfo(dtype).eps / 2


def max_error(x, truth):
    return (x.double() - truth.double()).abs().max().item()


def within_rounding_bound(x, truth, dtype, n):
    """|x - truth| <= n * u(dtype) * max|truth| (elementwise max); returns (ok, error, bound)."""
    bound = n * unit_roundoff(dtype) * max(truth.double().abs().max().item(), torch.finfo(dtype).tiny)
    err = max_error(x, truth)
    return err <= bound, err, bound


def assert_same_loss_and_grads(ref, lean, rel, **inputs):
    """One forward and backward of each model on ``inputs`` (with labels): the losses, and every
    nonzero parameter gradient (norm-wise), agree within ``rel`` relative."""
    l_ref, l_lean = ref(**inputs).loss, lean(**inputs).loss
    l_ref.backward()
    l_lean.backward()
    assert abs(l_ref - l_lean) <= rel * abs(l_ref)
    for (name, p), q in zip(ref.named_parameters(), lean.parameters()):
        if p.grad is not None and p.grad.norm() > 0:
            assert (p.grad - q.grad).norm() <= rel * p.grad.norm(), name


def assert_grads_close(want: dict, got: dict, rel: float = 1e-5) -> None:
    """Every gradient of ``want`` ({name: tensor}) in ``got`` within ``rel`` of its norm; a gradient
    that is zero in exact arithmetic (a key projection's bias under softmax; norm below 1e-6 of the
    median) is rounding noise on both sides: within 1e-6 of the median norm instead."""
    assert got.keys() == want.keys(), set(got) ^ set(want)
    median = torch.stack([g.norm() for g in want.values()]).median()
    for name, g in want.items():
        if g.norm() < 1e-6 * median:
            assert (got[name] - g).norm() <= 1e-6 * median, name
        else:
            assert (got[name] - g).norm() <= rel * g.norm(), name
