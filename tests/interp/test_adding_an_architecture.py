"""docs/adding_a_family.md's steps for a transformers architecture, followed alone: an adapter module written to a
temporary file (its spec, its adapter class and its mixer, a gated delta rule over transformers' Qwen3-Next layer,
written from the steps, not the shipped qwen3_next adapter), registered by patching the registry in place of the
shipped one, with nothing else in recurscope touched. The model it loads is checked against transformers' own
forward, against a hand edit of transformers' cache, and the head scan against one patched forward per head.

Also: the architecture table of docs/adding_a_family.md is the registry's."""
import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import test_bridge as bridge_checks   # its per-layout checks, called here on the throwaway (not collected again)
from test_bridge import _reference, _tokens, tiny_checkpoint
from test_bridge_hybrids import _build

from recurscope.interp.bridge import families as registry
from recurscope.interp.bridge.torch_path import torch_reference_path
from recurscope.interp.loading import load_model

ROOT = Path(__file__).resolve().parents[2]

# Steps 1-3 of "an architecture in transformers' format", as a module of its own
ADAPTER_MODULE = '''
    import torch
    import torch.nn.functional as F

    from recurscope.interp.bridge.adapters.base import GATED_DELTA_KERNELS, TRANSFORMERS_WEIGHTS, BridgeAdapter
    from recurscope.interp.bridge.mixers import BridgedDeltaRule
    from recurscope.interp.models.families import FamilySpec


    class ToyQwen3NextDeltaRule(BridgedDeltaRule):
        """Step 2: the shared gated delta rule; this layer's projections only."""

        def __init__(self, hf_layer):
            super().__init__(hf_layer)
            self._split = type(hf_layer).fix_query_key_value_ordering

        def _project(self, h, cache):
            B, T, _ = h.shape
            q, k, v, z, b, a = self._split(self, self.in_proj_qkvz(h), self.in_proj_ba(h))
            q, k, v = self._conv_qkv(torch.cat([t.reshape(B, T, -1) for t in (q, k, v)], dim=-1), cache)
            g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
            return q, k, v, b.sigmoid(), g, z


    SPEC = FamilySpec(
        name="qwen3_next", title="a throwaway Qwen3-Next adapter (tests only)", weights=TRANSFORMERS_WEIGHTS,
        config_keys=frozenset({"linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                               "linear_value_head_dim", "linear_conv_kernel_dim", "layer_types"}),
        kernel_inputs={"q": "l2norm(silu(conv(q)))", "k": "l2norm(silu(conv(k)))", "x": "beta v",
                       "g": "-exp(A_log) softplus(a + dt_bias)", "a": "beta k"},
        mixer="ToyQwen3NextDeltaRule", mixer_module=__name__,
        state_shape=lambda cfg: (cfg.linear_key_head_dim, cfg.linear_value_head_dim),
        state_heads=lambda cfg: cfg.linear_num_value_heads, paper_family="GDN",
    )


    class ToyQwen3NextAdapter(BridgeAdapter):
        """Step 1: the decoder hybrid's defaults fit (linear_attn, self_attn, pre-norm)."""
        spec = SPEC
        model_types = ("qwen3_next",)
        dispatched = {"transformers.models.qwen3_next.modeling_qwen3_next": GATED_DELTA_KERNELS}


    ADAPTER = ToyQwen3NextAdapter()
'''

@pytest.fixture
def toy_adapter(tmp_path, monkeypatch):
    path = tmp_path / "toy_qwen3_next_adapter.py"
    path.write_text(textwrap.dedent(ADAPTER_MODULE))
    spec = importlib.util.spec_from_file_location("toy_qwen3_next_adapter", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    shipped = tuple(a for a in registry.adapters() if "qwen3_next" not in a.model_types)
    monkeypatch.setattr(registry, "adapters", lambda: shipped + (module.ADAPTER,))
    return module.ADAPTER


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    return tiny_checkpoint("qwen3_next", _build, tmp_path_factory)


def test_the_throwaway_adapter_loads_runs_as_transformers_and_patches(toy_adapter, qwen3_next):
    layout, path, cls = qwen3_next
    model = load_model(path)
    assert model.bridge_family is toy_adapter and model.family is toy_adapter.spec
    assert all(type(model.blocks[l].mixer).__name__ == "ToyQwen3NextDeltaRule" for l in model.recurrent_layers)
    ref = _reference(path, cls)
    tokens = _tokens(model.cfg.vocab_size)
    with torch.no_grad(), torch_reference_path():   # its `dispatched` entry, through the patched registry
        torch.testing.assert_close(model(tokens), ref(input_ids=tokens).logits, rtol=0, atol=1e-5)
    bridge_checks.test_state_patch_equals_a_hand_edit_of_the_transformers_cache(qwen3_next)
    bridge_checks.test_scan_equals_one_full_patched_forward_per_head(qwen3_next)


def test_the_registry_without_the_throwaway_is_unchanged(qwen3_next):
    assert type(load_model(qwen3_next[1]).bridge_family).__name__ == "Qwen3NextAdapter"


def test_the_architecture_table_of_the_docs_is_the_registrys():
    text = (ROOT / "docs" / "adding_a_family.md").read_text()
    table = text.split("<!-- architectures:start -->\n", 1)[1].split("\n<!-- architectures:end -->", 1)[0]
    assert table == registry.render_markdown()
