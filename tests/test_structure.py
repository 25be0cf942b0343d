"""The package's shape, checked: no import cycles; a lesson takes from another lesson only the names
it declares it builds on (a strategy, a formula), never a utility; the ranks never load
matplotlib, ipywidgets or the launcher's kernel side; each lesson's docstring names exactly its
files."""

import ast
import importlib
import inspect
import json
import pathlib
import re
import subprocess
import sys

import pytest

from helpers import lessons
from helpers.exercises import solutions_withheld

HELPERS = pathlib.Path(__file__).resolve().parent.parent / "helpers"
LESSONS = {lesson.package.split(".")[-1] for lesson in lessons.lessons()}

# Where a later lesson builds on an earlier lesson's strategy or formula, as the course says it
# does: each lesson package declares the names it takes (BUILDS_ON, "module:name" -> why). Shared
# tools live in helpers/ itself.
BUILDS_ON = {(lesson.package.split(".")[-1], name)
             for lesson in lessons.lessons()
             for name in getattr(importlib.import_module(lesson.package), "BUILDS_ON", {})}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(HELPERS.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: pathlib.Path) -> set:
    """Every helpers module `path` imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("helpers"):
            for alias in node.names:  # `from helpers.x import y`: y may be a module itself
                child = f"{node.module}.{alias.name}"
                found.add(child if (HELPERS.parent / child.replace(".", "/")).with_suffix(
                    ".py").exists() else node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("helpers")}
    return found


GRAPH = {module_name(path): imports_of(path) for path in HELPERS.rglob("*.py")}


def lesson_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in LESSONS else None


def test_no_module_imports_itself_through_others():
    # `helpers` and `helpers.launcher` (packages whose __init__ re-exports) are where every
    # module starts; a cycle through them is every module's, so they are left out
    packages = {"helpers", "helpers.launcher"}
    graph = {module: {m for m in deps if m in GRAPH and m not in packages} - {module}
             for module, deps in GRAPH.items() if module not in packages}
    done, on_path = set(), []

    def visit(module):
        if module in on_path:
            cycle = on_path[on_path.index(module):] + [module]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        if module in done:
            return
        on_path.append(module)
        for dependency in sorted(graph[module]):
            visit(dependency)
        on_path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def names_taken(path: pathlib.Path) -> set:
    """("module:name") for every name `path` imports from a helpers module, at its top or inside a
    function; a module imported whole is "module:*" (a crossing must name what it takes)."""
    taken = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "helpers":  # a package whole
            taken |= {f"helpers.{alias.name}:*" for alias in node.names if alias.name in LESSONS}
        elif (isinstance(node, ast.ImportFrom) and node.module
              and node.module.startswith("helpers.")):
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                whole = (HELPERS.parent / child.replace(".", "/")).with_suffix(".py").exists()
                taken.add(f"{child}:*" if whole else f"{node.module}:{alias.name}")
        elif isinstance(node, ast.Import):
            taken |= {f"{alias.name}:*" for alias in node.names
                      if alias.name.startswith("helpers.")}
    return {name.removeprefix("helpers.") for name in taken}


def test_a_lesson_takes_from_another_only_the_names_it_builds_on():
    crossings = {(lesson_of(module_name(path)), name)
                 for path in HELPERS.rglob("*.py") if lesson_of(module_name(path))
                 for name in names_taken(path)
                 if name.split(".")[0].split(":")[0] in LESSONS - {lesson_of(module_name(path))}}
    assert crossings - BUILDS_ON == set(), "declare the name in BUILDS_ON, or move it to helpers/"
    if not solutions_withheld():  # a student release lacks the solutions that take some of them
        assert BUILDS_ON - crossings == set(), "a declared name that is no longer taken"



def test_a_lesson_needs_every_earlier_lesson_it_builds_on():
    """A lesson's title slide says what it needs (NEEDS): at least the lessons whose names it
    takes (BUILDS_ON), each of them earlier."""
    number = {lesson.package.split(".")[-1]: lesson.number for lesson in lessons.lessons()}
    for lesson in lessons.lessons():
        taken = {number[name.split(".")[0].split(":")[0]] for owner, name in BUILDS_ON
                 if owner == lesson.package.split(".")[-1]}
        assert taken <= set(lesson.needs), (lesson.stem, sorted(taken - set(lesson.needs)))
        assert all(0 < need < lesson.number for need in lesson.needs), lesson.stem


def test_a_mistyped_needs_is_refused_by_name():
    import types

    package = types.SimpleNamespace(__name__="helpers.made_up", NOTEBOOK="05_made_up.ipynb",
                                    NEEDS=(7,))
    with pytest.raises(ValueError, match="helpers.made_up: NEEDS is \\(7,\\)"):
        lessons._lesson(package)

def shared_crossings(path: pathlib.Path) -> set:
    """The lesson names a module outside every lesson (helpers/ itself) takes."""
    return {name for name in names_taken(path) if name.split(".")[0].split(":")[0] in LESSONS}


SHARED = [path for path in sorted(HELPERS.rglob("*.py"))  # helpers.x, but no lesson's package
          if module_name(path).count(".") and module_name(path).split(".")[1] not in LESSONS]


@pytest.mark.parametrize("path", SHARED, ids=lambda path: module_name(path))
def test_a_shared_module_declares_each_lesson_name_it_takes(path):
    """The shared layer sits below the lessons; where it builds a lesson's strategy by name (the
    registry of strategies, the TinyLM's layout), the module declares the names as a lesson
    does, in its own BUILDS_ON (CONTRIBUTING.md says why they stay in their lessons)."""
    declared = set(getattr(importlib.import_module(module_name(path)), "BUILDS_ON", {}))
    taken = shared_crossings(path)
    assert taken - declared == set(), "declare the name in the module's BUILDS_ON"
    assert declared - taken == set(), "a declared name that is no longer taken"


def test_a_planted_crossing_of_the_shared_layer_is_seen(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    from helpers.zero_and_fsdp.fsdp import FSDP\n")
    assert shared_crossings(planted) == {"zero_and_fsdp.fsdp:FSDP"}


# The course's layout, torchtitan's ParallelDims and parallelize_llama, has one home.
LAYOUT = HELPERS / "layouts.py"


def defined_at_top(path: pathlib.Path) -> set:
    return {node.name for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.FunctionDef | ast.ClassDef)}


def test_the_layout_is_defined_only_in_layouts():
    homes = {name: [module_name(path) for path in HELPERS.rglob("*.py")
                    if name in defined_at_top(path)]
             for name in ("Plan", "make_mesh", "lay_out", "clip_to_norm", "quiet_redistribute",
                          "init_weights")}
    assert homes == {**{name: ["helpers.layouts"] for name in homes},
                     "init_weights": ["helpers.llama"]}


def meshes_made(path: pathlib.Path) -> list:
    """(function, its docstring) for each call of init_device_mesh in `path`; a call outside any
    function has the module's name and docstring."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node, scope):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            scope = (node.name, ast.get_docstring(node) or "")
        if isinstance(node, ast.Call) and getattr(
                node.func, "id", getattr(node.func, "attr", None)) == "init_device_mesh":
            found.append(scope)
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(tree, (path.stem, ast.get_docstring(tree) or ""))
    return found


