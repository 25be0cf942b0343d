"""The exercise engine: every lesson's checker passes its reference solution, greets an unstarted
exercise, and knows every exercise by name. Each lesson's test file shows that its checkers reject
typical mistakes (tests/checker.py)."""

import html
import pathlib
import re

import nbformat
import pytest
import torch
from checker import not_started

from helpers import exercises
from helpers.lessons import lessons

ROOT = pathlib.Path(__file__).resolve().parent.parent

# One of a tier's longest files: a tier starts it first (helpers/lessons.py).
STARTS_FIRST = True

# Checked by the soak tier, to keep make test within its minutes: lesson 13's layout exercise,
# whose reference solution runs 42 fake steps of one or two blocks of Llama 3 8B (40 s; its four
# of the whole model are read from the sweeps), its checker's rejections in make test
# (tests/test_at_scale.py); lesson 14's capstone, five launches of 4 ranks
# (20 s), recipe_step (three launches, 18 s) and entry_point (four torchruns, about a minute),
# their checkers' rejections in the soak tier too (tests/test_capstone.py); lesson 12's
# resumable (16 s) and lesson 11's scaled_step (11 s), whose rejections make test runs.
# The soak tier runs a third of them a commit (--cases-share 3), in these turns (conftest.py), by
# their seconds in the soak runs of 2026-11-30/12-01 (choose_plan 70, entry_point 45, resumable 16,
# scaled_step 11, capstone 9, recipe_step 6), beside tests/test_capstone.py's entry-point
# rejections' turns: by their index, choose_plan and entry_point shared one, and that run of the
# soak tier took 6:30, against 4:38 to 5:28 for the others.
SLOW_TURNS = {"choose_plan": 2, "recipe_step": 2, "entry_point": 1, "scaled_step": 1,
              "resumable": 0, "capstone": 0}
# Lesson 15's checkers need Slurm (scontrol; a cluster they start): the cluster tier runs their
# reference solutions and rejections (tests/test_on_a_cluster_exercises.py).
ON_A_CLUSTER = {"batch_script", "hostnames"}


def _tier(name):
    if name in ON_A_CLUSTER:
        return pytest.param(name, marks=pytest.mark.cluster)
    if name in SLOW_TURNS:
        return pytest.param(name, marks=[pytest.mark.soak, pytest.mark.turn(SLOW_TURNS[name])])
    return name


@pytest.mark.parametrize("name", [_tier(name) for name in exercises.exercises()])
def test_checker_passes_the_reference_solution(name, monkeypatch):
    if name == "choose_plan":
        _whole_model_steps_from_the_sweeps(monkeypatch)
    result = exercises.check(name, exercises.solution(name))
    assert result.passed, repr(result)
    assert repr(result).startswith(f"[PASSED] {name}\nEvery result was right")


def _whole_model_steps_from_the_sweeps(monkeypatch):
    """choose_plan's reference solution sizes each layout from fake steps of one and two blocks,
    then confirms its choice by a fake step of the whole model (four of them, 8 s each). A whole
    model's step of a layout the committed sweeps hold is taken from them here: a sample of their
    rows is run again and required in tests/test_at_scale.py (the sweep is what a fake run gives).
    The small steps run."""
    from helpers.at_scale import fits
    from helpers.composing.strategy import MODELS

    recorded = {(MODELS[question["model"]], plan): {"peak": {"Total": peak}, "sent": sent}
                for path, question in fits.SWEEPS.items()
                for plan, peak, sent in fits.load_sweep(path)}
    fake_step = fits.fake_step
    monkeypatch.setattr(fits, "fake_step", lambda shape, plan, *args, **kwargs: recorded.get(
        (shape, plan)) or fake_step(shape, plan, *args, **kwargs))


