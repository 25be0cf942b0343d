"""The autograder for a class: every student's handed-in notebooks, every exercise, a sandbox each.

    make grade SUBMISSIONS=handed-in          # or: python -m helpers.grading handed-in
    make grade SUBMISSIONS=handed-in ARGS="--again alice"

`handed-in/<student>/<NN_name>.ipynb`: one folder per student, one notebook per lesson handed in,
any subset. For each student, each lesson handed in and each of its exercises, the answer cell
(found by its metadata, `cells.py`) and the cells it needs run in a sandbox of their own
(`sandbox.py`), where the exercise's checker judges the function handed to `check`. One of six
statuses is recorded:

    passed    the checker passed it                  failed   the checker's message says why
    error     a cell raised: the traceback, at the learner's line
    timeout   a hang the checker located, or the whole answer past its time limit
    missing   no answer cell, the notebook's stub untouched, or a notebook that cannot be read
    by hand   an answer the sandbox cannot check (lesson 15's batch_script, which needs the
              Slurm cluster's root daemons): 0 points until the instructor gives them

It writes, in `handed-in/`:
- `grades.csv`: student, lesson, exercise, points, max_points, status, seconds, message; a row
  per exercise of each lesson handed in, written as each is graded;
- `gradebook.csv`: a row per student, a column of points per lesson, then the total and the
  most there is: the shape a learning platform's grade import takes (a column per assignment);
- `feedback/<student>.md`: each exercise's status and points, and the checker's message as the
  student would read it in the notebook.

Points are declared beside each exercise (`Exercise.points`: 3 for a design exercise, 2 for a
harder one, 1 for the rest). A run can be stopped (Ctrl-C) and run again: it grades only what
`grades.csv` does not yet hold. `--again STUDENT` grades that student anew. A folder or file that
is not a student's notebook (empty, corrupt, another lesson's, an unknown name) is reported by
name and graded as missing where it stands for a lesson.
"""

from __future__ import annotations

import argparse
import csv
import functools
import os
import pathlib
import sys
import time

from helpers.grading import cells as notebook_cells
from helpers.grading.sandbox import STATUSES, Limits, check_in_sandbox

BY_HAND = "by hand"  # an answer the sandbox cannot check (Exercise.by_hand says why)

COLUMNS = ("student", "lesson", "exercise", "points", "max_points", "status", "seconds",
           "message")
OWN = {"grades.csv", "gradebook.csv", "feedback"}  # what the grader writes in the folder
COURSE = pathlib.Path(__file__).resolve().parent.parent.parent


def grade(folder, again=(), limits: Limits | None = None, say=None) -> list:
    """Grade every submission in `folder` not yet in its grades.csv (all of `again`'s anew);
    returns the problems found, each a sentence naming its file or folder."""
    from helpers.exercises import exercises
    from helpers.lessons import lessons

    folder, limits = pathlib.Path(folder).resolve(), limits or Limits()
    say = say or functools.partial(print, flush=True)  # a line as each answer is graded
    by_stem = {lesson.stem: lesson for lesson in lessons()}
    every = exercises()
    rows = [row for row in _read(folder / "grades.csv") if row["student"] not in again]
    done = {(row["student"], row["lesson"], row["exercise"]) for row in rows}
    _write(folder / "grades.csv", rows)
    problems, work = [], []
    for student in sorted(path for path in folder.iterdir() if path.name not in OWN
                          and not path.name.startswith(".")):
        if not student.is_dir():
            problems.append(f"{student.name}: not a student's folder (a folder per student)")
            continue
        handed = sorted(student.glob("*.ipynb"))
        if not handed:
            problems.append(f"{student.name}/: handed in no notebook")
        problems += [f"{student.name}/{path.name}: not a notebook (left ungraded)"
                     for path in sorted(student.iterdir()) if path.suffix != ".ipynb"]
        for notebook in handed:
            lesson = by_stem.get(notebook.stem)
            if lesson is None:
                problems.append(f"{student.name}/{notebook.name}: no lesson's notebook has this "
                                f"name (they are {', '.join(sorted(by_stem))}.ipynb)")
                continue
            names = [name for name, exercise in every.items() if exercise.lesson == lesson.package]
            work += [(student.name, lesson, notebook, name) for name in names
                     if (student.name, lesson.stem, name) not in done]
    for problem in problems:
        say(f"note: {problem}")
    hide = [str(folder), *_secrets(COURSE)]
    by_notebook = {}
    for student, lesson, notebook, name in work:
        by_notebook.setdefault((student, lesson, notebook), []).append(name)
    try:
        _grade_all(by_notebook, rows=rows, folder=folder, every=every, hide=hide, limits=limits,
                   problems=problems, say=say, total=len(work))
    finally:  # stopped or not: the gradebook and feedback say what grades.csv holds
        _write_gradebook(folder, rows, every)
        _write_feedback(folder, rows)
    return problems


