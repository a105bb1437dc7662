"""The guards of issue 32 beyond the harness's one-line refusals: what they let through (the opt-ins and the
legitimate layouts), and the numbers they compute (run sizes against the pairs actually built, safetensors
headers against safetensors' own reader, the Ray worker clamp)."""
import argparse
import json
import os
import shutil

import pytest
import torch

from recurscope import kernels
from recurscope.hooks import StateReplace, WriteScale, run_with_patches
from recurscope.interp import cli_checks
from recurscope.interp.checkpoint_files import CheckpointError, safetensors_header
from recurscope.interp.data import build_pairs
from recurscope.interp.loading import load_model
from recurscope.interp.results import checkpoint_hash


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tiny_checkpoint):
    return tiny_checkpoint(tmp_path_factory.mktemp("guards") / "ckpt")


# ---- the run size -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_facts, presentations, filler, gap", [(4, 3, 512, 24), (1, 1, 0, 24), (16, 3, 0, 24),
                                                                  (2, 2, 12, 24), (8, 1, 64, 4)])
def test_size_estimate_bounds_the_pairs_built(ckpt, word_tok, n_facts, presentations, filler, gap):
    """The up-front estimate never undercounts the tokens build_pairs makes, and stays within 1.6x of them."""
    pairs = build_pairs(word_tok, split="dev", n_sources=2, n_facts=n_facts, presentations=presentations,
                        filler_tokens=filler, gap_tokens=gap, pairs_per_source=2)
    args = argparse.Namespace(model=str(ckpt), fn=print, command="lens", n_sources=2, pairs_per_source=2,
                              n_facts=n_facts, presentations=presentations, filler=filler, gap=gap, batch_size=4)
    size = cli_checks.size_run(args)
    built = int(pairs.recipient_ids.shape[1])
    assert size.pairs == len(pairs) == 4
    assert built <= size.sequence_tokens <= 1.6 * built, (built, size.sequence_tokens)
    assert size.total_tokens == 2 * size.pairs * size.sequence_tokens


def test_default_runs_pass_the_size_check(ckpt):
    """The paper's sizes (128 held-out sources x 4 pairs) are far inside the limits and this machine's memory."""
    args = argparse.Namespace(model=str(ckpt), fn=print, command="confirm", n_sources=128, pairs_per_source=4,
                              n_facts=4, presentations=3, filler=512, batch_size=16, yes=False, max_memory=None)
    size = cli_checks.check_size(args)
    assert size.total_tokens < cli_checks.MAX_TOTAL_TOKENS / 100


def test_yes_overrides_the_sanity_limit_but_not_the_memory_bound(ckpt):
    args = argparse.Namespace(model=str(ckpt), fn=print, command="scan", n_sources=2_000_000, pairs_per_source=1,
                              n_facts=1, presentations=1, filler=0, batch_size=1, yes=False, max_memory="1T")
    with pytest.raises(ValueError, match="sanity limit"):
        cli_checks.check_size(args)
    args.yes = True
    assert cli_checks.check_size(args).sources == 2_000_000
    args.max_memory = "1M"
    with pytest.raises(ValueError, match="set by --max-memory"):
        cli_checks.check_size(args)


def test_parse_bytes():
    assert cli_checks.parse_bytes("64G") == 64 << 30 and cli_checks.parse_bytes("512MiB") == 512 << 20
    assert cli_checks.parse_bytes("1.5k") == 1536 and cli_checks.parse_bytes("4096") == 4096
    for bad in ("", "-1G", "lots", "nanG"):
        with pytest.raises(ValueError, match="--max-memory"):
            cli_checks.parse_bytes(bad)


