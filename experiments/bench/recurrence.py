"""Times the recurrence on a CPU against its pure-torch peers, interleaved in a shuffled order, at one thread.

Contenders per family (B=1, H=4, K=V=128, float32), all called through their public entry points:
    GDN    recurscope chunked (kernels.recurrence with beta=, input checks included), fla 0.6's
           naive_chunk_gated_delta_rule, transformers' torch_chunk_gated_delta_rule (its pure-torch body, unwrapped
           from the hub-kernel dispatcher), and optionally the step-loop reference (--reference)
    KDA    recurscope chunked (beta=), fla's naive_chunk_kda
    GDN-2  recurscope chunked (a = b k, x = w v formed outside), fla's naive_chunk_gdn2
    GLA    recurscope chunked, fla's naive_recurrent_gla (fla has no pure-torch chunked GLA)
    sGLA   scalar-decay GLA (one log decay per head and step: simple GLA, Mamba-2, RetNet-style): recurscope
           chunked, fla's naive_chunk_simple_gla
    QED    recurscope chunked (fla has no QED op); its overhead over GDN-2 is printed
    RWKV-7 kernels.recurrence_low_rank (chunked), fla's dplr_chunkwise (chunk 32) and dplr_recurrence, on RWKV-7's
           form (log w in (-0.607, 0), a = kk, b = kk iclr; fla's alpha = -a)
--backward times each contender's forward plus the gradient of every input it reads (q, k, v, g and the gates),
against the same peers.
plus a plain torch bmm of the chunked path's shape class, so that a same-run matmul rate sits in every round.

Each round runs every contender of a (family, T) once, in an order shuffled per round (seeded); a ratio is
formed within each round (paired) and the median of those paired ratios is printed beside the ratio of the minima.
`uptime` is printed before and after: on a shared machine other jobs inflate every figure, the ratios less so.
--clock cpu times each call by this process's CPU time instead of elapsed time: at one thread the time other
jobs hold the core then does not count (cache and memory-bandwidth contention still does).

Useful FLOPs of the chunked algorithm, per chunk of C steps and per head (multiply-add = 2 FLOPs), with C the
kernel's default chunk length (kernels.chunked.default_chunk_size: 32 with an erase vector, 64 without):
    pairwise A_qk, A_ak (lower triangles)          C(C+1) K + C(C-1) K
    unit-triangular inverse of (I + A_ak)           C^3 / 3
    sequential: R = L^-1 (X - (a e^G) S)            2 C^2 V + 2 C K V
    sequential: S' = D S + K^T R                    2 C K V
    output: A_qk R + (q e^G) S_0                    C(C+1) V + 2 C K V
For a family without an erase vector (GLA) the A_ak, inverse and L^-1 terms drop out (R = X). With autograd the
kernel forms R = R0 - M S instead (R0 = L^-1 X, M = L^-1 (a e^G): 2 C^2 K more); the bench times calls without a
graph. Elementwise work (exponentials, decay factors) is not counted. The bmm that sets the reference rate keeps
one fixed shape, (128, 64, 128) @ (128, 128, 128), whatever C is.

--baseline DIR adds an older checkout's chunked kernels (DIR/kernels/chunked.py and low_rank.py, e.g. from `git
archive`) as a contender, called through the same entry, so that old against new is a paired ratio of one run; --no-peers leaves
only those two (no peers, no bmm between their calls).

--families GVA varlen adds the GDN cases of grouped value heads (q and k with half the heads, against repeating
them first) and of packed sequences of different lengths (cu_seqlens, against padding to the longest and a loop),
each beside fla's naive chunk and transformers' torch chunk on the inputs they need.

Usage:  python -m experiments.bench.recurrence [--lengths 2048 8192] [--repeats 7] [--threads 1] [--reference]
                 [--backward] [--baseline DIR] [--families GDN KDA GDN-2 GLA sGLA QED RWKV-7 GVA varlen]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import random
import resource
import statistics
import subprocess
import time
import warnings
from types import SimpleNamespace
from typing import Callable, NamedTuple, Optional

import torch

import recurscope

from recurscope import kernels
from recurscope.kernels.chunked import default_chunk_size
from recurscope.kernels.inputs import family_inputs
from recurscope.kernels.low_rank import DEFAULT_CHUNK

B, H, K, V = 1, 4, 128, 128
# chunked time / fastest peer's, at T >= 2048 (issue 44: at least 2x every peer, forward and backward)
TARGETS = {fam: 0.5 for fam in ("GDN", "KDA", "GDN-2", "GLA", "sGLA", "RWKV-7")}
RATE_TARGETS = {"GDN": 70, "KDA": 70, "GDN-2": 70, "GLA": 45, "sGLA": 45, "RWKV-7": 50}  # % of the same-run bmm rate


def chunked_flops(T: int, with_erase: bool = True) -> float:
    C = default_chunk_size(with_erase)                                # the chunk length the kernel runs
    n_chunks = -(-T // C)
    per = C * (C + 1) * K + C * (C + 1) * V + 2 * C * K * V          # A_qk, A_qk R, (q e^G) S_0
    per += 2 * C * K * V                                              # S' = D S + K^T R
    if with_erase:                                                    # A_ak, inverse, L^-1 (X - (a e^G) S)
        per += C * (C - 1) * K + C ** 3 / 3 + 2 * C * C * V + 2 * C * K * V
    return float(per * n_chunks * B * H)


def low_rank_flops(T: int) -> float:
    """Useful FLOPs of the decay-plus-low-rank chunked forward (kernels.low_rank, chunk low_rank.DEFAULT_CHUNK), per
    chunk of C steps and per head: the pairwise terms A_ab, A_ak (strictly lower) and A_qb, A_qk (lower), the inverse,
    R0 = L^-1 A_ak X and M = L^-1 (a e^G), the within-chunk output A_qb R0 + A_qk X and A_qb M, and the sequential
    products M S_0, (q e^G - A_qb M) S_0, B^T R and K^T X (each 2 C K V)."""
    C = DEFAULT_CHUNK
    per = 2 * C * (C - 1) * K + 2 * C * (C + 1) * K + C ** 3 / 3          # pairwise terms, inverse
    per += C * (C - 1) * V + C * C * V + C * C * K                        # A_ak X, L^-1 (.), L^-1 (a e^G)
    per += 2 * C * (C + 1) * V + C * C * K                                # A_qb R0 + A_qk X, A_qb M
    per += 4 * 2 * C * K * V                                              # M S, Q S, B^T R, K^T X
    return float(per * -(-T // C) * B * H)


BMM_SHAPE = (128, 64, 128, 128)                                       # (batch, rows, K, V)
BMM_FLOPS = 2.0 * BMM_SHAPE[0] * BMM_SHAPE[1] * BMM_SHAPE[2] * BMM_SHAPE[3]


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average %.2f %.2f %.2f" % os.getloadavg()


def peers():
    """The pure-torch peers, imported quietly (fla warns that Triton has no CPU driver): a namespace of functions."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fla.ops.generalized_delta_rule.dplr.naive import dplr_chunkwise, dplr_recurrence
        from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule
        from fla.ops.gdn2.naive import naive_chunk_gdn2
        from fla.ops.gla.naive import naive_recurrent_gla
        from fla.ops.kda.naive import naive_chunk_kda
        from fla.ops.simple_gla.naive import naive_chunk_simple_gla
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
    # transformers wraps the function in a hub-kernel dispatcher that routes to fla's Triton op when fla is
    # installed (no CPU driver here); __wrapped__ is its own pure-torch body.
    hf = getattr(torch_chunk_gated_delta_rule, "__wrapped__", torch_chunk_gated_delta_rule)
    return SimpleNamespace(gdn=naive_chunk_gated_delta_rule, gdn2=naive_chunk_gdn2, gla=naive_recurrent_gla,
                           kda=naive_chunk_kda, simple_gla=naive_chunk_simple_gla, dplr_chunk=dplr_chunkwise,
                           dplr_recurrent=dplr_recurrence, hf_gdn=hf)


