"""The shape of the package, read from its source: no import cycle (module-level or inside a function),
and no library module imports a command-line tool or the tools' kit.

A tool is a module that runs as `python -m zoo.<name>` (it has a `__main__` block), the modules only
the tools import (`zoo.tools.scale`, the scale report of zoo.tools.inspect_step) and the tools' kit (`zoo.tools.kit`,
`zoo.tools.cli`). Everything else is the library, which research code imports; it must stand without
the tools, so a tool can be renamed or removed without touching it.
"""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "zoo"
TOOLS = "zoo.tools"
# Library modules with a __main__ block (a command outside zoo.tools): none.
LIBRARY_WITH_MAIN: set[str] = set()


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str:
    """The zoo module an imported dotted name lives in (`zoo.hf.convert.Family` -> zoo.hf.convert)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in MODULES else ""


def _submodules(package: str) -> list[str]:
    """The modules directly inside `package` that a registry finds by listing it: those whose name does
    not start with `_` (zoo.families: `_hf.py` and `_qwen.py` are no families)."""
    return sorted(m for m in MODULES if m.rsplit(".", 1)[0] == package and not m.rsplit(".", 1)[1].startswith("_"))


def _imported_by_name(module: str, tree: ast.Module) -> dict[str, int]:
    """zoo module -> line, for the imports `module` makes through `importlib.import_module`, which no
    import statement shows: a registry's `import_module(f"{__name__}.{name}")` over the names it lists
    (its package's submodules), and, in a module that imports by name, each zoo module a string of it
    names (a table of where names live, read on first use)."""
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "import_module"
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == "importlib"
    ]
    if not calls:
        return {}
    found = {}
    for call in calls:
        arg = call.args[0] if call.args else None
        if (
            isinstance(arg, ast.JoinedStr)
            and arg.values
            and isinstance(arg.values[0], ast.FormattedValue)
            and isinstance(arg.values[0].value, ast.Name)
            and arg.values[0].value.id == "__name__"
        ):
            for sub in _submodules(module):
                found.setdefault(sub, call.lineno)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value in MODULES
            and node.value != module
        ):
            found.setdefault(node.value, node.lineno)
    return found


def _imports(module: str) -> dict[str, int]:
    """zoo module -> line of its first import in `module`, at any depth (functions included), by an
    import statement or through importlib (`_imported_by_name`)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text(), str(path))
    found = _imported_by_name(module, tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rsplit(".", 1)[0]
                base = f"{anchor}.{base}" if base else anchor
            # `from zoo import tags` imports the submodule zoo.tags, not the package's __init__ alone.
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for name in names:
            target = _resolve(name) if name.startswith("zoo") else ""
            if target and target != module:
                found.setdefault(target, node.lineno)
    return found


GRAPH = {m: _imports(m) for m in MODULES}


def _is_tool(module: str) -> bool:
    return module == TOOLS or module.startswith(TOOLS + ".")


def _has_main(module: str) -> bool:
    return '__name__ == "__main__"' in MODULES[module].read_text()


def _cycle() -> list[str]:
    """One import cycle as a path of modules, or [] (depth-first search, edges in source order)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        path.append(m)
        for nxt in GRAPH[m]:
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return []

    for m in sorted(GRAPH):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return []


def test_the_walk_sees_the_package():
    # A walk that found nothing would pass everything below: the known edges must be there.
    assert len(MODULES) > 40
    assert "zoo.model" in GRAPH["zoo.offload"] and "zoo.placement" in GRAPH["zoo.tools.inspect_step"]
    assert (
        "zoo.families" in GRAPH["zoo.hf.convert"] and "zoo.tools.cli" in GRAPH["zoo.tools.kit"]
    )  # from-imports of a submodule
    # through importlib: the registry imports every family module, the package's face the homes of its names
    assert {"zoo.families.llama", "zoo.families.mistral"} <= set(GRAPH["zoo.families"])
    assert "zoo.families._qwen" not in GRAPH["zoo.families"] and {"zoo.model", "zoo.families"} <= set(GRAPH["zoo"])
    commands = {
        "zoo.tools.inspect_step",
        "zoo.tools.plan",
        "zoo.tools.export",
        "zoo.tools.generate",
        "zoo.tools.report",
    }
    assert commands <= {m for m in MODULES if _is_tool(m) and _has_main(m)}
    assert not _is_tool("zoo.sampling") and not _is_tool("zoo.toolsy") and _is_tool("zoo.tools")


def test_only_the_tools_run_as_commands():
    # A `python -m zoo.<name>` outside zoo.tools would be a command the library carries: it belongs in
    # zoo.tools, over a library function.
    wrong = sorted(m for m in MODULES if not _is_tool(m) and _has_main(m) and m not in LIBRARY_WITH_MAIN)
    assert not wrong, f"__main__ blocks outside zoo.tools: {wrong}"


def test_no_module_shadows_the_standard_library():
    # `zoo/tools/inspect.py` would shadow the standard library's `inspect` for a script run from its folder
    # and read as the same module in tracebacks and docs; so would a `zoo/<x>/json.py`.
    import sys

    wrong = sorted(m for m in MODULES if m.rsplit(".", 1)[-1] in sys.stdlib_module_names)
    assert not wrong, f"modules named like the standard library's: {wrong}"


def test_no_import_cycle():
    cycle = _cycle()
    assert not cycle, "import cycle: " + " -> ".join(
        f"{m} ({MODULES[m].relative_to(ROOT)}:{GRAPH[m][n]})" for m, n in zip(cycle, cycle[1:])
    )


def _command_of(name: str, modules: list[str]) -> bool:
    """Whether `modules` are a library package zoo.<name> and the tool zoo.tools.<name> that imports it."""
    library, tool = f"zoo.{name}", f"{TOOLS}.{name}"
    drives = any(t == library or t.startswith(library + ".") for t in GRAPH.get(tool, {}))
    return sorted(modules) == [library, tool] and drives


def test_no_two_modules_share_a_name():
    # `zoo.config` beside a `zoo.train.config`, or `zoo.data` beside `zoo.train.data`, read as one module in
    # prose, tracebacks and `from ... import config`. The exception: each `errors` module holds its own
    # package's exceptions (zoo.errors.ConfigError and CheckpointError, zoo.data.errors.DataError;
    # zoo.data stands alone); and a command named after the library it is the command line of
    # (`zoo.tools.plan` over the planner `zoo.plan`).
    seen: dict[str, list[str]] = {}
    for m in MODULES:
        seen.setdefault(m.rsplit(".", 1)[-1], []).append(m)
    wrong = {
        name: sorted(ms) for name, ms in seen.items() if len(ms) > 1 and name != "errors" and not _command_of(name, ms)
    }
    assert not wrong, f"modules sharing a name: {wrong}"


def test_the_library_never_imports_a_tool():
    wrong = [
        f"{MODULES[m].relative_to(ROOT)}:{line} imports the tool {t}"
        for m in sorted(MODULES)
        if not _is_tool(m)
        for t, line in GRAPH[m].items()
        if _is_tool(t)
    ]
    assert not wrong, "; ".join(wrong)


def test_the_cycle_check_can_fail(monkeypatch):
    monkeypatch.setitem(GRAPH, "zoo.tags", {**GRAPH["zoo.tags"], "zoo.model": 1})
    assert _cycle()[0] == _cycle()[-1]


def test_the_cycle_check_follows_the_registry(monkeypatch):
    # A family module importing the registry that imports it (`from zoo.families import ...`) closes a
    # cycle only importlib shows: the walk must see it.
    monkeypatch.setitem(GRAPH, "zoo.families.llama", {**GRAPH["zoo.families.llama"], "zoo.families": 1})
    assert {"zoo.families", "zoo.families.llama"} <= set(_cycle())


# The modules below zoo.config's floor: what a config needs (its fields' declared ranges and the one-line
# error they raise). Blocks, families and the loader stand above it.
GROUND = {"zoo", "zoo.config", "zoo.ranges", "zoo.errors"}


def _loaded_by(statement: str) -> set[str]:
    """The zoo modules in sys.modules after `statement`, in a fresh interpreter."""
    code = f"import sys; {statement}; print(' '.join(m for m in sys.modules if m == 'zoo' or m.startswith('zoo.')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_the_config_is_the_ground_floor():
    """`import zoo.config` loads no block and no family: a config is plain data, and what builds on it
    (zoo.nn, zoo.model, the registry zoo.families, the loader zoo.hf) stands above it."""
    loaded = _loaded_by("import zoo.config")
    above = sorted(m for m in loaded if m.startswith(("zoo.nn", "zoo.families", "zoo.model", "zoo.hf")))
    assert not above, f"import zoo.config loads {above}"
    assert loaded == GROUND, sorted(loaded - GROUND)


def test_the_ground_floor_check_can_fail():
    # The same walk over a module that does build on the blocks finds them.
    assert {"zoo.nn", "zoo.families.llama"} <= _loaded_by("import zoo.families, zoo.model")


def test_the_blocks_import_nothing_built_on_them():
    """zoo.nn (the blocks) stands below the model and the adapters: the LoRA weight the blocks project
    through lives in zoo.nn.lora_weight, and zoo.lora builds on it, not the other way round."""
    above = {"zoo.model", "zoo.lora"}
    wrong = [
        f"{MODULES[m].relative_to(ROOT)}:{line} imports {t}"
        for m in sorted(MODULES)
        if m.startswith("zoo.nn")
        for t, line in GRAPH[m].items()
        if t in above
    ]
    assert not wrong, "; ".join(wrong)
    assert "zoo.nn.lora_weight" in GRAPH["zoo.lora"]
