"""nnsight interoperability: reads through RecurscopeNNsight equal run_with_cache, writes and batched donor->recipient
patches equal the same patches done with TransformerLens hooks, and bad use fails with a clear error."""
from __future__ import annotations

import re
import runpy
from pathlib import Path

import nnsight
import pytest
import torch

from recurscope.hooks.nnsight import RecurscopeNNsight
from recurscope.hooks.patches import ReadoutReplace, StateReplace, WriteScale, run_with_patches
from recurscope.hooks.points import hook_name, names_for
from recurscope.interp.models import ModelConfig, RecurrentLM

T = 10
TOL = 1e-5

CONFIGS = {
    "gla": dict(model_type="gla", num_heads=2),
    "gdn": dict(model_type="gated_deltanet", num_heads=2, head_dim=16, use_short_conv=True),
    "gdn2_qed": dict(model_type="gated_deltanet2", num_heads=2, head_dim=16, erase_arm="full"),
    "hybrid_gdn": dict(model_type="gated_deltanet", num_heads=2, head_dim=16, attn={"layers": [1], "num_heads": 2}),
}


def _model(kind: str, seed: int = 0) -> RecurrentLM:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, **CONFIGS[kind])
    return RecurrentLM(ModelConfig.from_dict(cfg)).eval()


def _tokens(seed: int, length: int = T) -> torch.Tensor:
    return torch.randint(0, 50, (1, length), generator=torch.Generator().manual_seed(seed))


def _maxdiff(a, b) -> float:
    return float((a - b).detach().abs().max())


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_reading_every_hook_point_equals_run_with_cache(kind):
    model = _model(kind)
    tokens, positions = _tokens(1), [3, 8]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, state_positions=positions)
    # The documented vocabulary and the cache agree, so reading the cache's names reads every kind of hook point.
    assert set(cache.keys()) == names_for(model)
    order = list(cache.keys())   # hooks fire (and are cached) in execution order; nnsight reads must follow it
    model_nn = RecurscopeNNsight(model)
    read = {}   # filled inside the trace (the body runs on a copy of the locals, which shares this dict)
    with torch.no_grad():
        with model_nn.trace(tokens, state_positions=positions):
            for name in order:
                read[name] = model_nn.get(name).output.save()
            logits = model_nn.output.save()
    with torch.no_grad():   # the trace ran without autograd; the kernel's autograd path may round differently
        plain = model(tokens)
    assert _maxdiff(logits, plain) == 0.0
    for name in order:
        assert read[name].shape == cache[name].shape, name
        assert _maxdiff(read[name], cache[name]) < TOL, name
    # The gating hooks are gone after the trace: a plain forward is as before.
    assert all(not point._forward_hooks for point in model.hook_dict.values())


def test_plain_nnsight_reads_and_writes_hook_state():
    # The mixers call every hook point on every forward, so nnsight's forward replacement sees hook_state too.
    model = _model("gla")
    tokens = _tokens(2)
    plain = nnsight.NNsight(model)
    _, cache = model.run_with_cache(tokens, state_positions=[4])
    with torch.no_grad():
        with plain.trace(tokens, state_positions=[4]):
            state = plain.blocks[0].mixer.hook_state.output.save()
        with plain.trace(tokens, state_positions=[4]):
            plain.blocks[0].mixer.hook_state.output[:, 0, 1] = 0.0
            patched = plain.output.save()
    assert _maxdiff(state, cache[hook_name("hook_state", 0)]) < TOL
    clean = model(tokens)
    assert (patched - clean)[:, 4:].abs().max() > 1e-4 and (patched - clean)[:, :4].abs().max() < TOL


