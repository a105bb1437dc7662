"""The transformers bridge on Mamba-2 in transformers' format (`Mamba2ForCausalLM`) and its hybrids: Nemotron-H (Mamba-2,
attention and MLP-only blocks), Bamba, Granite-4.0-H, Falcon-H1 (Mamba-2 and attention side by side in every layer)
and Zamba2 (Mamba-2 layers, some fed by one transformer block shared by several depths): tiny random checkpoints
built from transformers' own config classes and saved with save_pretrained.

test_bridge.py's per-layout checks run here again with this module's `checkpoint` fixture (parity with transformers'
torch path with idle hooks, stepping, the state patch against a hand edit of transformers' cache, hook_state against
transformers' own state, the write patches, the interventions, the head scan against one full patched forward per
head, the hook table of docs/hooks.md). Added here: Mamba-2's own facts (no attention layer, no erase, the state
N x P while transformers' cache keeps P x N), the state patch's carry-forward at the patched mixer's own output,
single-token steps against transformers' own decode, the CLI's scan and patch; Falcon-H1 with its gated RMSNorm,
Zamba2's per-use hook points, and every CLI verb on both."""
import pytest
import torch
from test_bridge import (  # noqa: F401  (collected here with this module's checkpoint fixture)
    _tokens, tiny_checkpoint, test_a_state_patch_through_nnsight_equals_run_with_patches,
    test_component_swaps_equal_the_same_swaps_in_transformers_cache,
    test_every_hook_name_is_a_module_path_and_an_nnsight_envoy, test_greedy_generate_equals_transformers_generate,
    test_conv_tail_spans_reach_as_far_as_the_conv_transformers_runs,
    test_corrected_logits_equal_the_hooked_forward, test_hook_state_at_requested_positions_is_transformers_own_state,
    test_interventions_run_through_the_protocol, test_the_bridge_hook_tables_of_the_docs_are_the_models_hook_points,
    test_lens_after_the_last_layer_is_the_model_itself,
    test_parity_with_transformers_torch_path_hooks_idle, test_state_patch_equals_a_hand_edit_of_the_transformers_cache,
    test_scan_equals_one_full_patched_forward_per_head, test_stepping_equals_the_full_run,
    test_unembed_of_the_last_residual_is_transformers_own_logits,
)
from test_bridge_hybrids import test_single_token_steps_equal_transformers_own_decode as _decode_steps

from recurscope import kernels
from recurscope.hooks.patches import StateReplace, WriteReplace, WriteScale, run_with_patches
from recurscope.interp.loading import load_model

LAYOUTS = ("mamba2", "nemotron_h", "bamba", "granitemoehybrid", "falcon_h1", "zamba2")
# 4 heads in 2 groups (contiguous: heads 0, 1 read group 0), several chunks of transformers' chunked scan per run;
# time steps dt near 1 (the default 0.001-0.1 leaves the writes, and so every state patch, nearly invisible)
MAMBA2 = dict(hidden_size=32, num_heads=4, head_dim=16, state_size=8, n_groups=2, expand=2, num_hidden_layers=3,
              conv_kernel=4, chunk_size=8, time_step_min=0.2, time_step_max=1.0, pad_token_id=None,
              bos_token_id=None, eos_token_id=None)
# Nemotron-H: dt_bias starts at 1 (dt near 1.3); time_step_min stays at its default 0.001, below every dt here:
# transformers' single-token decode (mamba2_selective_state_update) ignores the clamp its chunked forward applies
NEMOTRON_BLOCKS = ["mamba", "mamba", "mamba", "attention", "mlp"]
# Falcon-H1 with every muP multiplier away from 1 (the five ssm_multipliers on gate, x, B, C and dt differ from each
# other), so that parity, the cache swaps and the scan's growing batch check each one
FALCON_H1 = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                 intermediate_size=64, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
                 mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=8, initializer_range=0.1,
                 embedding_multiplier=2.0, lm_head_multiplier=0.5, ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.7],
                 ssm_in_multiplier=1.3, ssm_out_multiplier=0.6, attention_in_multiplier=0.9,
                 attention_out_multiplier=0.7, key_multiplier=0.4, mlp_multipliers=[1.1, 0.8], pad_token_id=None,
                 bos_token_id=None, eos_token_id=None)
