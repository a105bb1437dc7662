"""The transformers bridge on MiniMax (`MiniMaxForCausalLM`: lightning attention with a fixed per-head decay,
interleaved with softmax attention, MoE, a residual stream normed at each layer): a tiny random checkpoint built
from transformers' own config class and saved with save_pretrained. The adapter (bridge/adapters/minimax.py) is the
only code the architecture added.

test_bridge.py's per-layout checks run here with this module's `checkpoint` fixture (parity with transformers'
forward with idle hooks, stepping, hook names as module paths and nnsight envoys, the nnsight state patch, greedy
generation against transformers' generate, the interventions, unembed, the lens, the corrector, the head scan
against one full patched forward per head, the hook table of docs/hooks.md). Added here: the lightning recurrence
by hand, hook_state against transformers' own `linear_cache`, a state patch against a hand edit of transformers'
cache, the carry-forward of a state patch at the patched mixer's own output, single-token steps against
transformers' decode, the cache factorial's parts, and the CLI's `run`."""
import json

import pytest
import torch
from test_bridge import (  # noqa: F401  (collected here with this module's checkpoint fixture)
    _reference, _tokens, tiny_checkpoint, test_a_state_patch_through_nnsight_equals_run_with_patches,
    test_corrected_logits_equal_the_hooked_forward, test_every_hook_name_is_a_module_path_and_an_nnsight_envoy,
    test_greedy_generate_equals_transformers_generate,
    test_lens_after_the_last_layer_is_the_model_itself, test_parity_with_transformers_torch_path_hooks_idle,
    test_scan_equals_one_full_patched_forward_per_head, test_stepping_equals_the_full_run,
    test_the_bridge_hook_tables_of_the_docs_are_the_models_hook_points,
    test_unembed_of_the_last_residual_is_transformers_own_logits,
)

from recurscope import kernels
from recurscope.hooks.patches import ReadoutReplace, StateReplace, run_with_patches
from recurscope.interp.loading import load_model

# three lightning layers and one softmax attention layer (3:1, the attention last, as test_bridge's checks expect);
# block_size 4, so that transformers' block-wise prefill runs several blocks and a partial
# one; the alpha/beta factors away from 1, so that the normed residual's weights are checked
MINIMAX = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
               intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, block_size=4,
               layer_types=["linear_attention"] * 3 + ["full_attention"],
               linear_attn_alpha_factor=0.9, linear_attn_beta_factor=1.2, full_attn_alpha_factor=1.1,
               full_attn_beta_factor=0.8, mlp_alpha_factor=0.7, mlp_beta_factor=1.3, initializer_range=0.1,
               max_position_embeddings=512, pad_token_id=None, bos_token_id=None, eos_token_id=None)


def _build(layout: str, vocab: int):
    import transformers as tf

    return tf.MiniMaxForCausalLM(tf.MiniMaxConfig(vocab_size=vocab, **MINIMAX)), tf.MiniMaxForCausalLM


LAYOUTS = ("minimax",)


@pytest.fixture(scope="module", params=LAYOUTS)
def checkpoint(request, tmp_path_factory):
    return tiny_checkpoint(request.param, _build, tmp_path_factory)


def _theirs(ref, tokens, upto):
    """transformers' own MiniMaxCache after its run of tokens[:, :upto] (one prefill, as its generate does)."""
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    cache = MiniMaxCache()
    ref(input_ids=tokens[:, :upto], cache=cache, use_cache=True)
    return cache


def _decode(ref, tokens, cache, start):
    """transformers' own one-token decode steps from `start` on (its multi-token continuation of a cache is
    misplaced: docs/hooks.md, MiniMax)."""
    return torch.cat([ref(input_ids=tokens[:, t:t + 1], cache=cache, use_cache=True,
                          position_ids=torch.tensor([[t]])).logits for t in range(start, tokens.shape[1])], 1)


def test_loads_the_adapter_with_the_lightning_mixer_and_no_erase(checkpoint):
    _, path, _ = checkpoint
    model = load_model(path)
    assert model.family.name == "minimax" and model.bridge_family.spec is model.family
    assert model.recurrent_layers == [0, 1, 2] and model.attention_layers == [3] and model.n_state_heads == 2
    assert all(type(model.blocks[l].mixer).__name__ == "BridgedLightningAttention" for l in model.recurrent_layers)
    assert "blocks.0.mixer.hook_erase" not in model.hook_dict and "blocks.0.mixer.hook_state" in model.hook_dict
    assert model.cfg.state_shape() == (16, 16) and not model.cfg.use_short_conv and model.cfg.conv_size == 1
    assert model.heads() == [(l, h) for l in range(3) for h in range(2)]


