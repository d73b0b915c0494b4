import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors only under the interpreter, which @triton.jit picks when it is applied,
    # also to triton's own library functions: set it before anything (torch included) imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")
# DynamiQ compiles its CPU kernels once per chunk size (seconds each); the tests use the eager kernels, except
# tests/dynamiq/test_compiled_codec.py, which checks that compiled and eager ones give the same bytes.
os.environ.setdefault("FEDSHARD_DYNAMIQ_COMPILE", "0")


def pytest_collection_modifyitems(config, items):
    if config.getoption("-m"):
        return
    skip_slow = pytest.mark.skip(reason="slow: run with `pytest -m slow` (benchmarks)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)