RWKV7_LOG_W_MIN = -0.6065306597126334        # RWKV-7's log w = -e^{-1/2} sigmoid(.) lies in (-0.607, 0)


def rwkv7_inputs(T: int) -> dict:
    """RWKV-7's form (the tests' rwkv7_inputs): log w uniform in (RWKV7_LOG_W_MIN, 0) per channel, kk unit-norm,
    a = kk, b = kk * iclr with iclr in (0, 1)."""
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    kk = torch.nn.functional.normalize(r(B, T, H, K), dim=-1)
    return dict(q=r(B, T, H, K), k=0.5 * r(B, T, H, K), x=r(B, T, H, V),
                g=RWKV7_LOG_W_MIN * torch.rand(B, T, H, K, generator=gen), a=kk,
                b=kk * torch.rand(B, T, H, K, generator=gen))


class Family(NamedTuple):
    """One family's contenders: each takes the inputs (a dict of tensors) and returns the output o. `inputs` holds
    the leaves a backward run differentiates (every tensor a peer reads); flops: the useful FLOPs of recurscope's
    forward (None: no bmm share printed); slow: peers skipped above --slow-peer-max-T."""
    inputs: dict
    mine: Callable
    peers: dict
    flops: Optional[float]
    slow: tuple = ()


def _head_first(t):
    return t.transpose(1, 2)


