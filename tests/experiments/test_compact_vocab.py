"""experiments/compact_vocab.py: training over a real vocabulary's task rows plus one shared row is the full
vocabulary model's loss exactly; the rows cover every token the task and the filler produce; a smoke run on GPT-2's
vocabulary bundles into a checkpoint that loads with its tokenizer, scores as the compact model did, and whose prompt
ids are the package encoder's."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from experiments import train_tiny as tt
from experiments.compact_vocab import CompactLM, CompactVocabulary, task_token_ids
from recurscope.interp.models import ModelConfig, RecurrentLM


def _tiny(vocab_size: int, seed: int = 0) -> RecurrentLM:
    torch.manual_seed(seed)
    return RecurrentLM(ModelConfig.from_dict(dict(model_type="gla", vocab_size=vocab_size, hidden_size=32,
                                                  num_hidden_layers=2, num_heads=2)))


def test_compact_loss_and_candidate_logits_equal_the_expanded_full_vocabulary_model():
    """The reference is an ordinary V-row model whose other tokens all carry the shared row; its full-vocabulary
    cross-entropy over task tokens must equal the compact model's with log(n_other) on the shared logit."""
    V = 300
    full_ids = sorted(torch.randperm(V, generator=torch.Generator().manual_seed(1))[:40].tolist())
    vocab = CompactVocabulary(full_ids, V)
    compact = _tiny(vocab.size)
    with torch.no_grad():   # a shared row that is not negligible, so a wrong offset would show
        compact.lm_head.weight[vocab.other] = compact.lm_head.weight[0] * 3
    full = _tiny(V, seed=5)
    state = compact.state_dict()
    for name in ("embed.weight", "lm_head.weight"):
        key = next(k for k in state if k.endswith(name) or k == name)
        state[key] = vocab.expand_rows(state[key])
    full.load_state_dict(state)
    tokens = torch.tensor(full_ids)[torch.randint(0, len(full_ids), (3, 25), generator=torch.Generator().manual_seed(2))]
    with torch.no_grad():
        full_logits = full(tokens)
        small_logits = CompactLM(compact, vocab)(vocab.to_compact(tokens))
    want = F.cross_entropy(full_logits[:, :-1].reshape(-1, V), tokens[:, 1:].reshape(-1))
    got = F.cross_entropy(small_logits[:, :-1].reshape(-1, vocab.size), vocab.to_compact(tokens[:, 1:]).reshape(-1))
    assert got.item() == pytest.approx(want.item(), abs=1e-5)
    assert torch.allclose(full_logits[..., torch.tensor(full_ids)], small_logits[..., :vocab.other], atol=1e-5)
    # the offset is what makes it exact: without it the compact loss is lower than the full model's
    plain = F.cross_entropy(compact(vocab.to_compact(tokens))[:, :-1].reshape(-1, vocab.size),
                            vocab.to_compact(tokens[:, 1:]).reshape(-1))
    assert plain.item() < want.item() - 1e-3


def test_compact_vocabulary_refuses_ids_outside_the_vocabulary():
    with pytest.raises(ValueError, match="distinct token ids below full_size"):
        CompactVocabulary([1, 1, 2], 10)
    with pytest.raises(ValueError, match="distinct token ids below full_size"):
        CompactVocabulary([3, 12], 10)


@pytest.mark.slow
def test_task_rows_cover_every_token_of_paper_and_filler_batches(real_tok):
    ids = set(task_token_ids(real_tok))
    vocab = CompactVocabulary(sorted(ids), len(real_tok))
    import random

    rng = random.Random(0)
    for stage in (tt.paper_curriculum()[0], tt.paper_curriculum()[-1]):
        batch = vocab.remap_batch(tt.make_stage_batch(real_tok, rng, 0, stage, n_recall=4))
        assert int((batch["tokens"] == vocab.other).sum()) == 0
    assert vocab.unmapped == 0


def test_paper_curriculum_trains_the_paper_format_up_to_the_paper_layout():
    from recurscope.interp.data.layout import LAYOUTS

    paper = LAYOUTS["paper"]
    stages = tt.paper_curriculum()
    assert all(st["templates"] == (paper.template,) for st in stages)
    assert [st["name"] for st in stages] == [st["name"] for st in tt.STAGES if st["name"] != "templates"]
    last = stages[-1]
    assert paper.n_facts in last["facts"] and paper.presentations in last["presentations"]
    assert last["gap"][0] <= paper.gap_tokens <= last["gap"][1]
    assert last["filler"][1] == paper.filler_tokens


@pytest.mark.slow
def test_gpt2_smoke_run_bundles_into_a_checkpoint_that_loads_with_its_tokenizer(tmp_path, real_tokenizer_dir):
    from experiments.compact_vocab import bundle
    from recurscope.interp.data.layout import recorded_layout
    from recurscope.interp.loading import load_model

    run = tmp_path / "run"
    tt.train("tiny-gla", smoke=True, out=run, progress=False, tokenizer_dir=real_tokenizer_dir("gpt2"),
             layout="paper")
    out = tmp_path / "bundle"
    checks = bundle(run, out, "gpt2")
    assert checks["recall_equals_training_evaluation"]
    assert checks["prompt_ids_equal_package_encoder"]["equal"] == checks["prompt_ids_equal_package_encoder"]["rows"]
    assert checks["max_abs_logsumexp_difference"] < 1e-3
    model = load_model(out)
    assert len(model.tokenizer) == model.cfg.vocab_size == 50257
    assert recorded_layout(out).name == "paper"
    rows = json.loads((out / "vocab_rows.json").read_text())
    assert (out / "model.safetensors").stat().st_size < 4 * 128 * 2 * (len(rows["token_ids"]) + 1) + 4_000_000


def test_paper_curriculum_vocabs_fix_the_values_of_every_stage():
    assert all(st["vocabs"] == ("cities",) for st in tt.paper_curriculum(["cities"]))
    assert tt.paper_curriculum()[0]["vocabs"] == ("cities",) and tt.paper_curriculum()[-1]["vocabs"] is tt.ALL
    with pytest.raises(ValueError, match="vocabs must be a non-empty list"):
        tt.paper_curriculum(["planets"])
    with pytest.raises(ValueError, match="vocabs applies to the paper layout"):
        tt.train("tiny-gla", smoke=True, vocabs=["cities"])
