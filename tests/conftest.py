import pytest


def pytest_collection_modifyitems(config, items):
    if config.getoption("-m"):
        return
    skip_slow = pytest.mark.skip(reason="slow: run with `pytest -m slow` (benchmarks)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)
