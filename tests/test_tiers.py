"""The tiers as data: each lesson's package says where its notebook and tests run (TIER, SLOW,
ROUNDING_FREE; helpers/lessons.py), conftest.py's `--tier` selects and orders from that, and the
Makefile and .ci/run name no lesson's files. The expectations here are written out, not read from
the code under test."""

import importlib
import importlib.util
import json
import pathlib
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from helpers import lessons

ROOT = pathlib.Path(__file__).resolve().parent.parent
LESSON_NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
# What a lesson's __init__.py may define in capitals: a mistyped tier constant would otherwise
# leave its lesson at the defaults without a word.
LESSON_CONSTANTS = {"NOTEBOOK", "BUILDS_ON", "TIER", "SLOW", "ROUNDING_FREE",
                    "CAN_DO", "NEEDS"}


def test_every_lessons_constants_are_valid():
    for lesson in lessons.lessons():  # lessons() raises on a bad value
        package = importlib.import_module(lesson.package)
        capitals = {name for name in vars(package) if name.isupper()}
        assert capitals <= LESSON_CONSTANTS, f"{lesson.package}: {capitals - LESSON_CONSTANTS}"
        assert lesson.tier in ("test", "long", "cluster")
        assert all(isinstance(flag, bool)
                   for flag in (lesson.slow, lesson.rounding_free))


@pytest.mark.parametrize("notebook", LESSON_NOTEBOOKS, ids=lambda path: path.stem)
def test_every_notebook_is_a_lessons_and_in_exactly_one_of_test_long_cluster(notebook):
    assert lessons.lesson_of(notebook) is not None, "no lesson's NOTEBOOK names it"
    assert len(lessons.tiers_of(notebook) & {"test", "long", "cluster"}) == 1


# (file, the tiers that run it): the old Makefile's lists, for a few lessons and shared files.
EXPECTED = [
    ("notebooks/01_processes_and_groups.ipynb", {"test"}),  # rounding-free
    ("notebooks/03_collectives.ipynb", {"test", "other-cpu"}),
    ("notebooks/13_at_scale.ipynb", {"test"}),  # rounding-free
    ("notebooks/14_capstone.ipynb", {"long"}),
    ("notebooks/15_on_a_cluster.ipynb", {"cluster"}),
    ("tests/test_capstone.py", {"test", "other-cpu"}),  # a long lesson's tests run in make test
    ("tests/test_composing_experts.py", {"test", "other-cpu"}),
    ("tests/test_on_a_cluster.py", {"test", "cluster"}),  # make test runs its tests but cluster's
    ("tests/test_on_a_cluster_exercises.py", {"test", "cluster"}),
    ("tests/test_launcher.py", {"test", "other-cpu"}),
    ("notebooks/Untitled.ipynb", set()),  # a learner's own notebook, from make lab
    ("tests/conftest.py", None),
    ("notebooks/rise.css", None),
]


@pytest.mark.parametrize(("path", "tiers"), EXPECTED, ids=[path for path, _ in EXPECTED])
def test_the_tiers_of_a_file_are_what_its_lesson_says(path, tiers):
    assert lessons.tiers_of(ROOT / path) == tiers


def test_a_test_file_belongs_to_the_lesson_it_is_named_after():
    owner = {name: lessons.lesson_of(f"tests/{name}") for name in (
        "test_composing.py", "test_composing_experts.py", "test_at_scale_step_time.py",
        "test_launcher.py", "test_exercises.py", "conftest.py")}
    assert {name: lesson and lesson.package for name, lesson in owner.items()} == {
        "test_composing.py": "helpers.composing",
        "test_composing_experts.py": "helpers.composing",
        "test_at_scale_step_time.py": "helpers.at_scale",
        "test_launcher.py": None, "test_exercises.py": None, "conftest.py": None}