def _grade_all(by_notebook, *, rows, folder, every, hide, limits, problems, say, total):
    """Each handed-in notebook's answers, graded in its sandbox; each row appended to grades.csv
    (and to `rows`) as it comes, a progress line said."""
    graded = 0
    for (student, lesson, notebook), names in by_notebook.items():
        cells = _cells(notebook, lesson, every)
        if isinstance(cells, Exception):
            problems.append(f"{student}/{cells}")
            say(f"note: {student}/{cells}")
        for row in _graded(student, lesson, cells, names, every, hide, limits):
            rows.append(row)
            _append(folder / "grades.csv", row)
            graded += 1
            say(f"[{graded}/{total}] {student} {lesson.stem[:2]} {row['exercise']}: "
                f"{row['status']} ({row['points']}/{row['max_points']}, {row['seconds']} s)")


def _secrets(course) -> list:
    """Every copy of the solutions in the course: the files, their compiled bytecode, and the git
    history that holds them."""
    return [str(path) for pattern in ("helpers/*/solutions.py",
                                      "helpers/*/__pycache__/solutions.*", ".git")
            for path in sorted(course.glob(pattern))]


def _another_lessons(cells, lesson, every) -> str | None:
    """The lesson whose exercises a notebook holds, where it holds none of its own name's."""
    found = notebook_cells.exercises_in(cells) & set(every)
    if not found or any(every[name].lesson == lesson.package for name in found):
        return None
    return ", ".join(sorted({every[name].lesson.rpartition(".")[2] for name in found}))


def _cells(notebook, lesson, every):
    """The notebook's code cells, or Unreadable: not a notebook, or another lesson's."""
    try:
        cells = notebook_cells.read(notebook)
    except notebook_cells.Unreadable as error:
        return error
    other = _another_lessons(cells, lesson, every)
    if other:
        return notebook_cells.Unreadable(f"{notebook.name} holds the exercises of {other}, not "
                                         f"of {lesson.stem}")
    return cells


def _graded(student, lesson, cells, names, every, hide, limits) -> list:
    """A row for each of `names`, the exercises of one handed-in notebook: its answers checked
    together in one sandbox (one submission's), each in a process of its own."""
    rows, answers = {}, []
    for name in names:
        row = {"student": student, "lesson": lesson.stem, "exercise": name, "points": 0,
               "max_points": every[name].points, "seconds": 0}
        found = None if isinstance(cells, Exception) else notebook_cells.answer(cells, name)
        if isinstance(cells, Exception):
            rows[name] = {**row, "status": "missing", "message": str(cells)}
        elif found is None:
            rows[name] = {**row, "status": "missing", "message": f"No cell answers {name} (its "
                          "cell, marked in the notebook's metadata, or a cell calling check on "
                          "it)."}
        elif not found.started:
            rows[name] = {**row, "status": "missing", "message": "Not started: the function is "
                          "still the notebook's `raise NotImplementedError`."}
        elif every[name].by_hand:
            rows[name] = {**row, "status": BY_HAND, "message": f"Not graded here: "
                          f"{every[name].by_hand}. Run the student's cell on a machine where "
                          "it runs (docs/teaching.md), and give its points by hand."}
        else:
            rows[name] = row
            answers.append((name, found.cells))
    verdicts = check_in_sandbox(answers, hide=hide, limits=limits) if answers else {}
    for name, verdict in verdicts.items():
        rows[name] = {**rows[name], "points": every[name].points if verdict.status == "passed"
                      else 0, "status": verdict.status, "seconds": round(verdict.seconds, 1),
                      "message": verdict.message}
    return [rows[name] for name in names]


