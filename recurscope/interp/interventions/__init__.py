"""Donor/recipient interventions on chosen recurrent heads (How Linear Attention Remembers, Sec. 2.2 and 3.3):
write_block, donor_write, state_swap, output_patch, output_restore, and their controls (equal-norm random update of
the state or the output, equal-norm random write in two forms, control head; a write block widened by the short
convolution's reach). Every function runs batched over a PairBatch and returns the four candidate logits at query_pos.

Each intervention is a spec builder (`state_swap_spec`, ...) run by the one driver (`run_intervention`):

| module | job |
|---|---|
| `common.py` | the result type, argument checks (heads, pairs, spans, boundaries), chunking, candidate logits |
| `clean_runs.py` | the unpatched runs (clean logits, prefix caches) and their memo, `reuse_clean_runs` |
| `driver.py` | `WriteSpec`, `SuffixSpec`, `run_intervention`: pairs x patch spec x metric |
| `writes.py` | write_block, donor_write, the conv-tail write block |
| `query_time.py` | state_swap, output_patch, output_restore |
| `controls.py` | random_update, random_write, control heads |
| `registry.py` | `REGISTRY`, the named interventions that confirm, report, plots and the CLI read |

Conventions shared by every intervention:
- `heads` is one (layer, head) pair or a list of them; a list is intervened on JOINTLY in one run (effects of a
  head set are measured, never summed from single-head runs).
- Each result carries `clean`: the recipient's candidate logits computed along the same numerical path
  (full forward for the write interventions, prefix cache + suffix for the query-time ones), so
  "intervened - clean" contains only the intervention.
"""
from recurscope.interp.interventions.clean_runs import clean_run, prefix_caches, reuse_clean_runs
from recurscope.interp.interventions.common import (
    Collector, InterventionResult, candidate_logits, check_pairs, chunks, model_device, normalise_heads,
    require_one_query_per_state, resolve_boundaries, resolve_spans, span_mask,
)
from recurscope.interp.interventions.controls import (
    RANDOM_UPDATE_KINDS, RANDOM_WRITE_VARIANTS, choose_control_heads, control_head, control_head_spec,
    random_like_delta, random_update, random_update_spec, random_write, random_write_spec, seeded_gaussian,
)
from recurscope.interp.interventions.driver import SuffixRun, SuffixSpec, WriteSpec, copy_head_out, run_intervention
from recurscope.interp.interventions.query_time import (
    output_patch, output_patch_spec, output_restore, output_restore_spec, state_swap, state_swap_spec,
)
from recurscope.interp.interventions.registry import (
    CONTROL_METRIC, INTERVENTION_NAMES, INTERVENTIONS, REGISTRY, NamedIntervention, controls_of, named_intervention,
)
from recurscope.interp.interventions.writes import (
    conv_tail_write_block_spec, donor_write, donor_write_spec, spans_with_conv_tail, write_block, write_block_spec,
)

__all__ = [
    "InterventionResult", "INTERVENTIONS", "INTERVENTION_NAMES", "NamedIntervention", "REGISTRY", "CONTROL_METRIC",
    "RANDOM_UPDATE_KINDS", "RANDOM_WRITE_VARIANTS", "controls_of", "named_intervention", "normalise_heads",
    "check_pairs", "model_device", "candidate_logits", "resolve_boundaries", "resolve_spans", "span_mask", "chunks",
    "Collector", "clean_run", "prefix_caches", "reuse_clean_runs", "WriteSpec", "SuffixSpec", "SuffixRun",
    "run_intervention", "copy_head_out", "write_block", "donor_write", "state_swap", "output_patch", "output_restore",
    "random_update", "random_write", "control_head", "choose_control_heads", "spans_with_conv_tail",
    "write_block_spec", "donor_write_spec", "conv_tail_write_block_spec", "state_swap_spec", "output_patch_spec",
    "output_restore_spec", "random_update_spec", "random_write_spec", "control_head_spec", "seeded_gaussian",
    "random_like_delta", "require_one_query_per_state",
]
