"""Counts the overclaims of every protocol verb on models that cannot do the task (issue 40's negative controls):
two random-weight models (GLA and Gated DeltaNet, hidden 32, 2 layers of 2 heads, the word tokenizer) and a "live
noise" model (the bundled tiny-gla with every recurrent head's output projection scaled by 1e-7), each verb at tiny
sizes through the command line, with whichever recurscope is imported. Per run it records the exit status, how many
times report.md says "agrees with the paper", whether `heads` names a hub, and whether the gate refused; at the end
the totals.

    python experiments/protocols/overclaims.py OUT [--gate-threshold 0]

Run from another directory with PYTHONPATH set to a checkout to count that checkout's code (e.g. the code before
issue 40, which has no --gate-threshold on the verbs: run it without the option). Writes OUT/records.json.
"""
import contextlib
import io
import json
import sys
import traceback
from pathlib import Path

import torch

import recurscope
from recurscope.interp.cli import main
from recurscope.interp.data import build_word_tokenizer
from recurscope.interp.loading import load_model, save_model
from recurscope.interp.models import ModelConfig, RecurrentLM

root = Path(sys.argv[1]); root.mkdir(parents=True, exist_ok=True)
extra = sys.argv[2:]                       # e.g. --gate-threshold 0
print("recurscope from", Path(recurscope.__file__).parent, "options", extra, flush=True)
tok = build_word_tokenizer()
models = {}
for fam, kw in (("gla", {}), ("gated_deltanet", {"head_dim": 16})):
    torch.manual_seed(0)
    m = RecurrentLM(ModelConfig.from_dict(dict(model_type=fam, vocab_size=len(tok), hidden_size=32,
                                               num_hidden_layers=2, num_heads=2, **kw)))
    m.tokenizer = tok
    save_model(m, root / f"random-{fam}")
    models[f"random-{fam}"] = root / f"random-{fam}"
noise = load_model("tiny-gla")
with torch.no_grad():
    for layer in noise.recurrent_layers:
        noise.blocks[layer].mixer.o_proj.weight.mul_(1e-7)
save_model(noise, root / "live-noise-gla")
models["live-noise-gla"] = root / "live-noise-gla"

SMALL = ["--n-sources", "4", "--filler", "12", "--presentations", "2", "--gap", "4", "--resamples", "100",
         "--batch-size", "8"]
OWN = {"gate": ["--n-sources", "4", "--fillers", "8", "--resamples", "100", "--batch-size", "8"],
       "capacity": ["--n-sources", "4", "--loads", "1", "2", "--gaps", "8", "16", "--total-length", "120",
                    "--resamples", "100", "--batch-size", "8"],
       "retention": ["--n-sources", "4", "--loads", "1", "2", "--total-length", "200", "--n-nontarget", "1",
                     "--resamples", "100", "--batch-size", "8"],
       "corrector": ["--n-sources", "4", "--n-fit", "4", "--pairs-per-source", "2", "--k", "2", "--total-length",
                     "200", "--resamples", "100", "--batch-size", "8"],
       "reuse": ["--n-sources", "4", "--n-fit", "4", "--filler", "12", "--formats", "template:is_in", "update:is_in",
                 "--resamples", "100", "--batch-size", "8"],
       "topk": ["--n-sources", "4", "--n-dev", "4", "--filler", "12", "--presentations", "2", "--gap", "4",
                "--resamples", "100", "--batch-size", "8", "--no-gate"],
       "heads": [*SMALL, "--n-dev", "4"]}
VERBS = ["selectivity", "coupling", "neutral", "heads", "headscan", "lens", "gate", "capacity", "overlap",
         "retention", "corrector", "reuse", "topk"]
NO_HEAD = {"heads", "lens", "gate", "topk"}
records = []
for name, path in models.items():
    for verb in VERBS:
        out = root / "runs" / name / verb
        argv = [verb, str(path), *OWN.get(verb, SMALL), *([] if verb in NO_HEAD else ["--head", "0", "1"]),
                *(extra if verb != "gate" else []), "--out", str(out)]
        buf, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
                rc = main(argv)
        except SystemExit as e:
            rc = e.code
        except Exception:
            rc = "crash: " + traceback.format_exc().splitlines()[-1]
        report = (out / "report.md").read_text() if (out / "report.md").is_file() else ""
        text = buf.getvalue() + report
        agrees = report.count("agrees with the paper")
        named_hub = verb == "heads" and bool(report) and "No hub is named" not in report and "refused by the capability gate" not in report
        rec = {"model": name, "verb": verb, "rc": rc, "agrees": agrees, "named_hub": named_hub,
               "not_gated": report.count("not gated"), "refused": "refused by the capability gate" in report,
               "err": err.getvalue().strip().splitlines()[-1:] }
        records.append(rec)
        print(json.dumps(rec), flush=True)
(root / "records.json").write_text(json.dumps(records, indent=1))
print("TOTAL agrees", sum(r["agrees"] for r in records), "named hubs", sum(r["named_hub"] for r in records),
      "non-zero exits", sum(r["rc"] not in (0,) for r in records))
