"""The transformers bridge on tiny random checkpoints built from transformers' own config classes and saved with
save_pretrained: parity with transformers' torch path, stepping, state patches and per-component cache swaps
(recurrent state, conv tails, KV) against hand edits of transformers' cache, hook_state against transformers' own
state, write patches that keep the erase, the interventions, the final norm and unembedding (logit lens, corrector),
the conv reach of the widened write block, the hook tables of docs/hooks.md, bad input, and the CLI (scan, confirm,
run, patch). test_bridge_hybrids.py runs the per-layout tests again on Qwen3-Next, OLMo-hybrid and Kimi-Linear."""
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from recurscope import kernels
from recurscope.hooks.patches import ReadoutReplace, StateReplace, WriteReplace, WriteScale, run_with_patches
from recurscope.interp import interventions as iv
from recurscope.interp.bridge import TransformersBridge
from recurscope.interp.bridge.torch_path import torch_reference_path
from recurscope.interp.data import build_pairs, build_word_tokenizer, save_word_tokenizer
from recurscope.interp.loading import load_model

from helpers_models import output_of

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = ("qwen3_5_dense", "qwen3_5_moe", "qwen3_5_multimodal")
GDN = dict(linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=16,
           linear_conv_kernel_dim=4)
TEXT = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            layer_types=["linear_attention"] * 3 + ["full_attention"], initializer_range=0.05, **GDN)


def _build(layout: str, vocab: int):
    import transformers as tf

    if layout == "qwen3_5_dense":
        return tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(vocab_size=vocab, intermediate_size=64, **TEXT)), \
            tf.Qwen3_5ForCausalLM
    if layout == "qwen3_5_moe":
        cfg = tf.Qwen3_5MoeTextConfig(vocab_size=vocab, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                      shared_expert_intermediate_size=24, **TEXT)
        return tf.Qwen3_5MoeForCausalLM(cfg), tf.Qwen3_5MoeForCausalLM
    if layout == "qwen3_5_multimodal":   # the text model sits under model.language_model.*, beside a vision tower
        cfg = tf.Qwen3_5Config(text_config=dict(vocab_size=vocab, intermediate_size=64, **TEXT),
                               vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32,
                                                  out_hidden_size=32))
        return tf.Qwen3_5ForConditionalGeneration(cfg), tf.Qwen3_5ForConditionalGeneration
    raise KeyError(layout)