def test_the_lightning_recurrence_by_hand(checkpoint):
    """Each lightning layer's hook_head_out == a plain loop of S_t = exp(-slope_h) S_{t-1} + k_t v_t^T,
    o_t = S_t^T q_t over the q, k, v its hooks saw, with slope_h transformers' own slope_rate buffer."""
    _, path, _ = checkpoint
    model = load_model(path)
    tokens = _tokens(model.cfg.vocab_size)
    names = [f"blocks.1.mixer.{n}" for n in ("hook_q", "hook_k", "hook_v", "hook_head_out")]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
    q, k, v, o = (cache[n].double() for n in names)
    decay = torch.exp(-model.blocks[1].mixer.slope_rate.reshape(-1).double())   # (H,)
    S = torch.zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3], dtype=torch.float64)
    for t in range(q.shape[1]):
        S = decay[None, :, None, None] * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        torch.testing.assert_close(o[:, t], torch.einsum("bhkv,bhk->bhv", S, q[:, t]), rtol=0, atol=1e-5)


def test_hook_state_at_requested_positions_is_transformers_linear_cache(checkpoint):
    _, path, cls = checkpoint
    model, ref = load_model(path), _reference(path, cls)
    tokens = _tokens(model.cfg.vocab_size, seed=13)
    positions = [0, 6, 13, tokens.shape[1] - 1]
    names = {l: f"blocks.{l}.mixer.hook_state" for l in model.recurrent_layers}
    with torch.no_grad():
        _, got = model.run_with_cache(tokens, state_positions=positions, names_filter=lambda n: n in names.values())
        for j, p in enumerate(positions):
            theirs = _theirs(ref, tokens, p + 1)
            for layer, name in names.items():
                torch.testing.assert_close(got[name][:, j], theirs.linear_cache[layer], rtol=0, atol=1e-5)
    first = got[names[0]]
    assert float((first[:, 1] - first[:, 2]).abs().max()) > 1e-3


def test_state_patch_equals_a_hand_edit_of_transformers_cache(checkpoint):
    """StateReplace at p with the readout at p kept == transformers' prefill to p, its linear_cache edited by hand
    for that head, then its own decode steps; the plain patch changes every position from p on."""
    _, path, cls = checkpoint
    model, ref = load_model(path), _reference(path, cls)
    tokens = _tokens(model.cfg.vocab_size, seed=3)
    layer, head, p = 2, 1, 8
    new_state = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out_name = f"blocks.{layer}.mixer.hook_head_out"
        clean, clean_cache = model.run_with_cache(tokens, names_filter=out_name)
        state = StateReplace(layer, head, position=p, state=new_state)
        patched = run_with_patches(model, tokens, [state])
        as_cache_edit = run_with_patches(model, tokens, [state, ReadoutReplace(layer, head, [p],
                                                                               value=clean_cache[out_name])])
        cache = _theirs(ref, tokens, p + 1)
        cache.linear_cache[layer][:, head] = new_state
        suffix = _decode(ref, tokens, cache, p + 1)
    torch.testing.assert_close(as_cache_edit[:, p + 1:], suffix, rtol=0, atol=1e-5)
    torch.testing.assert_close(patched[:, :p], clean[:, :p], rtol=0, atol=0)
    assert bool(((patched - clean).abs().amax(-1)[:, p:] > 1e-4).all())


def test_state_patch_carries_forward_at_the_patched_mixers_own_output(checkpoint):
    """StateReplace at (layer, head, p): that layer's readout from p on is the reference kernel run from the new
    state over the layer's unchanged inputs; before p, and on the other head, nothing changes."""
    _, path, _ = checkpoint
    model = load_model(path)   # float32: transformers' grouped MoE matmul takes no float64
    tokens = _tokens(model.cfg.vocab_size, seed=3)
    layer, head, p = 1, 0, 8
    new_state = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(5))
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
    torch.testing.assert_close(o[:, p, head], torch.einsum("bkv,bk->bv", new_state, q[:, p, head]), rtol=0, atol=1e-5)
    torch.testing.assert_close(o[:, sl, head], suffix, rtol=0, atol=1e-5)
    # (float32 rounding: the patched run splits the kernel at p for every head)
    torch.testing.assert_close(o[:, :, 1 - head], o_clean[:, :, 1 - head], rtol=0, atol=1e-6)
    torch.testing.assert_close(o[:, :p], o_clean[:, :p], rtol=0, atol=1e-6)
    assert float((o[:, sl, head] - o_clean[:, sl, head]).abs().max()) > 1e-3


def test_single_token_steps_equal_transformers_own_decode(checkpoint):
    _, path, cls = checkpoint
    model, ref = load_model(path), _reference(path, cls)
    tokens = _tokens(model.cfg.vocab_size, T=12, seed=2)
    with torch.no_grad():
        full = model(tokens)
        cache, ours = model.run_prefix(tokens[:, :6]), []
        for t in range(6, 12):
            step, cache = model.run_suffix(tokens[:, t:t + 1], cache)
            ours.append(step)
        expected = _decode(ref, tokens, _theirs(ref, tokens, 6), 6)
    torch.testing.assert_close(torch.cat(ours, 1), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.cat(ours, 1), full[:, 6:], rtol=0, atol=1e-5)


