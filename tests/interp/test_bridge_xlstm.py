"""The transformers bridge on xLSTM (`xLSTMForCausalLM`: mLSTM blocks, a matrix memory with exponential input and
sigmoid forget gates and a normaliser state): a tiny random checkpoint built from transformers' own config class and
saved with save_pretrained. The adapter (bridge/adapters/xlstm.py, with its mixer and block) is the only code the
architecture added, beside three adapter hooks of BridgedLM (the layer list, the layer types, the logit cap).

test_bridge.py's per-layout checks run here with this module's `checkpoint` fixture (parity with transformers'
forward with idle hooks, stepping, hook names as module paths and nnsight envoys, the nnsight state patch, greedy
generation, the lens, the corrector, the head scan against one full patched forward per head, the hook table of
docs/hooks.md). Added here: the normaliser as the state's last value column, against transformers' own cache; a
state patch against a hand edit of transformers' cache; the carry-forward of a state patch at the patched mixer's
own output; single-token steps; unembed with the logit soft cap; and the CLI's `run`."""
import pytest
import torch
from test_bridge import (  # noqa: F401  (collected here with this module's checkpoint fixture)
    _reference, _tokens, tiny_checkpoint, test_a_state_patch_through_nnsight_equals_run_with_patches,
    test_corrected_logits_equal_the_hooked_forward, test_every_hook_name_is_a_module_path_and_an_nnsight_envoy,
    test_greedy_generate_equals_transformers_generate, test_lens_after_the_last_layer_is_the_model_itself,
    test_parity_with_transformers_torch_path_hooks_idle, test_scan_equals_one_full_patched_forward_per_head,
    test_stepping_equals_the_full_run, test_the_bridge_hook_tables_of_the_docs_are_the_models_hook_points,
)
from test_bridge_minimax import SMALL

from recurscope import kernels
from recurscope.hooks.patches import ReadoutReplace, StateReplace, run_with_patches
from recurscope.interp.bridge.adapters.xlstm import from_transformers_state, to_transformers_state
from recurscope.interp.loading import load_model

# hidden 128 (transformers' config rounds the q/k and v widths up to multiples of 64, its layers do not: they agree
# from 128 on), 2 heads of d_qk 32 and d_v 64; chunk_size 8, so that a 19-token run goes through transformers'
# chunkwise kernel (16 tokens) and its step loop (3); input gates near e^0 and forget gates near 1 (transformers'
# init writes e^-10 and forgets fast, which would leave every state patch invisible)
XLSTM = dict(hidden_size=128, num_hidden_layers=3, num_heads=2, qk_dim_factor=0.5, v_dim_factor=1.0, chunk_size=8,
             pad_token_id=None, bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)
K, V = 32, 64


def _build(layout: str, vocab: int):
    import transformers as tf

    hf = tf.xLSTMForCausalLM(tf.xLSTMConfig(vocab_size=vocab, **XLSTM))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "gate_preact" in name and name.endswith("bias"):   # forget gates near 1, input gates near e^0
                p.copy_(torch.randn(p.shape) * 0.5 + (3.0 if name.startswith("backbone") and "fgate" in name else 0.0))
    return hf, tf.xLSTMForCausalLM


LAYOUTS = ("xlstm",)


@pytest.fixture(scope="module", params=LAYOUTS)
def checkpoint(request, tmp_path_factory):
    return tiny_checkpoint(request.param, _build, tmp_path_factory)


def _theirs(ref, tokens, upto):
    """transformers' own xLSTMCache after its run of tokens[:, :upto]."""
    from transformers.models.xlstm.modeling_xlstm import xLSTMCache

    cache = xLSTMCache(ref.config, tokens.shape[0], dtype=torch.float32)
    ref(input_ids=tokens[:, :upto], cache=cache, use_cache=True)
    return cache


def test_loads_the_adapter_with_the_normaliser_as_a_value_column(checkpoint):
    _, path, _ = checkpoint
    model = load_model(path)
    assert model.family.name == "xlstm" and model.recurrent_layers == [0, 1, 2] and model.attention_layers == []
    assert all(type(b.mixer).__name__ == "BridgedMLSTM" for b in model.blocks)
    assert model.cfg.state_shape() == (K, V + 1) and model.n_state_heads == 2
    assert "blocks.0.mixer.hook_erase" not in model.hook_dict and "blocks.0.hook_mlp_out" in model.hook_dict


