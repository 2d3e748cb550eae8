"""The shape the project promises its readers, checked on the source:

- every ddp_utils function or method that takes part in a collective (directly, or through another
  one) says so first in its docstring: "All ranks call this";
- the scripts never call one of them under a rank condition (`if accelerator.is_main_process:`),
  nor after a rank condition that leaves early (`if not accelerator.is_main_process: return`),
  where the other ranks would wait for ever; no property or generator hides one;
- each script shows its whole training step;
- the error types sit in a leaf module, and matplotlib is not imported on the training path.
"""

import ast
import re
import subprocess
import sys

import pytest

from conftest import REPO, launch_env

PACKAGE = REPO / "ddp_utils"
SCRIPTS = {
    name: REPO / "scripts" / f"{name}.py"
    for name in ("train", "train_sft", "train_dpo", "train_grpo", "train_clm", "train_image")
}
# Calls that are collectives themselves: Accelerate's and torch.distributed's (`prepare` wraps in
# DDP, which broadcasts the weights; `clip_grad_norm_` all-reduces the norm under FSDP).
PRIMITIVES = {
    "Accelerator",
    "prepare",
    "reduce",
    "gather",
    "gather_for_metrics",
    "gather_object",
    "broadcast_object_list",
    "wait_for_everyone",
    "save_state",
    "load_state",
    "get_state_dict",
    "clip_grad_norm_",
    "barrier",
    "all_reduce",
    "broadcast",
    "init_process_group",
}
SAYS_SO = "All ranks call this"


def called_names(node) -> set[str]:
    """The names of everything `node` calls: f(...) -> f, x.y.f(...) -> f."""
    names = set()
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            if isinstance(call.func, ast.Name):
                names.add(call.func.id)
            elif isinstance(call.func, ast.Attribute):
                names.add(call.func.attr)
    return names


def package_functions(kind: str = "called") -> dict[str, list]:
    """name -> [(module, qualified name, node)] for every function and method in ddp_utils that is
    called by name (kind="called"), or for its properties (kind="property")."""
    functions = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            members = [(node.name, node)] if isinstance(node, ast.FunctionDef) else []
            if isinstance(node, ast.ClassDef):
                members = [
                    (f"{node.name}.{item.name}", item) for item in node.body if isinstance(item, ast.FunctionDef)
                ]
            for qualified, function in members:
                is_property = any(ast.unparse(d) == "property" for d in function.decorator_list)
                if is_property == (kind == "property"):
                    functions.setdefault(function.name, []).append((path.stem, qualified, function))
    return functions


def collective_functions() -> dict[str, list]:
    """The ddp_utils functions that reach a collective primitive, directly or through each other
    (matched by name: a method named like a collective function counts as one)."""
    functions = package_functions()
    collective = set()
    changed = True
    while changed:
        changed = False
        for name, definitions in functions.items():
            if name in collective:
                continue
            if any(called_names(node) & (PRIMITIVES | collective) for _, _, node in definitions):
                collective.add(name)
                changed = True
    return {name: functions[name] for name in collective}


@pytest.mark.fast
def test_every_collective_in_ddp_utils_says_all_ranks_call_this():
    collective = collective_functions()
    assert {
        "count_step",
        "save_model",
        "write_results",
        "evaluate_classification",
        "resume",
        "load_on_main_first",
        "prepare_output_dir",
        "refuse_together",
    } <= set(collective), sorted(collective)
    silent = [
        f"{module}.{qualified}"
        for name, definitions in collective.items()
        for module, qualified, node in definitions
        if not name.startswith("_") and not (ast.get_docstring(node) or "").startswith(SAYS_SO)
    ]
    assert silent == [], (
        f"these take part in a collective but their docstring does not start with {SAYS_SO!r}: {silent}"
    )


@pytest.mark.fast
def test_no_property_or_generator_in_ddp_utils_hides_a_collective():
    """A collective inside a property (`run.loss`) or a generator (`for batch in epoch(...)`) runs
    where the reader sees no call: it must be an explicit function call instead."""
    reaches = set(collective_functions()) | PRIMITIVES
    hidden = [
        f"{module}.{qualified} (property)"
        for definitions in package_functions("property").values()
        for module, qualified, node in definitions
        if called_names(node) & reaches
    ]
    hidden += [
        f"{module}.{qualified} (generator)"
        for definitions in package_functions().values()
        for module, qualified, node in definitions
        if any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in ast.walk(node)) and called_names(node) & reaches
    ]
    assert hidden == [], hidden


