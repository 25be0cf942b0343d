"""assert_close, named: a failing comparison says which tensor, and keeps assert_close's own
message (how many elements differ, the largest difference, and the tolerance); and two training
states compared bit for bit."""

import torch


def labelled(label: str):
    """For assert_close's `msg`: its message, after the tensor's `label`."""
    return lambda message: f"{label}: {message}"


def assert_same_state(got, expected):
    """Model and optimizer state equal bit for bit, name by name (a checkpoint's load copies
    bytes; a resumed run on the same kernels repeats every operation)."""
    assert got["model"].keys() == expected["model"].keys()
    for name, value in expected["model"].items():
        assert torch.equal(got["model"][name], value), name
    assert got["optimizer"].keys() == expected["optimizer"].keys()
    for name, state in expected["optimizer"].items():
        for key, value in state.items():
            assert torch.equal(got["optimizer"][name][key], value), (name, key)