def test_a_mesh_is_made_by_make_mesh_except_where_a_lesson_teaches_init_device_mesh():
    """Everywhere else a mesh comes from layouts.make_mesh; a function that calls
    init_device_mesh itself shows it on purpose, and its docstring says so by naming it."""
    unsaid = [f"{module_name(path)}.{name}" for path in HELPERS.rglob("*.py") if path != LAYOUT
              for name, docstring in meshes_made(path) if "init_device_mesh" not in docstring]
    assert unsaid == []


def test_a_planted_init_device_mesh_is_seen(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('"""A module."""\n\ndef f():\n    """Lays out."""\n'
                       "    return init_device_mesh('cpu', (2,))\n")
    assert meshes_made(planted) == [("f", "Lays out.")]


# Kernel-side modules, by role: what draws (an explorer too), what a notebook calls to start
# ranks (experiments, the launcher's launch), the exercises and the lesson registry; and the
# instructor's programs (the syllabus, the release, the grader), which no rank runs.
KERNEL_SIDE = re.compile(r"(plots|widgets|explorer|drawing|notebook|experiments|launch|exercises|"
                         r"lessons|syllabus|release|grading(\..+)?)$")
KERNEL_ONLY = ("matplotlib", "ipywidgets", "helpers.launcher.launch")


def test_the_ranks_never_load_matplotlib_ipywidgets_or_the_launcher():
    """Every module a rank may import, imported alone in a fresh interpreter."""
    rank_side = sorted(module for module in GRAPH
                       if not KERNEL_SIDE.search(module) and "exercises" not in module)
    code = ("import importlib, sys\n"
            f"for name in {rank_side!r}:\n"
            "    importlib.import_module(name)\n"
            f"print(sorted(m for m in {KERNEL_ONLY!r} if m in sys.modules))")
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               cwd=HELPERS.parent, timeout=300)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == "[]"


