"""The autograder (helpers/grading): a class of hand-made submissions, honest and hostile, graded
from a student release's notebooks; every row of grades.csv is what was planted, the hostile
submissions change no other student's grade, and nothing of theirs is left behind, running or on
disk.

The right answers are the reference solutions' own source (so that a student release withholds
these tests); the wrong, hanging and hostile ones are written here."""

import csv
import inspect
import os
import pathlib
import re

import nbformat
import pytest

from helpers import grading, release
from helpers.exercises import exercises, solution, solutions_withheld
from helpers.grading import cells as notebook_cells
from helpers.grading.sandbox import Limits, check_in_sandbox

LESSON = "01_processes_and_groups"
OTHER = "03_collectives"
MARK = "31337"  # in the command line of the processes a hostile answer leaves running
COURSE = pathlib.Path(__file__).resolve().parent.parent
# A hang the checker cannot see (the cell's top level, before any rank) ends at this limit; a
# rank's hang at the exercise's own (10 s).
LIMITS = Limits(seconds=30)


def right(name):
    """A right answer to `name`: the reference solutions' module (the solution and the helpers it
    calls), and the stub's name for the solution."""
    source = inspect.getsource(inspect.getmodule(solution(name)))
    return f"{source}\nmy_{name} = {name}"


def answered(notebook, answers):
    """A copy of a notebook with some exercises answered: name -> the code that takes the place
    of the stub (`def my_name(...):` and its `raise NotImplementedError`); the rest of the
    cell, its imports and its check() call, as handed out."""
    notebook = nbformat.from_dict(notebook)
    for cell in notebook.cells:
        name = cell.get("metadata", {}).get("exercise")
        if name in answers:
            stub = re.compile(rf"^def my_{name}\(.*?raise NotImplementedError\n", re.M | re.S)
            assert stub.search(cell.source), cell.source
            cell.source = stub.sub(lambda _, code=answers[name]: code + "\n", cell.source)
    return notebook


# What each hostile answer does, and the exercise it stands in for. Each also names the path it
# attacks through the placeholders FOLDER (the submissions) and COURSE.
HOSTILE = {
    # blocked for good, as a rank waiting for a message that never comes (a loop that spins ends
    # the same way, at the limit, and held a core of the soak tier for those 30 s)
    "hangs": {"even_odd_sum": "import threading\nthreading.Event().wait()"},
    "forks_forever": {"even_odd_sum": f"""
import os, subprocess, time
subprocess.Popen(["sleep", "{MARK}"], start_new_session=True)
if os.fork() == 0:
    os.execvp("sleep", ["sleep", "{MARK}.5"])
""" + "{right}"},
    "prints_megabytes": {"even_odd_sum": "print('x' * 50_000_000)\n{right}"},
    "allocates_20_gb": {"even_odd_sum": "import torch\nbig = torch.ones(20 * 2**30, "
                                        "dtype=torch.uint8)\n{right}"},
    "reads_solutions": {
        "even_odd_sum": "import glob\nstolen = [open(path, 'rb').read() for pattern in ("
                        "'/helpers/processes_and_groups/solutions.py', '/helpers/*/__pycache__/"
                        "solutions.*', '/.git/*') for path in glob.glob(COURSE + pattern)]\n"
                        "raise RuntimeError(f'stolen: {stolen}')",
        "column_sum": "import socket\nraise RuntimeError(f'interfaces: {socket.if_nameindex()}')"},
    "reads_and_writes_others": {
        "even_odd_sum": "raise RuntimeError('stolen: ' + open(FOLDER + "
                        f"'/alice/{LESSON}.ipynb').read())",
        "column_sum": "open(FOLDER + '/grades.csv', 'a').write('mallory,x,even_odd_sum,9,1,"
                      "passed,0,\\n')",
        "grid_sums": "open(COURSE + '/planted-by-a-student', 'w').write('here')"},
    "kills_its_parent": {"even_odd_sum": "import os, signal\nfor attempt in (os.getppid(), "
                                         "0, -1):  # its parent, its group, all it may\n"
                                         "    try:\n        os.kill(attempt, signal.SIGKILL)\n"
                                         "    except OSError:\n        pass"},
}


