"""The forward's hot path (issue 10 item 5): without hooks a forward reads one value back to the host (the token
range check at the top), whatever the number of layers; patches are found by whether a hook point is intercepted,
and finiteness checks run only under `model.debug`. Host reads are counted by wrapping the Tensor methods that make
them (on a GPU each is a stream sync)."""
import pytest
import torch

from recurscope import kernels
from recurscope.hooks import WriteScale, hook_name, is_intercepted, run_with_patches
from tests.interp.helpers_models import tiny_model

_READS = ("__bool__", "item", "tolist", "__int__", "__float__", "__index__")


@pytest.fixture
def host_reads(monkeypatch):
    count = {"n": 0}
    for name in _READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            count["n"] += 1
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    original_equal = torch.equal

    def equal(*args, **kwargs):
        count["n"] += 1
        return original_equal(*args, **kwargs)
    monkeypatch.setattr(torch, "equal", equal)
    return count


def _tokens(model, T=12):
    return torch.randint(0, model.cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", ["gla", "gdn", "qed", "gdn_hybrid"])
def test_a_forward_without_hooks_reads_the_host_once(family, host_reads):
    reads = {}
    for layers in (2, 4):
        model = tiny_model(family, layers=layers)
        model.set_backend("reference")   # the chunked kernel's own reads are the kernel's business
        tokens = _tokens(model)
        with torch.no_grad():
            host_reads["n"] = 0
            model(tokens)
            reads[layers] = host_reads["n"]
            model.debug = True
            host_reads["n"] = 0
            model(tokens)
            reads[(layers, "debug")] = host_reads["n"]
    assert reads[2] == reads[4] == 1
    assert reads[(4, "debug")] > reads[(2, "debug")] > 1     # the debug checks run per layer


def test_debug_flag_reaches_every_recurrent_layer_and_names_a_bad_input():
    model = tiny_model("gdn_hybrid", layers=3)
    assert not model.debug
    model.debug = True
    assert model.debug and all(b.mixer.check_finite for b in model.blocks if b.is_recurrent)

    def poison(g, hook):
        g = g.clone()
        g[0, 3, 0] = float("nan")
        return g
    with pytest.raises(ValueError, match="g contains 1 non-finite"):
        model.run_with_hooks(_tokens(model), fwd_hooks=[(hook_name("hook_decay", 0), poison)])
    model.debug = False
    with torch.no_grad():   # without the flag the NaN flows on, as in any torch model
        out = model.run_with_hooks(_tokens(model), fwd_hooks=[(hook_name("hook_decay", 0), poison)])
    assert bool(torch.isnan(out).any())


def test_recurrence_checks_finiteness_at_its_public_api_unless_asked_not_to():
    q = torch.randn(1, 4, 2, 3)
    g = -torch.rand(1, 4, 2)
    g[0, 1, 0] = float("inf")
    with pytest.raises(ValueError, match="g contains 1 non-finite"):
        kernels.recurrence(q, q, q, g, backend="reference")
    kernels.recurrence(q, q, q, g, backend="reference", check_finite=False)


def test_token_range_is_still_checked_at_the_top():
    model = tiny_model("gla")
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 60\]; got ids in \[0, 61\]"):
        model(torch.tensor([[0, 61]]))


def test_hooks_decide_the_patch_path_and_patches_still_apply():
    model = tiny_model("gdn")
    point = model.hook_dict[hook_name("hook_write_scale", 0)]
    assert not is_intercepted(point)
    tokens = _tokens(model)
    with torch.no_grad():
        clean = model(tokens)
        with model.hooks(fwd_hooks=[(point.name, lambda ws, hook: None)]):   # an observer changes nothing
            assert is_intercepted(point)
            assert torch.equal(model(tokens), clean)
        blocked = run_with_patches(model, tokens, [WriteScale(0, 1, 4)])
    assert not is_intercepted(point)
    assert torch.equal(blocked[:, :4], clean[:, :4]) and (blocked[:, 4:] - clean[:, 4:]).abs().max() > 1e-4