def contenders(T: int, with_reference: bool) -> dict:
    """{family: Family}. GDN, KDA and GDN-2 run recurscope on (q, k, x, g, a) formed from their gates (beta, b, w) in
    the entry (beta=) or outside it, so that a backward run differentiates the gates as the peers do."""
    P = peers()
    # One builder for every family (kernels.inputs); one seed, so the families share q, k and v.
    gla, gdn, kda, gdn2, qed = (family_inputs(f, B, T, H, K, V, dtype=torch.float32, decay=(0.0, 0.05))
                                for f in ("gla", "gdn", "kda", "gdn2", "qed"))
    rc = lambda *a, be, **kw: kernels.recurrence(*a, backend=be, **kw).o  # noqa: E731
    delta = dict(q=gdn.q, k=gdn.k, v=gdn.v, g=gdn.g, beta=gdn.beta)
    kda_in = dict(q=kda.q, k=kda.k, v=kda.v, g=kda.g, beta=kda.beta)
    gdn2_in = dict(q=gdn2.q, k=gdn2.k, v=gdn2.v, g=gdn2.g, b=gdn2.b, w=gdn2.w)
    # scalar-decay GLA (simple GLA, Mamba-2, RetNet-style): GLA's q, k, v with GDN's per-head decay
    sgla = dict(q=gla.q, k=gla.k * K ** 0.5, v=gla.v, g=gdn.g)
    rw = rwkv7_inputs(T)
    with_fs = dict(chunk_size=64, output_final_state=True)
    fams = {
        "GDN": Family(delta, lambda d, be="chunked": rc(d["q"], d["k"], d["v"], d["g"], beta=d["beta"], be=be), {
            "fla naive chunk": lambda d: P.gdn(d["q"], d["k"], d["v"], d["g"], d["beta"], **with_fs)[0],
            "transformers torch chunk": lambda d: P.hf_gdn(d["q"], d["k"], d["v"], d["g"], d["beta"], **with_fs)[0]},
            chunked_flops(T, True)),
        "KDA": Family(kda_in, lambda d, be="chunked": rc(d["q"], d["k"], d["v"], d["g"], beta=d["beta"], be=be), {
            "fla naive chunk": lambda d: P.kda(d["q"], d["k"], d["v"], d["g"], d["beta"], **with_fs)[0]},
            chunked_flops(T, True), ("fla naive chunk",)),
        "GDN-2": Family(gdn2_in, lambda d, be="chunked": rc(d["q"], d["k"], d["w"] * d["v"], d["g"], d["b"] * d["k"], be=be), {
            "fla naive chunk": lambda d: P.gdn2(d["q"], d["k"], d["v"], d["g"], d["b"], d["w"], **with_fs)[0]},
            chunked_flops(T, True), ("fla naive chunk",)),
        "GLA": Family(dict(q=gla.q, k=gla.k, v=gla.v, g=gla.g), lambda d, be="chunked": rc(d["q"], d["k"], d["v"], d["g"], be=be), {
            "fla naive recurrent": lambda d: P.gla(d["q"], d["k"], d["v"], d["g"], output_final_state=True)[0]},
            chunked_flops(T, False), ("fla naive recurrent",)),
        "sGLA": Family(sgla, lambda d, be="chunked": rc(d["q"], d["k"], d["v"], d["g"], be=be), {
            "fla naive chunk": lambda d: P.simple_gla(d["q"], d["k"], d["v"], d["g"], **with_fs)[0]},
            chunked_flops(T, False)),
        "QED": Family(dict(q=qed.q, k=qed.k, x=qed.x, g=qed.g, a=qed.a),
                      lambda d, be="chunked": rc(d["q"], d["k"], d["x"], d["g"], d["a"], be=be), {}, chunked_flops(T, True)),
        "RWKV-7": Family(rw, lambda d, be="chunked": kernels.recurrence_low_rank(
            d["q"], d["k"], d["x"], d["g"], d["a"], d["b"], backend=be).o, {
            # fla reads alpha^T S and writes along beta: ours with a = -alpha (docs/kernels.md); head-first layout
            "fla dplr_chunkwise": lambda d: _head_first(P.dplr_chunk(*(_head_first(d[n]) for n in "qkx"),
                                                                     _head_first(-d["a"]), _head_first(d["b"]),
                                                                     _head_first(d["g"]), chunk_size=32)[0]),
            "fla dplr_recurrence": lambda d: _head_first(P.dplr_recurrent(*(_head_first(d[n]) for n in "qkx"),
                                                                          _head_first(-d["a"]),
                                                                          _head_first(d["b"]),
                                                                          _head_first(d["g"]))[0])},
            low_rank_flops(T)),
    }
    if with_reference:
        for fam in fams.values():
            fam.peers["step reference"] = (lambda f: lambda d: f(d, be="reference"))(fam.mine)
    return fams