def test_a_lesson_with_an_unknown_tier_or_flag_is_refused_by_name(monkeypatch):
    import helpers.capstone

    monkeypatch.setattr(helpers.capstone, "TIER", "nonsense", raising=False)
    with pytest.raises(ValueError, match=r"helpers\.capstone: TIER is 'nonsense'"):
        lessons.lessons()
    with pytest.raises(ValueError, match="helpers.capstone"):
        lessons.tiers_of(ROOT / "notebooks/03_collectives.ipynb")
    monkeypatch.setattr(helpers.capstone, "TIER", "long")
    monkeypatch.setattr(helpers.capstone, "SLOW", "yes", raising=False)
    with pytest.raises(ValueError, match=r"helpers\.capstone: SLOW is 'yes'"):
        lessons.lessons()


def _notebook(path, stem, seconds):
    """A fake notebook of lesson `stem`, whose code cells took `seconds` each, and a markdown cell
    that carries timings too (nbconvert's, which do not count)."""
    def cell(kind, took):
        times = {"iopub.execute_input": "2026-11-29T07:00:00.000000Z",
                 "shell.execute_reply": f"2026-11-29T07:00:{took:09.6f}Z"}
        return {"cell_type": kind, "metadata": {"execution": times}, "source": ""}

    cells = [cell("code", took) for took in seconds] + [cell("markdown", 30.0)]
    cells.append({"cell_type": "code", "metadata": {}, "source": ""})  # never executed
    notebook = path / f"{stem}.ipynb"
    notebook.write_text(json.dumps({"cells": cells}))
    return notebook


def test_a_notebooks_seconds_are_its_code_cells_committed_times(tmp_path):
    notebook = _notebook(tmp_path, "03_collectives", [1.5, 2.25])
    assert lessons.notebook_seconds(notebook) == pytest.approx(3.75)


def test_slow_notebooks_start_first_the_longest_first_then_the_test_files_that_say_so(tmp_path):
    # 04, 09 and 12 are SLOW; 01 is not, however long.
    collected = [_notebook(tmp_path, "01_processes_and_groups", [50.0]),
                 _notebook(tmp_path, "04_measuring_communication", [20.0]),
                 _notebook(tmp_path, "09_pipeline_parallelism", [5.0, 5.0]),
                 _notebook(tmp_path, "12_checkpoints_and_failures", [40.0]),
                 tmp_path / "test_launcher.py", tmp_path / "test_llama.py"]
    first = {tmp_path / "test_launcher.py"}
    order = sorted(collected, key=lambda path: lessons.start_key(path, path in first))
    assert [path.stem for path in order] == [
        "12_checkpoints_and_failures", "04_measuring_communication", "09_pipeline_parallelism",
        "test_launcher", "01_processes_and_groups", "test_llama"]


def _root_conftest():
    spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Options:
    """A pytest config that has only --tier and --cases-share."""

    def __init__(self, tier, share=1):
        self.options = {"--tier": tier, "--cases-share": share}

    def getoption(self, name):
        return self.options[name]


@pytest.mark.parametrize(("tier", "path", "ignored"), [
    ("test", "notebooks/14_capstone.ipynb", True),
    ("long", "notebooks/14_capstone.ipynb", None),
    ("long", "tests/test_capstone.py", True),
    ("other-cpu", "notebooks/01_processes_and_groups.ipynb", True),
    ("other-cpu", "tests/test_on_a_cluster_exercises.py", True),
    ("cluster", "tests/test_on_a_cluster_exercises.py", None),
    ("cluster", "tests/conftest.py", None),  # not a notebook or test file: pytest's to judge
    ("cluster", "tests", None),
    (None, "notebooks/14_capstone.ipynb", None),  # no --tier: everything as before
])
def test_a_tier_does_not_collect_another_tiers_files(tier, path, ignored):
    conftest = _root_conftest()
    assert conftest.pytest_ignore_collect(ROOT / path, _Options(tier)) is ignored


