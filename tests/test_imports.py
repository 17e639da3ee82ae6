"""The shape of the package, read from its source: no import cycle (module-level or inside a function),
and no library module imports a command-line tool or the tools' kit.

A tool is a module that runs as `python -m zoo.<name>` (it has a `__main__` block), the modules only
the tools import (`zoo.tools.scale`, the scale report of zoo.tools.inspect_step) and the tools' kit (`zoo.tools.kit`,
`zoo.tools.cli`). Everything else is the library, which research code imports; it must stand without
the tools, so a tool can be renamed or removed without touching it.
"""

import ast
import pathlib

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


def _imports(module: str) -> dict[str, int]:
    """zoo module -> line of its first import in `module`, at any depth (functions included)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
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
                return path[path.index(nxt):] + [nxt]
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
    assert "zoo.tags" in GRAPH["zoo.families"] and "zoo.tools.cli" in GRAPH["zoo.tools.kit"]  # from-imports of a submodule
    commands = {"zoo.tools.inspect_step", "zoo.tools.plan", "zoo.tools.export", "zoo.tools.generate", "zoo.tools.report"}
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


def test_no_two_modules_share_a_name():
    # `zoo.config` beside a `zoo.train.config`, or `zoo.data` beside `zoo.train.data`, read as one module in
    # prose, tracebacks and `from ... import config`. The exception: each `errors` module holds its own
    # package's one exception (zoo.errors.ConfigError, zoo.data.errors.DataError; zoo.data stands alone).
    seen: dict[str, list[str]] = {}
    for m in MODULES:
        seen.setdefault(m.rsplit(".", 1)[-1], []).append(m)
    wrong = {name: sorted(ms) for name, ms in seen.items() if len(ms) > 1 and name != "errors"}
    assert not wrong, f"modules sharing a name: {wrong}"


def test_the_library_never_imports_a_tool():
    wrong = [
        f"{MODULES[m].relative_to(ROOT)}:{line} imports the tool {t}"
        for m in sorted(MODULES) if not _is_tool(m)
        for t, line in GRAPH[m].items() if _is_tool(t)
    ]
    assert not wrong, "; ".join(wrong)


def test_the_cycle_check_can_fail(monkeypatch):
    monkeypatch.setitem(GRAPH, "zoo.tags", {**GRAPH["zoo.tags"], "zoo.model": 1})
    assert _cycle()[0] == _cycle()[-1]


def test_the_blocks_import_nothing_built_on_them():
    """zoo.nn (the blocks) stands below the model and the adapters: the LoRA weight the blocks project
    through lives in zoo.nn.lora_weight, and zoo.lora builds on it, not the other way round."""
    above = {"zoo.model", "zoo.lora"}
    wrong = [f"{MODULES[m].relative_to(ROOT)}:{line} imports {t}" for m in sorted(MODULES) if m.startswith("zoo.nn")
             for t, line in GRAPH[m].items() if t in above]
    assert not wrong, "; ".join(wrong)
    assert "zoo.nn.lora_weight" in GRAPH["zoo.lora"]