@pytest.fixture(scope="module")
def course_for_students():
    """The notebooks a class is handed, as a student release writes them (tests/test_release.py
    builds a whole one)."""
    texts = {stem: (COURSE / "notebooks" / f"{stem}.ipynb").read_text() for stem in (LESSON, OTHER)}
    return {stem: nbformat.reads(text if solutions_withheld() else
                                 release.notebook_for_students(text), as_version=4)
            for stem, text in texts.items()}


def hand_in(folder, student, notebook, stem=LESSON):
    (folder / student).mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, folder / student / f"{stem}.ipynb")


def honest_class(folder, notebooks):
    lesson = notebooks[LESSON]
    hand_in(folder, "alice", answered(lesson, {name: right(name) for name in
                                               ("even_odd_sum", "column_sum", "grid_sums")}))
    hand_in(folder, "bob", answered(lesson, {"even_odd_sum": "def my_even_odd_sum(rank, "
                                             "world_size):\n    return rank",
                                             "grid_sums": right("grid_sums")}))
    hand_in(folder, "carol", answered(lesson, {"column_sum": "def helper(rows):\n"
                                               "    return 1 // (rows - rows)\n\n"
                                               "def my_column_sum(rank, world_size, rows):\n"
                                               "    return helper(rows)"}))
    hand_in(folder, "dave", answered(lesson, {"even_odd_sum": "value = 1 / 0"}))


# The index of lesson 01's answer cell for even_odd_sum, by which the grader names the cell
ANSWER_CELL = next(index for index, cell in enumerate(
    nbformat.read(COURSE / "notebooks" / f"{LESSON}.ipynb", as_version=4).cells)
    if cell.metadata.get("exercise") == "even_odd_sum")

HONEST = {  # (student, exercise) -> status, and the words its message holds
    ("alice", "even_odd_sum"): ("passed", "[PASSED] even_odd_sum"),
    ("alice", "column_sum"): ("passed", "Every result was right"),
    ("alice", "grid_sums"): ("passed", "Every result was right"),
    ("bob", "even_odd_sum"): ("failed", "On 4 ranks, rank 0: expected 2, got 0"),
    ("bob", "column_sum"): ("missing", "Not started"),
    ("bob", "grid_sums"): ("passed", "Every result was right"),
    ("carol", "even_odd_sum"): ("missing", "Not started"),
    ("carol", "column_sum"): ("failed", "ZeroDivisionError"),
    ("carol", "grid_sums"): ("missing", "Not started"),
    ("dave", "even_odd_sum"): ("error", 'ZeroDivisionError: division by zero\nTraceback (most '
                               f'recent call last):\n  File "<cell {ANSWER_CELL}>", line 4, in '
                               '<module>'),
    ("dave", "column_sum"): ("missing", "Not started"),
    ("dave", "grid_sums"): ("missing", "Not started"),
}


def grades(folder):
    with open(folder / "grades.csv", newline="") as file:
        return {(row["student"], row["exercise"]): row for row in csv.DictReader(file)}