def test_hook_state_is_memory_and_normaliser_of_transformers_cache(checkpoint):
    """hook_state at several positions == [C | n] = transformers' (C~, n~) times e^m after a prefix run to each
    position; the normaliser column is n, and the stabilised triple round-trips."""
    _, path, cls = checkpoint
    model, ref = load_model(path), _reference(path, cls)
    tokens = _tokens(model.cfg.vocab_size, seed=13)
    positions = [0, 6, 16, tokens.shape[1] - 1]
    names = {l: f"blocks.{l}.mixer.hook_state" for l in model.recurrent_layers}
    with torch.no_grad():
        _, got = model.run_with_cache(tokens, state_positions=positions, names_filter=lambda n: n in names.values())
        for j, p in enumerate(positions):
            theirs = _theirs(ref, tokens, p + 1)
            for layer, name in names.items():
                c, n, m = theirs.rnn_state[layer]
                S, _ = from_transformers_state(c, n, m)
                # 1e-5 of the state's own scale (its entries reach several units; transformers' chunkwise kernel
                # sums in another order)
                tol = 1e-5 * float(S.abs().max())
                torch.testing.assert_close(got[name][:, j], S, rtol=1e-5, atol=tol)
                torch.testing.assert_close(got[name][:, j, :, :, V], n * m.exp(), rtol=1e-5, atol=tol)
                for mine, orig in zip(to_transformers_state(S, m), (c, n, m)):
                    torch.testing.assert_close(mine, orig, rtol=1e-6, atol=1e-6)
    assert float((got[names[0]][:, 1] - got[names[0]][:, 2]).abs().max()) > 1e-3


def test_the_readout_divides_by_the_normaliser(checkpoint):
    """h = o[:V] / (max(|o[V]|, 1) + eps e^m) from hook_head_out, m the gates' running stabiliser: multihead_norm
    of it times sigmoid(o_pre) is hook_z."""
    _, path, _ = checkpoint
    model = load_model(path)
    tokens = _tokens(model.cfg.vocab_size, seed=4)
    names = ["blocks.1.hook_resid_pre", "blocks.1.mixer.hook_head_out", "blocks.1.mixer.hook_z",
             "blocks.1.mixer.hook_decay"]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
        block = model.blocks[1]
        mixer = block.mixer
        _, _, _, o_pre, i, _ = mixer._projections(block.norm_mlstm(cache[names[0]]))
        g = cache[names[3]]
        m, prev = [], torch.zeros_like(g[:, 0])
        for t in range(g.shape[1]):
            prev = torch.maximum(g[:, t] + prev, i[:, t])
            m.append(prev)
        m = torch.stack(m, 1)
        o = cache[names[1]]
        h = o[..., :V] / (torch.maximum(o[..., V:].abs(), torch.ones_like(o[..., V:])) + 1e-6 * m.exp()[..., None])
        z = torch.sigmoid(o_pre) * mixer.multihead_norm(h).reshape(*h.shape[:2], -1)
    torch.testing.assert_close(cache[names[2]], z.reshape(cache[names[2]].shape), rtol=0, atol=1e-5)


def test_state_patch_equals_a_hand_edit_of_transformers_cache(checkpoint):
    """StateReplace of [C | n] at p with the readout at p kept == transformers' prefix run to p, its (C~, n~) for
    that head set to the new [C | n] times e^{-m} (its own m), then its own suffix run."""
    _, path, cls = checkpoint
    model, ref = load_model(path), _reference(path, cls)
    tokens = _tokens(model.cfg.vocab_size, seed=3)
    layer, head, p = 1, 1, 8
    new_state = torch.randn(2, K, V + 1, generator=torch.Generator().manual_seed(5))
    new_state[..., V] = new_state[..., V].abs() * 3   # a normaliser that dominates max(|n q|, 1)
    with torch.no_grad():
        out_name = f"blocks.{layer}.mixer.hook_head_out"
        clean, clean_cache = model.run_with_cache(tokens, names_filter=out_name)
        state = StateReplace(layer, head, position=p, state=new_state)
        patched = run_with_patches(model, tokens, [state])
        as_cache_edit = run_with_patches(model, tokens, [state, ReadoutReplace(layer, head, [p],
                                                                               value=clean_cache[out_name])])
        cache = _theirs(ref, tokens, p + 1)
        c, n, m = cache.rnn_state[layer]
        edited_c, edited_n, _ = to_transformers_state(new_state[:, None], m[:, head:head + 1])
        c[:, head], n[:, head] = edited_c[:, 0], edited_n[:, 0]
        suffix = ref(input_ids=tokens[:, p + 1:], cache=cache, use_cache=True).logits
    torch.testing.assert_close(as_cache_edit[:, p + 1:], suffix, rtol=0, atol=1e-5)
    torch.testing.assert_close(patched[:, :p], clean[:, :p], rtol=0, atol=0)
    assert bool(((patched - clean).abs().amax(-1)[:, p:] > 1e-4).all())