def test_notebooks_are_dealt_into_turns_of_about_equal_committed_seconds(tmp_path):
    """The longest first, each to the turn with the fewest seconds so far (ties: the lower
    turn): 50 | 30 + 15 + 5 | 25 + 20."""
    seconds = {"03_collectives": 25.0, "05_point_to_point": 5.0, "07_zero_and_fsdp": 50.0,
               "08_tensor_parallelism": 15.0, "09_pipeline_parallelism": 30.0,
               "11_fitting_a_model": 20.0}
    paths = {stem: _notebook(tmp_path, stem, [took]) for stem, took in seconds.items()}
    dealt = lessons.turns(list(paths.values()), 3)
    assert {stem: dealt[path] for stem, path in paths.items()} == {
        "07_zero_and_fsdp": 0, "09_pipeline_parallelism": 1, "03_collectives": 2,
        "11_fitting_a_model": 2, "08_tensor_parallelism": 1, "05_point_to_point": 1}
    assert lessons.turns(list(paths.values()), 1) == dict.fromkeys(paths.values(), 0)


def test_the_other_cpu_tier_takes_one_turn_of_its_notebooks_and_every_one_in_three_commits(
        monkeypatch):
    """Of make test's notebooks that rounding can change (not lessons 01, 02, 04, 12, 13), each
    commit's run of the other-CPU tier collects one turn: together the three turns are all of them,
    each once. Without a share, or in another tier, every notebook of the tier is collected."""
    conftest = _root_conftest()
    others = {"03", "05", "06", "07", "08", "09", "10", "11"}
    taken = []
    for number in (30, 31, 32):
        monkeypatch.setattr(conftest, "_commit_number", lambda number=number: number)
        taken.append({path.name[:2] for path in LESSON_NOTEBOOKS if conftest.pytest_ignore_collect(
            path, _Options("other-cpu", 3)) is None})
    assert sorted(name for turn in taken for name in turn) == sorted(others)
    assert all(turn for turn in taken)
    for tier, expected in (("other-cpu", others), ("test", others | {"01", "02", "04", "12",
                                                                     "13"})):
        assert {path.name[:2] for path in LESSON_NOTEBOOKS if conftest.pytest_ignore_collect(
            path, _Options(tier, 1 if tier == "other-cpu" else 3)) is None} == expected
    assert conftest.turns_summary(
        {pathlib.Path("notebooks/03_x.ipynb"): 1, pathlib.Path("notebooks/11_y.ipynb"): 0,
         pathlib.Path("notebooks/05_z.ipynb"): 1}, 3, 1) == (
        "turn 1 of 3, by the commit: lessons 03, 05 (make test ran every one natively); the "
        "other turns, in the next commits' runs: 11")


def test_a_tiers_items_are_sorted_by_file_slow_ones_first_the_tests_marked_to_start_first_first(
        tmp_path):
    """conftest.py's sort of the collected items, on stand-ins for nbval's cells and tests: the
    slow notebooks, the test files that start first, the rest; in each, what is marked
    `starts_first` first, and the others in their order."""
    def items(path, count, module=None, first=()):
        return [SimpleNamespace(path=path, name=f"{path.stem} {index}", module=module,
                                get_closest_marker=lambda marker, index=index: (
                                    object() if index in first and marker == "starts_first"
                                    else None))
                for index in range(count)]

    collected = (items(_notebook(tmp_path, "03_collectives", [90.0]), 2)
                 + items(_notebook(tmp_path, "07_zero_and_fsdp", [10.0]), 3)
                 + items(_notebook(tmp_path, "09_pipeline_parallelism", [20.0]), 2)
                 + items(tmp_path / "test_launcher.py", 2, SimpleNamespace(STARTS_FIRST=True))
                 + items(tmp_path / "test_llama.py", 1, SimpleNamespace())
                 + items(tmp_path / "test_layouts.py", 3, SimpleNamespace(), first={2}))
    _root_conftest()._slowest_first(collected)
    assert [item.name for item in collected] == [
        "09_pipeline_parallelism 0", "09_pipeline_parallelism 1",
        "07_zero_and_fsdp 0", "07_zero_and_fsdp 1", "07_zero_and_fsdp 2",
        "test_launcher 0", "test_launcher 1", "test_layouts 2", "03_collectives 0",
        "03_collectives 1", "test_llama 0", "test_layouts 0", "test_layouts 1"]


