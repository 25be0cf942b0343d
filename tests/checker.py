"""What every lesson's test file uses to show that an exercise's checker rejects a typical mistake
(and accepts a right answer written another way).

The mistakes are written in the lesson's test file. They run inside the ranks, so they travel by
value: a rank then never imports the test module (pytest, matplotlib) to find them.
"""

import sys

import cloudpickle

from helpers import exercises

# Hangs are expected among the mistakes: a short timeout keeps the suite quick.
TIMEOUT = 3


def expect_rejection(name, mistake, says):
    """`check(name, mistake)` fails, and its message contains `says`. Returns the message."""
    result = _check(name, mistake)
    text = repr(result)
    assert not result.passed, text
    assert text.startswith(f"[NOT YET] {name}\n"), text
    assert says in text, text
    return text


def expect_acceptance(name, answer):
    """`check(name, answer)` passes: a right answer that differs from the reference solution."""
    result = _check(name, answer)
    assert result.passed, repr(result)


def _check(name, function):
    cloudpickle.register_pickle_by_value(sys.modules[function.__module__])
    return exercises.check(name, function, timeout=TIMEOUT)


def not_started(*inputs):
    """A learner's stub, as the notebooks ship it."""
    raise NotImplementedError
