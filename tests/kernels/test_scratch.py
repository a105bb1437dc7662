"""The chunked kernel's scratch pool: pooled temporaries change no result, never leak into what a call returns, stay
per thread and within the limit, and autograd calls never lease."""
from __future__ import annotations

import threading

import pytest
import torch

from recurscope import kernels
from recurscope.kernels import scratch
from recurscope.kernels.inputs import FAMILIES, family_inputs

from tests.kernels.test_chunked import assert_outputs_close, make_patches

ALL = ("write_scale", "extra_write", "capture", "initial_state")


@pytest.fixture
def pool_everything(monkeypatch):
    """Every temporary through the pool, however small (the tests' shapes are far below MIN_POOLED_BYTES), from an
    empty pool, and the pool emptied afterwards."""
    monkeypatch.setattr(scratch, "MIN_POOLED_BYTES", 0)
    scratch.release_scratch()
    yield
    scratch.release_scratch()


def poison_pool():
    """NaN in every free buffer: a temporary that is read before it is written then shows in the result."""
    for buf in scratch._pool.free:
        buf.fill_(float("nan"))


def storages(result):
    return [t.untyped_storage().data_ptr() for t in result if t is not None]


@pytest.mark.parametrize("features", [(), ALL], ids=["plain", "all"])
@pytest.mark.parametrize("family", FAMILIES)
def test_pooled_calls_match_the_reference_with_stale_buffers(family, features, pool_everything):
    """The second call runs on buffers the first left behind, poisoned with NaN; both match the float64 reference
    (a ragged last chunk included), and the second equals the first bit for bit."""
    B, T, H, K, V = 2, 150, 2, 16, 8
    q, k, x, g, a = family_inputs(family, B, T, H, K, V, seed=11).args()
    kw = make_patches(features, B, T, H, K, V, torch.float64)
    ref = kernels.recurrence(q, k, x, g, a, backend="reference", **kw)
    first = kernels.recurrence(q, k, x, g, a, backend="chunked", **kw)
    assert scratch.pooled_bytes() > 0
    poison_pool()
    second = kernels.recurrence(q, k, x, g, a, backend="chunked", **kw)
    assert_outputs_close(ref, second, atol=1e-10, rtol=1e-10)
    for one, two in zip(first, second):
        assert (one is None and two is None) or torch.equal(one, two)


@pytest.mark.parametrize("family", ["gla", "gdn2"])
def test_float32_strong_decays_and_shorter_calls_on_a_warm_pool(family, pool_everything):
    """float32 on both routes (the chunk-start pivot and, past its range, the sub-block pivots), and a shorter call
    served by larger buffers than it needs: each equals the same call on an empty pool."""
    for T, strength in ((300, 1.0), (70, 1.0), (130, 200.0)):
        q, k, x, g, a = family_inputs(family, 1, T, 2, 16, 8, dtype=torch.float32, seed=T).args()
        kw = make_patches(ALL, 1, T, 2, 16, 8, torch.float32)
        poison_pool()
        warm = kernels.recurrence(q, k, x, g * strength, a, backend="chunked", **kw)
        scratch.release_scratch()
        cold = kernels.recurrence(q, k, x, g * strength, a, backend="chunked", **kw)
        for w, c in zip(warm, cold):
            assert torch.equal(w, c), (T, strength)


def test_what_a_call_returns_is_never_pool_memory(pool_everything):
    """Outputs, final states and captured states own their memory: a later call leaves them as they were."""
    B, H, K, V = 1, 1, 16, 8                             # one head (and one step first): a view would be free
    for T in (1, 64, 150):
        q, k, x, g, a = family_inputs("gdn", B, T, H, K, V, dtype=torch.float32, seed=T).args()
        res = kernels.recurrence(q, k, x, g, a, capture=[T - 1], backend="chunked")
        kept = [t.clone() for t in res]
        pooled = {b.untyped_storage().data_ptr() for b in scratch._pool.free}
        assert pooled and not pooled & set(storages(res))
        q2, k2, x2, g2, a2 = family_inputs("gdn", B, T, H, K, V, dtype=torch.float32, seed=T + 1).args()
        kernels.recurrence(q2, k2, x2, g2, a2, capture=[T - 1], backend="chunked")
        for now, before in zip(res, kept):
            assert torch.equal(now, before)


def test_a_repeated_call_allocates_nothing_new():
    """Same shapes, same buffers: the pool's second call takes exactly the buffers the first returned. At this size
    the temporaries are above MIN_POOLED_BYTES, so this is the default configuration."""
    scratch.release_scratch()
    q, k, x, g, a = family_inputs("gdn2", 1, 512, 2, 64, 64, dtype=torch.float32).args()
    kernels.recurrence(q, k, x, g, a, backend="chunked")
    first = sorted(b.untyped_storage().data_ptr() for b in scratch._pool.free)
    assert first and scratch.pooled_bytes() >= scratch.MIN_POOLED_BYTES
    kernels.recurrence(q, k, x, g, a, backend="chunked")
    assert sorted(b.untyped_storage().data_ptr() for b in scratch._pool.free) == first
    scratch.release_scratch()
    assert scratch.pooled_bytes() == 0