def _randomise(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():   # visible norms, decays and gates, so that every path matters in the comparisons
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.copy_(p + 0.3 * torch.randn(p.shape, generator=g))
            elif "A_log" in name:   # slow forgetting, as in trained models, so that erase and state patches persist
                p.copy_(torch.empty(p.shape).uniform_(0.01, 0.1, generator=g).log())


def tiny_checkpoint(layout: str, build, tmp_path_factory, randomise: bool = True):
    """(layout, directory, transformers class) of a tiny random checkpoint: `build(layout, vocab)` gives transformers'
    own model (and its class), after torch.manual_seed(0), randomised by `_randomise` (unless randomise=False), saved
    with save_pretrained beside the word tokenizer. Every bridge test module's parametrised `checkpoint` fixture (and
    test_hybrid's bridged layouts) build theirs with it."""
    tok = build_word_tokenizer()
    torch.manual_seed(0)
    hf, cls = build(layout, len(tok))
    if randomise:
        _randomise(hf, 0)
    path = tmp_path_factory.mktemp(layout)
    hf.save_pretrained(path)
    save_word_tokenizer(tok, path)
    return layout, path, cls


@pytest.fixture(scope="module", params=LAYOUTS)
def checkpoint(request, tmp_path_factory):
    return tiny_checkpoint(request.param, _build, tmp_path_factory)


def _in_transformers_layout(model, state):
    """A head's state (..., K, V) as transformers' cache keeps it: (..., V, K) for Mamba-2 (head_dim x state_size)."""
    return state.transpose(-1, -2) if model.bridge_family.state_transposed else state


def _after(ids, start: int):
    """Position ids of ids[:, start:] after a cached prefix of `start` tokens: passed to transformers' own suffix runs,
    since Bamba's model numbers a suffix from 0 when it is given none (its RoPE would then see the wrong positions)."""
    return torch.arange(start, ids.shape[1])[None]


def _reference(path, cls):
    return cls.from_pretrained(str(path), dtype=torch.float32).eval()


def _tokens(vocab, B=2, T=19, seed=1):
    return torch.randint(4, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def test_loads_as_a_bridge_with_the_project_hooks(checkpoint):
    layout, path, _ = checkpoint
    model = load_model(path)
    assert isinstance(model, TransformersBridge) and model.tokenizer is not None
    assert model.recurrent_layers == [0, 1, 2] and model.attention_layers == [3] and model.n_state_heads == 2
    for point in ("hook_write_key", "hook_write_value", "hook_write_scale", "hook_erase", "hook_decay", "hook_state",
                  "hook_head_out", "hook_q", "hook_k", "hook_v", "hook_z"):
        assert f"blocks.0.mixer.{point}" in model.hook_dict
    for point in ("hook_q", "hook_k", "hook_v", "hook_pattern", "hook_head_out"):
        assert f"blocks.3.mixer.{point}" in model.hook_dict
    for point in ("hook_resid_pre", "hook_mixer_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post"):
        assert f"blocks.2.{point}" in model.hook_dict
    assert "hook_embed" in model.hook_dict
    assert model.heads() == [(l, h) for l in range(3) for h in range(2)]


def test_parity_with_transformers_torch_path_hooks_idle(checkpoint):
    layout, path, cls = checkpoint
    model, ref = load_model(path), _reference(path, cls)
    tokens = _tokens(model.cfg.vocab_size)
    seen = set()

    def idle(t, hook):
        seen.add(hook.name)
        return t

    with torch.no_grad(), torch_reference_path():
        expected = ref(input_ids=tokens).logits
        with model.hooks(fwd_hooks=[(lambda name: True, idle)]):
            got = model(tokens)
    assert len(seen) >= 40   # every hook point fired (hook_state fires only when positions are asked for)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_grouped_value_heads_reach_the_kernel_without_a_copy(checkpoint, monkeypatch):
    """Qwen3.5 has 2 value heads per key head here: without hooks on q, k or the write key, the kernel gets q and k
    with the key heads (no repeat) and the logits are transformers' own; a hook on hook_k still sees one key per value
    head (and the kernel then gets them repeated)."""
    layout, path, cls = checkpoint
    model, ref = load_model(path), _reference(path, cls)
    tokens = _tokens(model.cfg.vocab_size)
    heads = []
    real = kernels.recurrence
    monkeypatch.setattr(kernels, "recurrence",
                        lambda q, k, x, *a, **kw: heads.append((q.shape[2], x.shape[2])) or real(q, k, x, *a, **kw))
    with torch.no_grad(), torch_reference_path():
        expected = ref(input_ids=tokens).logits
        got = model(tokens)
        assert set(heads) == {(1, 2)}
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        heads.clear()
        seen = []
        with model.hooks(fwd_hooks=[("blocks.0.mixer.hook_k", lambda t, hook: seen.append(t.shape) or t)]):
            hooked = model(tokens)
    assert seen[0][2] == 2 and heads[0] == (2, 2) and set(heads[1:]) == {(1, 2)}
    torch.testing.assert_close(hooked, expected, rtol=0, atol=1e-5)


def test_stepping_equals_the_full_run(checkpoint):
    _, path, _ = checkpoint
    model = load_model(path)
    tokens = _tokens(model.cfg.vocab_size)
    with torch.no_grad():
        full = model(tokens)
        cache = model.run_prefix(tokens[:, :7])
        mid, cache = model.run_suffix(tokens[:, 7:15], cache)
        last, _ = model.run_suffix(tokens[:, 15:], cache)
    torch.testing.assert_close(torch.cat([mid, last], 1), full[:, 7:], rtol=0, atol=1e-5)


def test_state_patch_equals_a_hand_edit_of_the_transformers_cache(checkpoint):
    """StateReplace at position p, with that layer's readout at p itself kept as it was (the state patch also
    changes o_p, which a cache edit after step p cannot) == transformers' own run of [0, p], its cache's recurrent
    state edited by hand, then transformers' own run of the suffix. The plain patch changes every position >= p."""
    from transformers import DynamicCache

    _, path, cls = checkpoint
    model, ref = load_model(path), _reference(path, cls)
    tokens = _tokens(model.cfg.vocab_size, seed=3)
    layer, head, p = 1, 1, 8
    K, V = model.cfg.state_shape()
    new_state = torch.randn(2, K, V, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out_name = f"blocks.{layer}.mixer.hook_head_out"
        clean, clean_cache = model.run_with_cache(tokens, names_filter=out_name)
        state = StateReplace(layer, head, position=p, state=new_state)
        keep_readout = ReadoutReplace(layer, head, [p], value=clean_cache[out_name])
        patched = run_with_patches(model, tokens, [state])
        as_cache_edit = run_with_patches(model, tokens, [state, keep_readout])
        with torch_reference_path():
            text_cfg = ref.config.get_text_config(decoder=True)
            cache = DynamicCache(config=text_cfg)
            ref(input_ids=tokens[:, :p + 1], cache=cache, use_cache=True)
            cache.layers[layer].recurrent_states[0][:, head] = _in_transformers_layout(model, new_state)
            suffix = ref(input_ids=tokens[:, p + 1:], cache=cache, use_cache=True,
                         position_ids=_after(tokens, p + 1)).logits
    torch.testing.assert_close(as_cache_edit[:, p + 1:], suffix, rtol=0, atol=1e-5)
    torch.testing.assert_close(patched[:, :p], clean[:, :p], rtol=0, atol=0)
    change = (patched - clean).abs().amax(-1)                # (B, T)
    assert bool((change[:, p:] > 1e-4).all()), change


def _hand_swapped_suffix(ref, recipient, donor, b, parts):
    """transformers' own prefix runs of both rows to b, the donor's `parts` copied into the recipient's cache by hand
    (recurrent_states, conv_states, the attention layers' keys/values), then transformers' own suffix run."""
    from transformers import DynamicCache

    caches = []
    for ids in (recipient, donor):
        c = DynamicCache(config=ref.config.get_text_config(decoder=True))
        ref(input_ids=ids[:, :b], cache=c, use_cache=True)
        caches.append(c)
    rec, don = caches
    for mine, theirs in zip(rec.layers, don.layers):
        if hasattr(mine, "recurrent_states"):
            if "state" in parts:
                mine.recurrent_states[0] = theirs.recurrent_states[0].clone()
            if "conv" in parts:
                mine.conv_states[0] = theirs.conv_states[0].clone()
        # attention layers and Falcon-H1's parallel layers (state, conv and K/V in one cache layer); not Nemotron-H's
        # MLP blocks
        if "kv" in parts and getattr(mine, "keys", None) is not None:
            mine.keys, mine.values = theirs.keys.clone(), theirs.values.clone()
    return ref(input_ids=recipient[:, b:], cache=rec, use_cache=True, position_ids=_after(recipient, b)).logits


def test_every_hook_name_is_a_module_path_and_an_nnsight_envoy(checkpoint):
    """get_submodule(name) and nnsight's envoy of every hook name are that hook point; `blocks` and each block's
    `mixer` are modules; the state dict and the parameters keep transformers' names (under `hf.`) and reload."""
    from recurscope.hooks.nnsight import RecurscopeNNsight

    _, path, _ = checkpoint
    model = load_model(path)
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == model.cfg.n_layers
    model_nn = RecurscopeNNsight(model)
    for name, point in model.hook_dict.items():
        assert model.get_submodule(name) is point, name
        assert model_nn.get(name)._module is point, name
    for layer, block in enumerate(model.blocks):
        assert model.get_submodule(f"blocks.{layer}.mixer") is block.mixer
    # the class load_model wraps (AutoModelForCausalLM's, or the family's model_class where fla shares the name)
    theirs = {f"hf.{k}" for k in type(model.hf).from_pretrained(str(path)).state_dict()}
    assert set(model.state_dict()) == theirs
    assert {n for n, _ in model.named_parameters()} <= theirs
    model.load_state_dict(model.state_dict(), strict=True)


def test_a_state_patch_through_nnsight_equals_run_with_patches(checkpoint):
    """The nnsight doc's donor -> recipient state patch (one batched trace with a barrier) on every layout."""
    from recurscope.hooks.nnsight import RecurscopeNNsight

    _, path, _ = checkpoint
    model = load_model(path)
    donor, recipient = _tokens(model.cfg.vocab_size, B=1, seed=6), _tokens(model.cfg.vocab_size, B=1, seed=7)
    layer, head, t = 1, 1, 8
    model_nn = RecurscopeNNsight(model)
    with torch.no_grad():
        with model_nn.trace(state_positions=[t]) as tracer:
            barrier = tracer.barrier(2)
            with tracer.invoke(donor):
                donor_state = model_nn.blocks[layer].mixer.hook_state.output[:, 0].clone().save()
                barrier()
            with tracer.invoke(recipient):
                barrier()
                model_nn.blocks[layer].mixer.hook_state.output[:, 0, head] = donor_state[:, head]
                patched = model_nn.output.save()
        _, cache = model.run_with_cache(donor, state_positions=[t])
        reference = run_with_patches(model, recipient,
                                     [StateReplace(layer, head, t, cache[f"blocks.{layer}.mixer.hook_state"][:, 0])])
        clean = model(recipient)
    torch.testing.assert_close(patched, reference, rtol=0, atol=1e-5)
    assert float((reference - clean)[:, t:].abs().max()) > 1e-3


def test_greedy_generate_equals_transformers_generate(checkpoint):
    """generate on the recurrent cache == transformers' own greedy generate (its torch path), == generate rerunning
    the whole sequence each step, and each new token is the full forward's argmax at the position before it."""
    _, path, cls = checkpoint
    model, ref = load_model(path), _reference(path, cls)
    prompt, new = _tokens(model.cfg.vocab_size, B=2, T=9, seed=8), 7
    with torch.no_grad(), torch_reference_path():
        theirs = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                              min_new_tokens=new, do_sample=False)
        ours = model.generate(prompt, max_new_tokens=new, do_sample=False, stop_at_eos=False)
        rerun = model.generate(prompt, max_new_tokens=new, do_sample=False, stop_at_eos=False,
                               use_past_kv_cache=False)
        full = model(ours)
    assert ours.shape == (2, 9 + new)
    assert torch.equal(ours, theirs)
    assert torch.equal(rerun, ours)
    assert torch.equal(full[:, 8:-1].argmax(-1), ours[:, 9:])


def test_component_swaps_equal_the_same_swaps_in_transformers_cache(checkpoint):
    """swap_from(donor, parts) at a boundary, then the suffix == the same parts swapped by hand in transformers'
    cache and transformers' own suffix run, for the recurrent states, the conv tails, the KV and all three; each
    part changes the suffix."""
    _, path, cls = checkpoint
    model = load_model(path)
    ref = cls.from_pretrained(str(path), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(11)
    recipient = torch.randint(4, model.cfg.vocab_size, (2, 17), generator=g)
    donor = torch.randint(4, model.cfg.vocab_size, (2, 17), generator=g)
    b = 10
    with torch.no_grad():
        rec_cache, don_cache = model.run_prefix(recipient[:, :b]), model.run_prefix(donor[:, :b])
        clean, _ = model.run_suffix(recipient[:, b:], rec_cache)
        kv = ("kv",) if model.attention_layers else ()   # Mamba-2 has no attention layer, so no K/V
        for parts in (("state",), ("conv",), *[kv] * bool(kv), ("state", "conv", *kv)):
            got, _ = model.run_suffix(recipient[:, b:], rec_cache.swap_from(don_cache, parts=parts))
            with torch_reference_path():
                expected = _hand_swapped_suffix(ref, recipient, donor, b, parts)
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5, msg=lambda m: f"{parts}: {m}")
            assert float((got - clean).abs().max()) > 1e-3, parts


def test_hook_state_at_requested_positions_is_transformers_own_state(checkpoint):
    """hook_state captured at several positions in one run == the recurrent state transformers' own torch path keeps
    in its cache (recurrent_states, (B, H, K, V): the project's layout as it is) after a prefix run to each
    position, on every linear-attention layer."""
    from transformers import DynamicCache

    _, path, cls = checkpoint
    model, ref = load_model(path), _reference(path, cls)
    tokens = _tokens(model.cfg.vocab_size, seed=13)
    positions = [0, 6, 13, tokens.shape[1] - 1]
    names = {l: f"blocks.{l}.mixer.hook_state" for l in model.recurrent_layers}
    with torch.no_grad():
        _, got = model.run_with_cache(tokens, state_positions=positions, names_filter=lambda n: n in names.values())
        with torch_reference_path():
            for j, p in enumerate(positions):
                theirs = DynamicCache(config=ref.config.get_text_config(decoder=True))
                ref(input_ids=tokens[:, :p + 1], cache=theirs, use_cache=True)
                for layer, name in names.items():
                    expected = _in_transformers_layout(model, theirs.layers[layer].recurrent_states[0])
                    assert got[name].shape == (2, len(positions), *expected.shape[1:])
                    torch.testing.assert_close(got[name][:, j].to(expected.dtype), expected, rtol=0, atol=1e-5,
                                               msg=lambda m: f"layer {layer}, position {p}: {m}")
    first = got[names[model.recurrent_layers[0]]]
    assert float((first[:, 1] - first[:, 2]).abs().max()) > 1e-3   # the positions hold different states


def _layer_inputs(model, tokens, layer):
    names = [f"blocks.{layer}.mixer.{p}" for p in ("hook_q", "hook_k", "hook_write_value", "hook_decay",
                                                   "hook_erase", "hook_write_key", "hook_head_out")]
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
    return [cache[n] for n in names]


def test_write_patches_keep_the_erase(checkpoint):
    """write_block (WriteScale 0) and donor_write (WriteReplace) at layer l: layer l's readout equals the kernel
    with the write changed and the erase a_t still acting, and differs from the kernel with the erase removed."""
    _, path, _ = checkpoint
    model = load_model(path, dtype=torch.float64)   # float64 throughout, so that the comparison is sharp
    model.hf.set_experts_implementation("eager")    # MoE layers: grouped_mm has no float64
    tokens, donor = _tokens(model.cfg.vocab_size, seed=7), _tokens(model.cfg.vocab_size, seed=8)
    layer, head, positions = 0, 1, [10, 11, 12]
    K, _ = model.cfg.state_shape()
    with torch.no_grad():
        q, k, x, g, a, _, _ = _layer_inputs(model, tokens, layer)
        _, _, dx, _, _, du, _ = _layer_inputs(model, donor, layer)
        mask = torch.zeros(q.shape[:3], dtype=torch.bool)
        mask[:, positions, head] = True
        scale = K ** -0.5
        # write_block
        with model.hooks(fwd_hooks=WriteScale(layer, head, positions, 0.0).fwd_hooks()):
            _, got = model.run_with_cache(tokens, names_filter=f"blocks.{layer}.mixer.hook_head_out")
        o = got[f"blocks.{layer}.mixer.hook_head_out"]
        ws = (~mask).double()
        keep = kernels.recurrence(q, k, x, g, a, scale=scale, write_scale=ws, backend="reference").o
        no_erase = kernels.recurrence(q, k, x, g, torch.where(mask[..., None], 0.0, a), scale=scale, write_scale=ws,
                                      backend="reference").o
        torch.testing.assert_close(o, keep, rtol=0, atol=1e-12)
        assert float((o - no_erase).abs().max()) > 1e-4 * float(o.abs().max())   # the erase mattered here
        # donor_write
        patch = WriteReplace(layer, head, positions, key=du, value=dx)
        with model.hooks(fwd_hooks=patch.fwd_hooks()):
            _, got = model.run_with_cache(tokens, names_filter=f"blocks.{layer}.mixer.hook_head_out")
        o = got[f"blocks.{layer}.mixer.hook_head_out"]
        m = mask[..., None]
        extra = (torch.where(m, du, 0.0), torch.where(m, dx, 0.0))
        keep = kernels.recurrence(q, k, x, g, a, scale=scale, write_scale=ws, extra_write=extra,
                                  backend="reference").o
        torch.testing.assert_close(o, keep, rtol=0, atol=1e-12)


def test_interventions_run_through_the_protocol(checkpoint):
    """state_swap on the bridge == transformers' own prefix runs, the chosen head's state swapped by hand in
    transformers' cache, and transformers' own suffix run."""
    from transformers import DynamicCache

    from recurscope.interp.interventions import state_swap, write_block

    _, path, cls = checkpoint
    model, ref = load_model(path), _reference(path, cls)
    pairs = build_pairs(model.tokenizer, split="dev", n_sources=2, n_facts=2, presentations=2, filler_tokens=8)
    heads = [(2, 0)]
    result = state_swap(model, pairs, heads)
    assert torch.isfinite(result.logits).all() and torch.isfinite(write_block(model, pairs, heads).logits).all()
    text_cfg = ref.config.get_text_config(decoder=True)
    with torch.no_grad(), torch_reference_path():
        for i in range(len(pairs)):
            b = int(pairs.query_start[i]) - 1
            caches = []
            for ids in (pairs.recipient_ids[i:i + 1], pairs.donor_ids[i:i + 1]):
                c = DynamicCache(config=text_cfg)
                ref(input_ids=ids[:, :b + 1], cache=c, use_cache=True)
                caches.append(c)
            rec, don = caches
            rec.layers[2].recurrent_states[0][:, 0] = don.layers[2].recurrent_states[0][:, 0]
            logits = ref(input_ids=pairs.recipient_ids[i:i + 1, b + 1:], cache=rec, use_cache=True,
                         position_ids=_after(pairs.recipient_ids, b + 1)).logits
            at = logits[0, int(pairs.query_pos[i]) - b - 1]
            expect = at[pairs.candidate_ids[i]]
            torch.testing.assert_close(result.logits[i], expect, rtol=0, atol=1e-4)


# ---- the final norm and unembedding (the logit lens, the corrector) -----------------------------------------------
def test_unembed_of_the_last_residual_is_transformers_own_logits(checkpoint):
    """unembed (the final norm, then the LM head) of the residual leaving the last block == transformers' own logits:
    the norm is applied once, to what the last block returns. So is final_norm(resid) @ unembed_weight.T, the linear
    map that attribution and the corrector read (Granite-4.0-H's logits_scaling included)."""
    _, path, cls = checkpoint
    model, ref = load_model(path), _reference(path, cls)
    tokens = _tokens(model.cfg.vocab_size, seed=9)
    last = f"blocks.{model.cfg.num_hidden_layers - 1}.hook_resid_post"
    with torch.no_grad(), torch_reference_path():
        expected = ref(input_ids=tokens).logits
        _, cache = model.run_with_cache(tokens, names_filter=last)
        got = model.unembed(cache[last])
        linear = model.final_norm(cache[last]) @ model.unembed_weight.T
        head_only = model.hf.lm_head(cache[last])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(linear, expected, rtol=0, atol=1e-5)
    assert float((head_only - expected).abs().max()) > 1e-3   # the final norm matters in this comparison
    assert model.unembed_weight.shape == (model.cfg.vocab_size, cache[last].shape[-1])


def _candidate_rows(model, tokens, layer, head, pos, good, bad):
    """attribute_readout's rows with candidates (good, bad), after checking that they sum to hook_head_out."""
    from recurscope.interp.attribution import attribute_readout

    df = attribute_readout(model, tokens, layer, head, pos, candidates=(good, bad))
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    o = cache[f"blocks.{layer}.mixer.hook_head_out"][0, pos, head]
    np.testing.assert_allclose(np.stack(df.contribution).sum(0), o.numpy(), rtol=0,
                               atol=1e-9 * float(o.abs().max()))
    return df, cache


def test_candidate_projections_follow_the_gated_norm_by_hand(checkpoint):
    """attribution's candidate direction on a bridged Qwen3.5: z = rmsnorm(o) * weight * silu(in_proj_z(h)) per
    value head; with the rms frozen, the head's direct logit difference through out_proj, the final norm (its weight
    1 + w) frozen at the last residual and the LM head, by hand from transformers' own modules."""
    _, path, _ = checkpoint
    model = load_model(path, dtype=torch.float64)
    model.hf.set_experts_implementation("eager")    # MoE layers: grouped_mm has no float64
    layer, head, pos, good, bad = 1, 1, 10, 5, 17
    tokens = _tokens(model.cfg.vocab_size, B=1, T=12, seed=3)
    mixer = model.blocks[layer].mixer
    cols = slice(head * mixer.head_v, (head + 1) * mixer.head_v)
    gate = output_of(mixer.in_proj_z, model, tokens)[0, pos, cols]
    df, cache = _candidate_rows(model, tokens, layer, head, pos, good, bad)
    o = cache[f"blocks.{layer}.mixer.hook_head_out"][0, pos, head]
    with torch.no_grad():
        s = torch.rsqrt(o.pow(2).mean() + mixer.norm.variance_epsilon) * mixer.norm.weight * F.silu(gate)
        torch.testing.assert_close(s * o, cache[f"blocks.{layer}.mixer.hook_z"][0, pos, head], rtol=1e-5, atol=1e-9)
        written = mixer.out_proj.weight[:, cols] @ (s * o)
        resid = cache[f"blocks.{model.cfg.num_hidden_layers - 1}.hook_resid_post"][0, pos]
        final = model.final_norm
        frozen = written * torch.rsqrt(resid.pow(2).mean() + final.eps) * (1 + final.weight)
        expected = float((model.hf.lm_head.weight[good] - model.hf.lm_head.weight[bad]) @ frozen)
    assert abs(expected) > 1e-6
    assert df.projection.sum() == pytest.approx(expected, rel=1e-5)


def test_lens_after_the_last_layer_is_the_model_itself(checkpoint):
    from recurscope.interp.protocols import lens

    _, path, _ = checkpoint
    model = load_model(path)
    pairs = build_pairs(model.tokenizer, split="heldout", n_sources=3, n_facts=2, presentations=2, filler_tokens=8)
    rows = lens.lens_rows(model, pairs)
    L = model.cfg.num_hidden_layers
    last = rows[(rows.layer == L - 1) & (rows.side == "after")]
    np.testing.assert_array_equal(last["correct"], last["final_correct"])
    assert len(last) == int(pairs.is_target.sum())
    for layer in range(L - 1):   # before layer l + 1 is after layer l: the same residual
        before = rows[(rows.layer == layer + 1) & (rows.side == "before")]["correct"].to_numpy()
        np.testing.assert_array_equal(before, rows[(rows.layer == layer) & (rows.side == "after")]["correct"])


def test_corrected_logits_equal_the_hooked_forward(checkpoint):
    """The corrector's shortcut (delta added to the last residual at the query position, then unembed) == a real
    forward with delta added there by a hook."""
    from recurscope.interp.protocols import corrector

    _, path, _ = checkpoint
    model = load_model(path)
    p = build_pairs(model.tokenizer, split="heldout", n_sources=3, n_facts=2, presentations=2, filler_tokens=8)
    feats = corrector.collect_features(model, p, [(1, 1)])
    delta = torch.randn(feats.resid.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    fast = corrector.corrected_logits(model, p, feats.resid, delta)
    at = torch.arange(len(p))

    def add(resid, hook):
        out = resid.clone()
        out[at, p.query_pos] += delta.to(out.dtype)
        return out
    with torch.no_grad(), model.hooks(fwd_hooks=[(f"blocks.{model.cfg.num_hidden_layers - 1}.hook_resid_post", add)]):
        logits = model(p.recipient_ids)
    torch.testing.assert_close(fast, iv.candidate_logits(logits[at, p.query_pos], p.candidate_ids), atol=1e-4,
                               rtol=1e-4)
    torch.testing.assert_close(corrector.corrected_logits(model, p, feats.resid, 0 * delta), feats.clean, atol=1e-4,
                               rtol=1e-4)


def test_conv_tail_spans_reach_as_far_as_the_conv_transformers_runs(checkpoint):
    """write_block_conv_tail's spans widen each fact span by the reach of the conv1d transformers runs (its kernel
    minus 1), as on a native model; and pairs are bounded by the attention layers' max_position_embeddings."""
    from recurscope.interp.protocols._common import max_length

    _, path, _ = checkpoint
    model = load_model(path)
    kernel = model.blocks[model.recurrent_layers[0]].mixer.conv1d.weight.shape[-1]
    pairs = build_pairs(model.tokenizer, split="heldout", n_sources=2, n_facts=2, presentations=2, filler_tokens=8)
    fact, wide = iv.resolve_spans(pairs, "fact"), iv.spans_with_conv_tail(model, pairs)
    assert kernel > 1 and torch.equal(wide[..., 0], fact[..., 0])
    assert torch.equal(wide[..., 1], torch.minimum(fact[..., 1] + kernel - 1, pairs.query_start[:, None]))
    bound = getattr(model.hf.config.get_text_config(decoder=True), "max_position_embeddings", None)
    assert max_length(model) == (bound if model.attention_layers else None)   # Mamba-2: no attention, no bound


# ---- the bridge's hook tables in docs/hooks.md --------------------------------------------------------------------
_HOOK_TOKEN = re.compile(r"`((?:blocks\.\{l\}\.)?(?:mixer\.|attn\.)?hook_\w+)`")


def _documented_hooks(layout: str) -> set:
    """{(kind, name)} of the bridge's tables in docs/hooks.md, kind "model", "block" (every layer), "recurrent" or
    "attention" (a row marked "(attention)"); names as blocks.{l}.[mixer.]hook_x. The Qwen3.5 table serves every
    layout, the second table adds the rows of Qwen3-Next, OLMo-hybrid and Kimi-Linear (their other rows read as in
    the first); Mamba-2, Nemotron-H, Bamba, Granite-4.0-H, Falcon-H1 and Zamba2 have tables of their own ("mlp
    block": a row marked "(MLP blocks)", Nemotron-H's blocks that hold only an MLP or MoE; `attn.` names are the
    attention beside Falcon-H1's recurrent mixer or in a use of Zamba2's shared block, kind "attention", as is
    `hook_attn_out`, what that attention adds). An architecture added later has its own section, whose heading names
    its model_type in backticks."""
    text = (ROOT / "docs" / "hooks.md").read_text().split("## On transformers checkpoints (the bridge)", 1)[1]
    text = text.split("\n## ", 1)[0]
    # an architecture's own section, whose heading names its model_type in backticks: "### MiniMax (`minimax`)"
    for section in text.split("\n### ")[1:]:
        if f"`{layout}`" in section.split("\n", 1)[0]:
            return _hook_rows(section)
    text = re.split(r"\n### [^\n]*\(`[a-z0-9_]+`\)", text, maxsplit=1)[0]   # the sections above, without those
    qwen, others = text.split("### Qwen3-Next, OLMo-hybrid and Kimi-Linear", 1)
    others, mamba = others.split("### Mamba-2", 1)
    mamba, nemotron = mamba.split("### Nemotron-H", 1)
    nemotron, bamba = nemotron.split("### Bamba", 1)
    bamba, granite = bamba.split("### Granite-4.0-H", 1)
    granite, falcon = granite.split("### Falcon-H1", 1)
    falcon, zamba = falcon.split("### Zamba2", 1)
    own = {"mamba2": mamba, "nemotron_h": nemotron, "bamba": bamba, "granitemoehybrid": granite, "falcon_h1": falcon,
           "zamba2": zamba}
    tables = [qwen] if layout.startswith("qwen3_5") else [own[layout]] if layout in own else [qwen, others]
    return set().union(*(_hook_rows(table) for table in tables))


def _hook_rows(table: str) -> set:
    """{(kind, name)} of one hook table's rows (see _documented_hooks)."""
    found = set()
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        cell = line.split("|")[1]
        context = "blocks.{l}"
        for token in _HOOK_TOKEN.findall(cell):
            if token == "hook_embed":
                found.add(("model", token))
                continue
            if token.startswith(("mixer.", "attn.")):
                token = "blocks.{l}." + token
            elif not token.startswith("blocks."):   # a bare hook_x continues the cell's first name
                token = f"{context}.{token}"
            context = token.rsplit(".", 1)[0]
            kind = ("attention" if "(attention)" in cell else "recurrent") if ".mixer." in token \
                else "attention" if ".attn." in token or token.endswith(".hook_attn_out") \
                else "mlp block" if "(MLP blocks)" in cell else "block"
            found.add((kind, token))
    return found


def test_the_bridge_hook_tables_of_the_docs_are_the_models_hook_points(checkpoint):
    layout, path, _ = checkpoint
    model = load_model(path)
    documented = _documented_hooks(layout)
    mixer_layers = model.recurrent_layers + model.attention_layers   # the rest: Nemotron-H's MLP-only blocks
    actual = set()
    for name in model.hook_dict:
        m = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
        if m is None:
            actual.add(("model", name))
            continue
        layer, rest = int(m.group(1)), m.group(2)
        kind = ("recurrent" if layer in model.recurrent_layers else "attention") if rest.startswith("mixer.") \
            else "attention" if rest.startswith("attn.") or rest == "hook_attn_out" \
            else "block" if layer in mixer_layers else "mlp block"
        actual.add((kind, "blocks.{l}." + rest))
    assert len(documented) >= (20 if model.attention_layers else 14)   # Mamba-2: no attention or MLP hooks
    assert documented - actual == set(), "docs/hooks.md names hooks this model lacks"
    assert actual - documented == set(), "this model has hooks docs/hooks.md does not list"
    # and each documented name is there on every layer of its kind
    layers = {"block": mixer_layers, "recurrent": model.recurrent_layers, "attention": model.attention_layers,
              "mlp block": [l for l in range(model.cfg.num_hidden_layers) if l not in mixer_layers]}
    for kind, name in documented - {("model", "hook_embed")}:
        assert all(name.format(l=l) in model.hook_dict for l in layers[kind]), name


def _scan_against_naive(model):
    from recurscope.interp import scan
    from recurscope.interp.data import build_pairs

    pairs = build_pairs(model.tokenizer, split="dev", n_sources=2, pairs_per_source=2, n_facts=2, presentations=2,
                        filler_tokens=8)
    key = list(scan.SCAN_KEY)
    fast = scan.run_scan(model, pairs, batch_size=4, prefix_batch=2).rows.set_index(key).sort_index()
    slow = scan.naive_head_shifts(model, pairs).set_index(key).sort_index()
    assert fast.index.equals(slow.index) and len(fast) == len(pairs) * len(model.heads())
    torch.testing.assert_close(torch.tensor(fast["shift"].to_numpy()), torch.tensor(slow["shift"].to_numpy()),
                               rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(fast["clean_margin"].to_numpy()),
                               torch.tensor(slow["clean_margin"].to_numpy()), rtol=0, atol=1e-5)
    assert float(fast["shift"].abs().max()) > 1e-4   # the heads move the margin, so the comparison has teeth


def test_scan_equals_one_full_patched_forward_per_head(checkpoint):
    """The head scan on the bridge (the growing batch through embed_suffix / run_layer / unembed: rows join at their
    patched layer, logits at the query position only, the recipient's cache read as shared views) == one full
    patched forward per head (scan.naive_head_shifts), to 1e-5; batch_size 4 splits the rows of a layer."""
    _scan_against_naive(load_model(checkpoint[1]))


def test_scan_with_attention_below_recurrent_layers(tmp_path_factory):
    """As above on a Qwen3.5 whose attention layer sits second: the causal mask within the suffix, recorded from
    transformers' own model, then reaches the query through the recurrent layers above it."""
    import transformers as tf

    text = dict(TEXT, layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"])
    _, path, _ = tiny_checkpoint("qwen3_5_dense", lambda _, vocab: (tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(
        vocab_size=vocab, intermediate_size=64, **text)), None), tmp_path_factory)
    model = load_model(path)
    assert model.attention_layers == [1]
    _scan_against_naive(model)


# ---- bad input ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return tiny_checkpoint("qwen3_5_dense", _build, tmp_path_factory, randomise=False)[1]


def test_scan_under_a_hook_on_the_attention_keys(dense):
    """The scan's rows read the cached K/V of an attention layer once for all rows; a hook on hook_k still sees
    every cached and new key (the attention then concatenates them), and the scan's rows are the same."""
    from recurscope.interp import scan
    from recurscope.interp.data import build_pairs

    model = load_model(dense)
    pairs = build_pairs(model.tokenizer, split="dev", n_sources=1, pairs_per_source=2, n_facts=2, presentations=2,
                        filler_tokens=8)
    plain = scan.run_scan(model, pairs, batch_size=4).rows
    lengths = set()

    def see(k, hook):
        lengths.add(k.shape[1])
        return k

    with model.hooks(fwd_hooks=[("blocks.3.mixer.hook_k", see)]):
        hooked = scan.run_scan(model, pairs, batch_size=4).rows
    T = pairs.recipient_ids.shape[1]
    suffix = T - int(pairs.query_start[0])
    assert lengths <= {int(pairs.query_start[0]), T} and T in lengths   # prefix keys, then cached + suffix keys
    assert suffix > 0
    torch.testing.assert_close(torch.tensor(hooked["shift"].to_numpy()), torch.tensor(plain["shift"].to_numpy()),
                               rtol=0, atol=1e-6)


def test_refuses_an_unsupported_architecture(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"unknown model_type 'llama' in config.json \(architectures "
                                         r"\['LlamaForCausalLM'\]\)"):
        load_model(tmp_path)


def test_a_checkpoint_without_tokenizer_loads_and_refuses_only_pairs(dense, tmp_path):
    """As a native checkpoint: it loads for forward and hook work; building pairs names the fix (issue 27)."""
    for f in ("config.json", "model.safetensors"):
        (tmp_path / f).write_bytes((dense / f).read_bytes())
    model = load_model(tmp_path)
    assert model.tokenizer is None and model(torch.tensor([[1, 2, 3]])).shape[:2] == (1, 3)
    with pytest.raises(ValueError, match=r"no tokenizer.*load_model\(dir, tokenizer="):
        build_pairs(model.tokenizer, n_sources=1)
    assert load_model(tmp_path, tokenizer=dense).tokenizer is not None


def test_refuses_shards_that_do_not_match_the_index(dense, tmp_path):
    for f in dense.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    sd = load_file(str(dense / "model.safetensors"))
    names = sorted(sd)
    half = len(names) // 2
    save_file({k: sd[k] for k in names[:half]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({k: sd[k] for k in names[half:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    wrong = {k: ("model-00002-of-00002.safetensors" if i < 2 else
                 "model-00001-of-00002.safetensors" if i < half else "model-00002-of-00002.safetensors")
             for i, k in enumerate(names)}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wrong}))
    with pytest.raises(ValueError, match="do not match model.safetensors.index.json"):
        load_model(tmp_path)


@pytest.mark.slow  # end to end
def test_recurscope_run_completes_on_a_tiny_qwen35(dense, tmp_path):
    from recurscope.interp.cli import main

    out = tmp_path / "study"
    args = ["run", str(dense), "--n-dev", "2", "--n-heldout", "3", "--out", str(out), "--n-facts", "2",
            "--presentations", "2", "--filler", "12", "--batch-size", "8", "--gate-threshold", "0"]
    assert main(args) == 0
    report = (out / "report.md").read_text()
    assert "Head selection" in report and "Confirmation on held-out sources" in report


@pytest.mark.slow  # end to end
def test_recurscope_scan_then_confirm_from_the_scan_on_a_tiny_qwen35(dense, tmp_path):
    """`recurscope scan` then `recurscope confirm --from-scan` as two commands: the scan rows cover every
    (target pair, recurrent head) once and no attention layer; the confirmation runs every arm on every held-out
    target pair, on the scan's winner, and its all-readouts restore gives the clean margin by construction."""
    import pandas as pd

    from recurscope.interp.cli import main
    from recurscope.interp.confirm import ARMS
    from recurscope.interp.results import RunDir

    small = ["--n-facts", "2", "--presentations", "2", "--filler", "12", "--batch-size", "8", "--n-sources", "2",
             "--gate-threshold", "0"]
    scan_dir, confirm_dir = tmp_path / "scan", tmp_path / "confirm"
    assert main(["scan", str(dense), *small, "--out", str(scan_dir)]) == 0
    manifest = json.loads((scan_dir / "manifest.json").read_text())
    assert manifest["kind"] == "scan" and manifest["split"] == "dev" and manifest["sources"] == [0, 1]
    rows = RunDir.open(scan_dir).table("scan_rows").read()
    heads = [(l, h) for l in range(3) for h in range(2)]   # layers 0-2 are GDN, layer 3 attention
    keys = list(zip(rows["source"], rows["pair"], rows["layer"], rows["head"]))
    assert len(keys) == len(set(keys)) == 2 * 4 * len(heads)      # 2 sources x 4 pairs per source x 6 heads
    assert set(zip(rows["layer"], rows["head"])) == set(heads)
    table = pd.read_csv(scan_dir / "scan_heads.csv")
    assert sorted(zip(table["layer"], table["head"])) == heads
    winner = [int(table.iloc[0]["layer"]), int(table.iloc[0]["head"])]

    assert main(["confirm", str(dense), "--from-scan", str(scan_dir), *small, "--out", str(confirm_dir)]) == 0
    manifest = json.loads((confirm_dir / "manifest.json").read_text())
    assert manifest["kind"] == "confirm" and manifest["split"] == "heldout" and manifest["args"]["heads"] == [winner]
    rows = RunDir.open(confirm_dir).table("confirm_rows").read()
    assert set(rows["intervention"]) == set(ARMS)
    per_arm = rows.groupby("intervention").size()
    assert (per_arm == 2 * 4).all(), per_arm                       # every held-out target pair, once per arm
    label = f"L{winner[0]}H{winner[1]}"
    control = rows["intervention"].str.startswith("control_head")
    assert set(rows.loc[~control, "heads"]) == {label}
    assert len(set(rows.loc[control, "heads"])) == 1 and label not in set(rows.loc[control, "heads"])
    restore = rows[rows["intervention"] == "output_restore"]
    np.testing.assert_allclose(restore["margin"], restore["clean_margin"], rtol=0, atol=1e-4)
    summary = pd.read_csv(confirm_dir / "confirm_summary.csv")
    assert set(summary["intervention"]) == set(ARMS)
    assert (scan_dir / "figures" / "scan_heatmap.png").is_file() and (confirm_dir / "figures" / "effects.png").is_file()


def _patch_cli_runs_the_five_interventions(path, capsys):
    """`recurscope patch` on the checkpoint at `path` (layer 1, head 0) exits 0 and reports the five arms."""
    from recurscope.interp.cli import main

    args = ["patch", str(path), "--layer", "1", "--head", "0", "--n-facts", "2", "--presentations", "2",
            "--filler", "12"]
    assert main(args) == 0
    out = capsys.readouterr().out
    for name in ("write_block", "donor_write", "state_swap", "output_patch", "output_restore"):
        assert name in out


@pytest.mark.slow  # end to end
def test_recurscope_patch_runs_the_five_interventions_on_a_tiny_qwen35(dense, capsys):
    _patch_cli_runs_the_five_interventions(dense, capsys)
