"""Evaluates the trained QED arms: validation loss; S-NIAH accuracy at 1x-16x the training length on fixed examples
shared by every arm (95% Wilson intervals, Figure 1); paired exact McNemar contrasts (Figure 2); the inference-time
strength sweep paired against s = 1; and eigenvalue / non-normality diagnostics from hook points and captured states.

Usage:  python -m experiments.qed.evaluate [--train DIR] [--out DIR] [--n 500] [--jobs 2] [--smoke]
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Optional, Sequence


import numpy as np
import pandas as pd
import torch

from recurscope import kernels
from experiments.qed import common
from experiments.qed.train_arms import DEFAULT_OUT as DEFAULT_TRAIN, validation_loss
from recurscope.hooks import hook_name
from recurscope.interp.data import FillerSource, NiahBatch, build_niah
from recurscope.interp.loading import load_model
from recurscope.interp.models import RecurrentLM, qed_strength
from recurscope.interp.plots import plot_accuracy_vs_length, plot_contrasts
from recurscope.interp.results import RunDir
from recurscope.interp.stats import binomial_ci, mcnemar_exact, mcnemar_table

DEFAULT_EVAL = common.ROOT / "results" / "qed" / "eval"
EVAL_SEED = 20260813          # the fixed S-NIAH examples; training examples use seeds >= 1_000_003
FULL_N = 500
BATCH_TOKENS = 16_384         # rows per forward = max(1, BATCH_TOKENS // length)


def niah_sets(tokenizer, lengths: Sequence[int], n: int, seed: int = EVAL_SEED) -> dict[int, NiahBatch]:
    """`n` S-NIAH examples per length at evenly spaced depths; a pure function of (lengths, n, seed)."""
    return {int(L): build_niah(tokenizer, n, int(L), seed=seed) for L in lengths}


@torch.no_grad()
def score_niah(model: RecurrentLM, batch: NiahBatch, batch_tokens: int = BATCH_TOKENS) -> np.ndarray:
    """Per-example correctness: argmax over the number vocabulary at query_pos is the needle's value."""
    length = batch.input_ids.shape[1]
    step = max(1, batch_tokens // length)
    cand = batch.candidate_ids
    out = []
    for lo in range(0, len(batch), step):
        hi = min(len(batch), lo + step)
        logits = common.last_logits(model, batch.input_ids[lo:hi], batch.query_pos[lo:hi])
        out.append((logits[:, cand].argmax(-1).cpu() == batch.answer_index[lo:hi]).numpy())
    return np.concatenate(out)


def _rows(arm, seed, length, correct, **extra) -> list[dict]:
    return [{"arm": arm, "seed": seed, "length": length, "item": i, "correct": bool(c), **extra}
            for i, c in enumerate(correct)]


# ---------------------------------------------------------------------------------------------------------------
# Diagnostics
# ---------------------------------------------------------------------------------------------------------------


def diagnostic_sequences(tokenizer, n_sequences: int, length: int) -> torch.Tensor:
    """Half held-out filler, half S-NIAH (seed distinct from the scored examples), each `length` tokens."""
    n_niah = n_sequences // 2
    rows = []
    if n_niah:
        rows.append(build_niah(tokenizer, n_niah, length, seed=EVAL_SEED + 1).input_ids)
    filler = [FillerSource(id=10_000 + i, split="heldout").token_ids(tokenizer, length)
              for i in range(n_sequences - n_niah)]
    if filler:
        rows.append(torch.tensor(filler, dtype=torch.long))
    return torch.cat(rows)


@torch.no_grad()
def token_head_quantities(model: RecurrentLM, tokens: torch.Tensor) -> dict[int, dict[str, torch.Tensor]]:
    """Per recurrent layer, flattened over (batch, time, head): e (from the model's own erase vector a), e_gdn2
    (1 - sum b k^2), rho = q.k, ||Sbar^T d|| with Sbar_t = D_t S_{t-1} and d = P_perp_k(b*q), and the raw
    k, a, g needed for the erase-factor matrices. q, k, a, g come from hook points, S from hook_state."""
    T = tokens.shape[1]
    names = set()
    for layer, _ in common.qed_mixers(model):
        names |= {hook_name(h, layer) for h in ("hook_q", "hook_k", "hook_erase", "hook_erase_gate", "hook_decay",
                                                 "hook_state")}
    _, cache = model.run_with_cache(tokens, state_positions=list(range(T)), names_filter=lambda n: n in names)
    out = {}
    for layer, mixer in common.qed_mixers(model):
        q, k = cache[hook_name("hook_q", layer)].float(), cache[hook_name("hook_k", layer)].float()
        a, g = cache[hook_name("hook_erase", layer)].float(), cache[hook_name("hook_decay", layer)].float()
        states = cache[hook_name("hook_state", layer)].float()          # (B, T, H, K, V), S_t after step t
        b = cache[common.erase_gate_name(layer)].float()
        prev = torch.cat([torch.zeros_like(states[:, :1]), states[:, :-1]], dim=1)
        sbar = g.exp()[..., None] * prev
        d = common.qed_direction(k, q, b)
        sd = torch.einsum("bthkv,bthk->bthv", sbar, d).norm(dim=-1)
        H = q.shape[2]
        out[layer] = {"e": kernels.erase_eigenvalue(k, a).reshape(-1), "e_gdn2": common.gdn2_eigenvalue(k, b).reshape(-1),
                      "rho": (q * k).sum(-1).reshape(-1), "sbar_d_norm": sd.reshape(-1),
                      "k_shortfall": (1 - (k * k).sum(-1)).reshape(-1),
                      "k": k.reshape(-1, k.shape[-1]), "a": a.reshape(-1, a.shape[-1]), "g": g.reshape(-1, g.shape[-1]),
                      "head": torch.arange(H).repeat(q.shape[0] * q.shape[1]),
                      "pos": torch.arange(T).repeat_interleave(H).repeat(q.shape[0])}
        del states, prev, sbar
    return out


def erase_factor_norms(k: torch.Tensor, a: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """For M = I - k a^T and M D (D = Diag(exp g)): spectral radius and largest singular value (float64)."""
    k, a, g = k.double(), a.double(), g.double()
    K = k.shape[-1]
    M = torch.eye(K, dtype=torch.float64) - k[:, :, None] * a[:, None, :]
    MD = M * g.exp()[:, None, :]
    return {"radius_M": torch.linalg.eigvals(M).abs().amax(-1), "sigma_M": torch.linalg.matrix_norm(M, ord=2),
            "radius_MD": torch.linalg.eigvals(MD).abs().amax(-1), "sigma_MD": torch.linalg.matrix_norm(MD, ord=2)}


def diagnose(model: RecurrentLM, tokens: torch.Tensor, arm: str, seed: int, matrix_samples: int = 2000,
             batch: int = 1) -> tuple[dict, Optional[dict]]:
    """Summary statistics over every token-head of every layer, and the most amplifying non-normal example."""
    parts = {key: [] for key in ("e", "e_gdn2", "rho", "sbar_d_norm", "k_shortfall")}
    mats = {key: [] for key in ("k", "a", "g")}
    where = []
    for lo in range(0, tokens.shape[0], batch):
        for layer, qd in token_head_quantities(model, tokens[lo:lo + batch]).items():
            for key in parts:
                parts[key].append(qd[key])
            for key in mats:
                mats[key].append(qd[key])
            where.append(torch.stack([torch.full_like(qd["head"], layer), qd["head"], qd["pos"]], -1))
    cat = {key: torch.cat(v) for key, v in parts.items()}
    e, e_gdn2, rho, sd = cat["e"], cat["e_gdn2"], cat["rho"], cat["sbar_d_norm"]
    lam = common.qed_lambdas(model)
    lams = [x for v in lam.values() if v for x in v]
    row = {"arm": arm, "seed": seed, "token_heads": int(e.numel()),
           "lambda_mean": float(np.mean(lams)) if lams else float("nan"),
           "e_min": float(e.min()), "e_max": float(e.max()), "n_abs_e_gt_1": int((e.abs() > 1).sum()),
           "n_e_outside_0_1": int(((e <= 0) | (e >= 1)).sum()),
           "max_abs_e_minus_gdn2": float((e - e_gdn2).abs().max()),
           # L2 normalisation has an eps, so ||k||^2 < 1 and a projected arm's e moves by lam |k.(b*q)| (1 - ||k||^2)
           # <= lam_max * max(1 - ||k||^2); this column is that shortfall
           "max_k_norm_shortfall": float(cat["k_shortfall"].max()),
           "rho_mean": float(rho.mean()), "rho_min": float(rho.min()), "rho_max": float(rho.max()),
           "abs_rho_mean": float(rho.abs().mean()),
           "sbar_d_mean": float(sd.mean()), "sbar_d_median": float(sd.median()), "sbar_d_max": float(sd.max()),
           "lam_rho_sbar_d_mean": float("nan")}
    if lams:
        # |o_QED - o_GDN2| for one step from common inputs is lam |rho| ||Sbar^T d|| (paper eq. 12), full arm's d.
        H = len(next(v for v in lam.values() if v))
        per_head = torch.tensor([lam[l][h] for l in sorted(lam) for h in range(H)])
        idx = torch.cat(where)
        lam_t = per_head[idx[:, 0] * H + idx[:, 1]] if len(lam) == (int(idx[:, 0].max()) + 1) else None
        if lam_t is not None:
            row["lam_rho_sbar_d_mean"] = float((lam_t * rho.abs() * sd).mean())
    if arm in ("noproj", "nogate_noproj") and lams:
        # e(s) = e_gdn2 - s * (e_gdn2 - e): the smallest strength s >= 0 at which some sample leaves (0, 1).
        c = e_gdn2 - e
        s_to_0 = torch.where(c > 0, e_gdn2 / c.clamp_min(1e-30), torch.full_like(c, float("inf")))
        s_to_1 = torch.where(c < 0, (1 - e_gdn2) / (-c).clamp_min(1e-30), torch.full_like(c, float("inf")))
        row["min_strength_leaving_0_1"] = float(torch.minimum(s_to_0, s_to_1).min())
    # Non-normality on a random subset of token-heads (eigenvalues of K x K matrices are the costly part).
    k_all, a_all, g_all = (torch.cat(mats[key]) for key in ("k", "a", "g"))
    gen = torch.Generator().manual_seed(seed)
    pick = torch.randperm(k_all.shape[0], generator=gen)[:matrix_samples]
    norms = erase_factor_norms(k_all[pick], a_all[pick], g_all[pick])
    inside_M = norms["radius_M"] <= 1 + 1e-9
    grow_M = norms["sigma_M"] > 1 + 1e-9
    inside_MD = norms["radius_MD"] < 1
    grow_MD = norms["sigma_MD"] > 1 + 1e-9
    row.update({"matrix_samples": int(len(pick)), "frac_M_spec_in_disk_and_norm_gt_1": float((inside_M & grow_M).float().mean()),
                "max_sigma_M": float(norms["sigma_M"].max()),
                "frac_MD_radius_lt_1_and_norm_gt_1": float((inside_MD & grow_MD).float().mean()),
                "max_sigma_MD_with_radius_lt_1": float(norms["sigma_MD"][inside_MD].max()) if inside_MD.any() else float("nan")})
    example = None
    cand = inside_MD & grow_MD
    if cand.any():
        j = int(torch.argmax(torch.where(cand, norms["sigma_MD"], torch.zeros_like(norms["sigma_MD"]))))
        i = int(pick[j])
        k1, a1, g1 = k_all[i].double(), a_all[i].double(), g_all[i].double()
        MD = (torch.eye(k1.numel(), dtype=torch.float64) - torch.outer(k1, a1)) * g1.exp()[None, :]
        _, svals, vh = torch.linalg.svd(MD)
        x = vh[0]
        layer, head, pos = (int(v) for v in torch.cat(where)[i])
        example = {"arm": arm, "seed": seed, "layer": layer, "head": head, "position_in_sequence": pos,
                   "spectral_radius_MD": float(torch.linalg.eigvals(MD).abs().max()),
                   "sigma_max_MD": float(svals[0]), "growth_norm_MDx_over_x": float((MD @ x).norm() / x.norm()),
                   "e_t": float(1 - a1 @ k1), "min_decay": float(g1.exp().min()), "max_decay": float(g1.exp().max())}
    return row, example


def paper_nonnormal_example() -> dict:
    """A hand-worked 2x2 case (not from the paper): k=(1,0), b=(.5,.5), q=(0,1), lam=.2 gives M with spec {0.5, 1}
    and ||M(0,1)|| > 1."""
    k = torch.tensor([[[1.0, 0.0]]], dtype=torch.float64)
    q = torch.tensor([[[0.0, 1.0]]], dtype=torch.float64)
    b = torch.full_like(k, 0.5)
    a = kernels.erase_vector(k, q, b, torch.tensor([0.2], dtype=torch.float64), "full")[0, 0]
    M = torch.eye(2, dtype=torch.float64) - torch.outer(k[0, 0], a)
    x = torch.tensor([0.0, 1.0], dtype=torch.float64)
    return {"M": M.tolist(), "spectrum": sorted(float(v) for v in torch.linalg.eigvals(M).real),
            "norm_Mx_over_x": float((M @ x).norm()), "expected": (1.01) ** 0.5}


def constructed_eigenvalue_check(seed: int = 0, n: int = 100_000, K: int = 32, H: int = 2) -> pd.DataFrame:
    """Random unit k, q, gates b in (0,1) and lam = 0.25 (lambda_max): per arm, max |e - e_gdn2| and the range of e.
    Projected arms keep e = 1 - sum b k^2 in (0,1); unprojected arms can leave it (q = k, b -> 1 gives 1 - 1.25)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.nn.functional.normalize(torch.randn(n, H, K, generator=gen, dtype=torch.float64), dim=-1)
    q = torch.nn.functional.normalize(torch.randn(n, H, K, generator=gen, dtype=torch.float64), dim=-1)
    q[: n // 10] = k[: n // 10]   # aligned queries: the case in which the unprojected arms move e most
    b = torch.rand(n, H, K, generator=gen, dtype=torch.float64) ** 0.25
    z = torch.nn.functional.normalize(torch.randn(H, K, generator=gen, dtype=torch.float64), dim=-1)
    lam = torch.full((H,), 0.25, dtype=torch.float64)
    e0 = common.gdn2_eigenvalue(k, b)
    rows = []
    for arm in common.ARMS:
        e = kernels.erase_eigenvalue(k, kernels.erase_vector(k, q, b, lam, arm, z))
        rows.append({"arm": arm, "samples": n * H, "max_abs_e_minus_gdn2": float((e - e0).abs().max()),
                     "e_min": float(e.min()), "e_max": float(e.max()), "n_outside_0_1": int(((e <= 0) | (e >= 1)).sum())})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------------------------
# One job per model (run in a worker process)
# ---------------------------------------------------------------------------------------------------------------


def evaluate_model(train_root: str, arm: str, seed: int, lengths: Sequence[int], n: int, strengths: Sequence[float],
                   strength_lengths: Sequence[int], diag_sequences: int, diag_length: int, matrix_samples: int,
                   val_rows: int, threads: int = 1) -> dict:
    torch.set_num_threads(int(threads))
    t0 = time.time()
    model = load_model(Path(train_root) / f"{arm}-s{seed}", backend="chunked")
    tok = model.tokenizer
    result = {"arm": arm, "seed": seed, "val_loss": validation_loss(model, tok, rows=val_rows), "niah": [],
              "strength": [], "diag": None, "example": None}
    sets = niah_sets(tok, sorted(set(lengths) | set(strength_lengths)), n)
    for L in lengths:
        result["niah"] += _rows(arm, seed, L, score_niah(model, sets[L]))
    if strengths and arm != "gdn2":
        for s in strengths:
            with qed_strength(model, s):
                for L in strength_lengths:
                    result["strength"] += _rows(arm, seed, L, score_niah(model, sets[L]), strength=float(s))
    if diag_sequences:
        tokens = diagnostic_sequences(tok, diag_sequences, diag_length)
        result["diag"], result["example"] = diagnose(model, tokens, arm, seed, matrix_samples)
    result["seconds"] = round(time.time() - t0, 1)
    print(f"[eval {arm} s{seed}] done in {result['seconds']:.0f}s", flush=True)
    return result


def evaluate_model_cached(cache: str, settings: dict, train_root: str, arm: str, seed: int, *rest) -> dict:
    """evaluate_model(train_root, arm, seed, *rest), saved per model so that an interrupted evaluation resumes where
    it stopped: a model whose result file exists with the same settings and the same checkpoint file is not
    evaluated again."""
    cache_path = Path(cache)
    weights = (Path(train_root) / f"{arm}-s{seed}" / "model.safetensors").stat()
    key = {"settings": settings, "arm": arm, "seed": seed, "checkpoint_bytes": weights.st_size,
           "checkpoint_mtime_ns": weights.st_mtime_ns}
    if cache_path.is_file():
        saved = torch.load(cache_path, weights_only=False)
        if saved.get("key") == key:
            print(f"[eval {arm} s{seed}] reusing {cache_path}", flush=True)
            return saved["result"]
    result = evaluate_model(train_root, arm, seed, *rest)
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache_path.with_suffix(".tmp")
    torch.save({"key": key, "result": result}, tmp)
    tmp.replace(cache_path)  # atomic: a kill mid-write leaves no half file to trust
    return result


# ---------------------------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------------------------


def accuracy_table(examples: pd.DataFrame) -> pd.DataFrame:
    g = examples.groupby(["arm", "seed", "length"], sort=False)["correct"]
    frame = g.agg(n="size", n_correct="sum").reset_index()
    cis = [binomial_ci(int(k), int(m)) for k, m in zip(frame["n_correct"], frame["n"])]
    frame["accuracy"] = [c.estimate for c in cis]
    frame["ci_low"] = [c.low for c in cis]
    frame["ci_high"] = [c.high for c in cis]
    return frame


def contrast_table(examples: pd.DataFrame, contrasts: Sequence[tuple]) -> pd.DataFrame:
    """Exact McNemar per (contrast, seed, length) on the same items. b_only/a_only: discordant counts."""
    rows = []
    key = examples.set_index(["arm", "seed", "length", "item"])["correct"].sort_index()  # sorted: fast, warning-free .loc
    arms = set(examples["arm"])
    for arm_a, arm_b in contrasts:
        if arm_a not in arms or arm_b not in arms:
            continue
        for seed in sorted(set(examples["seed"])):
            for L in sorted(set(examples["length"])):
                try:
                    ca, cb = key.loc[(arm_a, seed, L)].sort_index(), key.loc[(arm_b, seed, L)].sort_index()
                except KeyError:
                    continue
                if not ca.index.equals(cb.index):
                    raise ValueError(f"{arm_a} and {arm_b} (seed {seed}, length {L}) were scored on different items")
                r = mcnemar_exact(ca.to_numpy(), cb.to_numpy())
                rows.append({"contrast": f"{arm_a} - {arm_b}", "seed": seed, "length": L, "n": r.n,
                             "acc_a": r.accuracy_a, "acc_b": r.accuracy_b, "diff_pp": 100 * r.accuracy_difference,
                             "a_only_correct": r.b10, "b_only_correct": r.b01, "p_value": r.p_value})
    return pd.DataFrame(rows)


def strength_table(strength_rows: pd.DataFrame) -> pd.DataFrame:
    frame = strength_rows.assign(unit=strength_rows["arm"] + "/s" + strength_rows["seed"].astype(str))
    out = mcnemar_table(frame, arm_col="strength", correct_col="correct", item_col="item", reference=1.0,
                        by=["unit", "length"])
    out = out.rename(columns={"arm": "strength", "reference": "reference_strength",
                              "b01": "only_s1_correct", "b10": "only_s_correct"})
    out[["arm", "seed"]] = out["unit"].str.split("/s", expand=True)
    out["seed"] = out["seed"].astype(int)
    return out[["arm", "seed", "length", "strength", "n", "accuracy", "accuracy_reference", "difference_pp",
                "only_s_correct", "only_s1_correct", "p_value"]].sort_values(["arm", "seed", "length", "strength"])


def _write(rd: RunDir, name: str, frame: pd.DataFrame) -> None:
    rd.write_table(name, frame)
    (rd.path / f"{name}.md").write_text(common.markdown_table(frame))


def run(train_root: Path, out: Path, arms: Sequence[str], seeds: Sequence[int], n: int, multipliers: Sequence[int],
        strengths: Sequence[float], strength_arms: Sequence[str], strength_multipliers: Sequence[int],
        diag_sequences: int, diag_length: int, matrix_samples: int, val_rows: int, jobs: int = 1,
        threads: int = 1) -> dict:
    lengths = common.lengths_from(common.TRAIN_LENGTH, multipliers)
    strength_lengths = common.lengths_from(common.TRAIN_LENGTH, strength_multipliers)
    args = {"train_root": str(train_root), "arms": list(arms), "seeds": list(seeds), "n": n, "lengths": lengths,
            "strengths": list(strengths), "strength_arms": list(strength_arms), "strength_lengths": strength_lengths,
            "diag_sequences": diag_sequences, "diag_length": diag_length, "matrix_samples": matrix_samples,
            "val_rows": val_rows, "eval_seed": EVAL_SEED}
    rd = RunDir.create_or_open(out, kind="qed-evaluate", model_name="qed-arms", args=args, seeds=list(seeds),
                               extra={"jobs": jobs, "threads": threads})
    trained = [(a, s) for s in seeds for a in arms if (Path(train_root) / f"{a}-s{s}" / "model.safetensors").is_file()]
    missing = [f"{a}-s{s}" for s in seeds for a in arms if (a, s) not in trained]
    if not trained:
        raise ValueError(f"no trained model under {train_root} for arms {list(arms)} and seeds {list(seeds)}; "
                         "run experiments/qed/train_arms.py first.")
    if missing:  # a partial run (e.g. cut by a deadline) is evaluated on what exists; the tables say which
        print(f"evaluate: no checkpoint for {missing}; evaluating the other {len(trained)} models", flush=True)
    jobs_args = [(str(rd.path / "per_model" / f"{a}-s{s}.pt"), args, str(train_root), a, s, lengths, n,
                  list(strengths) if a in strength_arms else [], strength_lengths, diag_sequences, diag_length,
                  matrix_samples, val_rows, threads) for a, s in trained]
    if jobs <= 1:
        results = [evaluate_model_cached(*ja) for ja in jobs_args]
    else:
        with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
            results = list(pool.map(evaluate_model_cached, *zip(*jobs_args)))
    examples = pd.DataFrame([r for res in results for r in res["niah"]])
    rd.write_table("niah_examples", examples)
    tables = {"val_loss": pd.DataFrame([{"arm": r["arm"], "seed": r["seed"], "val_loss": r["val_loss"]} for r in results]),
              "niah_accuracy": accuracy_table(examples),
              "contrasts": contrast_table(examples, common.CONTRASTS)}
    srows = [r for res in results for r in res["strength"]]
    if srows:
        tables["strength"] = strength_table(pd.DataFrame(srows))
    diag = [r["diag"] for r in results if r["diag"] is not None]
    if diag:
        tables["diagnostics"] = pd.DataFrame(diag)
        examples_nn = [r["example"] for r in results if r["example"] is not None]
        if examples_nn:
            tables["nonnormal_examples"] = pd.DataFrame(examples_nn)
    tables["eigenvalue_constructed"] = constructed_eigenvalue_check()
    for name, frame in tables.items():
        _write(rd, name, frame)
    (rd.path / "paper_nonnormal_example.json").write_text(json.dumps(paper_nonnormal_example(), indent=2) + "\n")
    acc = tables["niah_accuracy"]
    plot_accuracy_vs_length(acc, rd.figure_path("fig1_niah_accuracy"), train_length=common.TRAIN_LENGTH,
                            arms=[a for a in common.ARMS if a in set(acc["arm"])],
                            title="S-NIAH accuracy (95% Wilson intervals)", dpi=80)
    contrasts = [c for c in common.CONTRASTS if c[0] in set(acc["arm"]) and c[1] in set(acc["arm"])]
    if contrasts:
        plot_contrasts(acc, rd.figure_path("fig2_contrasts"), contrasts=contrasts, train_length=common.TRAIN_LENGTH,
                       dpi=80)
    (rd.path / "timing.json").write_text(json.dumps({f"{r['arm']}-s{r['seed']}": r["seconds"] for r in results},
                                                    indent=2) + "\n")
    return tables


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=Path, default=DEFAULT_TRAIN, help="directory holding <arm>-s<seed>/")
    parser.add_argument("--out", type=Path, default=DEFAULT_EVAL)
    parser.add_argument("--arms", nargs="+", default=list(common.ARMS), choices=common.ARMS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--n", type=int, default=FULL_N, help="S-NIAH examples per length")
    parser.add_argument("--multipliers", nargs="+", type=int, default=list(common.LENGTH_MULTIPLIERS))
    parser.add_argument("--strengths", nargs="+", type=float, default=list(common.STRENGTHS))
    parser.add_argument("--strength-arms", nargs="+", default=["full"], choices=common.QED_ARMS)
    parser.add_argument("--strength-multipliers", nargs="+", type=int, default=list(common.LENGTH_MULTIPLIERS))
    parser.add_argument("--diag-sequences", type=int, default=128, help="sequences per model for the diagnostics")
    parser.add_argument("--diag-length", type=int, default=2048)
    parser.add_argument("--matrix-samples", type=int, default=4000, help="token-heads per model for eig/svd")
    parser.add_argument("--val-rows", type=int, default=32)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes everywhere (a pipeline check)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.n, args.multipliers, args.strength_multipliers = 8, [1, 2], [2]
        args.diag_sequences, args.diag_length, args.matrix_samples, args.val_rows = 2, 64, 64, 4
    for name in ("n", "diag_length", "val_rows", "matrix_samples"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1; received {getattr(args, name)}.")
    print("command: python -m experiments.qed.evaluate " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])))
    tables = run(args.train, args.out, args.arms, args.seeds, args.n, args.multipliers, args.strengths,
                 args.strength_arms, args.strength_multipliers, args.diag_sequences, args.diag_length,
                 args.matrix_samples, args.val_rows, args.jobs, args.threads)
    for name, frame in tables.items():
        print(f"\n== {name} ==\n{frame.to_string(index=False)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
