"""Start-up: what each entry point imports. `import recurscope` resolves its names on first use, the kernels need
torch alone, the hooks import TransformerLens only when a hook object is built, `recurscope --help` and argument
errors run without torch, and a Ray worker imports only what its units use.

Every check runs in a fresh interpreter on this checkout's code and reads which modules were loaded; none is timed
(experiments/bench/startup.py measures the time). Each failed before the start-up work of issue 28.
"""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import recurscope

ROOT = Path(__file__).resolve().parents[1]
#: packages that take seconds to import, none of which the kernels, the hook names or the parser need
HEAVY = ("transformer_lens", "transformers", "datasets", "pandas", "scipy", "matplotlib", "nnsight", "triton", "fla",
         "ray")


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


def _modules_after(code: str, *args: str) -> tuple[set[str], str]:
    """The top-level packages and the recurscope modules loaded once `code` has run in a fresh interpreter, and
    what it printed before them."""
    code += "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    *printed, last = proc.stdout.strip().splitlines()
    names = json.loads(last)
    loaded = {n.split(".")[0] for n in names} | {n for n in names if n.startswith(("recurscope.", "torch._dynamo"))}
    return loaded, "\n".join(printed)


def _heavy(loaded: set[str]) -> list[str]:
    return sorted(loaded & {*HEAVY, "torch"})


# ---- the facade ------------------------------------------------------------------------------------------------
def test_import_recurscope_imports_nothing_heavy():
    loaded, _ = _modules_after("import recurscope")
    assert _heavy(loaded) == []
    assert not any(n.startswith("recurscope.") for n in loaded), sorted(n for n in loaded if "." in n)


def test_a_facade_name_imports_only_its_module():
    loaded, printed = _modules_after("import recurscope as rs\nprint(rs.recurrence.__module__)")
    assert printed == "recurscope.kernels"
    assert _heavy(loaded) == ["torch"]
    assert "recurscope.interp" not in loaded and "recurscope.hooks" not in loaded


def test_every_facade_name_resolves_to_its_module_object():
    import recurscope.hooks as hooks
    import recurscope.interp as interp
    import recurscope.interp.confirm as confirm
    import recurscope.interp.data as data
    import recurscope.interp.interventions as iv
    import recurscope.interp.loading as loading
    import recurscope.interp.scan as scan
    import recurscope.kernels as kernels
    from recurscope.interp.bridge import torch_path

    expected = {"load_model": loading.load_model, "build_pairs": data.build_pairs, "state_swap": iv.state_swap,
                "write_block": iv.write_block, "donor_write": iv.donor_write, "output_patch": iv.output_patch,
                "output_restore": iv.output_restore, "run_scan": scan.run_scan, "run_confirm": confirm.run_confirm,
                "recurrence": kernels.recurrence, "torch_reference": torch_path.torch_reference, "kernels": kernels,
                "hooks": hooks, "interp": interp}
    assert set(expected) <= set(recurscope.__all__)
    for name, obj in expected.items():
        assert getattr(recurscope, name) is obj, name
    for name in recurscope.__all__:   # names added later resolve too
        assert getattr(recurscope, name) is not None, name
    assert set(recurscope.__all__) <= set(dir(recurscope))
    namespace: dict = {}
    exec("from recurscope import *", namespace)
    assert set(recurscope.__all__) <= set(namespace)
    with pytest.raises(AttributeError, match="no attribute 'load_modle'.*load_model"):
        recurscope.load_modle


# ---- kernels and hooks -----------------------------------------------------------------------------------------
def test_kernels_import_and_run_with_torch_alone():
    loaded, printed = _modules_after(
        "import torch\n"
        "from recurscope.kernels import recurrence\n"
        "from recurscope.kernels.inputs import family_inputs\n"
        "for family in ('gla', 'gdn', 'qed'):\n"
        "    inp = family_inputs(family, 1, 8, 2, 4, 4, dtype=torch.float32)\n"
        "    for backend in ('auto', 'reference', 'chunked'):\n"
        "        out = recurrence(*inp.args(), backend=backend)\n"
        "print(tuple(out.o.shape))")
    assert printed == "(1, 8, 2, 4)"
    assert _heavy(loaded) == ["torch"]
    assert not any(n.startswith(("recurscope.hooks", "recurscope.interp")) for n in loaded)