@pytest.mark.parametrize("lesson", sorted(LESSONS))
def test_a_lessons_docstring_names_exactly_its_files(lesson):
    folder = HELPERS / lesson
    files = {path.stem for path in folder.glob("*.py")} - {"__init__"}
    if solutions_withheld():  # a student release (make release): named, and withheld
        files.add("solutions")
    docstring = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
    body = " ".join(docstring.split("\n", 1)[1].split())  # after the title line
    # Each file is introduced as "name:" or "name and other:" in the docstring's body.
    named = set(re.findall(r"\b(\w+)(?= and \w+:|:)", body))
    named |= set(re.findall(r"\band (\w+):", body))
    assert named == files


def test_notebooks_use_no_private_name_and_print_no_docstring():
    """What a notebook shows or calls is the course's public face: no `module._name`."""
    private = re.compile(r"\b[A-Za-z]\w*(?:\.\w+)*\._[A-Za-z]\w*")
    found = []
    for path in sorted((HELPERS.parent / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "code":
                source = "".join(cell["source"])
                found += [f"{path.name}: {name}" for name in private.findall(source)]
                # lesson prose lives in the notebook: a docstring is for maintainers, and
                # editing one must not change what a lesson shows
                found += [f"{path.name}: prints a __doc__"] if "__doc__" in source else []
    assert found == []


def shown_code(path: pathlib.Path) -> dict:
    """{expression: the source show_code displays} for every show_code(...) in a notebook,
    resolved with the notebook's own import lines."""
    cells = ["".join(cell["source"]) for cell in json.loads(path.read_text())["cells"]
             if cell["cell_type"] == "code"]
    namespace = {}
    for cell in cells:
        for node in ast.parse(cell).body:  # top-level imports, on one line or several
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                exec(ast.unparse(node), namespace)
    shown = re.findall(r"show_code\(([\w.]+)[,)]", "\n".join(cells))
    return {name: inspect.getsource(eval(name, namespace)) for name in shown}


def test_the_code_a_notebook_shows_calls_no_private_helper():
    """A learner reading shown code can look up every function it calls by a public name."""
    # (os._exit is the standard library's exit without cleanup, not a private name)
    calls = re.compile(r"(?<![\w])(?<!\bos\.)(?<!\bos)\.?(_[a-z]\w*)\(")
    found = [f"{path.name}: {name} calls {helper}"
             for path in sorted((HELPERS.parent / "notebooks").glob("[0-9][0-9]_*.ipynb"))
             for name, source in shown_code(path).items()
             for helper in sorted(set(calls.findall(source)))]
    assert found == []


def code_sources():
    """(where, source) of every Python file of the course and every notebook code cell."""
    root = HELPERS.parent
    for path in sorted([*HELPERS.rglob("*.py"), *root.glob("tests/*.py"),
                        *root.glob("benchmarks/*.py")]):
        yield str(path.relative_to(root)), path.read_text()
    for path in sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        for index, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] == "code":
                yield f"{path.name}, cell {index}", "".join(cell["source"])


def test_no_launch_passes_more_than_three_worker_arguments_by_position():
    """run(fn, n, args=(a, b, c, d)) reads as a riddle: past three, the worker's arguments are
    named (kwargs=dict(...)). CS336's own lecture functions, started as the lecture does with
    spawn(lecture.main, args=(...)), are quoted as they are."""
    found = []
    for where, source in code_sources():
        try:
            tree = ast.parse(source)
        except SyntaxError:  # a cell of shell or magic commands
            continue
        for call in ast.walk(tree):
            if not isinstance(call, ast.Call):
                continue
            name = getattr(call.func, "id", getattr(call.func, "attr", None))
            quoted = name == "spawn" and call.args and "lecture" in ast.unparse(call.args[0])
            for keyword in call.keywords:
                if (name in ("run", "spawn") and keyword.arg == "args" and not quoted
                        and isinstance(keyword.value, ast.Tuple | ast.List)
                        and len(keyword.value.elts) > 3):
                    found.append(f"{where}, line {call.lineno}: {ast.unparse(call)[:80]}")
    assert found == []


def offered_choices(path: pathlib.Path) -> set:
    """The module-level names a `raise ValueError(...)` in `path` offers as the choices
    ("unknown strategy ...; choose one of {STRATEGIES}")."""
    tree = ast.parse(path.read_text())
    constants = {node.targets[0].id for node in tree.body if isinstance(node, ast.Assign)
                 and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)}
    return {name.id for node in ast.walk(tree)
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
            and getattr(node.exc.func, "id", None) == "ValueError"
            for name in ast.walk(node.exc)
            if isinstance(name, ast.Name) and name.id in constants}