def test_the_cache_factorials_parts_each_move_the_suffix(checkpoint):
    """The hybrid factorial's cache parts: the donor's lightning states, its softmax K/V, or both, swapped at a
    boundary; each equals transformers' prefill of both rows, the same parts copied by hand, then its decode."""
    _, path, cls = checkpoint
    model, ref = load_model(path), _reference(path, cls)
    g = torch.Generator().manual_seed(11)
    recipient, donor = (torch.randint(4, model.cfg.vocab_size, (2, 15), generator=g) for _ in range(2))
    b = 9
    with torch.no_grad():
        rec, don = model.run_prefix(recipient[:, :b]), model.run_prefix(donor[:, :b])
        clean, _ = model.run_suffix(recipient[:, b:], rec)
        for parts in (("state",), ("kv",), ("state", "kv")):
            got, _ = model.run_suffix(recipient[:, b:], rec.swap_from(don, parts=parts))
            mine, theirs = _theirs(ref, recipient, b), _theirs(ref, donor, b)
            for l in range(4):
                if "state" in parts and l != 3:
                    mine.linear_cache[l] = theirs.linear_cache[l].clone()
                if "kv" in parts and l == 3:
                    mine.layers[l].keys, mine.layers[l].values = theirs.layers[l].keys, theirs.layers[l].values
            torch.testing.assert_close(got, _decode(ref, recipient, mine, b), rtol=0, atol=1e-5,
                                       msg=lambda m: f"{parts}: {m}")
            assert float((got - clean).abs().max()) > 1e-3, parts


def test_state_swap_through_the_protocol_equals_transformers_cache_edited_by_hand(checkpoint):
    """interventions.state_swap of head (2, 0) on recall pairs == transformers' prefill of both rows to the query
    boundary, the donor's state of that head copied into the recipient's linear_cache, then its decode steps."""
    from recurscope.interp.data import build_pairs
    from recurscope.interp.interventions import state_swap

    _, path, cls = checkpoint
    model, ref = load_model(path), _reference(path, cls)
    pairs = build_pairs(model.tokenizer, split="dev", n_sources=2, n_facts=2, presentations=2, filler_tokens=8)
    result = state_swap(model, pairs, [(2, 0)])
    with torch.no_grad():
        for i in range(len(pairs)):
            b = int(pairs.query_start[i])
            rec = _theirs(ref, pairs.recipient_ids[i:i + 1], b)
            don = _theirs(ref, pairs.donor_ids[i:i + 1], b)
            rec.linear_cache[2][:, 0] = don.linear_cache[2][:, 0]
            logits = _decode(ref, pairs.recipient_ids[i:i + 1], rec, b)
            at = logits[0, int(pairs.query_pos[i]) - b]
            torch.testing.assert_close(result.logits[i], at[pairs.candidate_ids[i]], rtol=0, atol=1e-4)


SMALL = ["--n-dev", "2", "--n-heldout", "3", "--n-facts", "2", "--presentations", "2", "--filler", "12",
         "--batch-size", "8"]


@pytest.mark.slow  # end to end
def test_recurscope_run_on_a_tiny_minimax(checkpoint, tmp_path, capsys):
    """`recurscope run` on the random checkpoint: the capability gate finds no recall and names no head; with the gate
    off (--gate-threshold 0) the scan covers every lightning head and the confirmation runs on its winner."""
    import pandas as pd

    from recurscope.interp.cli import main

    _, path, _ = checkpoint
    gated = tmp_path / "gated"
    assert main(["run", str(path), "--out", str(gated), *SMALL]) == 0
    assert "THE MODEL DOES NOT DO THE TASK" in capsys.readouterr().out
    assert "Confirmation on held-out sources" not in (gated / "report.md").read_text()
    study = tmp_path / "study"
    assert main(["run", str(path), "--out", str(study), "--gate-threshold", "0", *SMALL]) == 0
    report = (study / "report.md").read_text()
    assert "Head selection" in report and "Confirmation on held-out sources" in report
    heads = pd.read_csv(study / "scan" / "scan_heads.csv")
    assert sorted(zip(heads["layer"], heads["head"])) == [(l, h) for l in range(3) for h in range(2)]


def test_attribution_refuses_the_normed_residual_of_minimax(checkpoint):
    """MiniMax's layers norm the mixer's output after out_proj (post_attention_layernorm of the normed stream), so
    the candidate direction, which follows pre-norm blocks, is refused by name."""
    from recurscope.interp.attribution import attribute_readout

    _, path, _ = checkpoint
    model = load_model(path)
    with pytest.raises(ValueError, match="post-norm block.*explicit direction"):
        attribute_readout(model, _tokens(model.cfg.vocab_size, B=1), 1, 0, 10, candidates=(5, 6))