# Zamba2: one shared transformer block (num_mem_blocks 1) used at layers 1 and 2, each use with its own LoRA adapters
# on q, k, v and the MLP, RoPE in the shared attention. (transformers' adapters need num_key_value_heads equal to
# num_attention_heads.)
ZAMBA2 = dict(hidden_size=32, num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "hybrid"], mamba_d_state=8,
              mamba_d_conv=4, mamba_expand=2, mamba_ngroups=2, n_mamba_heads=4, chunk_size=8, num_attention_heads=2,
              num_key_value_heads=2, intermediate_size=64, num_mem_blocks=1, use_shared_attention_adapter=True,
              adapter_rank=4, use_mem_rope=True, initializer_range=0.1, pad_token_id=None, bos_token_id=None,
              eos_token_id=None)


def _build(layout: str, vocab: int):
    import transformers as tf

    if layout == "mamba2":
        return tf.Mamba2ForCausalLM(tf.Mamba2Config(vocab_size=vocab, **MAMBA2)), tf.Mamba2ForCausalLM
    if layout == "nemotron_h":   # three Mamba-2 blocks, an attention block (no RoPE), an MLP-only block
        cfg = tf.NemotronHConfig(vocab_size=vocab, hidden_size=32, layers_block_type=NEMOTRON_BLOCKS,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64,
                                 ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=16, n_groups=2, conv_kernel=4,
                                 chunk_size=8, initializer_range=0.2, rescale_prenorm_residual=False,
                                 pad_token_id=None, bos_token_id=None, eos_token_id=None)
        return tf.NemotronHForCausalLM(cfg), tf.NemotronHForCausalLM
    if layout == "bamba":   # three Mamba-2 decoder layers and an attention one (RoPE), each with a SwiGLU MLP
        cfg = tf.BambaConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=4, attn_layer_indices=[3],
                             num_attention_heads=2, num_key_value_heads=1, intermediate_size=64, mamba_n_heads=4,
                             mamba_d_head=16, mamba_d_state=8, mamba_n_groups=2, mamba_expand=2, mamba_d_conv=4,
                             mamba_chunk_size=8, initializer_range=0.1, pad_token_id=None, bos_token_id=None,
                             eos_token_id=None)
        return tf.BambaForCausalLM(cfg), tf.BambaForCausalLM
    if layout == "granitemoehybrid":   # Granite-4.0-H: MoE + shared MLP; every multiplier away from 1
        cfg = tf.GraniteMoeHybridConfig(
            vocab_size=vocab, hidden_size=32, num_hidden_layers=4, layer_types=["mamba"] * 3 + ["attention"],
            num_attention_heads=2, num_key_value_heads=1, intermediate_size=24, shared_intermediate_size=48,
            num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
            mamba_n_groups=2, mamba_expand=2, mamba_d_conv=4, mamba_chunk_size=8, position_embedding_type="rope",
            embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0, attention_multiplier=0.3,
            initializer_range=0.1, pad_token_id=None, bos_token_id=None, eos_token_id=None)
        return tf.GraniteMoeHybridForCausalLM(cfg), tf.GraniteMoeHybridForCausalLM
    if layout == "falcon_h1":   # three layers, each a Mamba-2 mixer and attention side by side; every multiplier != 1
        return tf.FalconH1ForCausalLM(tf.FalconH1Config(vocab_size=vocab, **FALCON_H1)), tf.FalconH1ForCausalLM
    if layout == "zamba2":   # a Mamba-2 layer, then two layers that each run the one shared block first
        hf = tf.Zamba2ForCausalLM(tf.Zamba2Config(vocab_size=vocab, **ZAMBA2))
        with torch.no_grad():   # dt near 1, as in the Mamba-2 layout (Zamba2 draws dt_bias from time_step_min..max)
            for layer in hf.model.layers:
                (layer.mamba if hasattr(layer, "mamba") else layer.mamba_decoder.mamba).dt_bias.fill_(0.5)
        return hf, tf.Zamba2ForCausalLM
    raise KeyError(layout)


