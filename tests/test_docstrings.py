"""The public API's docstrings (issue 39): each names every parameter under `Args:` and shows the callable used in an
`Example:` whose names exist where it says they are; the examples cheap enough to run on a CPU are run (doctest),
the others (a whole search) are marked `# doctest: +SKIP` and only checked for their names."""

from __future__ import annotations

import ast
import doctest
import importlib
import inspect
import re
from collections.abc import Callable
from typing import Any

import pytest

PUBLIC = (
    "autoprec.tune.search",
    "autoprec.tune.sweep",
    "autoprec.tune.profile",
    "autoprec.tune.load_task",
    "autoprec.tune.SearchConfig",
    "autoprec.apply_policy",
    "autoprec.applied_summary",
    "autoprec.grad_scaler",
    "autoprec.Policy",
)
_SECTION = re.compile(r"^(Args|Returns|Raises|Warns|Example|Examples):\s*$")
_ENTRY = re.compile(r"^ {4}(\*{0,2}\w+)(?: \([^)]*\))?:")


def _resolve(dotted: str) -> Any:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _sections(doc: str) -> dict[str, list[str]]:
    """A Google-style docstring's sections (inspect.getdoc's dedented text): header -> its indented lines."""
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in doc.splitlines():
        match = _SECTION.match(line)
        if match:
            current = found.setdefault(match.group(1), [])
        elif line and not line[0].isspace():
            current = None  # a paragraph at the left margin ends the section
        elif current is not None:
            current.append(line)
    return found


def _parameters(obj: Callable) -> list[str]:
    """The names the `Args:` section must use: `*args` and `**kwargs` with their stars."""
    stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return [stars.get(p.kind, "") + p.name for p in inspect.signature(obj).parameters.values()]


def docstring_problems(obj: Callable, shown_as: str) -> list[str]:
    """What the docstring of `obj` (imported as `shown_as`) lacks; empty when it has it all."""
    doc = inspect.getdoc(obj) or ""
    if not doc.strip():
        return ["no docstring"]
    problems = []
    sections = _sections(doc)
    if not doc.splitlines()[0].strip():
        problems.append("no one-line summary first")
    documented = [m.group(1) for line in sections.get("Args", []) if (m := _ENTRY.match(line))]
    wanted = _parameters(obj)
    problems += [f"Args: does not name {name!r}" for name in wanted if name not in documented]
    problems += [f"Args: names {name!r}, which is no parameter" for name in documented if name not in wanted]
    if not inspect.isclass(obj) and "Returns" not in sections:
        problems.append("no Returns: section")
    examples = doctest.DocTestParser().get_examples(doc)
    if not ("Example" in sections or "Examples" in sections) or not examples:
        return [*problems, "no Example: section with >>> lines"]
    problems += example_problems("".join(e.source for e in examples), obj, shown_as)
    return problems


def example_problems(source: str, documented: object, shown_as: str) -> list[str]:
    """An example's imports must import, every attribute chain on an imported name (autoprec.tune.search,
    torch.nn.Linear) must exist, and the documented callable must be among them: it is called from where it is."""
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        return [f"Example: not Python: {exc}"]
    names: dict[str, Any] = {}
    problems = []
    for node in ast.walk(tree):
        try:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    importlib.import_module(alias.name)
                    top = alias.asname or alias.name.split(".")[0]
                    names[top] = importlib.import_module(alias.name if alias.asname else alias.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom) and node.module:
                module = importlib.import_module(node.module)
                for alias in node.names:
                    names[alias.asname or alias.name] = getattr(module, alias.name)
        except (ImportError, AttributeError) as exc:
            problems.append(f"Example: {ast.unparse(node)}: {exc}")
    used = [names[n.id] for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id in names]
    for node in ast.walk(tree):
        chain: list[str] = []
        inner: ast.AST = node
        while isinstance(inner, ast.Attribute):
            chain.insert(0, inner.attr)
            inner = inner.value
        if not chain or not isinstance(inner, ast.Name) or inner.id not in names:
            continue
        value = names[inner.id]
        for i, attr in enumerate(chain):
            try:
                value = getattr(value, attr)
            except AttributeError:
                try:  # a submodule not imported yet by the package (autoprec.tune._search._pipeline)
                    value = importlib.import_module(".".join([value.__name__, attr]))
                except (AttributeError, ImportError):
                    problems.append(f"Example: {inner.id}.{'.'.join(chain[: i + 1])} does not exist")
                    break
            used.append(value)
    if not any(u is documented for u in used):
        problems.append(f"Example: never uses {shown_as} itself")
    return problems


@pytest.mark.parametrize("dotted", PUBLIC)
def test_a_public_callable_documents_every_parameter_and_shows_an_example_that_exists(dotted):
    assert docstring_problems(_resolve(dotted), dotted) == []


@pytest.mark.parametrize("dotted", PUBLIC)
def test_the_examples_run_where_they_are_cheap(dotted, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an example that writes a file writes it here
    obj = _resolve(dotted)
    finder = doctest.DocTestFinder(recurse=False)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(obj, dotted, globs={}):
        runner.run(test)
    results = runner.summarize(verbose=False)
    assert results.attempted > 0 and results.failed == 0


def test_the_check_fails_on_a_docstring_that_misses_an_argument_or_calls_what_does_not_exist():
    def documented(alpha: int, *rest: int, beta: str = "", **more: object) -> int:
        """Do a thing.

        Args:
            alpha: A number.
            *rest: More numbers.
            gamma: No such parameter.

        Returns:
            A number.

        Example:
            >>> import autoprec.tune
            >>> autoprec.tune.serach(model)  # doctest: +SKIP
            >>> from autoprec.tune import nothing_here
        """
        return alpha

    problems = docstring_problems(documented, "documented")
    assert "Args: does not name 'beta'" in problems and "Args: does not name '**more'" in problems
    assert "Args: names 'gamma', which is no parameter" in problems
    assert "Example: autoprec.tune.serach does not exist" in problems
    assert any(p.startswith("Example: from autoprec.tune import nothing_here") for p in problems)
    assert "Example: never uses documented itself" in problems

    def bare(x: int) -> int:
        """Do a thing, with no sections."""
        return x

    assert docstring_problems(bare, "bare") == [
        "Args: does not name 'x'", "no Returns: section", "no Example: section with >>> lines"
    ]  # fmt: skip