@pytest.mark.parametrize("name", list(exercises.exercises()))
def test_an_unstarted_exercise_gets_a_friendly_message(name):
    result = exercises.check(name, not_started)
    assert not result.passed
    assert "waiting for your code" in repr(result)
    assert repr(result).endswith(f"The task: {exercises.exercises()[name].task}.")


def test_a_stub_is_greeted_without_running_a_case(monkeypatch):
    """The notebooks' stubs (`raise NotImplementedError` and nothing else) start no ranks and no
    torchrun; a function that raises it after doing something runs as any other."""
    def never(*args):
        raise AssertionError("a case ran")

    monkeypatch.setattr(exercises, "_check_case", never)
    assert "waiting for your code" in repr(exercises.check("entry_point", not_started))

    def started(rank, world_size):
        print(rank)
        raise NotImplementedError

    with pytest.raises(AssertionError, match="a case ran"):
        exercises.check("even_odd_sum", started)


def test_every_lesson_has_exercises_and_each_knows_its_lesson():
    by_lesson = {}
    for name, exercise in exercises.exercises().items():
        by_lesson.setdefault(exercise.lesson, []).append(name)
    assert set(by_lesson) == {lesson.package for lesson in lessons()}
    assert all(len(names) >= 2 for names in by_lesson.values()), by_lesson


def test_unknown_exercise_names_the_known_ones():
    with pytest.raises(KeyError, match="there are: even_odd_sum, column_sum, grid_sums, broadcast"):
        exercises.check("even_odd", not_started)


def test_a_result_off_by_a_factor_is_named():
    """A sum for a mean, a missing 1/m: the message says by how much, as well as where."""
    message = exercises._compare(torch.tensor([2.0, 4.0, 6.0]), torch.tensor([1.0, 2.0, 3.0]))
    assert message.endswith("Your result is 2 times the expected one")
    unrelated = exercises._compare(torch.tensor([2.0, 1.0, 6.0]), torch.tensor([1.0, 2.0, 3.0]))
    assert "times the expected" not in unrelated


def _first_rows_only(rank, world_size, w1, w2, x, y, tp):
    return w1[:1], w2[:, :1]


def test_a_failing_case_is_named_by_its_arguments():
    text = repr(exercises.check("dp_tp_step", _first_rows_only))
    assert text.endswith("The case: seed=3, tp=2."), text  # the first case, dp 3 x tp 2


def _raises_on_a_rank(rank, world_size):
    raise ValueError(f"rank {rank} gave up")


def _harness_running_ranks(function):
    from helpers import run

    return run(function, 2, show_output=False)


def test_a_ranks_error_inside_a_harness_shows_its_traceback_once():
    """A plain exercise whose harness starts ranks (as `resumable`'s does): the rank's own
    traceback, at the learner's line, once; none of the engine's frames."""
    exercise = exercises.Exercise("a task", [()], lambda: None, distributed=False,
                                  harness=_harness_running_ranks)
    lines = exercises._check_case(exercise, _raises_on_a_rank, ())
    text = "\n".join(lines)
    assert lines[0].startswith("For the case , your function raised WorkerError: rank 0 raised "
                               "ValueError: rank 0 gave up"), text
    assert text.count("Traceback") == 1 and 'in _raises_on_a_rank' in text, text
    assert "helpers/exercises.py" not in text, text


def test_a_message_shown_as_html_is_cut_to_the_width_of_a_slide():
    """JupyterLab's sanitizer drops CSS that would wrap a <pre>: the lines are cut instead, each
    continuation indented under its line, and nothing is lost but the line breaks added."""
    result = exercises.CheckResult("an_exercise", False,
                                   ["word " * 60, "  File \"mine.py\", line 3, in f", "x" * 250])
    shown = result._repr_html_()
    body = html.unescape(shown[shown.index(">") + 1:shown.rindex("</pre>")])
    assert max(len(line) for line in body.split("\n")) <= exercises.HTML_WIDTH
    assert body.split() == repr(result).replace("x" * 250, " ".join(
        ["x" * 100, "x" * 96, "x" * 54])).split()  # the long word cut, with the indent's width
    assert '  File "mine.py", line 3, in f' in body.split("\n")