@pytest.fixture(scope="module", params=LAYOUTS)
def checkpoint(request, tmp_path_factory):
    return tiny_checkpoint(request.param, _build, tmp_path_factory)


def _float64(path):
    model = load_model(path, dtype=torch.float64)
    if any("experts" in n for n, _ in model.named_modules()):
        model.hf.set_experts_implementation("eager")   # MoE layers: grouped_mm has no float64
    return model


def test_loads_as_transformers_own_model_even_with_fla_registered(checkpoint):
    """Mamba-2: every layer a bridged Mamba-2 mixer; Nemotron-H: layers 0-2 Mamba-2, 3 attention, 4 an MLP-only block
    that is neither; no erase hooks; the state is N x P. fla registers its own Mamba-2 under the same model_type
    ("mamba2") in transformers' Auto classes: the bridge still builds transformers'."""
    import fla.models  # noqa: F401  (registers fla's Mamba2ForCausalLM for "mamba2" with AutoModelForCausalLM)

    layout, path, cls = checkpoint
    model = load_model(path)
    assert type(model.hf) is cls and model.family.name == layout
    assert model.recurrent_layers == [0, 1, 2]
    assert model.attention_layers == {"mamba2": [], "falcon_h1": [0, 1, 2], "zamba2": [1, 2]}.get(layout, [3])
    mixer = "BridgedFalconH1Mamba2" if layout == "falcon_h1" else "BridgedMamba2"
    assert all(type(model.blocks[l].mixer).__name__ == mixer for l in model.recurrent_layers)
    assert model.cfg.state_shape() == (8, 16) and model.n_state_heads == 4 and model.cfg.conv_size == 4
    assert model.heads() == [(l, h) for l in range(3) for h in range(4)]
    assert "blocks.0.mixer.hook_erase" not in model.hook_dict
    assert ("blocks.0.hook_mlp_out" in model.hook_dict) == (layout in ("bamba", "granitemoehybrid", "falcon_h1"))
    # Falcon-H1: the attention beside the recurrent mixer has hooks of its own, blocks.{l}.attn.*
    assert ("blocks.0.attn.hook_pattern" in model.hook_dict) == (layout == "falcon_h1")
    assert ("blocks.0.hook_attn_out" in model.hook_dict) == (layout == "falcon_h1")
    assert ("blocks.1.attn.hook_pattern" in model.hook_dict) == (layout in ("falcon_h1", "zamba2"))
    if layout == "nemotron_h":
        assert "blocks.4.hook_mlp_out" in model.hook_dict and "blocks.4.hook_mixer_out" not in model.hook_dict
    cache = model.run_prefix(_tokens(model.cfg.vocab_size, T=5))
    assert cache.layers[0].state.shape == (2, 4, 8, 16)   # (B, H, N, P), recurscope's layout
    if layout == "falcon_h1":   # one cache layer holds the state, the conv tail and the K/V
        assert cache.layers[0].kind == "hybrid" and cache.layers[0].keys.shape == (2, 5, 1, 16)
    if layout == "zamba2":      # the layers with a use of the shared block cache that use's K/V beside the state
        assert [lc.kind for lc in cache.layers] == ["recurrent", "hybrid", "hybrid"]
        assert cache.layers[1].keys.shape == cache.layers[2].keys.shape == (2, 5, 2, 32)


def test_single_token_steps_equal_transformers_own_decode(checkpoint):
    """test_bridge_hybrids' check: token by token through the bridge's cache == transformers' own decode steps (and
    == the full run). (transformers' Nemotron-H decode once disagreed with its own full forward by about 1e-3; with
    the pinned versions, Hugging Face's `kernels` among them, it agrees, so every layout takes the same check.)"""
    _decode_steps(checkpoint)


