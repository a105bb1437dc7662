"""The shared optimiser groups: QED's theta alone at 10x the learning rate, every parameter in exactly one group."""
import pytest

from recurscope.interp.models.optim import param_groups
from tests.interp.helpers_models import tiny_model


def test_theta_group_at_ten_times_the_rate_and_a_partition():
    model = tiny_model("qed")
    groups = {g["name"]: g for g in param_groups(model, lr=2e-3)}
    assert groups["qed_theta"]["lr"] == pytest.approx(2e-2) and groups["qed_theta"]["weight_decay"] == 0.0
    thetas = {id(b.mixer.qed_theta) for b in model.blocks if hasattr(b.mixer, "qed_theta")}
    assert {id(p) for p in groups["qed_theta"]["params"]} == thetas
    ids = [id(p) for g in groups.values() for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    assert "qed_theta" not in {g["name"] for g in param_groups(tiny_model("gdn2"), lr=1e-3)}
    with pytest.raises(ValueError, match="theta_lr_mult must be > 0"):
        param_groups(model, lr=1e-3, theta_lr_mult=0)
