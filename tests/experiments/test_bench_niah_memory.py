"""experiments/bench/niah_memory.py runs, and its two scorers (the full float64 log-softmax before issue 41 and
NiahBatch.candidate_loglik today) give the same log-likelihoods at Qwen3.5's vocabulary size."""
import pytest

from experiments.bench import niah_memory


def test_old_and_new_scorers_agree_and_the_table_prints(capsys):
    old = niah_memory.measure("old", 16, 2, 2)
    new = niah_memory.measure("new", 16, 2, 2)
    assert len(old["loglik"]) == len(new["loglik"]) == 2 * niah_memory.CHOICES
    assert old["loglik"] == pytest.approx(new["loglik"], abs=1e-4)
    # float32 logits, their float64 copy and the float64 log-softmax: about 150 GiB (the float64 output alone is 65 GB)
    assert niah_memory.predicted_old_gib(4096, 8) > 100
