"""The exercise engine: every lesson's checker passes its reference solution, greets an unstarted
exercise, and knows every exercise by name. Each lesson's test file shows that its checkers reject
typical mistakes (tests/checker.py)."""

import pytest
from checker import not_started

from helpers import exercises
from helpers.lessons import lessons


@pytest.mark.parametrize("name", list(exercises.exercises()))
def test_checker_passes_the_reference_solution(name):
    result = exercises.check(name, exercises.solution(name))
    assert result.passed, repr(result)
    assert repr(result).startswith(f"[PASSED] {name}\nEvery result was right")


@pytest.mark.parametrize("name", list(exercises.exercises()))
def test_an_unstarted_exercise_gets_a_friendly_message(name):
    result = exercises.check(name, not_started)
    assert not result.passed
    assert "waiting for your code" in repr(result)
    assert repr(result).endswith(f"The task: {exercises.exercises()[name].task}.")


def test_every_lesson_has_exercises_and_each_knows_its_lesson():
    by_lesson = {}
    for name, exercise in exercises.exercises().items():
        by_lesson.setdefault(exercise.lesson, []).append(name)
    assert set(by_lesson) == {lesson.package for lesson in lessons()}
    assert all(len(names) >= 2 for names in by_lesson.values()), by_lesson


def test_unknown_exercise_names_the_known_ones():
    with pytest.raises(KeyError, match="there are: even_odd_sum, column_sum, grid_sums, broadcast"):
        exercises.check("even_odd", not_started)