# Choices whose spelling is PyTorch's, not the course's: a backend for each device type
# (init_process_group's "cpu:gloo,cuda:nccl")
PYTORCH_SPELLINGS = {"cpu:gloo,cuda:nccl"}


def test_the_keys_of_a_choice_are_names():
    """A caller picks a strategy, a layout or a mode by a key made of letters, digits and
    underscores ("torch_ddp", "1f1b"), never by a display string ("torch DDP", "dp×tp"); labels
    for display live beside the keys."""
    found = []
    for path in sorted(HELPERS.rglob("*.py")):
        module = importlib.import_module(module_name(path))
        for name in sorted(offered_choices(path)):
            keys = getattr(module, name)
            if isinstance(keys, dict | list | tuple | set | frozenset):
                found += [f"{module_name(path)}.{name}: {key!r}" for key in keys
                          if not (isinstance(key, str) and re.fullmatch(r"[A-Za-z0-9_]+", key))
                          and key not in PYTORCH_SPELLINGS]
    assert found == []


DEVICE_TYPES = re.compile(r"(cpu|cuda)(:\d+)?$")


def test_rank_code_takes_its_device_from_the_launcher():
    """No module names a device type ("cpu", "cuda", "cuda:0") in a call: meshes, autocast,
    GradScaler, models and batches follow the launcher's get_device() (a rank's GPU under NCCL,
    else the CPU). A line that must stay on one device says why, in a comment, and ends with
    "# CPU on purpose". The launcher, which decides, and CS336's stand-ins (the lecture's own
    get_device) are exempt."""
    found = []
    for path in sorted(HELPERS.rglob("*.py")):
        module = module_name(path)
        if module.startswith("helpers.launcher") or module == "helpers.cs336":
            continue
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            for value in [*node.args, *(keyword.value for keyword in node.keywords)]:
                if (isinstance(value, ast.Constant) and isinstance(value.value, str)
                        and DEVICE_TYPES.match(value.value)
                        and not lines[node.lineno - 1].rstrip().endswith("# CPU on purpose")):
                    found.append(f"{path.relative_to(HELPERS.parent)}:{node.lineno}: "
                                 f"{value.value!r}")
    assert found == []


