"""Every exercise checker passes its reference solution and fails typical mistakes, usefully."""

import pytest

import mistakes
from helpers import exercises, solutions

# Hangs are expected among the mistakes: a short timeout keeps the suite quick.
TIMEOUT = 3


@pytest.mark.parametrize("name", list(exercises.EXERCISES))
def test_checker_passes_the_reference_solution(name):
    result = exercises.check(name, getattr(solutions, name))
    assert result.passed, repr(result)
    assert repr(result).startswith(f"[PASSED] {name}\nEvery result was right")


@pytest.mark.parametrize("name, mistake, says", [
    ("even_odd_sum", mistakes.sum_over_the_world, "On 2 ranks, rank 0: expected 0, got 1"),
    ("even_odd_sum", mistakes.only_my_own_group, "On 4 ranks"),  # a hang or a reset: groups mix up
    ("column_sum", mistakes.row_instead_of_column, "On 4 ranks, rank 0: expected 2, got 1"),
    ("broadcast_from_p2p", mistakes.broadcast_to_rank_one_only, "Is there a recv without a matching send"),
    ("broadcast_from_p2p", mistakes.return_without_communicating, "On 2 ranks, rank 1: expected tensor("),
    ("ring_shift", mistakes.blocking_send_first, "blocked in torch.distributed.send()"),
    ("ring_shift", mistakes.shift_the_wrong_way, "On 3 ranks, rank 0: expected tensor([2., 2., 2.]), got tensor([1., 1., 1.])"),
    ("mean_and_variance", mistakes.average_of_local_variances, "On 2 ranks, rank 0: expected"),
    ("mean_and_variance", mistakes.forgot_to_divide, "On 2 ranks, rank 0: expected"),
    ("all_gather_from_all_reduce", mistakes.slots_not_zeroed, "On 2 ranks, rank 0: expected tensor([ 0., 10.]), got tensor([ 1., 11.])"),
    ("bus_bandwidth", mistakes.algbw_not_busbw, "For the input ('all_reduce', 4, 67108864, 0.05): expected"),
    ("bus_bandwidth", mistakes.reduce_scatter_on_output_size, "For the input ('reduce_scatter', 8, 16777216, 0.01)"),
    ("alpha_beta_from_two_points", mistakes.alpha_and_beta_swapped, "expected 0.001, got"),
    ("ring_all_reduce", mistakes.ring_that_adds_in_both_phases, "On 2 ranks, rank 0: expected tensor("),
    ("ring_all_reduce", mistakes.ring_without_all_gather, "On 2 ranks, rank 0: expected tensor("),
    ("tree_reduce", mistakes.tree_with_wrong_parent, "On 5 ranks"),
])
def test_checker_fails_a_typical_mistake_and_says_what_differed(name, mistake, says):
    result = exercises.check(name, mistake, timeout=TIMEOUT)
    assert not result.passed
    text = repr(result)
    assert text.startswith(f"[NOT YET] {name}\n")
    assert says in text, text


@pytest.mark.parametrize("name", list(exercises.EXERCISES))
def test_an_unstarted_exercise_gets_a_friendly_message(name):
    result = exercises.check(name, mistakes.not_started)
    assert not result.passed
    assert "waiting for your code" in repr(result)
    assert repr(result).endswith(f"The task: {exercises.EXERCISES[name].task}.")


def test_unknown_exercise_names_the_known_ones():
    with pytest.raises(KeyError, match="there are: even_odd_sum, column_sum"):
        exercises.check("even_odd", solutions.even_odd_sum)
