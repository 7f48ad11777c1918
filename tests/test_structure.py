"""The structure drawn from the imports (issue 26): no import circle among the product modules, counting the imports
made inside functions as well as the module-level ones (a late import hides a circle, it does not remove it), and no
product Python file over MAX_LINES."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("vcpo", "vcpo_kernels")
MAX_LINES = 600
# modules the build makes (setup.py: the compiled extension, the record of the torch it was built with); they import
# nothing of the product
BUILT = ("vcpo_kernels._C", "vcpo_kernels._build")


def _modules() -> dict[str, str]:
    """module name -> file, for every .py file of the product packages."""
    out = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
                    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return {**out, **{name: None for name in BUILT}}


def _imports(name: str, path: str, modules: dict[str, str]) -> set[str]:
    """The product modules `name` imports anywhere in its file (`from P import m` counts as P.m when that is a
    module, else as P)."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a name inside a module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _circle(graph: dict[str, set[str]]):
    """One import circle as a list of modules (first = last), or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = "done"
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_circle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) if path else set() for name, path in modules.items()}
    circle = _circle(graph)
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_the_circle_finder_finds_one():
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b"}, "b": set()}) is None


def test_no_product_file_over_max_lines():
    long = {os.path.relpath(p, ROOT): n for p in _modules().values() if p and (n := sum(1 for _ in open(p))) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines: {long}"


def _layer(module: str) -> int:
    """0 the kernels, 1 the algorithm, 2 the trainer (docs/architecture.md): imports go to a layer at or below the
    importer's."""
    if module.startswith("vcpo_kernels"):
        return 0
    return 2 if module.startswith("vcpo.trainer") else 1


def test_imports_go_down_the_layers():
    modules = _modules()
    upward = sorted((name, target) for name, path in modules.items() if path
                    for target in _imports(name, path, modules) if _layer(target) > _layer(name))
    assert not upward, f"imports from a lower layer to a higher one: {upward}"


def test_the_layer_check_sees_an_upward_import():
    assert _layer("vcpo_kernels.ops") < _layer("vcpo.step") < _layer("vcpo.trainer.run") == _layer("vcpo.trainer.cli")


# The trainer's inner layers, top to bottom (docs/architecture.md): a module imports its own layer's and those below.
# A name ending in "." is a whole package. Every trainer module is in exactly one layer.
TRAINER_LAYERS = (
    ("the commands", ("vcpo.trainer", "vcpo.trainer.__main__", "vcpo.trainer.cli", "vcpo.trainer.ray_launch")),
    ("the loop", ("vcpo.trainer.run",)),
    ("the loop's parts", ("vcpo.trainer.evaluate", "vcpo.trainer.export", "vcpo.trainer.task", "vcpo.trainer.policy",
                          "vcpo.trainer.run_folder", "vcpo.trainer.loop_state")),
    ("the engines", ("vcpo.trainer.engines.",)),
    ("where things run", ("vcpo.trainer.placement.",)),
    ("the settings", ("vcpo.trainer.config",)),
    ("the foundations", ("vcpo.trainer.data", "vcpo.trainer.errors", "vcpo.trainer.gguf_models", "vcpo.trainer.lora",
                         "vcpo.trainer.lr_schedule", "vcpo.trainer.plot", "vcpo.trainer.process_guard",
                         "vcpo.trainer.report", "vcpo.trainer.rewards", "vcpo.trainer.rollouts",
                         "vcpo.trainer.tiny", "vcpo.trainer.net")),
)


def _trainer_layer(module: str) -> int:
    """The depth of `module` in TRAINER_LAYERS (0 the top); -1 outside the trainer."""
    for depth, (_, names) in enumerate(TRAINER_LAYERS):
        if any(module.startswith(n) or module == n[:-1] if n.endswith(".") else module == n for n in names):
            return depth
    return -1


def test_the_trainer_imports_go_down_its_layers():
    modules = _modules()
    trainer = [name for name, path in modules.items() if path and name.startswith("vcpo.trainer")]
    unplaced = [name for name in trainer if _trainer_layer(name) < 0]
    assert not unplaced, f"trainer modules in no layer of TRAINER_LAYERS: {unplaced}"
    upward = sorted((name, target) for name in trainer for target in _imports(name, modules[name], modules)
                    if target.startswith("vcpo.trainer") and _trainer_layer(target) < _trainer_layer(name))
    assert not upward, "imports from a lower trainer layer to a higher one: " + ", ".join(
        f"{a} ({TRAINER_LAYERS[_trainer_layer(a)][0]}) -> {b} ({TRAINER_LAYERS[_trainer_layer(b)][0]})"
        for a, b in upward)


def test_the_trainer_layer_check_sees_an_upward_import():
    assert _trainer_layer("vcpo.trainer.cli") < _trainer_layer("vcpo.trainer.run") < \
        _trainer_layer("vcpo.trainer.policy") < _trainer_layer("vcpo.trainer.engines.pool") < \
        _trainer_layer("vcpo.trainer.placement.ranks") < _trainer_layer("vcpo.trainer.config") < \
        _trainer_layer("vcpo.trainer.data")
    assert _trainer_layer("vcpo.trainer.engines") == _trainer_layer("vcpo.trainer.engines.start")
    assert _trainer_layer("vcpo_kernels.ops") == -1


def test_every_package_is_installed():
    """pyproject.toml lists the packages a non-editable install copies: a package missing there imports in this
    checkout (editable) and fails in a wheel (vcpo.grad_norms was missing for a while)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10 (pyproject installs tomli there)
        import tomli as tomllib

    listed = set(tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["tool"]["setuptools"]["packages"])
    packages = {name for name, path in _modules().items() if path and path.endswith("__init__.py")}
    assert packages == listed, f"not in pyproject.toml: {sorted(packages - listed)}; not packages: " \
                               f"{sorted(listed - packages)}"