def test_writing_head_out_equals_tl_hook():
    model = _model("gdn")
    tokens, layer, head, pos = _tokens(3), 1, 1, 6

    def zero_head(o, hook=None):
        o = o.clone()
        o[:, pos, head] = 0.0
        return o

    model_nn = RecurscopeNNsight(model)
    with torch.no_grad():
        with model_nn.trace(tokens):
            model_nn.blocks[layer].mixer.hook_head_out.output[:, pos, head] = 0.0       # in place
            in_place = model_nn.output.save()
        with model_nn.trace(tokens):
            point = model_nn.blocks[layer].mixer.hook_head_out
            point.output = zero_head(point.output)                                     # replaced
            replaced = model_nn.output.save()
        reference = model.run_with_hooks(tokens, fwd_hooks=[(hook_name("hook_head_out", layer), zero_head)])
        clean = model(tokens)
    assert _maxdiff(in_place, reference) < TOL
    assert _maxdiff(replaced, reference) < TOL
    assert _maxdiff(reference[:, pos], clean[:, pos]) > 1e-4
    assert _maxdiff(reference[:, pos + 1:], clean[:, pos + 1:]) < TOL    # a readout patch does not carry forward


def test_writing_write_scale_equals_write_scale_patch():
    model = _model("gdn2_qed")
    tokens, layer, head, pos = _tokens(4), 0, 1, 2
    model_nn = RecurscopeNNsight(model)
    with torch.no_grad():
        with model_nn.trace(tokens):
            model_nn.blocks[layer].mixer.hook_write_scale.output[:, pos, head] = 0.0
            blocked = model_nn.output.save()
        reference = run_with_patches(model, tokens, [WriteScale(layer, head, pos)])
        clean = model(tokens)
    assert _maxdiff(blocked, reference) < TOL
    assert _maxdiff(reference[:, pos:], clean[:, pos:]) > 1e-4


def test_in_place_write_key_edit_keeps_the_erase():
    # An in-place edit of hook_write_key must change only the write, as a TL hook returning a new tensor does.
    model = _model("gdn")
    tokens, layer, head, pos = _tokens(5), 0, 0, 4

    def flip(u, hook=None):
        u = u.clone()
        u[:, pos, head] = -u[:, pos, head]
        return u

    model_nn = RecurscopeNNsight(model)
    with torch.no_grad():
        with model_nn.trace(tokens):
            u = model_nn.blocks[layer].mixer.hook_write_key.output
            u[:, pos, head] = -u[:, pos, head]
            edited = model_nn.output.save()
        reference = model.run_with_hooks(tokens, fwd_hooks=[(hook_name("hook_write_key", layer), flip)])
        clean = model(tokens)
    assert _maxdiff(edited, reference) < TOL
    assert _maxdiff(reference, clean) > 1e-4


@pytest.mark.parametrize("kind,layer", [("gla", 1), ("gdn", 0), ("gdn2_qed", 1), ("hybrid_gdn", 0)])
def test_donor_to_recipient_state_patch_in_one_trace_equals_tl(kind, layer):
    model = _model(kind)
    donor, recipient, head, t = _tokens(10), _tokens(11), 1, 6
    model_nn = RecurscopeNNsight(model)
    with torch.no_grad():
        with model_nn.trace(state_positions=[t]) as tracer:
            barrier = tracer.barrier(2)
            with tracer.invoke(donor):
                donor_state = model_nn.blocks[layer].mixer.hook_state.output[:, 0].clone().save()
                barrier()   # before reading anything later in the forward, or the recipient never gets past it
                donor_logits = model_nn.output.save()
            with tracer.invoke(recipient):
                barrier()
                model_nn.blocks[layer].mixer.hook_state.output[:, 0, head] = donor_state[:, head]
                patched = model_nn.output.save()
        _, cache = model.run_with_cache(donor, state_positions=[t])
        tl_donor_state = cache[hook_name("hook_state", layer)][:, 0]
        reference = run_with_patches(model, recipient, [StateReplace(layer, head, t, tl_donor_state)])
        clean = model(recipient)
    assert donor_state.shape == tl_donor_state.shape
    assert _maxdiff(donor_state, tl_donor_state) < TOL
    assert patched.shape == reference.shape == (1, T, 50)
    assert _maxdiff(patched, reference) < TOL
    assert _maxdiff(patched[:, t:], clean[:, t:]) > 1e-4
    assert _maxdiff(donor_logits, model(donor)) < TOL     # the donor's row is untouched by the recipient's patch


