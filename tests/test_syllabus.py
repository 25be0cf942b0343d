"""The syllabus (helpers/syllabus.py, docs/syllabus.md): the page is what the lessons' committed
runs give, its minutes add up to the lessons' own, recounted here cell by cell, and its plan
fits ten weeks of two slots."""

import importlib
import json
import pathlib
import re
from datetime import datetime

from helpers import syllabus
from helpers.lessons import lessons

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_committed_syllabus_is_what_the_committed_runs_give():
    """After `make notebooks` (which writes it) or a changed lesson, `python -m helpers.syllabus
    --write` remakes it."""
    assert (ROOT / "docs" / "syllabus.md").read_text() == syllabus.render()


def minutes_recounted(stem):
    """A lesson's talk by the model, counted over its cells as JSON, sections aside."""
    cells = json.loads((ROOT / "notebooks" / f"{stem}.ipynb").read_text())["cells"]
    words = sum(len(re.findall(r"[\w’'-]+", "".join(cell["source"])))
                for cell in cells if cell["cell_type"] == "markdown")
    code = [cell for cell in cells if cell["cell_type"] == "code"]
    run = 0.0
    for cell in code:
        times = cell["metadata"].get("execution", {})
        if "shell.execute_reply" in times:
            run += (datetime.fromisoformat(times["shell.execute_reply"]) -
                    datetime.fromisoformat(times["iopub.execute_input"])).total_seconds()
    return words / 130 + (len(code) * 20 + run) / 60


def test_the_plans_minutes_add_up_to_the_lessons():
    rows = syllabus.plan()
    for lesson in lessons():
        own = [minutes for _, _, of, _, _, minutes in rows if of == lesson]
        assert abs(sum(own) - minutes_recounted(lesson.stem)) < 1e-6, lesson.stem
    assert len(rows) <= syllabus.WEEKS * syllabus.SLOTS_PER_WEEK
    weeks = [(week, slot) for week, slot, *_ in rows]
    assert weeks == sorted(weeks) and len(set(weeks)) == len(weeks)


def test_the_long_lessons_split_where_their_sections_part():
    """Each part of a split lesson starts at one of its `## ` headings, and each part fits the
    talk of a slot; the split ones are exactly the lessons whose minutes, recounted here, are too
    long for one (at least one is, or this test would check nothing)."""
    split = set()
    for lesson in lessons():
        parts = syllabus.parts(lesson)
        text = (ROOT / "notebooks" / f"{lesson.stem}.ipynb").read_text()
        if len(parts) > 1:
            split.add(lesson.stem)
            assert f"## {parts[1][0].title}" in text
        assert all(sum(section.minutes for section in part) <= syllabus.TALK_PER_SLOT
                   for part in parts), lesson.stem
    too_long = {lesson.stem for lesson in lessons()
                if minutes_recounted(lesson.stem) > syllabus.TALK_PER_SLOT}
    assert split == too_long and split


def test_the_minutes_shown_add_up_as_printed():
    """Whole minutes on the page: a lesson's parts sum to its own row, the rows to the total."""
    rows = syllabus.plan()
    shown = syllabus._whole_minutes(rows)
    for lesson in lessons():
        mine = [minutes for row, minutes in zip(rows, shown) if row[2] == lesson]
        assert sum(mine) == round(minutes_recounted(lesson.stem)), lesson.stem
    assert f"; {sum(shown)} minutes of talk in all" in syllabus.render()


def test_every_exercise_has_one_cold_read_and_the_homework_adds_up():
    """docs/cold_reads.csv holds one row per exercise of the course, no other, each with hours
    in quarters and the reader's attempts; the page's homework total is the sum of the design
    and harder exercises' rows, recounted here from the file."""
    import csv

    from helpers.exercises import exercises

    with open(ROOT / "docs" / "cold_reads.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    every = exercises()
    assert sorted(row["exercise"] for row in rows) == sorted(every)
    for row in rows:
        hours = float(row["hours"])
        assert hours > 0 and (hours * 4).is_integer(), row
        assert int(row["attempts"]) >= 1 and row["basis"] and row["reader"], row
        assert every[row["exercise"]].lesson.endswith(
            next(lesson.package for lesson in lessons()
                 if lesson.stem[:2] == row["lesson"]).split(".")[-1]), row
    homework = sum(float(row["hours"]) for row in rows if every[row["exercise"]].points > 1)
    assert f"Homework in all: {homework:g} hours" in syllabus.render()


def test_each_lesson_opens_on_a_title_slide_that_says_what_it_needs_and_takes():
    """Its first cell, a sub-slide of its own: the heading, the lesson's number, what a student
    can do after it, the lessons it needs (by number and title, by number alone where more than
    two), its talk minutes (recounted here from the JSON) and its exercises (the notebook's
    exercise cells, by their metadata; a design one's heading says so)."""
    every = {lesson.number: lesson for lesson in lessons()}
    for lesson in every.values():
        cells = json.loads((ROOT / "notebooks" / f"{lesson.stem}.ipynb").read_text())["cells"]
        title = "".join(cells[0]["source"])
        assert cells[0]["metadata"]["tags"] == ["lesson-title"], lesson.stem
        assert cells[0]["metadata"]["slideshow"]["slide_type"] == "slide"
        assert cells[1]["metadata"]["slideshow"]["slide_type"] == "subslide", lesson.stem
        heading = title.splitlines()[0]
        assert heading.startswith(f"# {lesson.stem[:2]} — "), heading
        assert f"\nLesson {lesson.number} of {len(every)}\n" in title
        can_do = importlib.import_module(lesson.package).CAN_DO
        assert f"\n- **After it, you can** {can_do}.\n" in title, lesson.stem
        needs = re.search(r"\*\*Needs:\*\* (.*)", title).group(1)
        if len(lesson.needs) <= 2:
            for need in lesson.needs:
                other = json.loads((ROOT / "notebooks" / f"{every[need].stem}.ipynb").read_text())
                name = "".join(other["cells"][0]["source"]).splitlines()[0].split(" — ", 1)[1]
                assert f"{need:02d} {name}" in title, (lesson.stem, need)
            assert len(re.findall(r"(?:^lessons? | · )\d\d ", needs)) == len(lesson.needs), needs
        else:  # e.g. "lessons 07, 08, 10 and 11."
            *first, last = (f"{need:02d}" for need in lesson.needs)
            assert needs == f"lessons {', '.join(first)} and {last}.", needs
        assert (f"**Takes:** an estimated {round(minutes_recounted(lesson.stem))} minutes of talk"
                in title)
        answers = [cell for cell in cells if "exercise" in cell["metadata"]]
        design = sum("(design)" in "".join(cell["source"]) for cell in cells
                     if cell["cell_type"] == "markdown" and "".join(cell["source"]).startswith("#"))
        assert f"; {len(answers)} exercise" in title, lesson.stem
        assert (f" ({design} design)." in title) == (design > 0), lesson.stem