# Where code may read a clock, hook the tensors autograd saves, or patch torch.distributed: the
# course's observer and timing harness; lessons 01-03, which teach timing and collectives by hand;
# the launcher, which times out processes, the grader, which times out sandboxes, and a cell's
# heartbeat (notebook.py), which counts the seconds a cell has run. Everywhere else these go
# through instrument.py and timing.py, so that one definition of "how long" and one way of
# watching hold.
MAY_INSTRUMENT = re.compile(r"helpers\.(instrument|timing|notebook|launcher(\..+)?|grading(\..+)?"
                            r"|processes_and_groups\..+|point_to_point\..+|collectives\..+)$")
CLOCKS = {"perf_counter", "perf_counter_ns", "time", "time_ns", "monotonic", "monotonic_ns",
          "process_time"}


def instrumentation_in(tree) -> list:
    """(line, what) for every clock read, saved-tensor hook and patch of torch.distributed."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "time" \
                    and node.attr in CLOCKS:
                found.append((node.lineno, f"time.{node.attr}"))
            if node.attr == "saved_tensors_hooks":
                found.append((node.lineno, "saved_tensors_hooks"))
        elif isinstance(node, ast.ImportFrom) and node.module == "time":
            found += [(node.lineno, f"from time import {alias.name}") for alias in node.names
                      if alias.name in CLOCKS]
        elif isinstance(node, ast.Assign):  # dist.all_reduce = ..., distributed_c10d.x = ...
            found += [(node.lineno, "assignment to torch.distributed")
                      for target in node.targets if isinstance(target, ast.Attribute)
                      and isinstance(target.value, ast.Name)
                      and target.value.id in ("dist", "distributed_c10d")]
        elif isinstance(node, ast.Call):
            text = ast.unparse(node.func)
            arguments = [ast.unparse(argument) for argument in node.args]
            if text in ("setattr", "mock.patch.object", "patch.object") and arguments and \
                    arguments[0] in ("dist", "distributed_c10d", "torch.distributed"):
                found.append((node.lineno, f"{text}({arguments[0]}, ...)"))
            if text in ("mock.patch", "patch") and arguments \
                    and "torch.distributed" in arguments[0]:
                found.append((node.lineno, f"{text}({arguments[0]})"))
    return found


def test_clocks_saved_tensor_hooks_and_patches_live_in_instrument_and_timing():
    found = [f"{path.relative_to(HELPERS.parent)}:{line}: {what}"
             for path in sorted(HELPERS.rglob("*.py"))
             if not MAY_INSTRUMENT.match(module_name(path))
             for line, what in instrumentation_in(ast.parse(path.read_text()))]
    assert found == []


def test_the_instrumentation_rule_sees_what_it_forbids():
    code = ("import time\nfrom time import perf_counter\nimport torch.distributed as dist\n"
            "start = time.perf_counter()\n"
            "with torch.autograd.graph.saved_tensors_hooks(pack, unpack): pass\n"
            "dist.all_reduce = wrapped\nsetattr(dist, 'send', wrapped)\n"
            "mock.patch('torch.distributed.recv', fake)\ntime.sleep(1)\n")
    assert [what for _, what in sorted(instrumentation_in(ast.parse(code)))] == [
        "from time import perf_counter", "time.perf_counter", "saved_tensors_hooks",
        "assignment to torch.distributed", "setattr(dist, ...)",
        "mock.patch('torch.distributed.recv')"]