def test_candidate_projections_follow_the_gated_group_norm_by_hand(checkpoint):
    """attribution's candidate direction on a bridged Mamba-2: z = the gated norm of y = o + D x, the rms of
    y * silu(gate) taken over the group of heads the norm spans (Falcon-H1 without mamba_rms_norm: z = y * silu(gate),
    its gate scaled by mup_vector). By hand from transformers' own in_proj (the gate), D and norm: with the rms frozen,
    o_h writes s * o_h into z, then out_proj, the layer's multiplier (Granite-4.0-H's residual_multiplier 0.5,
    Falcon-H1's ssm_out_multiplier 0.6), the final norm frozen at the last residual, and the LM head times its
    multiplier (Granite-4.0-H: 1 / logits_scaling 2, Falcon-H1: lm_head_multiplier 0.5)."""
    import torch.nn.functional as F
    from helpers_models import output_of
    from test_bridge import _candidate_rows

    layout, path, _ = checkpoint
    model = _float64(path)
    layer, head, pos, good, bad = 1, 3, 10, 5, 17
    tokens = _tokens(model.cfg.vocab_size, B=1, T=12, seed=3)
    mixer = model.blocks[layer].mixer
    H, P = mixer.num_heads, mixer.head_dim
    projected = output_of(mixer.in_proj, model, tokens)
    if layout == "falcon_h1":
        projected = projected * mixer.mup_vector
    gate = projected[0, pos, :mixer.intermediate_size].view(H, P)
    df, cache = _candidate_rows(model, tokens, layer, head, pos, good, bad)
    at = lambda point: cache[f"blocks.{layer}.mixer.{point}"][0, pos]  # noqa: E731
    o = at("hook_head_out")
    config = model.hf.config
    with torch.no_grad():
        y = o + mixer.D[:, None] * at("hook_v")
        if layout == "falcon_h1" and not config.mamba_rms_norm:
            s = F.silu(gate[head])
        else:
            per_group = H // mixer.n_groups
            mates = slice(head // per_group * per_group, (head // per_group + 1) * per_group)
            r = torch.rsqrt((y[mates] * F.silu(gate[mates])).pow(2).mean() + mixer.norm.variance_epsilon)
            s = r * mixer.norm.weight.view(H, P)[head] * F.silu(gate[head])
        torch.testing.assert_close(s * y[head], at("hook_z")[head], rtol=1e-5, atol=1e-9)
        multiplier = {"granitemoehybrid": getattr(config, "residual_multiplier", 1.0),
                      "falcon_h1": getattr(config, "ssm_out_multiplier", 1.0)}.get(layout, 1.0)
        written = multiplier * mixer.out_proj.weight[:, head * P:(head + 1) * P] @ (s * o[head])
        resid = cache[f"blocks.{model.cfg.num_hidden_layers - 1}.hook_resid_post"][0, pos]
        final = model.final_norm
        frozen = written * torch.rsqrt(resid.pow(2).mean() + final.variance_epsilon) * final.weight
        logit_scale = {"granitemoehybrid": 1 / getattr(config, "logits_scaling", 1.0),
                       "falcon_h1": getattr(config, "lm_head_multiplier", 1.0)}.get(layout, 1.0)
        unembed = model.hf.lm_head.weight * logit_scale
        expected = float((unembed[good] - unembed[bad]) @ frozen)
    assert abs(expected) > 1e-7
    assert df.projection.sum() == pytest.approx(expected, rel=1e-5)


def test_the_fla_format_of_the_same_model_type_still_loads_natively(tmp_path):
    """model_type "mamba2" in fla's format (norm_eps, dt_limit) stays a native RecurrentLM."""
    from helpers_models import tiny_model

    from recurscope.interp.loading import save_model

    save_model(tiny_model("mamba2"), tmp_path)
    model = load_model(tmp_path)
    assert type(model).__name__ == "RecurrentLM" and type(model.blocks[0].mixer).__name__ == "Mamba2Mixer"


def test_state_patch_carries_forward_at_the_patched_mixers_own_output(checkpoint):
    """StateReplace at (layer, head, p): the patched layer's own readout (hook_head_out) at p and after is the kernel
    run from the new state over that layer's unchanged inputs (a layer's inputs do not depend on its own state);
    before p, and on the layer's other heads, nothing changes."""
    _, path, _ = checkpoint
    model = _float64(path)
    tokens = _tokens(model.cfg.vocab_size, seed=3)
    layer, head, p = 1, 2, 8
    K, V = model.cfg.state_shape()
    new_state = torch.randn(2, K, V, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    names = [f"blocks.{layer}.mixer.{n}" for n in ("hook_q", "hook_k", "hook_write_value", "hook_decay",
                                                   "hook_head_out")]
    with torch.no_grad():
        _, clean = model.run_with_cache(tokens, names_filter=lambda n: n in names)
        q, k, x, g, o_clean = (clean[n] for n in names)
        patch = StateReplace(layer, head, position=p, state=new_state)
        captured = {}

        def keep(t, hook):
            captured["o"] = t.clone()
            return t
        with model.hooks(fwd_hooks=[(names[-1], keep)]):
            run_with_patches(model, tokens, [patch])
    o = captured["o"]
    sl = slice(p + 1, None)
    suffix = kernels.recurrence(q[:, sl, head:head + 1], k[:, sl, head:head + 1], x[:, sl, head:head + 1],
                                g[:, sl, head:head + 1], None, scale=1.0, initial_state=new_state[:, None],
                                backend="reference").o[:, :, 0]
    at_p = torch.einsum("bkv,bk->bv", new_state, q[:, p, head])        # o_p = S_p^T C_p
    torch.testing.assert_close(o[:, p, head], at_p, rtol=0, atol=1e-10)
    torch.testing.assert_close(o[:, sl, head], suffix, rtol=0, atol=1e-10)
    others = [h for h in range(model.n_state_heads) if h != head]
    torch.testing.assert_close(o[:, :, others], o_clean[:, :, others], rtol=0, atol=1e-12)   # float64 rounding
    torch.testing.assert_close(o[:, :p], o_clean[:, :p], rtol=0, atol=1e-12)
    assert float((o[:, sl, head] - o_clean[:, sl, head]).abs().max()) > 1e-3


def test_write_patches_change_only_the_write(checkpoint):
    """write_block (WriteScale 0) and donor_write (WriteReplace) at layer l: its readout equals the reference kernel
    (no erase, scale 1) with the write scaled to zero / replaced by the donor's B (dt x)^T on the span."""
    _, path, _ = checkpoint
    model = _float64(path)
    tokens, donor = _tokens(model.cfg.vocab_size, seed=7), _tokens(model.cfg.vocab_size, seed=8)
    layer, head, positions = 0, 1, [10, 11, 12]
    names = [f"blocks.{layer}.mixer.{n}" for n in ("hook_q", "hook_k", "hook_write_value", "hook_decay",
                                                   "hook_write_key", "hook_head_out")]

    def inputs(ids):
        _, c = model.run_with_cache(ids, names_filter=lambda n: n in names)
        return [c[n] for n in names]

    def readout(patch):
        seen = {}
        with model.hooks(fwd_hooks=patch.fwd_hooks() + [(names[-1], lambda t, hook: seen.setdefault("o", t))]):
            model(tokens)
        return seen["o"]

    with torch.no_grad():
        q, k, x, g, _, o_clean = inputs(tokens)
        _, _, dx, _, du, _ = inputs(donor)
        mask = torch.zeros(q.shape[:3], dtype=torch.bool)
        mask[:, positions, head] = True
        ws = (~mask).double()
        blocked = readout(WriteScale(layer, head, positions, 0.0))
        expected = kernels.recurrence(q, k, x, g, None, scale=1.0, write_scale=ws, backend="reference").o
        torch.testing.assert_close(blocked, expected, rtol=0, atol=1e-12)
        assert float((blocked - o_clean).abs().max()) > 1e-3
        m = mask[..., None]
        replaced = readout(WriteReplace(layer, head, positions, key=du, value=dx))
        expected = kernels.recurrence(q, k, x, g, None, scale=1.0, write_scale=ws,
                                      extra_write=(torch.where(m, du, 0.0), torch.where(m, dx, 0.0)),
                                      backend="reference").o
        torch.testing.assert_close(replaced, expected, rtol=0, atol=1e-12)
        assert float((replaced - blocked).abs().max()) > 1e-3


def test_recurscope_scan_and_patch_run_on_a_tiny_mamba2(checkpoint, tmp_path, capsys):
    import pandas as pd

    from recurscope.interp.cli import main

    _, path, _ = checkpoint
    small = ["--n-facts", "2", "--presentations", "2", "--filler", "12"]
    assert main(["scan", str(path), *small, "--batch-size", "8", "--n-sources", "2", "--gate-threshold", "0",
                 "--out", str(tmp_path / "scan")]) == 0
    table = pd.read_csv(tmp_path / "scan" / "scan_heads.csv")
    assert sorted(zip(table["layer"], table["head"])) == [(l, h) for l in range(3) for h in range(4)]
    assert main(["patch", str(path), "--layer", "1", "--head", "2", *small]) == 0
    out = capsys.readouterr().out
    for name in ("write_block", "donor_write", "state_swap", "output_patch", "output_restore"):
        assert name in out


def test_falcon_h1_with_its_gated_rms_norm_equals_transformers(tmp_path_factory):
    """Falcon-H1 with `mamba_rms_norm` (the gated group RMSNorm after the D skip, instead of the plain silu(z) gate
    of the layout above): the bridge's logits with idle hooks == transformers' torch path, and hook_z is that norm."""
    from test_bridge import _reference

    from recurscope.interp.bridge.torch_path import torch_reference_path

    def build(layout, vocab):
        import transformers as tf

        cfg = tf.FalconH1Config(vocab_size=vocab, **dict(FALCON_H1, mamba_rms_norm=True, mamba_norm_before_gate=False))
        return tf.FalconH1ForCausalLM(cfg), tf.FalconH1ForCausalLM

    _, path, cls = tiny_checkpoint("falcon_h1_rms_norm", build, tmp_path_factory)
    model, ref = load_model(path), _reference(path, cls)
    assert model.hf.config.mamba_rms_norm and type(model.blocks[0].mixer.norm).__name__ == "FalconH1RMSNormGated"
    tokens = _tokens(model.cfg.vocab_size)
    with torch.no_grad(), torch_reference_path():
        expected = ref(input_ids=tokens).logits
        with model.hooks(fwd_hooks=[(lambda name: True, lambda t, hook: t)]):
            got = model(tokens)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * float(expected.abs().max()))


@pytest.fixture(scope="module", params=["falcon_h1", "zamba2"])
def parallel_or_shared(request, tmp_path_factory):
    """The two layouts whose layers are recurrent and attention layers at once (Falcon-H1's side by side, Zamba2's
    shared block before the mixer)."""
    return tiny_checkpoint(request.param, _build, tmp_path_factory)[1]


def _protocol_verb_args():
    """tests/cli/test_protocol_verbs.py's tiny sizes per protocol verb (one table for both smoke runs)."""
    import importlib.util
    from pathlib import Path

    where = Path(__file__).resolve().parents[1] / "cli" / "test_protocol_verbs.py"
    spec = importlib.util.spec_from_file_location("_protocol_verb_sizes", where)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # end to end
@pytest.mark.parametrize("verb", ["run", "confirm", "selectivity", "coupling", "neutral", "heads", "headscan", "lens",
                                  "gate", "capacity", "overlap", "retention", "corrector", "reuse", "hybrid", "topk"])
def test_every_cli_verb_runs_on_falcon_h1_and_zamba2(verb, parallel_or_shared, tmp_path, capsys):
    """Every command of the CLI on Falcon-H1 and Zamba2 checkpoints, whose layers are recurrent and attention layers
    at once (scan and patch: test_recurscope_scan_and_patch_run_on_a_tiny_mamba2 above): `run` (scan on dev, confirm
    on held-out, report), `confirm --from-scan`, and each protocol verb with test_protocol_verbs' tiny sizes; each
    writes its manifest, tables and report."""
    import json

    from recurscope.interp.cli import main
    from recurscope.interp.protocols import VERBS

    path, out = str(parallel_or_shared), tmp_path / verb
    small = ["--n-facts", "2", "--presentations", "2", "--filler", "12", "--batch-size", "8", "--gate-threshold", "0"]
    if verb == "run":
        assert main(["run", path, "--n-dev", "2", "--n-heldout", "2", *small, "--out", str(out)]) == 0
        report = (out / "report.md").read_text()
        assert "Head selection" in report and "Confirmation on held-out sources" in report
        return
    if verb == "confirm":
        assert main(["scan", path, *small, "--n-sources", "2", "--out", str(tmp_path / "scan")]) == 0
        assert main(["confirm", path, "--from-scan", str(tmp_path / "scan"), *small, "--n-sources", "2",
                     "--out", str(out)]) == 0
        assert json.loads((out / "manifest.json").read_text())["kind"] == "confirm"
        return
    assert set(VERBS) == {"selectivity", "coupling", "neutral", "heads", "headscan", "lens", "gate", "capacity",
                          "overlap", "retention", "corrector", "reuse", "hybrid", "topk"}   # the parametrisation is complete
    sizes = _protocol_verb_args()
    head = [] if verb in ("heads", "lens", "gate", "hybrid", "topk") else ["--head", "0", "1"]
    dev = ["--n-dev", "2"] if verb in ("heads", "topk") else []
    assert main([verb, path, *sizes.OWN_ARGS.get(verb, sizes.TINY), *head, *dev, "--out", str(out)]) == 0
    assert json.loads((out / "manifest.json").read_text())["kind"] == verb
    for name in sizes.FIGURES[verb]:
        assert (out / "figures" / f"{name}.png").is_file()
    assert "### Reading" in (out / "report.md").read_text()


def test_each_use_of_zamba2s_shared_block_has_its_own_hook_points(tmp_path_factory):
    """Zamba2's shared transformer block is one set of weights used at layers 1 and 2 (transformers ties them; each
    use is its own module, with its own adapters): its hook points are per use, blocks.1.attn.* and blocks.2.attn.*.
    Zeroing the second use's attention output changes what that use feeds its mixer (blocks.2.hook_attn_out) and
    nothing at or before layer 1; the run with idle hooks is transformers' own."""
    _, path, cls = tiny_checkpoint("zamba2", _build, tmp_path_factory)
    model = load_model(path)
    one, two = (model.blocks[l].shared_transformer.self_attn for l in (1, 2))
    assert one is not two and one.q_proj.weight is two.q_proj.weight          # tied weights, two modules
    assert model.get_submodule("blocks.2.attn") is two
    assert not torch.equal(one.linear_q_adapter_list[0][0].weight, one.linear_q_adapter_list[1][0].weight)
    tokens = _tokens(model.cfg.vocab_size)
    names = ["blocks.1.hook_attn_out", "blocks.1.hook_resid_post", "blocks.2.hook_attn_out"]
    seen = []
    with torch.no_grad():
        _, clean = model.run_with_cache(tokens, names_filter=lambda n: n in names)
        with model.hooks(fwd_hooks=[("blocks.2.attn.hook_head_out", lambda t, hook: seen.append(1) or t * 0)]):
            _, zeroed = model.run_with_cache(tokens, names_filter=lambda n: n in names)
    assert seen == [1]   # one use, one call
    for name in names[:2]:
        torch.testing.assert_close(zeroed[name], clean[name], rtol=0, atol=0)
    assert float((zeroed[names[2]] - clean[names[2]]).abs().max()) > 1e-3