def test_batched_readout_patch_equals_readout_replace():
    model = _model("gla")
    donor, recipient, layer, head, pos = _tokens(20), _tokens(21), 0, 1, 5
    model_nn = RecurscopeNNsight(model)
    with torch.no_grad():
        with model_nn.trace() as tracer:
            barrier = tracer.barrier(2)
            with tracer.invoke(donor):
                donor_out = model_nn.blocks[layer].mixer.hook_head_out.output.clone()
                barrier()
            with tracer.invoke(recipient):
                barrier()
                model_nn.blocks[layer].mixer.hook_head_out.output[:, pos, head] = donor_out[:, pos, head]
                patched = model_nn.output.save()
        _, cache = model.run_with_cache(donor)
        reference = run_with_patches(model, recipient, [ReadoutReplace(
            layer, head, pos, cache[hook_name("hook_head_out", layer)])])
    assert _maxdiff(patched, reference) < TOL
    assert _maxdiff(reference, model(recipient)) > 1e-4


def _two_invokes(model_nn, first, second, **trace_kwargs):
    with model_nn.trace(**trace_kwargs) as tracer:
        with tracer.invoke(*first[0], **first[1]):
            model_nn.output.save()
        with tracer.invoke(*second[0], **second[1]):
            model_nn.output.save()


def test_bad_use_gives_clear_errors():
    model = _model("gla")
    model_nn = RecurscopeNNsight(model)
    a, short = _tokens(30), _tokens(31, length=T - 3)
    with pytest.raises(ValueError, match=r"equal length.*got lengths \[10, 7\]"):
        _two_invokes(model_nn, ((a,), {}), ((short,), {}))
    with pytest.raises(ValueError, match="integer torch tensor.*float32"):
        _two_invokes(model_nn, ((a,), {}), ((a.float(),), {}))
    with pytest.raises(ValueError, match="state_positions.*differs"):
        _two_invokes(model_nn, ((a,), {"state_positions": [2]}), ((a,), {"state_positions": [3]}))
    with pytest.raises(ValueError, match="expected a recurscope model"):
        RecurscopeNNsight(torch.nn.Linear(2, 2))
    assert all(not point._forward_hooks for point in model.hook_dict.values())
    # After the errors the wrapper still works.
    with model_nn.trace(a):
        out = model_nn.output.save()
    assert _maxdiff(out, model(a)) == 0.0


def test_docs_example_runs(tmp_path):
    text = (Path(__file__).resolve().parents[2] / "docs" / "nnsight.md").read_text()
    section = text.split("## Using nnsight", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    script = tmp_path / "nnsight_example.py"   # nnsight reads the trace body from the source file
    script.write_text(code)
    result = runpy.run_path(str(script), run_name="__main__")
    assert _maxdiff(result["patched_logits"], result["reference"]) < TOL


def test_class_docstring_example_runs_and_equals_the_hook_patch(tmp_path):
    # The example in RecurscopeNNsight's docstring, run as written (with its barrier) on a tiny model.
    import textwrap

    doc = RecurscopeNNsight.__doc__
    start = doc.index("        model_nn = RecurscopeNNsight(model)")
    example = textwrap.dedent(doc[start:doc.index("\n\n", start)])
    assert "barrier()" in example
    model = _model("gla")
    l, head, t = 1, 0, 6
    donor_tokens, recipient_tokens = _tokens(3), _tokens(4)
    scope = dict(RecurscopeNNsight=RecurscopeNNsight, model=model, l=l, head=head, t=t,
                 donor_tokens=donor_tokens, recipient_tokens=recipient_tokens)
    script = tmp_path / "docstring_example.py"   # nnsight reads a trace's body back from its source file
    script.write_text(example)
    with torch.no_grad():
        scope = runpy.run_path(str(script), init_globals=scope)
        _, cache = model.run_with_cache(donor_tokens, state_positions=[t])
        reference = run_with_patches(model, recipient_tokens,
                                     [StateReplace(l, head, t, cache[hook_name("hook_state", l)][:, 0])])
    assert _maxdiff(scope["logits"], reference) < TOL
    assert _maxdiff(reference, model(recipient_tokens)) > 1e-3  # the patch changed something