@pytest.mark.slow   # the second half imports TransformerLens
def test_hooks_import_transformer_lens_only_when_a_hook_object_is_built():
    loaded, printed = _modules_after(
        "import sys\n"
        "import recurscope.hooks as hooks\n"
        "hooks.hook_name('hook_state', 1); hooks.render_markdown(); hooks.WriteScale(layer=0, heads=[1], positions=[2])\n"
        "print('before', 'transformer_lens' in sys.modules)\n"
        "import pickle\n"
        "from transformer_lens.hook_points import HookPoint\n"
        "from recurscope.hooks.points import StateHookPoint\n"
        "point = hooks.StateHookPoint()\n"
        "print('one class', hooks.StateHookPoint is StateHookPoint, isinstance(point, HookPoint))\n"
        "print('pickled', type(pickle.loads(pickle.dumps(point))) is StateHookPoint, StateHookPoint.__qualname__)\n")
    assert printed.splitlines() == ["before False", "one class True True", "pickled True StateHookPoint"]
    assert "transformer_lens" in loaded


# ---- the command line ------------------------------------------------------------------------------------------
def _cli_imports(*argv: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Runs the real command (python -m recurscope.interp.cli) with -X importtime, which lists every module the
    process imported on stderr."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "recurscope.interp.cli", *argv], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=600)
    modules = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert modules, proc.stderr[-2000:]
    return proc, {m.split(".")[0] for m in modules}


def _stderr(proc) -> str:
    return "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("import time:"))


@pytest.mark.parametrize("argv, code, needle", [
    (["--help"], 0, "selectivity"),
    (["scan", "--help"], 0, "--pairs-per-source"),
    (["confirm", "--help"], 0, "--from-scan"),
    (["run", "--help"], 0, "--n-heldout"),
    (["no-such-command"], 2, "invalid choice: 'no-such-command'"),
    (["scan", "--out", "{tmp}/o", "--dtype", "float8"], 2, "invalid choice: 'float8'"),
    (["scan", "tiny-gla"], 2, "the following arguments are required: --out"),
    (["scan", "--out", "{tmp}/o", "--batch-size", "0"], 2, "--batch-size must be at least 1, got 0"),
    (["patch", "--layer", "0", "--head", "-1"], 2, "--head must be at least 0, got -1"),
    (["confirm", "--out", "{tmp}/o", "--from-scan", "{tmp}/missing"], 2, "is not a finished scan directory"),
    (["scan", "--out", "{tmp}/o", "--corpus", "{tmp}/missing.raw"], 2, "no such file or folder"),
])
def test_help_and_argument_errors_import_no_torch(argv, code, needle, tmp_path):
    proc, loaded = _cli_imports(*(a.format(tmp=tmp_path) for a in argv))
    assert proc.returncode == code, _stderr(proc)[-2000:]
    assert needle in (proc.stdout if code == 0 else _stderr(proc))
    assert _heavy(loaded) == []


def test_top_level_help_lists_every_verb_with_its_table_help(capsys):
    """`recurscope --help` lists the protocol verbs from the verbs' table; each verb's parser gives the same line
    and its own options, and the table names a run function (and a from_args and check, where given) that its
    module defines."""
    import importlib

    from recurscope.interp import protocols
    from recurscope.interp.cli import main
    from recurscope.interp.protocols.verbs import TABLE

    assert set(TABLE) == set(protocols.VERBS) == {p.stem for p in (ROOT / "recurscope/interp/protocols").glob("*.py")
                                                  if not p.stem.startswith("_") and p.stem not in ("runner", "verbs")}
    for verb in protocols.VERBS:
        spec = TABLE[verb]
        module = importlib.import_module(spec.module)
        for name in filter(None, (spec.run, spec.from_args, spec.check)):
            assert callable(getattr(module, name)), (verb, name)
        with pytest.raises(SystemExit) as stop:
            main([verb, "--help"])
        assert stop.value.code == 0
        text = "".join(capsys.readouterr().out.split())   # argparse wraps lines (also at hyphens)
        assert "".join(protocols.VERB_HELP[verb].split()) in text and "--out" in text and "--dtype" in text, verb


def test_every_verbs_help_and_argument_errors_import_no_torch():
    """For every command (the protocol verbs too): --help, a bad number and, where the verb takes --layout, a bad
    layout, each answered in one fresh interpreter (exit 0, 2, 2) with no heavy package loaded after any of them."""
    from recurscope.interp.protocols.verbs import TABLE

    loaded, printed = _modules_after(
        "import contextlib, io, sys\n"
        "from recurscope.interp.cli import main\n"
        "from recurscope.interp.protocols.verbs import TABLE\n"
        "heavy = ('torch', 'pandas', 'transformers', 'transformer_lens', 'scipy', 'matplotlib')\n"
        "for verb in ['scan', 'confirm', 'patch', 'run', *TABLE]:\n"
        "    argvs = [[verb, '--help'], [verb, '--batch-size', '0', '--out', 'x']]\n"
        "    if verb not in TABLE or TABLE[verb].layout:\n"
        "        argvs.append([verb, '--layout', 'bogus', '--out', 'x'])\n"
        "    for argv in argvs:\n"
        "        err = io.StringIO()\n"
        "        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):\n"
        "            try:\n"
        "                code = main(argv)\n"
        "            except SystemExit as stop:\n"
        "                code = stop.code\n"
        "        line = [l for l in err.getvalue().splitlines() if 'error' in l][-1:] or ['']\n"
        "        print(verb, argv[1], code, [m for m in heavy if m in sys.modules], line[0][-60:])\n")
    lines = printed.splitlines()
    verbs = ["scan", "confirm", "patch", "run", *TABLE]
    assert [line.split()[0] for line in lines if line.split()[1] == "--help"] == verbs
    for line in lines:
        verb, option, code, rest = line.split(" ", 3)
        assert rest.startswith("[]"), line                       # nothing heavy
        assert int(code) == (0 if option == "--help" else 2), line
        if option == "--layout":
            assert "invalid choice: 'bogus'" in rest, line
        if option == "--batch-size" and verb in TABLE:      # the built-in commands refuse other missing options first
            assert "--batch-size must be at least 1, got 0" in rest, line
    assert _heavy(loaded) == []


# ---- Ray workers -----------------------------------------------------------------------------------------------
@pytest.mark.slow   # loads a model in a fresh interpreter and runs a scan and a confirmation unit
def test_a_ray_worker_imports_only_what_its_units_use(tmp_path):
    """What a Ray actor does with our code (the class and its arguments unpickled, the model loaded once, a scan
    unit and a confirmation unit run) loads no statistics (scipy), figures, reports, protocols, CLI or nnsight, and
    building the model does not import torch._dynamo (a meta-device probe did)."""
    from recurscope.interp.data import build_pairs
    from recurscope.interp.distributed import ModelSpec, UnitWorker, confirm_units, scan_units
    from recurscope.interp.loading import load_model

    model = load_model("tiny-gla")
    pairs = build_pairs(model.tokenizer, split="dev", n_sources=2, filler_tokens=16, presentations=2)
    payload = tmp_path / "worker.pkl"
    payload.write_bytes(pickle.dumps((UnitWorker, ModelSpec("tiny-gla"), pairs, scan_units(pairs, [(0, 1)])[0],
                                      confirm_units(pairs, ["state_swap"])[0])))
    loaded, printed = _modules_after(
        "import pickle, sys\n"
        "cls, spec, pairs, scan_unit, confirm_unit = pickle.loads(open(sys.argv[1], 'rb').read())\n"
        "worker = cls(spec, pairs)\n"
        "print(len(worker.scan(scan_unit, 8, 4)), len(worker.confirm(confirm_unit, [(0, 1)], None, 0, 8)))\n",
        str(payload))
    n_scan, n_confirm = map(int, printed.split())
    assert n_scan > 0 and n_confirm > 0
    assert {"recurscope.interp.scan", "recurscope.interp.confirm", "torch", "transformer_lens"} <= loaded
    unused = {"scipy", "matplotlib", "nnsight", "ray", "torch._dynamo", "recurscope.interp.stats",
              "recurscope.interp.plots", "recurscope.interp.report", "recurscope.interp.protocols",
              "recurscope.interp.cli", "recurscope.hooks.nnsight"}
    assert sorted(loaded & unused) == []