def _read(path) -> list:
    """The rows already graded; a row cut short (a run killed as it wrote) is graded again."""
    if not path.exists():
        return []
    with open(path, newline="") as file:
        return [row for row in csv.DictReader(file)
                if None not in row.values() and row["status"] in (*STATUSES, "missing", BY_HAND)]


def _write(path, rows):
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def _append(path, row):
    with open(path, "a", newline="") as file:
        csv.DictWriter(file, COLUMNS).writerow(row)
        file.flush()
        os.fsync(file.fileno())


def _write_gradebook(folder, rows, every):
    """A row per student, a column per lesson anyone handed in: its points, or empty where the
    student handed in no notebook of it; then the total, and the most the class's lessons give."""
    stems = sorted({row["lesson"] for row in rows})
    packages = {f"helpers.{stem[3:]}" for stem in stems}  # 03_collectives: helpers.collectives
    most = sum(exercise.points for exercise in every.values() if exercise.lesson in packages)
    with open(folder / "gradebook.csv", "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["student", *stems, "total", "max_points"])
        for student in sorted({row["student"] for row in rows}):
            mine = [row for row in rows if row["student"] == student]
            points = [sum(int(row["points"]) for row in mine if row["lesson"] == stem)
                      if any(row["lesson"] == stem for row in mine) else "" for stem in stems]
            writer.writerow([student, *points, sum(p for p in points if p != ""), most])


def _write_feedback(folder, rows):
    (folder / "feedback").mkdir(exist_ok=True)
    for student in sorted({row["student"] for row in rows}):
        mine = [row for row in rows if row["student"] == student]
        lines = [f"# Feedback for {student}", "",
                 f"{sum(int(row['points']) for row in mine)} of "
                 f"{sum(int(row['max_points']) for row in mine)} points, for the lessons you "
                 "handed in.", ""]
        for lesson in sorted({row["lesson"] for row in mine}):
            lines += [f"## {lesson}", ""]
            for row in (row for row in mine if row["lesson"] == lesson):
                lines += [f"### {row['exercise']}: {row['status']}, {row['points']} of "
                          f"{row['max_points']}", "", "```", row["message"], "```", ""]
        (folder / "feedback" / f"{student}.md").write_text("\n".join(lines))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m helpers.grading", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("submissions", help="a folder of students' folders of notebooks")
    parser.add_argument("--again", action="append", default=[], metavar="STUDENT",
                        help="grade this student anew (may be given more than once)")
    parser.add_argument("--timeout", type=float, default=Limits.seconds,
                        help="seconds for each answer, all its cases (default %(default)s)")
    parser.add_argument("--memory", type=float, default=Limits.memory / 2**30,
                        help="GiB of address space per process (default %(default)s)")
    options = parser.parse_args(argv)
    folder = pathlib.Path(options.submissions)
    if not folder.is_dir():
        parser.error(f"{folder} is not a folder")
    start = time.monotonic()
    try:
        grade(folder, again=set(options.again),
              limits=Limits(seconds=options.timeout, memory=int(options.memory * 2**30)))
    except KeyboardInterrupt:
        print(f"\nStopped. What was graded is in {folder / 'grades.csv'}; run the same command "
              "again to grade the rest.")
        return 130
    print(f"Graded in {time.monotonic() - start:.0f} s: {folder / 'grades.csv'}, "
          f"{folder / 'gradebook.csv'}, {folder / 'feedback'}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
