"""The layout DESIGN.md promises students: imports flow one way, library modules import no stage,
one place calls Hugging Face `generate`, and every file stays short enough to read beside the paper."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODULES = {p.stem: p for p in REPO.glob("*.py")}
STAGES = {"stage0_build", "stage1_sft", "stage2_grpo", "reward", "evaluate", "cuemem"}
LIBRARY = set(MODULES) - STAGES
# The paper's order: a module may import only modules earlier in it (libraries come first).
ORDER = ["stage0_build", "reward", "stage1_sft", "stage2_grpo", "cuemem", "evaluate"]


def local_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names & set(MODULES)


def test_library_modules_import_no_stage():
    for name in LIBRARY:
        assert not local_imports(MODULES[name]) & STAGES, f"{name}.py imports a stage"


def test_stages_import_only_earlier_stages_and_cuemem_never_evaluate():
    for name in STAGES:
        for imported in local_imports(MODULES[name]) & STAGES:
            assert ORDER.index(imported) < ORDER.index(name), f"{name}.py imports the later {imported}.py"


def test_no_import_cycle():
    graph = {name: local_imports(path) - {name} for name, path in MODULES.items()}
    state = {}

    def visit(name, trail):
        if state.get(name) == "done":
            return
        assert state.get(name) != "open", "import cycle: " + " -> ".join(trail + [name])
        state[name] = "open"
        for other in sorted(graph[name]):
            visit(other, trail + [name])
        state[name] = "done"
    for name in sorted(graph):
        visit(name, [])


def test_exactly_one_place_calls_hugging_face_generate():
    callers = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "generate" and ast.unparse(node.func.value) != "modeling"):
                callers.append(name)
    assert callers == ["modeling"]


def test_files_stay_readable():
    for name, path in MODULES.items():
        lines = len(path.read_text().splitlines())
        assert lines < 750, f"{name}.py has {lines} lines"
    for name in ("stage1_sft", "stage2_grpo"):
        assert len(MODULES[name].read_text().splitlines()) < 500, name