def test_state_patch_carries_forward_at_the_patched_mixers_own_output(checkpoint):
    """StateReplace at (layer, head, p): that layer's readout [C^T q', n^T q'] from p on is the reference kernel run
    from the new [C | n] over the layer's unchanged inputs; before p, and on the other head, nothing changes."""
    _, path, _ = checkpoint
    model = load_model(path).to(torch.float64)
    tokens = _tokens(model.cfg.vocab_size, seed=3)
    layer, head, p = 2, 0, 8
    new_state = torch.randn(2, K, V + 1, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    names = [f"blocks.{layer}.mixer.{n}" for n in ("hook_q", "hook_k", "hook_write_value", "hook_decay",
                                                   "hook_head_out")]
    with torch.no_grad():
        _, clean = model.run_with_cache(tokens, names_filter=lambda n: n in names)
        q, k, x, g, o_clean = (clean[n] for n in names)
        seen = {}
        with model.hooks(fwd_hooks=[(names[-1], lambda t, hook: seen.setdefault("o", t.clone()))]):
            run_with_patches(model, tokens, [StateReplace(layer, head, position=p, state=new_state)])
    o, sl, one = seen["o"], slice(p + 1, None), slice(head, head + 1)
    suffix = kernels.recurrence(q[:, sl, one], k[:, sl, one], x[:, sl, one], g[:, sl, one], None, scale=1.0,
                                initial_state=new_state[:, None], backend="reference").o[:, :, 0]
    torch.testing.assert_close(o[:, p, head], torch.einsum("bkv,bk->bv", new_state, q[:, p, head]), rtol=0,
                               atol=1e-10)
    torch.testing.assert_close(o[:, sl, head], suffix, rtol=0, atol=1e-10)
    torch.testing.assert_close(o[:, :, 1 - head], o_clean[:, :, 1 - head], rtol=0, atol=1e-12)
    torch.testing.assert_close(o[:, :p], o_clean[:, :p], rtol=0, atol=1e-12)
    assert float((o[:, sl, head] - o_clean[:, sl, head]).abs().max()) > 1e-3


def test_single_token_steps_equal_transformers_own_decode(checkpoint):
    _, path, cls = checkpoint
    model, ref = load_model(path), _reference(path, cls)
    tokens = _tokens(model.cfg.vocab_size, T=12, seed=2)
    with torch.no_grad():
        full = model(tokens)
        cache, ours = model.run_prefix(tokens[:, :6]), []
        theirs, expected = _theirs(ref, tokens, 6), []
        for t in range(6, 12):
            step, cache = model.run_suffix(tokens[:, t:t + 1], cache)
            ours.append(step)
            expected.append(ref(input_ids=tokens[:, t:t + 1], cache=theirs, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(ours, 1), torch.cat(expected, 1), rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.cat(ours, 1), full[:, 6:], rtol=0, atol=1e-5)


def test_unembed_is_the_final_norm_the_head_and_its_soft_cap(checkpoint):
    """unembed of the last residual == transformers' logits (out_norm, lm_head, then soft_cap at
    output_logit_soft_cap); unembed_weight is the head's linear map before the cap."""
    from transformers.models.xlstm.modeling_xlstm import soft_cap

    _, path, cls = checkpoint
    model, ref = load_model(path), _reference(path, cls)
    tokens = _tokens(model.cfg.vocab_size, seed=9)
    last = "blocks.2.hook_resid_post"
    with torch.no_grad():
        expected = ref(input_ids=tokens).logits
        _, cache = model.run_with_cache(tokens, names_filter=last)
        linear = model.final_norm(cache[last]) @ model.unembed_weight.T
        torch.testing.assert_close(model.unembed(cache[last]), expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(soft_cap(linear, ref.config.output_logit_soft_cap), expected, rtol=0, atol=1e-5)


@pytest.mark.slow  # end to end
def test_recurscope_run_on_a_tiny_xlstm(checkpoint, tmp_path, capsys):
    """`recurscope run`: the capability gate finds no recall on the random checkpoint and names no head; with the gate
    off the scan covers every mLSTM head and the confirmation runs on its winner."""
    import pandas as pd

    from recurscope.interp.cli import main

    _, path, _ = checkpoint
    gated = tmp_path / "gated"
    assert main(["run", str(path), "--out", str(gated), *SMALL]) == 0
    assert "THE MODEL DOES NOT DO THE TASK" in capsys.readouterr().out
    study = tmp_path / "study"
    assert main(["run", str(path), "--out", str(study), "--gate-threshold", "0", *SMALL]) == 0
    report = (study / "report.md").read_text()
    assert "Head selection" in report and "Confirmation on held-out sources" in report
    heads = pd.read_csv(study / "scan" / "scan_heads.csv")
    assert sorted(zip(heads["layer"], heads["head"])) == [(l, h) for l in range(3) for h in range(2)]


def test_attribution_refuses_to_freeze_a_readout_divided_by_its_normaliser(checkpoint):
    """hook_z is no per-channel scale of hook_head_out on xLSTM (h divides the memory's readout by the normaliser's),
    so attribution's candidate direction is refused by name, not computed wrongly."""
    from recurscope.interp.attribution import attribute_readout

    _, path, _ = checkpoint
    model = load_model(path)
    with pytest.raises(ValueError, match="xlstm divides its readout by a normaliser.*explicit direction"):
        attribute_readout(model, _tokens(model.cfg.vocab_size, B=1), 1, 0, 10, candidates=(5, 6))