def baseline_kernel(checkout: str):
    """The chunked kernels of an older checkout (DIR/kernels/chunked.py, and DIR/kernels/low_rank.py when there),
    run through today's entries (kernels.recurrence and kernels.recurrence_low_rank, their input checks and dispatch
    included), so that old against new differs only in the kernel, also at short lengths where the entry's own cost
    is a visible share of a call. Returns wrap(fn): fn run with the old kernels in place."""
    from recurscope.kernels import low_rank

    path = os.path.join(checkout, "kernels", "chunked.py")
    if not os.path.isfile(path):
        raise SystemExit(f"--baseline {checkout}: no kernels/chunked.py there; pass a checkout of this repository "
                         "(e.g. git archive <commit> | tar -x -C DIR)")

    def load(name):
        spec = importlib.util.spec_from_file_location(f"baseline_{name}", os.path.join(checkout, "kernels", name))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    old_chunked = load("chunked.py").recurrence_chunked
    lr_path = os.path.join(checkout, "kernels", "low_rank.py")
    old_low_rank = low_rank.low_rank_chunked
    if os.path.isfile(lr_path):
        old_fn = load("low_rank.py").low_rank_chunked

        def old_low_rank(*args, chunk_size=None, **kw):       # today's entry passes None for the default chunk
            return old_fn(*args, **kw) if chunk_size is None else old_fn(*args, chunk_size=chunk_size, **kw)

    def wrap(fn):
        def run(*args, **kw):
            today = kernels.recurrence_chunked, low_rank.low_rank_chunked
            kernels.recurrence_chunked, low_rank.low_rank_chunked = old_chunked, old_low_rank
            try:
                return fn(*args, **kw)
            finally:
                kernels.recurrence_chunked, low_rank.low_rank_chunked = today
        return run
    return wrap


GVA_GROUPS = 2                    # value heads per key head, as Qwen3.5 and Qwen3-Next
VARLEN_SHARES = (1, 2, 4, 9)      # sequence lengths in proportion: the longest 9x the shortest


