"""``lowbit.quantize_`` on models that use one layer in several places."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowbit
from lowbit.nn import Nvfp4Linear


class TwoNames(nn.Module):
    """One Linear registered under two names (weight sharing by module), and
    a second one called twice from one name."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(64, 64, dtype=torch.bfloat16)
        self.alias = self.shared
        self.twice = nn.Linear(64, 64, bias=False, dtype=torch.bfloat16)
        self.block = nn.Sequential(self.shared)  # a third use, one level down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.alias(self.twice(self.twice(self.shared(x)))))


def test_a_layer_used_under_several_names_gets_one_replacement():
    model = TwoNames()
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    want = [Nvfp4Linear.from_linear(model.shared), Nvfp4Linear.from_linear(model.twice)]
    lowbit.quantize_(model, progress=False)
    assert isinstance(model.shared, Nvfp4Linear) and isinstance(model.twice, Nvfp4Linear)
    assert model.alias is model.shared and model.block[0] is model.shared  # the sharing is kept
    assert [n for n, _ in model.named_modules()] == ["", "shared", "twice", "block"]
    with torch.no_grad():
        expected = want[0](want[0](want[1](want[1](want[0](x)))))
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)


def test_filter_fn_must_agree_on_every_name_of_a_shared_layer():
    model = TwoNames()
    with pytest.raises(ValueError, match=r"quantize_: filter_fn accepts the module named 'shared' but not its other "
                                         r"name 'alias'"):
        lowbit.quantize_(model, filter_fn=lambda mod, name: name != "alias", progress=False)
    assert type(model.shared) is nn.Linear and model.alias is model.shared  # nothing replaced
    lowbit.quantize_(model, filter_fn=lambda mod, name: name not in ("shared", "alias", "block.0"), progress=False)
    assert type(model.shared) is nn.Linear and isinstance(model.twice, Nvfp4Linear)
