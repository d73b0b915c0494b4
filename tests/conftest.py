import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors only under the interpreter, which @triton.jit picks when it is applied,
    # also to triton's own library functions: set it before anything (torch included) imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    # GPU tests run only when asked for (`pytest -m cuda`, `make gpu-check`), and only where there is a GPU.
    if not torch.cuda.is_available():
        skip_cuda = pytest.mark.skip(reason="cuda: CUDA is not available on this machine")
    elif not config.getoption("-m"):
        skip_cuda = pytest.mark.skip(reason="cuda: run with `pytest -m cuda` or `make gpu-check`")
    else:
        skip_cuda = None
    skip_slow = pytest.mark.skip(reason="slow: run with `pytest -m slow` (benchmarks)")
    for item in items:
        if "cuda" in item.keywords and skip_cuda is not None:
            item.add_marker(skip_cuda)
        elif "slow" in item.keywords and not config.getoption("-m"):
            item.add_marker(skip_slow)