def varlen_lengths(T: int) -> list[int]:
    """Packed lengths summing to T, in the proportions VARLEN_SHARES (ragged on purpose: none a multiple of 16)."""
    total = sum(VARLEN_SHARES)
    lengths = [max(1, T * s // total - 3) for s in VARLEN_SHARES]
    lengths[-1] += T - sum(lengths)
    return lengths


def extra_cases(T: int, names) -> dict:
    """{case: (recurscope fn, {peer name: fn})} for grouped value heads and packed variable-length batches, GDN form.

    GVA: q and k with H / GVA_GROUPS heads. recurscope passes them as they are; "repeat then call" is the path before
    grouped heads (q and k repeated over the value heads, as the bridge did); fla's naive chunk and transformers'
    torch chunk take repeated q and k (transformers' Qwen3-Next layer repeats them the same way).
    varlen: sequences of VARLEN_SHARES proportions packed along T. recurscope runs them with cu_seqlens; "padded
    batch" pads each to the longest as one batch; "loop" calls once per sequence; fla's naive chunk and
    transformers' torch chunk have no cu_seqlens and run the padded batch."""
    P = peers()
    fla_gdn, hf_gdn = P.gdn, P.hf_gdn
    cases = {}
    if "GVA" in names:
        gdn = family_inputs("gdn", B, T, H, K, V, dtype=torch.float32, decay=(0.0, 0.05))
        qk, kk = gdn.q[:, :, ::GVA_GROUPS].contiguous(), gdn.k[:, :, ::GVA_GROUPS].contiguous()
        rep = lambda t: t.repeat_interleave(GVA_GROUPS, dim=2)  # noqa: E731
        # a = beta k and x = beta v are formed in the entry (beta=), from the key heads or from the repeated ones
        cases["GVA"] = (lambda: kernels.recurrence(qk, kk, gdn.v, gdn.g, beta=gdn.beta, backend="chunked").o, {
            "repeat then call": lambda: kernels.recurrence(rep(qk), rep(kk), gdn.v, gdn.g, beta=gdn.beta,
                                                           backend="chunked").o,
            "fla naive chunk": lambda: fla_gdn(rep(qk), rep(kk), gdn.v, gdn.g, gdn.beta, chunk_size=64,
                                               output_final_state=True)[0],
            "transformers torch chunk": lambda: hf_gdn(rep(qk), rep(kk), gdn.v, gdn.g, gdn.beta, chunk_size=64,
                                                       output_final_state=True)[0]})
    if "varlen" in names:
        gdn = family_inputs("gdn", B, T, H, K, V, dtype=torch.float32, decay=(0.0, 0.05))
        lengths = varlen_lengths(T)
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        L = max(lengths)

        def padded(t):
            out = t.new_zeros(len(lengths), L, *t.shape[2:])
            for i, (lo, hi) in enumerate(zip(cu[:-1], cu[1:])):
                out[i, : hi - lo] = t[0, lo:hi]
            return out

        def unpad(o):
            return torch.cat([o[i:i + 1, : hi - lo] for i, (lo, hi) in enumerate(zip(cu[:-1], cu[1:]))], 1)

        def pad_then_call():
            return unpad(kernels.recurrence(*(padded(t) for t in gdn.args()), backend="chunked").o)

        def loop():
            return torch.cat([kernels.recurrence(*(t[:, lo:hi] for t in gdn.args()), backend="chunked").o
                              for lo, hi in zip(cu[:-1], cu[1:])], 1)

        def padded_peer(fn):
            return lambda: unpad(fn(*(padded(t) for t in (gdn.q, gdn.k, gdn.v, gdn.g, gdn.beta)), chunk_size=64,
                                    output_final_state=True)[0])

        cases["varlen"] = (lambda: kernels.recurrence(*gdn.args(), cu_seqlens=cu, backend="chunked").o, {
            "padded batch": pad_then_call, "loop per sequence": loop,
            "fla naive chunk, padded": padded_peer(fla_gdn), "transformers torch chunk, padded": padded_peer(hf_gdn)})
    return cases


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def backward_call(family: Family):
    """make(fn) -> a call of fn's forward and the gradient of a fixed random projection of its output with respect to
    every input of the family (fresh leaves, shared by the contenders; torch.autograd.grad, so nothing accumulates)."""
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in family.inputs.items()}
    with torch.no_grad():
        w = torch.randn(family.mine(family.inputs).shape, generator=torch.Generator().manual_seed(1))

    def make(fn):
        return lambda: torch.autograd.grad((fn(leaves) * w).sum(), list(leaves.values()))
    return make


def difference(got, mine) -> float:
    """max |got - mine| over an output, or the largest relative max difference over a tuple of gradients."""
    if isinstance(mine, torch.Tensor):
        return (got.float() - mine.float()).abs().max().item()
    return max(((g.float() - m.float()).abs().max() / m.float().abs().max().clamp(min=1e-30)).item()
               for g, m in zip(got, mine))


def minor_faults() -> int:
    """This process's minor page faults so far: a fresh buffer the allocator has given back to the OS is faulted in
    again page by page on its first touch, which shows up as time that no kernel change explains."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def paired_rounds(fns: dict, repeats: int, clock=time.perf_counter, faults: Optional[dict] = None) -> dict:
    """Every fn once per round, in an order shuffled per round (seeded; after one untimed warm-up round), so that no
    contender always follows the same one: with the order only rotated, the contender after the bmm always met a
    cache the bmm had just filled, and two copies of one kernel read 0.89-0.93x at T = 64.
    faults, when given, collects each call's minor page faults per name."""
    names = list(fns)
    for n in names:
        fns[n]()
    times = {n: [] for n in names}
    order = random.Random(0)
    for r in range(repeats):
        for n in order.sample(names, len(names)):
            f0 = minor_faults()
            t0 = clock()
            fns[n]()
            times[n].append(clock() - t0)
            if faults is not None:
                faults.setdefault(n, []).append(minor_faults() - f0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1: stable under load)")
    ap.add_argument("--repeats", type=int, default=7, help="timed rounds per (family, T)")
    ap.add_argument("--lengths", type=int, nargs="*", default=[512, 2048, 8192], help="sequence lengths")
    ap.add_argument("--families", nargs="*", default=["GDN", "KDA", "GDN-2", "GLA", "sGLA", "QED", "RWKV-7"],
                    help="families (GDN, KDA, GDN-2, GLA, sGLA, QED, RWKV-7) and the GDN cases GVA (grouped value "
                         "heads) and varlen "
                         "(packed sequences of lengths in proportions 1:2:4:9)")
    ap.add_argument("--profile", type=int, default=0, metavar="ROWS",
                    help="after each family's rounds, one recurscope call under torch.profiler: the ROWS operators "
                         "with the most self CPU time, by input shape")
    ap.add_argument("--skip", nargs="*", default=[],
                    help="peers to leave out by name (e.g. \"fla dplr_recurrence\": its backward at T = 8192 keeps "
                         "every step's state, more than 16 GB)")
    ap.add_argument("--backward", action="store_true",
                    help="time each contender's forward plus the gradient of every input (no bmm share printed)")
    ap.add_argument("--reference", action="store_true", help="also time the step-loop reference (slow)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="wall: elapsed time; cpu: this process's CPU time (at one thread, time other jobs hold the "
                         "core does not count, which steadies the figures on a loaded machine)")
    ap.add_argument("--baseline", default=None, help="an older checkout whose chunked kernel runs as a contender")
    ap.add_argument("--no-peers", action="store_true",
                    help="time recurscope (and --baseline) only, without the peers and the bmm: an old-against-new "
                         "pair with nothing else between its calls, the steadiest reading of a small difference")
    ap.add_argument("--slow-peer-max-T", type=int, default=2048,
                    help="skip fla's naive GDN-2 and recurrent GLA above this length (they take seconds per call)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"recurrence benchmark: B={B} H={H} K=V={K}, float32, threads={torch.get_num_threads()}, "
          f"{args.repeats} interleaved rounds, order shuffled per round, torch {torch.__version__}")
    print(f"clock: {args.clock}")
    print(f"uptime before: {uptime()}")
    # `python -m experiments.bench.X` from a checkout times that checkout; say which code is being timed.
    print(f"recurscope code timed: {os.path.dirname(os.path.dirname(recurscope.__file__))}")
    a, b = torch.randn(BMM_SHAPE[0], BMM_SHAPE[1], BMM_SHAPE[2]), torch.randn(BMM_SHAPE[0], BMM_SHAPE[2], BMM_SHAPE[3])
    header = (f"{'family':6s} {'T':>5s} {'contender':26s} {'median':>9s} {'min':>9s} "
              f"{'paired med ratio':>16s} {'ratio of mins':>13s} {'faults/call':>11s}")
    print("ratios are contender time / recurscope chunked time (> 1: recurscope faster); faults/call: the median "
          "minor page faults of one call")
    print(header)
    print("-" * len(header))
    verdicts, chunked_med = [], {}
    base = None if args.baseline is None else baseline_kernel(args.baseline)
    if base is not None:
        print(f"baseline chunked kernels: {args.baseline}/kernels/chunked.py (and low_rank.py)")
    torch.set_grad_enabled(args.backward)
    for T in args.lengths:
        fams = contenders(T, args.reference)
        cases = extra_cases(T, args.families)
        if "varlen" in cases:
            print(f"varlen T={T}: lengths {varlen_lengths(T)}")
        for fam in args.families:
            family = None
            if fam in cases:
                mine_fn, peer = cases[fam]
                fns = {"recurscope chunked": mine_fn, **peer}
            else:
                family = fams[fam]
                make = backward_call(family) if args.backward else (lambda fn, d=family.inputs: lambda: fn(d))
                fns = {"recurscope chunked": make(family.mine)}
                if not args.no_peers:
                    fns.update({name: make(fn) for name, fn in family.peers.items()
                                if not (name in family.slow and T > args.slow_peer_max_T) and name not in args.skip})
                if base is not None:
                    fns["baseline chunked"] = make(base(family.mine))
            if not args.no_peers and not args.backward:
                fns["torch bmm"] = lambda: torch.bmm(a, b)
            mine = fns["recurscope chunked"]()
            for name, fn in fns.items():
                if name not in ("recurscope chunked", "torch bmm", "step reference"):
                    err = difference(fn(), mine)
                    if err > 1e-3:
                        print(f"  warning: {fam} T={T} {name} differs from recurscope by {err:.1e}")
            faults = {}
            times = paired_rounds(fns, args.repeats, CLOCKS[args.clock], faults)
            tc = times["recurscope chunked"]
            chunked_med[fam, T] = statistics.median(tc)
            best_peer = None
            for name, ts in times.items():
                if name == "torch bmm":
                    continue
                paired = statistics.median(t / c for t, c in zip(ts, tc))
                print(f"{fam:6s} {T:5d} {name:26s} {statistics.median(ts) * 1e3:7.1f}ms {min(ts) * 1e3:7.1f}ms "
                      f"{paired:15.2f}x {min(ts) / min(tc):12.2f}x {statistics.median(faults[name]):11.0f}")
                if name not in ("recurscope chunked", "step reference", "baseline chunked"):
                    best_peer = min(best_peer or (paired, name), (paired, name))
            if args.profile:
                from torch.profiler import profile

                with profile(record_shapes=True) as prof:
                    fns["recurscope chunked"]()
                print(prof.key_averages(group_by_input_shape=True).table(
                    sort_by="self_cpu_time_total", row_limit=args.profile, max_name_column_width=24,
                    max_shapes_column_width=70))
            if fam in TARGETS and T >= 2048 and best_peer is not None:
                ratio = 1 / best_peer[0]
                verdicts.append(f"{fam} T={T}{' fwd+bwd' if args.backward else ''}: chunked / fastest peer "
                                f"({best_peer[1]}) = {ratio:.2f} (target <= {TARGETS[fam]}) "
                                f"{'met' if ratio <= TARGETS[fam] else 'MISSED'}")
            if family is None or family.flops is None or "torch bmm" not in times:
                continue
            flops = family.flops
            pct = [100 * (flops / c) / (BMM_FLOPS / m) for c, m in zip(tc, times["torch bmm"])]
            mm_rate = BMM_FLOPS / statistics.median(times["torch bmm"]) / 1e9
            print(f"{fam:6s} {T:5d} {'chunked GFLOP/s, % of bmm':26s} {flops / statistics.median(tc) / 1e9:7.1f}   "
                  f"bmm {mm_rate:5.1f} GFLOP/s   paired median {statistics.median(pct):4.0f}% of bmm, "
                  f"best-of {100 * (flops / min(tc)) / (BMM_FLOPS / min(times['torch bmm'])):4.0f}%, "
                  f"bmm faults/call {statistics.median(faults['torch bmm']):.0f}")
            if fam in RATE_TARGETS and T >= 2048:
                p = statistics.median(pct)
                verdicts.append(f"{fam} T={T}: {p:.1f}% of the same-run bmm rate (target >= {RATE_TARGETS[fam]}%) "
                                f"{'met' if p >= RATE_TARGETS[fam] else 'MISSED'}")
    if "QED" in args.families and "GDN-2" in args.families:
        print("QED over GDN-2 (chunked medians, not paired): " + ", ".join(
            f"T={T}: {100 * (chunked_med['QED', T] / chunked_med['GDN-2', T] - 1):+.0f}%" for T in args.lengths))
    print(f"uptime after: {uptime()}")
    for v in verdicts:
        print("target: " + v)


if __name__ == "__main__":
    main()