def test_autograd_calls_never_lease(pool_everything):
    q, k, x, g, a = family_inputs("gdn2", 1, 100, 2, 16, 8, dtype=torch.float64).args()
    leaves = [t.clone().requires_grad_() for t in (q, k, x)]
    out = kernels.recurrence(*leaves, g, a, backend="chunked")
    assert scratch.pooled_bytes() == 0
    out.o.sum().backward()
    assert all(t.grad is not None for t in leaves)
    with torch.no_grad():
        kernels.recurrence(*leaves, g, a, backend="chunked")
    assert scratch.pooled_bytes() > 0


def test_limit_bounds_the_pool_and_zero_turns_it_off(pool_everything):
    q, k, x, g, a = family_inputs("gla", 1, 200, 2, 16, 8, dtype=torch.float32).args()
    ref = kernels.recurrence(q, k, x, g, a, backend="chunked")
    full = scratch.pooled_bytes()
    before = scratch.scratch_limit()
    try:
        scratch.set_scratch_limit(full // 2)
        assert 0 < scratch.pooled_bytes() <= full // 2          # trimmed at once
        assert torch.equal(kernels.recurrence(q, k, x, g, a, backend="chunked").o, ref.o)
        assert scratch.pooled_bytes() <= full // 2
        scratch.set_scratch_limit(0)
        assert scratch.pooled_bytes() == 0
        assert torch.equal(kernels.recurrence(q, k, x, g, a, backend="chunked").o, ref.o)
        assert scratch.pooled_bytes() == 0
    finally:
        scratch.set_scratch_limit(before)
    for bad in (-1, 1.5, True, "1GB"):
        with pytest.raises(ValueError, match="scratch limit must be a number of bytes"):
            scratch.set_scratch_limit(bad)
    assert scratch.scratch_limit() == before


def test_a_lease_returns_its_buffers_when_the_block_raises(pool_everything):
    with pytest.raises(RuntimeError, match="inside"):
        with scratch.lease(torch.device("cpu")) as new:
            held = new(100, 100, dtype=torch.float32)
            raise RuntimeError("inside")
    assert [b.untyped_storage().data_ptr() for b in scratch._pool.free] == [held.untyped_storage().data_ptr()]
    with scratch.lease(torch.device("cpu")) as new:          # the smallest buffer that fits, dtype respected
        assert new(50, 100, dtype=torch.float32).untyped_storage().data_ptr() == held.untyped_storage().data_ptr()
        assert new(10, dtype=torch.float64).untyped_storage().data_ptr() != held.untyped_storage().data_ptr()
    with scratch.lease(torch.device("cpu"), enabled=False) as new:
        new(100, 100, dtype=torch.float32)
    assert len(scratch._pool.free) == 2


def test_threads_keep_their_own_pools(pool_everything):
    """Concurrent calls never share a buffer: each thread's results equal the same calls made one after another."""
    cases = [family_inputs(f, 2, 150, 2, 16, 8, dtype=torch.float32, seed=s).args()
             for f, s in (("gdn2", 1), ("gla", 2), ("qed", 3), ("gdn", 4))]
    serial = [kernels.recurrence(*c, backend="chunked").o for c in cases]
    results, errors = {}, []

    def work(i):
        try:
            for _ in range(5):
                results[i] = kernels.recurrence(*cases[i], backend="chunked").o
        except Exception as exc:                              # surfaced below, in the test's own thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i, want in enumerate(serial):
        assert torch.equal(results[i], want), i


@pytest.mark.parametrize("family", ["gla", "gdn2"])
def test_inference_mode_and_no_grad_share_the_pool(family, pool_everything):
    """A buffer first leased under torch.inference_mode() is a normal tensor, so a later call outside it can still
    write it (an inference tensor could not be), and the other way round; every call gives one answer."""
    q, k, x, g, a = family_inputs(family, 1, 100, 2, 16, 8, dtype=torch.float32).args()
    run = lambda: kernels.recurrence(q, k, x, g, a, capture=[5, 99], backend="chunked")  # noqa: E731
    with torch.inference_mode():
        first = run()
    assert first.o.is_inference() and scratch.pooled_bytes() > 0
    assert not any(b.is_inference() for b in scratch._pool.free)
    with torch.no_grad():
        after = run()
    with torch.inference_mode():
        again = run()
    for res in (after, again, run()):
        for one, two in zip(first, res):
            assert torch.equal(one, two)
