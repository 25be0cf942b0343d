import os
import sys

import pytest

# tests/workers.py is imported by name, here and in every rank (the launcher ships sys.path).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _close_figures():
    """Every test's figures are closed after it: pyplot keeps them otherwise, and warns past 20."""
    yield
    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].close("all")


@pytest.fixture(autouse=True, scope="session")
def _ship_test_workers_by_value():
    """Workers written in a test file travel to the ranks by value. By reference, every rank
    would import the test file, and with it pytest, matplotlib and the lesson's widgets: seconds
    per launch."""
    import cloudpickle

    for name, module in list(sys.modules.items()):
        if name.startswith("test_") and getattr(module, "__file__", "").startswith(
                os.path.dirname(os.path.abspath(__file__))):
            cloudpickle.register_pickle_by_value(module)
    yield
