import pytest
import torch
from torch import nn

from lightning_fedshard.strategies.apply import apply_fsdp, check_fully_sharded, materialize


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


def test_materialize_initialises_meta_children_and_leaves_the_others_alone():
    from torchmetrics import MeanMetric

    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            with torch.device("meta"):
                self.linear = nn.Linear(4, 3)
            self.metric = MeanMetric()

    root = Root()
    root.metric.update(torch.tensor([2.0, 4.0]))
    torch.manual_seed(0)
    materialize(root, torch.device("cpu"))
    torch.manual_seed(0)
    assert torch.equal(root.linear.weight, nn.Linear(4, 3).weight)  # reset_parameters ran, same RNG draw
    assert root.metric.compute().item() == 3.0  # to_empty would have wiped the accumulators


def test_meta_modules_without_reset_parameters_are_named():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(3))

    root = nn.Sequential()
    with torch.device("meta"):
        root.append(Scale())
    with pytest.raises(TypeError, match="Scale was built on the meta device but has no `reset_parameters"):
        materialize(root, torch.device("cpu"))