def rank_conditions(tree):
    """Every `if` (or conditional expression) whose test reads which rank this is."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp)) and any(
            word in ast.unparse(node.test) for word in ("is_main_process", "process_index")
        ):
            yield node


def leaves_early(node) -> bool:
    return any(isinstance(n, (ast.Return, ast.Break, ast.Continue)) for n in ast.walk(node))


def collectives_only_some_ranks_reach(source: str, collective: set[str]) -> list[str]:
    """'line N: names' for each call of a collective that only some ranks reach: one under a rank
    condition, or one after a rank condition that leaves its block early on some ranks."""
    tree = ast.parse(source)
    collective = collective | {
        node.name for node in tree.body if isinstance(node, ast.FunctionDef) and called_names(node) & collective
    }
    found = []
    for condition in rank_conditions(tree):
        if called_names(condition) & collective:
            found.append(
                f"line {condition.lineno}: {sorted(called_names(condition) & collective)} under a rank condition"
            )
    for block in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            statements = getattr(block, field, None)
            if not isinstance(statements, list):
                continue
            early = None
            for statement in statements:
                if early is not None and called_names(statement) & collective:
                    found.append(
                        f"line {statement.lineno}: {sorted(called_names(statement) & collective)} after the rank "
                        f"condition of line {early} that leaves early"
                    )
                if (
                    isinstance(statement, ast.If)
                    and statement in set(rank_conditions(statement))
                    and leaves_early(statement)
                ):
                    early = statement.lineno
    return found


@pytest.mark.fast
def test_the_rank_condition_check_catches_the_ways_a_job_hangs():
    collective = set(collective_functions()) | PRIMITIVES
    hangs = {
        "guarded": "if accelerator.is_main_process:\n    log.step(plan, loss_sum, grad_norm, lr)\n",
        "early return": (
            "def f():\n    if not accelerator.is_main_process:\n        return\n    accelerator.wait_for_everyone()\n"
        ),
        "break on one rank": (
            "for batch in loader:\n    if accelerator.process_index == 1 and batch is None:\n        break\n"
            "    step_size = ddp_utils.count_step(accelerator, batch, 1)\n"
        ),
        "script helper": (
            "def save():\n    ddp_utils.save_model(accelerator, model, 'x')\n"
            "if accelerator.is_main_process:\n    save()\n"
        ),
    }
    for name, source in hangs.items():
        assert collectives_only_some_ranks_reach(source, collective), f"missed: {name}"
    fine = "if accelerator.is_main_process:\n    print('done')\naccelerator.wait_for_everyone()\n"
    assert collectives_only_some_ranks_reach(fine, collective) == []


@pytest.mark.fast
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_scripts_never_call_a_collective_that_only_some_ranks_reach(script):
    found = collectives_only_some_ranks_reach(SCRIPTS[script].read_text(), set(collective_functions()) | PRIMITIVES)
    assert found == [], f"{script}.py: {found}"


@pytest.mark.fast
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_each_script_shows_its_whole_training_step(script):
    """Forward and loss, backward of the exact loss, clipping, optimizer and scheduler steps: in
    the script's own main(), where a reader can change them."""
    tree = ast.parse(SCRIPTS[script].read_text())
    main = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main")
    source = ast.unparse(main)
    for piece in (
        "count_step(",
        "global_mean_loss(",
        "accelerator.backward(",
        "clip_grad_norm_(",
        "optimizer.step()",
        "optimizer.zero_grad()",
        "lr_scheduler.step()",
        "with accelerator.accumulate(model)",
    ):
        assert piece in source, f"{script}.py: main() does not show {piece}"


@pytest.mark.fast
def test_no_doc_copies_the_code_of_the_scripts_or_ddp_utils():
    """Docs name the code and link to its lines; a copy would drift, or make every edit of the step
    an edit of the docs too (issue 41). No line of a fenced code block in the README or docs/ (other
    than a command to run) is a line of the scripts or of ddp_utils."""
    import re

    code = set()
    for path in [*SCRIPTS.values(), *(REPO / "ddp_utils").rglob("*.py")]:
        code.update(line.strip() for line in path.read_text().splitlines() if len(line.strip()) > 24)
    copied = []
    for doc in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        for block in re.findall(r"^```\w*\n(.*?)^```", doc.read_text(), flags=re.DOTALL | re.MULTILINE):
            copied += [f"{doc.name}: {line.strip()}" for line in block.splitlines() if line.strip() in code]
    assert copied == [], f"docs copy code; name it and link to its lines instead: {copied[:3]}"