# ---- checkpoint files ---------------------------------------------------------------------------------------
def test_header_check_agrees_with_safetensors(ckpt, tmp_path):
    """Whatever safetensors' own reader refuses, the header check refuses before it (and accepts the intact file)."""
    from safetensors.torch import load_file

    data = (ckpt / "model.safetensors").read_bytes()
    assert safetensors_header(ckpt / "model.safetensors")
    for name, blob in {"short by one": data[:-1], "half": data[: len(data) // 2], "header only": data[:200],
                       "one byte more": data + b"\0"}.items():
        f = tmp_path / f"{name}.safetensors"
        f.write_bytes(blob)
        with pytest.raises(CheckpointError, match="cannot be read as weights"):
            safetensors_header(f)
        if name != "one byte more":        # safetensors reads past a trailing byte; we refuse it as damaged
            with pytest.raises(Exception):
                load_file(str(f))


def test_linked_weights_inside_the_directory_load(ckpt, tmp_path):
    """Hugging Face's cache links each snapshot file to a blob elsewhere: a link inside the directory is fine, and
    the hash reads through it (same bytes, same hash)."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    snap.mkdir()
    for f in ckpt.iterdir():
        shutil.copy(f, blobs / f.name)
        os.symlink(blobs / f.name, snap / f.name)
    model = load_model(snap)
    assert model.cfg.num_hidden_layers == 2
    assert checkpoint_hash(snap) == checkpoint_hash(ckpt)


def test_hash_covers_the_config(ckpt, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(ckpt, copy)
    before = checkpoint_hash(copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["tie_word_embeddings"] = not cfg.get("tie_word_embeddings", False)
    (copy / "config.json").write_text(json.dumps(cfg))
    assert checkpoint_hash(copy) != before


def test_check_finite_false_loads_nan_weights(ckpt, tmp_path):
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "copy"
    shutil.copytree(ckpt, copy)
    sd = load_file(str(copy / "model.safetensors"))
    name = sorted(sd)[0]
    sd[name] = sd[name].clone()
    sd[name].view(-1)[0] = float("inf")
    save_file(sd, str(copy / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"weight {name} in .* holds 1 NaN or inf"):
        load_model(copy)
    model = load_model(copy, check_finite=False)
    assert torch.isinf(model.state_dict()[model.family.weights.to_ours(name)]).any()


# ---- opt-ins of the strict API ------------------------------------------------------------------------------
def test_opt_ins_admit_what_the_checks_refuse(ckpt):
    model = load_model(ckpt)
    tokens = torch.randint(4, model.cfg.vocab_size, (1, 8))
    K, V = model.cfg.state_shape()
    state = torch.full((1, K, V), float("nan"))
    out = run_with_patches(model, tokens, [StateReplace(0, [1], 3, state, allow_nonfinite=True)])
    assert torch.isnan(out[0, 4:]).any()                      # NaN written on purpose propagates
    WriteScale(0, 1, 2, scale=float("inf"), allow_nonfinite=True)
    # a growing transition, computed alike by the step loop and the chunked form
    g = torch.full((1, 6, 1), 0.05, dtype=torch.float64)
    q, k, x = (torch.randn(1, 6, 1, 3, dtype=torch.float64) for _ in range(3))
    ref = kernels.recurrence(q, k, x, g, backend="reference", allow_growth=True)
    chk = kernels.recurrence(q, k, x, g, backend="chunked", allow_growth=True)
    torch.testing.assert_close(chk.o, ref.o)


def test_pairs_keep_their_tokenizer_through_select(ckpt):
    model = load_model(ckpt)
    pairs = build_pairs(model.tokenizer, split="dev", n_sources=2, n_facts=2, presentations=2, filler_tokens=12,
                        pairs_per_source=1)
    assert pairs.select([1]).report["tokenizer_hash"] == pairs.report["tokenizer_hash"]
    from recurscope.interp import interventions as iv

    iv.check_pairs(model, pairs.select([1]))                  # same tokenizer: accepted


# ---- Ray ------------------------------------------------------------------------------------------------------
class _FakeRay:
    def __init__(self, cpus, gpus=0):
        self.resources = {"CPU": cpus, "GPU": gpus}

    def cluster_resources(self):
        return self.resources


def test_workers_beyond_the_cluster_are_clamped(capsys):
    from recurscope.interp.distributed import DistributedError, fit_workers

    assert fit_workers(_FakeRay(2), None, False) == 2
    assert fit_workers(_FakeRay(2), 1, False) == 1
    assert fit_workers(_FakeRay(2), 8, False) == 2
    assert "--workers 8: the Ray cluster has 2 CPU(s)" in capsys.readouterr().err
    assert fit_workers(_FakeRay(16, 1), 4, True) == 1
    with pytest.raises(DistributedError, match="positive integer"):
        fit_workers(_FakeRay(2), 0, False)
