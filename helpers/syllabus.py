"""The syllabus (docs/syllabus.md), computed from the lessons' committed runs.

    python -m helpers.syllabus            # print it
    python -m helpers.syllabus --write    # write docs/syllabus.md and each lesson's title slide
                                          # (make notebooks does)

A lesson's talk time is a model built on measurements. Its prose is timed at WORDS_PER_MINUTE.
Each code cell gets SECONDS_PER_CELL to show and explain. Each cell's run time is the one its
committed notebook records: nbconvert's run, from the kernel taking the cell to its reply
(`helpers.lessons.cell_seconds`). A lesson whose talk exceeds TALK_PER_SLOT minutes is split
into two parts, at the section (`## `) boundary that halves it best. The ten-week plan gives each
part one 80-minute slot, and the rest of the slot goes to questions and an exercise done in class.
An exercise's hours outside class are a cold reader's (COLD_READS): someone who read the lesson as a
student, then did each exercise until its checker passed, counted the attempts and estimated a
student's hours. No class has been timed yet.

Each lesson opens on a title slide (`title_slide`), the notebook's first cell, tagged
slides.TITLE_TAG: its number and title, what a student can do after it (CAN_DO), the lessons it
needs (NEEDS), its minutes of talk by this model and its exercises. `--write` writes it there
too, and helpers.slides gives it a slide of its own.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import json
import pathlib
import re
from dataclasses import dataclass

import nbformat

from helpers import slides
from helpers.exercises import exercises
from helpers.lessons import cell_seconds, lessons

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORDS_PER_MINUTE = 130  # a lecturer's unhurried rate
SECONDS_PER_CELL = 20  # to show a code cell and say what it does, before it runs
SLOT_MINUTES, SLOTS_PER_WEEK, WEEKS = 80, 2, 10
TALK_PER_SLOT = 50  # of a slot's 80 minutes; the other 30 for questions and an exercise
COLD_READS = ROOT / "docs" / "cold_reads.csv"  # an exercise's hours, from a cold read of it


def cold_reads() -> dict:
    """{exercise: its row of COLD_READS}: lesson, exercise, hours (a student's, estimated by the
    reader), attempts (the reader's runs of `check` until it passed), read_on, reader, basis."""
    with open(COLD_READS, newline="") as file:
        return {row["exercise"]: row for row in csv.DictReader(file)}


@dataclass(frozen=True)
class Section:
    title: str
    words: int
    cells: int
    run_seconds: float

    @property
    def minutes(self) -> float:
        return (self.words / WORDS_PER_MINUTE + (self.cells * SECONDS_PER_CELL
                                                 + self.run_seconds) / 60)


def sections(lesson) -> list:
    """A lesson's sections, in order: the opening, then one per `## ` heading."""
    notebook = nbformat.read(ROOT / "notebooks" / f"{lesson.stem}.ipynb", as_version=4)
    found = [["Opening", 0, 0, 0.0]]
    for cell in notebook.cells:
        if cell.cell_type == "markdown":
            heading = re.match(r"^## (.*)", cell.source)
            if heading:
                found.append([heading.group(1).strip(), 0, 0, 0.0])
            found[-1][1] += len(re.findall(r"[\w’'-]+", cell.source))
        elif cell.cell_type == "code":
            found[-1][2] += 1
            found[-1][3] += cell_seconds(cell)
    return [Section(*one) for one in found]


def parts(lesson) -> list:
    """The lesson as one part, or two split at the section boundary that halves it best."""
    found = sections(lesson)
    total = sum(section.minutes for section in found)
    if total <= TALK_PER_SLOT:
        return [found]
    cut = min(range(1, len(found)), key=lambda at: abs(
        sum(section.minutes for section in found[:at]) - total / 2))
    return [found[:cut], found[cut:]]


def plan() -> list:
    """(week, slot, lesson, part's name, its sections, talk minutes) for every part, in course
    order, one part a slot."""
    rows, slot = [], 0
    for lesson in lessons():
        pieces = parts(lesson)
        for number, piece in enumerate(pieces, 1):
            name = lesson.stem[:2] + (f", part {number} of {len(pieces)}" if len(pieces) > 1
                                      else "")
            rows.append((slot // SLOTS_PER_WEEK + 1, "AB"[slot % SLOTS_PER_WEEK], lesson, name,
                         piece, sum(section.minutes for section in piece)))
            slot += 1
    return rows


def _whole_minutes(rows) -> list:
    """Each part's minutes as a whole number: its lesson's total rounded once, the first part
    rounded and the second given the rest, so that a lesson's parts add up to its rounded total."""
    shown = []
    for index, (*_, lesson, _, _, minutes) in enumerate(rows):
        first = index == 0 or rows[index - 1][2] != lesson
        if first:
            shown.append(round(minutes))
        else:
            whole = round(sum(row[5] for row in rows if row[2] == lesson))
            shown.append(whole - shown[-1])
    return shown


def _title(lesson) -> str:
    notebook = nbformat.read(ROOT / "notebooks" / f"{lesson.stem}.ipynb", as_version=4)
    return notebook.cells[0].source.split("\n")[0].lstrip("# ").split(" — ", 1)[-1]


def title_slide(lesson) -> str:
    """The lesson's title slide: its heading, what a student can do after it (CAN_DO), the
    lessons it needs, how long its talk takes by this module's model, and its exercises."""
    every = lessons()
    by_number = {other.number: other for other in every}
    # the lessons needed, by number and title; by number alone where more than two, whose titles
    # would take the room of the slide's 60 words (the syllabus's table has them all)
    needs = ("Python and PyTorch's basics (tensors, autograd, an optimizer); a laptop, no GPU"
             if not lesson.needs else
             "lesson" + "s" * (len(lesson.needs) > 1) + " " + (" · ".join(
                 f"{number:02d} {_title(by_number[number])}" for number in lesson.needs)
                 if len(lesson.needs) <= 2 else
                 ", ".join(f"{number:02d}" for number in lesson.needs[:-1])
                 + f" and {lesson.needs[-1]:02d}"))
    minutes = round(sum(section.minutes for section in sections(lesson)))
    pieces = len(parts(lesson))
    own = [exercise for exercise in exercises().values() if exercise.lesson == lesson.package]
    design = sum(exercise.points == 3 for exercise in own)
    can_do = importlib.import_module(lesson.package).CAN_DO
    return (f"# {lesson.stem[:2]} — {_title(lesson)}\n\n"
            f"Lesson {lesson.number} of {len(every)}\n\n"
            f"- **After it, you can** {can_do}.\n"
            f"- **Needs:** {needs}.\n"
            f"- **Takes:** an estimated {minutes} minutes of talk"
            + (f", in {pieces} parts" if pieces > 1 else "")
            + f"; {len(own)} exercise{'s' * (len(own) != 1)}"
            + (f" ({design} design)." if design else "."))


def write_title_slides() -> list:
    """Put each lesson's title slide in its notebook's first cell, and its opening prose, which
    began under the heading, in a cell of its own after it; the slides' metadata is written
    again (helpers.slides). Returns the notebooks changed."""
    changed = []
    for lesson in lessons():
        path = ROOT / "notebooks" / f"{lesson.stem}.ipynb"
        notebook = json.loads(path.read_text())
        cells, text = notebook["cells"], title_slide(lesson)
        first = cells[0]
        if slides.TITLE_TAG not in first.get("metadata", {}).get("tags", []):
            heading, _, rest = "".join(first["source"]).partition("\n")
            if not heading.startswith("# "):
                raise ValueError(f"{path}: its first cell starts {heading[:60]!r}, not the "
                                 "lesson's `# NN — Title` heading")
            cells.insert(1, dict(first, source=rest.strip("\n").splitlines(keepends=True),
                                 id=f"{first.get('id', 'title')}-opening"[:64]))
            first = cells[0] = dict(first, metadata={**first.get("metadata", {}),
                                                     "tags": [slides.TITLE_TAG]})
        if "".join(first["source"]) == text:
            continue
        first["source"] = text.splitlines(keepends=True)
        path.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n")
        slides.rewrite(str(path))
        changed.append(path)
    return changed


def render() -> str:
    every = exercises()
    rows = plan()
    slots = WEEKS * SLOTS_PER_WEEK
    lines = [
        "# Syllabus: ten weeks, two 80-minute slots a week",
        "",
        "Made by `python -m helpers.syllabus --write` from the lessons' committed runs (`make "
        "notebooks` remakes it); `tests/test_syllabus.py` checks that this page is what they give.",
        "",
        "**How the minutes are made (a model on measurements).** Each section's talk is its "
        f"prose at {WORDS_PER_MINUTE} words a minute, plus {SECONDS_PER_CELL} s to show each code "
        "cell, plus the time each cell ran in the notebook's committed run (nbconvert's, on the "
        "machine that last ran it: 2 cores). A lesson over "
        f"{TALK_PER_SLOT} minutes of talk is split in two where its sections best halve it; the "
        f"other {SLOT_MINUTES - TALK_PER_SLOT} minutes of a slot are for questions and an exercise "
        "worked in class.",
        "",
        "**Prerequisites.** Python; PyTorch's basics (tensors, `nn.Module`, autograd, an "
        "optimizer's step); a shell. No GPU: every lesson runs on a laptop's CPU. Each lesson "
        "names the earlier lessons it needs (the table below, and its title slide).",
        "",
        "## The plan",
        "",
        "| week | slot | lesson | sections | talk (min) |",
        "|---|---|---|---|---|",
    ]
    shown = _whole_minutes(rows)
    for (week, slot, lesson, name, piece, _), minutes in zip(rows, shown):
        titles = "; ".join(section.title for section in piece)
        lines.append(f"| {week} | {slot} | {name}: {_title(lesson)} | {titles} | {minutes} |")
    spare = slots - len(rows)
    if spare > 0:
        lines.append(f"| {WEEKS} | {'AB'[(len(rows)) % 2]}{'' if spare == 1 else ' +'} | "
                     f"open ({spare} slot{'s' if spare > 1 else ''}) | review, and questions on "
                     "the capstone's design exercises (homework) | |")
    total = sum(shown)
    lines += ["", f"{len(rows)} parts in {slots} slots; {total} minutes of talk in all, "
              f"{total / len(rows):.0f} a part on average. Each lesson's minutes are rounded "
              "once, and a split lesson's second part takes what its first leaves, so that the "
              "parts add up to the lesson's row below.", "",
              "## Each lesson", "",
              "| lesson | needs lessons | talk (min) | prose (words) | code cells | cells' run "
              "(s) | after it, a student can |", "|---|---|---|---|---|---|---|"]
    for lesson in lessons():
        found = sections(lesson)
        can_do = importlib.import_module(lesson.package).CAN_DO
        needs = ", ".join(f"{number:02d}" for number in lesson.needs) or "none"
        lines.append(f"| {lesson.stem[:2]} {_title(lesson)} | {needs} | "
                     f"{round(sum(section.minutes for section in found))} | "
                     f"{sum(section.words for section in found)} | "
                     f"{sum(section.cells for section in found)} | "
                     f"{sum(section.run_seconds for section in found):.0f} | {can_do} |")
    read = cold_reads()
    readers = sorted({(row["read_on"], row["reader"]) for row in read.values()})
    lines += ["", "## Exercises", "",
              "Each lesson ends with checked exercises (`check(name, your_function)`); "
              "`make grade` grades them for a class (docs/teaching.md). Set the design exercises "
              "(their statement says what must hold, not which calls to make) and the harder ones "
              "as homework; work a 1-point exercise in class. **The hours are a cold reader's "
              "estimate**, from docs/cold_reads.csv: a reader who had read the lesson as a "
              "student did each exercise until its checker passed, counted the attempts (runs of "
              "`check`), and estimated the hours of a student who knows Python and PyTorch and is "
              "new to `torch.distributed`; each row of the file says what the estimate rests on "
              "(for lesson 04's, the task alone: its reader saw the checker's code first). Read "
              "on " + "; ".join(f"{day} by {who}" for day, who in readers)
              + ". No class has been timed yet: replace them with your class's.", "",
              "| lesson | exercise | kind | points | hours (cold read) | reader's attempts | "
              "set as |", "|---|---|---|---|---|---|---|"]
    for lesson in lessons():
        for name, exercise in every.items():
            if exercise.lesson != lesson.package:
                continue
            kind = {3: "design", 2: "harder", 1: "core"}[exercise.points]
            lines.append(f"| {lesson.stem[:2]} | `{name}` | {kind} | {exercise.points} | "
                         f"{float(read[name]['hours']):g} | {read[name]['attempts']} | "
                         f"{'homework' if exercise.points > 1 else 'in class'} |")
    homework = sum(float(read[name]["hours"]) for name, exercise in every.items()
                   if exercise.points > 1)
    lines += ["", f"Homework in all: {homework:g} hours over {WEEKS} weeks (cold reads' "
              "estimates).", ""]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m helpers.syllabus", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true",
                        help="write docs/syllabus.md and each lesson's title slide")
    if parser.parse_args(argv).write:
        for _ in range(3):  # a title slide's own words count in its minutes: until they settle
            if not write_title_slides():
                break
        (ROOT / "docs" / "syllabus.md").write_text(render())
    else:
        print(render())


if __name__ == "__main__":
    main()