@pytest.mark.fast
def test_every_link_to_lines_of_code_holds_the_code_its_sentence_names():
    """A doc that links to lines (`train.py#L168-L211`) names what they hold in `backticks` in the same sentence:
    the range starts on the line of the first name and ends with the block of the last one, so that an edit that
    moves the lines fails here instead of sending readers to the wrong code."""
    wrong = []
    for doc in [REPO / "README.md", *(REPO / "docs").glob("*.md"), REPO / "bench" / "README.md"]:
        text = doc.read_text()
        for link in re.finditer(r"\]\(([^)#]+)#L(\d+)-L(\d+)\)", text):
            lines = (doc.parent / link.group(1)).resolve().read_text().splitlines()
            first, last = int(link.group(2)), int(link.group(3))
            sentence = text[link.end() :].split(". ", 1)[0].split("\n\n", 1)[0].replace("\n", " ")
            names = [name for name in re.findall(r"`([^`]+)`", sentence) if any(name in line for line in lines)]
            where = [next((n for n in range(first - 1, len(lines)) if name in lines[n]), None) for name in names]
            if not names or where[0] != first - 1 or None in where or max(where) >= last:
                wrong.append(f"{doc.name}: {link.group(0)} does not start on `{names[:1]}` or lacks one of {names}")
                continue
            indent = len(lines[max(where)]) - len(lines[max(where)].lstrip())
            after = next((line for line in lines[last:] if line.strip()), "")
            if len(after) - len(after.lstrip()) > indent:
                wrong.append(f"{doc.name}: {link.group(0)} ends inside the block of `{names[where.index(max(where))]}`")
    assert wrong == [], wrong


# Each sub-package of ddp_utils and the ones it may import (their docstrings say the same): a newcomer can
# tell what a change may touch, and no two modules import each other.
MAY_IMPORT = {
    "core": set(),
    "data": {"core"},
    "checkpoints": {"core"},
    "training": {"core", "data", "checkpoints"},
    "results": {"core", "data", "checkpoints", "training"},
    "language_models": {"core", "data", "checkpoints", "training", "results"},
    "lifecycle": {"core", "data", "checkpoints", "training", "results", "language_models"},
}


def module_imports() -> dict[tuple[str, str], set[tuple[str, str]]]:
    """(sub-package, module) -> the (sub-package, module) pairs it imports, lazily or not."""
    graph = {}
    for package in MAY_IMPORT:
        for path in sorted((PACKAGE / package).glob("*.py")):
            imported = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level:
                    parts = [*(node.module or "").split("."), *(alias.name for alias in node.names)]
                    parts = [part for part in parts if part]
                    imported.add((package, parts[0]) if node.level == 1 else (parts[0], parts[1]))
            graph[(package, path.stem)] = imported
    return graph


@pytest.mark.fast
def test_ddp_utils_sub_packages_import_only_the_ones_below_them_and_no_module_imports_itself_back():
    graph = module_imports()
    wrong = [
        f"{p}/{m}.py imports {q}/{n}.py"
        for (p, m), found in graph.items()
        for q, n in found
        if q != p and q not in MAY_IMPORT[p]
    ]
    assert wrong == [], wrong
    assert graph[("core", "errors")] == set() and graph[("core", "sharded")] == set(), "the leaves import nothing"

    def circle_from(module, path):
        for imported in graph.get(module, ()):
            if imported in path:
                return [*path[path.index(imported) :], imported]
            found = circle_from(imported, [*path, imported])
            if found:
                return found
        return None

    for module in graph:
        circle = circle_from(module, [module])
        assert circle is None, " -> ".join(f"{p}/{m}.py" for p, m in circle)


@pytest.mark.fast
def test_ddp_utils_modules_stay_short_and_their_index_names_them_all():
    """No module past 400 lines; each sub-package's docstring names its modules, and the package's
    docstring every name the scripts call."""
    import ddp_utils

    for path in sorted(PACKAGE.glob("*/*.py")):
        assert len(path.read_text().splitlines()) <= 400, f"{path.relative_to(REPO)} holds more than one job: split it"
    for package in MAY_IMPORT:
        index = (PACKAGE / package / "__init__.py").read_text()
        for path in (PACKAGE / package).glob("*.py"):
            named = path.stem == "__init__" or f"{path.name} " in index
            assert named, f"{package}/__init__.py does not name {path.name}"
    missing = [name for name in ddp_utils.__all__ if not re.search(rf"\b{name}\b", ddp_utils.__doc__)]
    assert missing == [], f"ddp_utils/__init__.py's docstring does not name {missing}"
    assert {path.name for path in PACKAGE.iterdir() if path.is_dir() and path.name != "__pycache__"} == set(MAY_IMPORT)


def test_matplotlib_is_not_imported_on_the_training_path():
    """Only the report's drawing imports it, on the main process at the end of a run."""
    check = (
        "import importlib.util, sys\n"
        "import ddp_utils, ddp_utils.language_models.causal_lm, ddp_utils.data.vision\n"
        "import ddp_utils.results.report, ddp_utils.training.training_log\n"
        f"for name in {sorted(SCRIPTS)!r}:\n"
        f"    spec = importlib.util.spec_from_file_location(name, {str(REPO / 'scripts')!r} + f'/{{name}}.py')\n"
        "    spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", check], env=launch_env(), cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"