def test_one_by_one_a_notebooks_cells_are_one_unit_and_each_test_one_of_its_own():
    unit = _root_conftest().notebook_or_test
    assert unit("notebooks/15_on_a_cluster.ipynb::Cell 3") == "notebooks/15_on_a_cluster.ipynb"
    assert unit("tests/test_tiers.py::test_a[x::y]") == "tests/test_tiers.py::test_a[x::y]"


def _makefile_rules():
    """(rule, line) for each line of the Makefile outside comments; a variable's line has no
    rule."""
    rule = None
    for line in (ROOT / "Makefile").read_text().splitlines():
        if line.startswith("\t"):
            yield rule, line
        elif not line.startswith("#") and line.strip():
            target = re.match(r"([\w.-]+)\s*:(?!=)", line)
            rule = target.group(1) if target else None
            yield rule, line


def test_the_makefile_names_no_notebook_or_test_file_but_the_few_a_target_runs_itself():
    named = {(rule, path) for rule, line in _makefile_rules()
             for path in re.findall(r"notebooks/\d\d_\w+\.ipynb|tests/test_\w+\.py", line)}
    assert named == {("slides", "tests/test_browser.py"), ("slides", "tests/test_book.py"),
                     ("test-gpu", "tests/test_gpu.py"),
                     ("test-python", "tests/test_launcher.py"),
                     ("test-python", "tests/test_spawn.py"),
                     ("test-python", "notebooks/01_processes_and_groups.ipynb")}


def test_each_tier_of_the_makefile_runs_pytest_on_its_tier_of_both_folders():
    recipes = {}
    for rule, line in _makefile_rules():
        recipes[rule] = recipes.get(rule, "") + line.rstrip("\\") + " "
    for target, tier in {"test": "test", "long": "long", "cluster-tests": "cluster",
                         "other-cpu": "other-cpu"}.items():
        assert re.search(rf"--tier {tier}\s+notebooks tests\b", recipes[target]), target


@pytest.mark.skipif(not (ROOT / ".ci/run").exists(),
                    reason="a student release (make release) has no CI of the course's")
def test_ci_runs_every_tier_readmes_test_first_and_ci_run_only_make_ci():
    makefile = (ROOT / "Makefile").read_text()
    tiers = re.search(r"^CI_TIERS := (.*)$", makefile, re.M).group(1).split()
    assert tiers[0] == "test"
    assert set(tiers) == {"test", "soak", "other-cpu", "cluster-tests", "long", "slides",
                          "test-python"}
    script = [line for line in (ROOT / ".ci/run").read_text().splitlines()
              if not line.lstrip().startswith("#")]
    assert [re.search(r"\bmake (\S+)", line).group(1) for line in script
            if re.search(r"\bmake ", line)] == ["ci"]


@pytest.mark.skipif(not (ROOT / ".ci/run").exists(),
                    reason="a student release (make release) has no CI of the course's")
@pytest.mark.parametrize("other_python, steps", [
    ("", ["test", "soak and system-packages", "other-cpu and book-env", "cluster-tests", "long",
          "slides", "test-python"]),
    ("python3.13", ["test", "soak and system-packages", "other-cpu and book-env and other-python",
                    "cluster-tests", "long and test-python", "slides"])])
def test_make_ci_runs_each_tier_once_in_order_and_the_pairs_side_by_side(other_python, steps):
    """make -n: every command printed, none run (those of the tiers' own makes too)."""
    done = subprocess.run(["make", "-n", "ci", f"OTHER_PYTHON={other_python}"], cwd=ROOT,
                          capture_output=True, text=True, check=True)
    assert re.findall(r"^make ci: (.+) took ", done.stdout, re.M) == steps


