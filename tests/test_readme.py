"""The README is a front page: at most 150 lines, one lessons table with one row per notebook,
and no relative link to a file that does not exist."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
NOTEBOOK_LINK = re.compile(r"\]\((notebooks/[0-9][0-9]_\w+\.ipynb)\)")


def tables(lines: list) -> list:
    """Each markdown table: a run of lines starting with `|`, which a blank line would end."""
    found, current = [], []
    for line in lines + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            found.append(current)
            current = []
    return found


def test_the_readme_is_a_finished_page():
    """No placeholder left for a number still to be measured."""
    assert "TODO" not in README.read_text()


def test_the_readme_is_at_most_150_lines():
    assert len(README.read_text().splitlines()) <= 150


def test_one_lessons_table_has_one_row_per_notebook():
    lesson_tables = [table for table in tables(README.read_text().splitlines())
                     if any(NOTEBOOK_LINK.search(line) for line in table)]
    assert len(lesson_tables) == 1, "one lessons table, with no blank line inside it"
    header, rule, *rows = lesson_tables[0]
    assert set(rule) <= set("|-: ")
    linked = [NOTEBOOK_LINK.findall(row) for row in rows]
    assert all(len(links) == 1 for links in linked), "each row links to one notebook"
    notebooks = sorted(path.relative_to(ROOT).as_posix()
                       for path in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert sorted(links[0] for links in linked) == notebooks


def test_every_relative_link_leads_to_a_file():
    text = README.read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r'src="([^"]+)"', text)
    relative = {target.split("#")[0] for target in targets
                if not re.match(r"[a-z]+:|#", target)}
    assert relative, "the patterns still find links"
    assert sorted(target for target in relative if not (ROOT / target).exists()) == []


def test_what_the_readme_says_of_make_train_is_its_committed_record():
    """The loss, the baseline, the machine and the sample quoted are those of
    helpers/capstone/trained.json, the record `python -m helpers.capstone --record` writes."""
    import json

    record = json.loads((ROOT / "helpers/capstone/trained.json").read_text())
    text = " ".join(README.read_text().split())
    last = max(record["validation"], key=int)
    assert f"fell to {record['validation'][last]:.2f} bits per byte" in text
    assert f"against {record['unigram_bits']:.2f} for the byte frequencies alone" in text
    assert f"({record['machine']})" in text
    assert f"for {record['config']['steps']} steps" in text
    section = README.read_text().split("## Training a model", 1)[1]
    quoted = section.split("```\n", 1)[1].split("\n```", 1)[0]
    assert record["sample"].startswith(quoted)