def test_a_long_task_is_folded_under_its_label_in_html_and_shown_whole_in_text():
    task = "The task: " + "train it so " * 100  # 1,210 characters
    result = exercises.CheckResult("an_exercise", False, ["waiting for your code", task])
    shown = result._repr_html_()
    assert repr(result) == f"[NOT YET] an_exercise\nwaiting for your code\n{task}"
    before, folded = shown.split("<details", 1)
    assert "waiting for your code" in before and "train it" not in before
    assert "<summary>The task (a click unfolds it)</summary>" in folded
    body = html.unescape(folded[folded.index("<pre>") + 5:folded.index("</pre>")])
    assert body.split() == task.split()


def _gives_back_zeros(rank, world_size, tensor):
    return torch.zeros_like(tensor)


def test_a_case_of_tensors_alone_is_named_by_their_shapes():
    text = repr(exercises.check("broadcast_from_p2p", _gives_back_zeros))
    shape = tuple(exercises.exercises()["broadcast_from_p2p"].cases[0][1][0].shape)
    assert text.endswith(f"The case: tensor=a tensor of shape {shape}, float32."), text


def _takes_too_few(rank, world_size):
    return rank


def test_a_function_of_the_wrong_signature_is_named_before_any_rank_starts():
    text = repr(exercises.check("broadcast_from_p2p", _takes_too_few))
    assert text.startswith("[NOT YET] broadcast_from_p2p\nYour function cannot be called as the "
                           "task calls it, with (rank, n, tensor): _takes_too_few(rank, "
                           "world_size) says: too many positional arguments."), text


def test_something_that_is_no_function_is_named_before_any_rank_starts():
    text = repr(exercises.check("broadcast_from_p2p", _takes_too_few(0, 1)))
    assert "check() needs your function itself, got int 0" in text, text


def _exercise_cells():
    """(notebook, the exercise its metadata names, the cell's source, the heading above it)."""
    found = []
    for lesson in lessons():
        notebook = nbformat.read(ROOT / "notebooks" / f"{lesson.stem}.ipynb", as_version=4)
        heading = ""
        for cell in notebook.cells:
            if cell.cell_type == "markdown":
                headings = re.findall(r"^(?:###? .*|\*\*.*?\*\*)", cell.source, re.M)
                heading = headings[-1] if headings else heading
            elif "exercise" in cell.metadata:
                found.append((lesson, cell.metadata["exercise"], cell.source, heading))
    return found


def test_every_exercise_has_one_answer_cell_marked_in_its_lessons_notebook():
    """A grader finds a learner's answer by the cell's metadata (`"exercise": name`), not by
    reading prose: each exercise's cell is marked, once, in its own lesson's notebook, and calls
    check() on that exercise; no other cell calls check()."""
    cells = _exercise_cells()
    marked = [name for _, name, _, _ in cells]
    assert sorted(marked) == sorted(exercises.exercises())
    for lesson, name, source, _ in cells:
        assert exercises.exercises()[name].lesson == lesson.package
        assert re.findall(r'^check\("(\w+)"', source, re.M) == [name]
    for lesson in lessons():
        text = (ROOT / "notebooks" / f"{lesson.stem}.ipynb").read_text()
        assert text.count('check(\\"') == sum(1 for one, *_ in cells if one == lesson)


def test_points_are_what_the_notebook_calls_the_exercise():
    """Graded points (helpers.grading): 3 for a design exercise, 2 for a harder one, 1 for the
    rest, as each exercise's heading in its notebook says."""
    for _, name, _, heading in _exercise_cells():
        want = 3 if "(design)" in heading else 2 if "(harder)" in heading else 1
        assert exercises.exercises()[name].points == want, (name, heading)
