"""assert_close, named: a failing comparison says which tensor, and keeps assert_close's own
message (how many elements differ, the largest difference, and the tolerance)."""


def labelled(label: str):
    """For assert_close's `msg`: its message, after the tensor's `label`."""
    return lambda message: f"{label}: {message}"