def test_each_lessons_share_of_a_tier_sums_its_notebook_and_its_test_files():
    seconds = {"notebooks/13_at_scale.ipynb": 60.0, "tests/test_at_scale.py": 20.0,
               "tests/test_at_scale_step_time.py": 10.0, "tests/test_launcher.py": 30.0,
               "notebooks/01_processes_and_groups.ipynb": 5.0}
    assert _root_conftest().lesson_shares(seconds) == [
        "lesson 13      90 s   72%", "shared         30 s   24%", "lesson 01       5 s    4%"]


def test_a_share_of_cases_keeps_every_test_and_one_case_in_n_chosen_by_the_commit():
    ids = ["t.py::plain", "t.py::table[a]", "t.py::table[b]", "t.py::table[c]",
           "t.py::table[d]", "t.py::pair[x]", "t.py::pair[y]"]
    keep = _root_conftest().cases_kept
    # number 4: 4 % 3 = 1, so index 1 of each table; the pair has index 1 too
    assert keep(ids, 3, 4) == {"t.py::plain", "t.py::table[b]", "t.py::pair[y]"}
    # number 5: index 2, and 5 % 3 = 2 leaves the pair none: its case 5 % 2 = 1
    assert keep(ids, 3, 5) == {"t.py::plain", "t.py::table[c]", "t.py::pair[y]"}
    # over three commits in a row, every case runs
    assert set().union(*(keep(ids, 3, number) for number in (6, 7, 8))) == set(ids)
    assert keep(ids, 1, 7) == set(ids)


def test_a_case_given_a_turn_runs_in_that_turn_and_the_others_by_their_index():
    ids = ["t.py::table[a]", "t.py::table[b]", "t.py::table[c]", "t.py::table[d]"]
    keep = _root_conftest().cases_kept
    turns = {"t.py::table[a]": 2, "t.py::table[d]": 2}  # a and d, the heavy two, apart from ...
    assert keep(ids, 3, 2, {"t.py::table[a]": 1}) == {"t.py::table[c]"}
    assert keep(ids, 3, 1, {"t.py::table[a]": 1}) == {"t.py::table[a]", "t.py::table[b]"}
    assert keep(ids, 3, 0, {"t.py::table[a]": 1}) == {"t.py::table[d]"}
    assert keep(ids, 3, 2, turns) == {"t.py::table[a]", "t.py::table[c]", "t.py::table[d]"}
    assert keep(ids, 3, 0, turns) == {"t.py::table[a]"}  # ... no case in turn 0: one by number


def test_without_a_tier_the_tests_marked_to_start_first_do_each_group_in_its_order():
    def item(name, first=False):
        return SimpleNamespace(name=name, get_closest_marker=lambda marker: (
            object() if first and marker == "starts_first" else None))

    collected = [item("a"), item("waits 1", first=True), item("b"), item("c"),
                 item("waits 2", first=True)]
    _root_conftest()._marked_first(collected)
    assert [test.name for test in collected] == ["waits 1", "waits 2", "a", "b", "c"]


def test_the_slides_tier_takes_a_fifth_of_the_handouts_and_every_lesson_as_slides():
    """--cases-share thins only the tests marked soak or takes_turns: the slides tier's collection
    (what `make slides` runs, collected only) keeps every lesson's slides test, and the handouts
    of a fifth of the lessons (takes_turns(5)); every lesson's handout over five commits
    (cases_kept, above)."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                           "no:cacheprovider", "-m", "slides", "--cases-share", "3",
                           "tests/test_book.py", "tests/test_browser.py"],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    slides = [nodeid for nodeid in ids if "::test_the_lesson_as_slides[" in nodeid]
    printed = [nodeid for nodeid in ids if "::test_the_handouts_print_each_lesson" in nodeid]
    assert len(slides) == len(LESSON_NOTEBOOKS) == 15, done.stdout[-500:]
    assert len(printed) == 3, printed
