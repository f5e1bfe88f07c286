"""The layout the design promises, checked on the source: what runs in the stub stays apart, without cycles."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

BACKEND = ROOT / "backends" / "coalesce"
PACKAGE = BACKEND / "coalesce"


def module_name(path: Path) -> str:
    parts = path.relative_to(BACKEND).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, *, module_level_only: bool) -> set[str]:
    """Modules ``path`` imports (``from x import y`` gives x and x.y); TYPE_CHECKING blocks left out."""
    tree = ast.parse(path.read_text())
    nodes = []
    for node in tree.body if module_level_only else ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        nodes.append(node)
    found: set[str] = set()
    for node in nodes:
        for item in ast.walk(node) if module_level_only else [node]:
            if isinstance(item, ast.ImportFrom) and item.module:
                found.add(item.module)
                found.update(f"{item.module}.{alias.name}" for alias in item.names)
            elif isinstance(item, ast.Import):
                found.update(alias.name for alias in item.names)
    return found


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def test_the_settings_module_imports_nothing_of_ours():
    found = imports(PACKAGE / "settings.py", module_level_only=False)
    ours = {m for m in found if m.split(".")[0].startswith("coalesce")}
    assert not ours, ours


def test_the_package_triton_loads_holds_no_tools_and_never_imports_triton():
    for name, path in MODULES.items():
        found = imports(path, module_level_only=False)
        assert not any(m.startswith("coalesce_tools") for m in found), f"{name} imports the developer tools"
        assert "triton_python_backend_utils" not in found, f"{name} imports pb_utils: only model.py may"
    for tool in ("launcher", "cli", "export", "tune", "engine", "perfanalyzer"):
        assert not (PACKAGE / f"{tool}.py").exists(), f"{tool} belongs to coalesce_tools"


def test_no_import_cycles_between_the_backends_modules():
    graph = {name: {m for m in imports(path, module_level_only=True) if m in MODULES and m != name}
             for name, path in MODULES.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
    assert not cycles, cycles


def test_nothing_task_specific_outside_the_tasks():
    """The planner, cache, scheduler, runtimes and metrics never name a task's tensors or classes."""
    task_words = ("EMBEDDING", "TEXT_PAIR", "SCORES", "last_hidden_state", "EmbeddingTask", "ClassifyTask",
                  "SimilarityTask", "TensorTask", "tokenizer")
    for folder in ("batching", "cache", "scheduling", "observability", "core", "runtimes"):
        for path in (PACKAGE / folder).rglob("*.py"):
            code = "\n".join(line for line in path.read_text().splitlines() if not line.strip().startswith("#"))
            body = ast.get_docstring(ast.parse(code)) or ""
            # The torch runtime loads a Hugging Face head and names its output as the ONNX export does.
            allowed = ("last_hidden_state",) if path.name == "torch_runtime.py" else ()
            named = [w for w in task_words if w in code.replace(body, "") and w not in allowed]
            assert not named, f"{path.relative_to(ROOT)} names {named}"
