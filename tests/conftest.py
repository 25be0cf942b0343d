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