def leftovers():
    """Processes on this machine whose command line holds MARK."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and MARK in pathlib.Path(f"/proc/{entry}/cmdline").read_text():
                found.append(entry)
        except OSError:
            continue
    return found


def test_one_sandbox_passes_a_right_answer_and_shows_nothing_of_the_machine(course_for_students,
                                                                           tmp_path):
    """make test's look at the sandbox (the soak tier grades whole classes): one notebook, three
    answers in it: a right one, one that reads the solutions and the network interfaces, one
    that writes into the course."""
    hand_in(tmp_path, "eve", answered(course_for_students[LESSON], {
        "even_odd_sum": right("even_odd_sum"),
        "column_sum": ("import socket\ninterfaces = socket.if_nameindex()\nstolen = open(COURSE "
                       "+ '/helpers/processes_and_groups/solutions.py').read()\nraise "
                       "RuntimeError(f'interfaces: {interfaces}, solutions: {stolen!r}')"
                       ).replace("COURSE", repr(str(COURSE))),
        "grid_sums": f"open({str(COURSE)!r} + '/planted-by-a-student', 'w')"}))
    grading.grade(tmp_path, limits=LIMITS, say=lambda line: None)
    got = grades(tmp_path)
    assert got[("eve", "even_odd_sum")]["status"] == "passed"
    assert "interfaces: [(1, 'lo')], solutions: ''" in got[("eve", "column_sum")]["message"]
    assert "Read-only file system" in got[("eve", "grid_sums")]["message"]
    assert not (COURSE / "planted-by-a-student").exists()


def test_without_root_the_sandbox_is_a_user_namespace_its_answers_cannot_undo():
    """The way an instructor without root grades (forced here, as CI is root): the answer runs in
    a user namespace nested in the one that made the mounts, whose mounts are locked there: it
    cannot unmount what hides the solutions (a mount of its own it may make, over nothing it
    could not already see); the right answer still passes."""
    hidden = str(COURSE / "helpers" / "processes_and_groups" / "solutions.py")
    undo = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"undone = libc.umount2({hidden!r}.encode(), 2)\n"
            f"size = len(open({hidden!r}).read())\n"
            "raise RuntimeError(f'unmounted: {undone}, bytes read: {size}')\n")
    verdicts = check_in_sandbox(
        [("even_odd_sum", [(0, right("even_odd_sum") + "\ncheck('even_odd_sum', even_odd_sum)")]),
         ("column_sum", [(0, undo)])],
        hide=[hidden], limits=LIMITS, user_namespace=True)
    assert verdicts["even_odd_sum"].status == "passed", verdicts["even_odd_sum"]
    assert "RuntimeError: unmounted: -1, bytes read: 0" in verdicts["column_sum"].message


def honest_grades_are_what_was_planted(folder):
    """The honest students' rows of grades.csv and gradebook.csv, and a feedback file: what was
    planted, whoever else is in the class."""
    got = grades(folder)
    for key, (status, says) in HONEST.items():
        row = got[key]
        assert row["status"] == status, (key, row)
        assert says in row["message"], (key, row["message"])
        points = exercises()[key[1]].points
        assert (int(row["points"]), int(row["max_points"])) == (
            points if status == "passed" else 0, points), row
    book = list(csv.reader((folder / "gradebook.csv").read_text().splitlines()))
    assert book[0] == ["student", LESSON, "total", "max_points"]
    rows = {row[0]: row for row in book[1:]}
    assert rows["alice"] == ["alice", "4", "4", "4"] and rows["bob"] == ["bob", "2", "2", "4"]
    feedback = (folder / "feedback" / "bob.md").read_text()
    assert "### even_odd_sum: failed, 0 of 1" in feedback
    assert "[NOT YET] even_odd_sum\nOn 4 ranks, rank 0: expected 2, got 0" in feedback


# The honest students are graded among the hostile ones, and get what was planted for them: the
# hostile submissions cost only their own points.
@pytest.mark.soak  # about 2 minutes: eleven sandboxes, one answer hanging to its limit
@pytest.mark.starts_first  # the soak's longest
def test_an_honest_class_and_hostile_submissions_that_cost_only_their_own_points(
        course_for_students, tmp_path):
    folder = tmp_path / "class"
    honest_class(folder, course_for_students)
    lesson = course_for_students[LESSON]
    for student, answers in HOSTILE.items():
        hand_in(folder, student, answered(lesson, {
            name: code.replace("{right}", right(name))
                      .replace("FOLDER", repr(str(folder))).replace("COURSE", repr(str(COURSE)))
            for name, code in answers.items()}))
    (folder / "oscar").mkdir()
    (folder / "oscar" / f"{LESSON}.ipynb").write_bytes(os.urandom(2000))
    hand_in(folder, "peggy", course_for_students[OTHER])  # another lesson's, under this name
    (folder / "trent").mkdir()  # nothing handed in
    (folder / "victor").mkdir()
    (folder / "victor" / "homework.ipynb").write_text("{}")
    before = sorted(path.name for path in COURSE.iterdir())

    problems = grading.grade(folder, limits=LIMITS, say=lambda line: None)

    got = grades(folder)
    solution_text = (COURSE / "helpers/processes_and_groups/solutions.py").read_text()
    alice_notebook = (folder / "alice" / f"{LESSON}.ipynb").read_text()
    for row in got.values():  # nothing stolen reached a message
        assert "def even_odd_sum" not in row["message"] and solution_text not in row["message"]
        assert '"cells"' not in row["message"] and alice_notebook[:200] not in row["message"]
    honest_grades_are_what_was_planted(folder)
    planted = {
        ("hangs", "even_odd_sum"): ("timeout", "did not finish within 30 s"),
        ("forks_forever", "even_odd_sum"): ("passed", "Every result was right"),
        ("prints_megabytes", "even_odd_sum"): ("passed", "Every result was right"),
        ("allocates_20_gb", "even_odd_sum"): ("error", "can't allocate memory"),
        ("reads_solutions", "even_odd_sum"): ("error", "RuntimeError: stolen: [b''"),
        ("reads_solutions", "column_sum"): ("error", "interfaces: [(1, 'lo')]"),
        ("reads_and_writes_others", "even_odd_sum"): ("error", "FileNotFoundError"),
        # what a write meets: a read-only file system, or under /tmp (where pytest puts the
        # class, and where CI may clone the course) a fresh one without the path
        ("reads_and_writes_others", "column_sum"): ("error", "Error: [Errno"),
        ("reads_and_writes_others", "grid_sums"): ("error", "Error: [Errno"),
        ("kills_its_parent", "even_odd_sum"): ("error", "ended before its check said"),
    }
    for student in HOSTILE:
        for name in ("even_odd_sum", "column_sum", "grid_sums"):
            status, says = planted.get((student, name), ("missing", "Not started"))
            assert got[(student, name)]["status"] == status, (student, name, got[(student, name)])
            assert says in got[(student, name)]["message"], got[(student, name)]["message"]
    # the solutions, their bytecode and the git history: each read gave nothing
    assert re.match(rf"Cell {ANSWER_CELL} raised RuntimeError: stolen: \[b''(, b'')*\]\n",
                    got[("reads_solutions", "even_odd_sum")]["message"])
    for name in ("even_odd_sum", "column_sum", "grid_sums"):
        assert got[("oscar", name)]["status"] == "missing"
        assert "could not be read as a notebook" in got[("oscar", name)]["message"]
        assert got[("peggy", name)]["status"] == "missing"
        assert "holds the exercises of collectives" in got[("peggy", name)]["message"]
    assert {key[0] for key in got} == {*dict.fromkeys(s for s, _ in HONEST), *HOSTILE,
                                       "oscar", "peggy"}
    assert "trent/: handed in no notebook" in problems
    assert any(problem.startswith("victor/homework.ipynb: no lesson's") for problem in problems)
    assert not leftovers()
    assert sorted(path.name for path in COURSE.iterdir()) == before
    assert not [line for line in (folder / "grades.csv").read_text().splitlines()
                if line.startswith("mallory,")]  # the row the hostile answer tried to add


def test_a_run_stopped_goes_on_and_one_student_is_graded_anew(course_for_students, tmp_path):
    """Only what grades.csv lacks is graded; --again grades a student anew (untouched stubs and
    unreadable notebooks: no sandbox needed, so the test is quick)."""
    hand_in(tmp_path, "amy", course_for_students[LESSON])
    hand_in(tmp_path, "ben", course_for_students[LESSON])
    said = []
    grading.grade(tmp_path, say=said.append)
    assert len([line for line in said if line.startswith("[")]) == 6
    rows = (tmp_path / "grades.csv").read_text().splitlines()
    (tmp_path / "grades.csv").write_text("\n".join(rows[:3]) + "\n")  # stopped after two rows
    said.clear()
    grading.grade(tmp_path, say=said.append)
    assert [line.split(":")[0] for line in said if line.startswith("[")] == [
        "[1/4] amy 01 grid_sums", "[2/4] ben 01 even_odd_sum", "[3/4] ben 01 column_sum",
        "[4/4] ben 01 grid_sums"]
    said.clear()
    grading.grade(tmp_path, again={"amy"}, say=said.append)
    assert len([line for line in said if line.startswith("[")]) == 3
    assert len(grades(tmp_path)) == 6
    # a lesson one student alone handed in: a column, empty for the others; a stray file named
    hand_in(tmp_path, "cat", course_for_students[OTHER], stem=OTHER)
    (tmp_path / "cat" / "notes.txt").write_text("my answers are in the notebook")
    said.clear()
    problems = grading.grade(tmp_path, say=said.append)
    assert problems == ["cat/notes.txt: not a notebook (left ungraded)"]
    book = (tmp_path / "gradebook.csv").read_text().splitlines()
    lessons_points = {name: exercise.points for name, exercise in exercises().items()}
    most = sum(points for name, points in lessons_points.items()
               if exercises()[name].lesson in {"helpers.processes_and_groups",
                                               "helpers.collectives"})
    assert book == [f"student,{LESSON},{OTHER},total,max_points", f"amy,0,,0,{most}",
                    f"ben,0,,0,{most}", f"cat,,0,0,{most}"]


def test_an_answer_takes_the_statements_it_needs_and_no_other():
    cells = [(0, "import torch\nimport torch.distributed as dist", {}),
             (1, "SIZE = 4\nunused = torch.zeros(SIZE)\nslow = sum(range(10**9))", {}),
             (2, "def helper(x):\n    return x * SIZE\n\nraise ValueError('a wrong answer')\n"
                 "check('e', helper)", {"exercise": "e"}),
             (3, "def my_f(rank, world_size):\n    return helper(rank) + len(dist.__name__)\n"
                 "\ncheck('f', my_f)", {"exercise": "f"})]
    found = notebook_cells.answer(cells, "f")
    assert found.cells == ((0, "\nimport torch.distributed as dist"), (1, "SIZE = 4\n\n"),
                           (2, "def helper(x):\n    return x * SIZE\n\n\n"), cells[3][:2])
    assert found.started
    stub = [(5, "def my_f(rank, world_size):\n    # Your code here.\n    raise "
                "NotImplementedError\n\n\ncheck('f', my_f)", {"exercise": "f"})]
    assert not notebook_cells.answer(stub, "f").started
    assert notebook_cells.answer(cells, "g") is None


def test_an_answer_the_sandbox_cannot_check_is_left_to_the_instructor_with_the_reason(tmp_path):
    """Lesson 15's batch_script needs the Slurm cluster's root daemons: its row says "by hand",
    0 points of 3, and why, whatever the answer; it never reads `failed` against the student.
    (No sandbox starts: the other exercise is an untouched stub.)"""
    stem = "15_on_a_cluster"
    text = (COURSE / "notebooks" / f"{stem}.ipynb").read_text()
    notebook = nbformat.reads(text if solutions_withheld() else
                              release.notebook_for_students(text), as_version=4)
    for cell in notebook.cells:  # (this lesson's stubs are named as the function, no my_)
        if cell.metadata.get("exercise") == "batch_script":
            cell.source = ("def batch_script(nodes, ranks_per_node):\n    return '#!/bin/bash'\n"
                           '\n\ncheck("batch_script", batch_script)')
    hand_in(tmp_path, "erin", notebook, stem=stem)
    assert grading.grade(tmp_path, say=lambda line: None) == []
    got = grades(tmp_path)
    assert got[("erin", "batch_script")]["status"] == "by hand"
    assert (got[("erin", "batch_script")]["points"],
            got[("erin", "batch_script")]["max_points"]) == ("0", "3")
    assert "Slurm cluster, whose daemons run as root" in got[("erin", "batch_script")]["message"]
    assert got[("erin", "hostnames")]["status"] == "missing"
    assert grading.grade(tmp_path, say=lambda line: None) == []  # graded: nothing left to do
    assert len((tmp_path / "grades.csv").read_text().splitlines()) == 3
