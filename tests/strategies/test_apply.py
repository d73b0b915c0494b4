import pytest
from torch import nn

from lightning_fedshard.strategies.apply import apply_fsdp, check_fully_sharded


def test_parameters_left_unsharded_are_named():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    with pytest.raises(ValueError, match=r"Parameters \['0.weight', '0.bias', '1.weight', '1.bias'\] are not sharded"):
        check_fully_sharded(model)


def test_parameters_held_by_the_root_itself_are_rejected_before_sharding():
    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(nn.init.ones_(nn.Linear(1, 1).weight))

    with pytest.raises(ValueError, match=r"Root holds parameters \['scale'\] directly"):
        apply_fsdp(Root(), mesh=None)
