"""Ahead-of-time compile of the Triton recurrent kernel for sm_90 on a CPU, with the triton wheel's own ptxas.

GPU-only failures (lowering errors, register spills) show up here without a GPU. The compile runs in a fresh
subprocess without TRITON_INTERPRET, because the interpreter switch changes what triton.jit returns.
Run `python -m tests.kernels.test_triton_aot` to print the per-size resource table.
"""
import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZES = ((64, 64), (128, 128), (256, 256))
INPUT_DTYPES = ("bf16", "fp32")
TARGET_CAPABILITY = 90

# The heaviest variant: per-channel decay, erase, every patch feature on, packed sequences and grouped heads.
HEAVY_FLAGS = dict(
    CHANNEL_DECAY=True, HAS_ERASE=True, HAS_WRITE_SCALE=True, HAS_EXTRA_WRITE=True,
    HAS_INITIAL_STATE=True, STORE_FINAL_STATE=True, HAS_CAPTURE=True, IS_VARLEN=True,
)
FLOAT32_STATE_ARGS = ("h0_ptr", "ht_ptr", "states_ptr")


def compile_and_measure(K, V, input_dtype, flags=HEAVY_FLAGS, H=4):
    """Compiles one specialisation exactly as the launcher would (tile rule, warps, stages) and reads the cubin's
    resource usage (registers, stack and local memory per thread) with cuobjdump."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from recurscope.kernels import triton_recurrent as tr

    fn = tr.recurrent_fwd_kernel
    assert isinstance(fn, triton.runtime.jit.JITFunction), "TRITON_INTERPRET must be unset for an AOT compile"
    BK, BV, num_warps = tr.tile_config(K, V)
    constexprs = dict(H=H, HK=H // 2, K=K, V=V, BK=BK, BV=BV, **flags)
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name == "cap_slot_ptr":
            signature[name] = "*i32"
        elif name == "cu_ptr":
            signature[name] = "*i64"
        elif name in FLOAT32_STATE_ARGS:
            signature[name] = "*fp32"
        elif name.endswith("_ptr"):
            signature[name] = "*" + input_dtype  # inputs and o share q's dtype
        elif name == "scale":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"  # T, P
    compiled = triton.compile(
        ASTSource(fn, signature=signature, constexprs=constexprs),
        target=GPUTarget("cuda", TARGET_CAPABILITY, 32),
        options=dict(num_warps=num_warps, num_stages=tr.NUM_STAGES),
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run(
            [triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage", cubin.name],
            capture_output=True, text=True, check=True,
        ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no resource line:\n{usage}")
    regs, stack, shared, local = map(int, found.groups())
    return dict(K=K, V=V, dtype=input_dtype, BK=BK, BV=BV, num_warps=num_warps, registers=regs,
                stack_bytes=stack, local_bytes=local, shared_bytes=shared,
                ptx_target=re.search(r"\.target\s+(\S+)", compiled.asm["ptx"]).group(1))


def main():
    rows = [compile_and_measure(K, V, dt) for K, V in SIZES for dt in INPUT_DTYPES]
    print(json.dumps(rows))


@pytest.mark.slow
def test_heavy_variant_compiles_for_sm90_without_spills(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a real compile, not a cache hit
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the launcher's default; silences triton 3.9's notice
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.test_triton_aot"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"AOT compile failed:\n{proc.stderr[-4000:]}"
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == len(SIZES) * len(INPUT_DTYPES)
    for row in rows:
        assert row["ptx_target"].startswith(f"sm_{TARGET_CAPABILITY}"), row  # triton emits sm_90a for Hopper
        # A spill shows as local memory (and a stack frame) per thread in the cubin.
        assert row["local_bytes"] == 0 and row["stack_bytes"] == 0, f"register spill: {row}"
        # Headroom below the 255-register cap: the tile rule aims at ~16 state values per thread.
        assert row["registers"] <= 160, f"register pressure above the tile rule's budget: {row}"


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    main()
