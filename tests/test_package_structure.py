"""The package's structure, read from its source with ``ast`` (issue 20's numbers): no import
cycle between its modules (function-local imports included), every family in its own folder
behind the contract of ``models/family.py``, and the comparisons of a family's name outside the
family folders no more than the count below, which only goes down."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
from typing import Dict, List, Set

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "megatron_ext")
FAMILY_DIRS = ("stem", "structmoe", "sigma")
# Comparisons of a family's name outside the family folders (the exported HF code aside):
# 33 before the family contract (entry, forward step, arguments, estimate, run report,
# megatron_logits, presets, to-hf, stem_edit); none since.
MAX_FAMILY_NAME_COMPARISONS = 0


def modules() -> Dict[str, str]:
    found = {}
    for root, dirs, files in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if d not in ("__pycache__", "hf_code")]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return found


def imports_of(path: str, known: Set[str]) -> Set[str]:
    """The package modules ``path`` imports, at module level or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name in known:
                out.add(name)
    return out


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    mods = modules()
    graph = {m: imports_of(p, set(mods)) - {m} for m, p in mods.items()}
    # a package's __init__ imported through a submodule is not an edge back
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}
    assert cycles(graph) == []


def test_the_cycle_check_can_fail():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# The package's layers, top to bottom (docs/architecture.md): an import goes sideways within a
# layer or down, never up. The base is compat/, the top-level modules and megatron_ext_kernels.
LAYERS = (("offline tools", ("tools", "convert")), ("trainer seam", ("training",)),
          ("planning", ("planning",)), ("families", FAMILY_DIRS), ("models", ("models",)),
          ("base", ("compat",)))


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of a package module (a folder not in it is an error)."""
    parts = module.split(".")
    if parts[0] == "megatron_ext_kernels" or len(parts) == 1 or \
            os.path.isfile(os.path.join(PACKAGE, parts[1] + ".py")):
        return len(LAYERS) - 1
    for i, (_, folders) in enumerate(LAYERS):
        if parts[1] in folders:
            return i
    raise AssertionError(f"megatron_ext/{parts[1]}/ is in no layer of LAYERS")


def upward_imports(graph: Dict[str, Set[str]]) -> List[str]:
    """``importer (layer) -> imported (layer)`` for every import of a module above its own."""
    return sorted(f"{m} ({LAYERS[layer_of(m)][0]}) -> {d} ({LAYERS[layer_of(d)][0]})"
                  for m, deps in graph.items() for d in deps if layer_of(d) < layer_of(m))


def test_no_import_runs_up_the_layers():
    mods = modules()
    kernels = os.path.join(ROOT, "kernels")  # imported as megatron_ext_kernels (setup.py)
    mods.update({f"megatron_ext_kernels.{n[:-3]}": os.path.join(kernels, n)
                 for n in os.listdir(kernels) if n.endswith(".py")})
    graph = {m: imports_of(p, set(mods)) for m, p in mods.items()}
    found = upward_imports(graph)
    assert found == [], "\n".join(found)


def test_the_layer_check_can_fail():
    graph = {"megatron_ext.models.a": {"megatron_ext.training.b", "megatron_ext.compat.c"},
             "megatron_ext.tools.d": {"megatron_ext.convert.e", "megatron_ext.stem.f"},
             "megatron_ext.data_paths": {"megatron_ext.sigma.g"}}
    assert upward_imports(graph) == [
        "megatron_ext.data_paths (base) -> megatron_ext.sigma.g (families)",
        "megatron_ext.models.a (models) -> megatron_ext.training.b (trainer seam)"]


def test_every_family_is_one_object_in_its_folder():
    from megatron_ext.models.family import Family
    from megatron_ext.models.registry import get_family

    for name in ("gpt",) + FAMILY_DIRS:
        family = get_family(name)
        assert isinstance(family, Family) and family.name == name
    for folder in FAMILY_DIRS:
        assert os.path.exists(os.path.join(PACKAGE, folder, "family.py"))


COMPARISON = re.compile(r'(==|!=|in) *\(?"(gpt|stem|structmoe|sigma)"|"(gpt|stem|structmoe|sigma)" *'
                        r'(==|!=|in)|(?<!for )family *(==|!=|in) ')


def family_name_comparisons() -> List[str]:
    found = []
    for module, path in modules().items():
        parts = module.split(".")
        if len(parts) > 1 and parts[1] in FAMILY_DIRS:
            continue
        for i, line in enumerate(open(path), 1):
            if COMPARISON.search(line):
                found.append(f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()}")
    launch = os.path.join(ROOT, "launch")
    for name in sorted(os.listdir(launch)):
        if name.endswith(".py"):
            for i, line in enumerate(open(os.path.join(launch, name)), 1):
                if COMPARISON.search(line):
                    found.append(f"launch/{name}:{i}: {line.strip()}")
    return found


def test_family_name_comparisons_outside_the_family_folders_only_go_down():
    found = family_name_comparisons()
    assert len(found) <= MAX_FAMILY_NAME_COMPARISONS, "\n".join(found)
    assert not any(p.startswith("megatron_ext/training/") for p in found), found


def _imports_megatron_training(path: str) -> List[str]:
    found = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [n for n in names if n == "megatron.training" or
                  n.startswith("megatron.training.") or n == "megatron_ext.training" or
                  n.startswith("megatron_ext.training.")]
    return found


def test_family_folders_do_not_reach_into_the_trainer():
    """The families (and the models they build) use Megatron-Core only; the trainer seam
    (``training/``) calls their hooks."""
    for module, path in modules().items():
        parts = module.split(".")
        if len(parts) > 1 and parts[1] in FAMILY_DIRS + ("models",):
            assert _imports_megatron_training(path) == [], module


# Where the package replaces attributes of upstream modules: tests/test_upstream_seams.py (one
# table, training/upstream_seams.py; every other assignment onto a megatron.* name is refused).


# Imports a function may make: dependencies the plugin imports and works without (the GPU-only
# extras, the CPU Adam of DeepSpeed, lm-eval), compiled modules a build may lack, and torch's
# JIT compiler (the row-wise AdamW kernel's build: it needs a C++ toolchain, and importing it
# warns about CUDA_HOME on a machine without CUDA).
OPTIONAL_IMPORTS = ("transformer_engine", "triton", "apex", "megablocks", "deepspeed", "lm_eval",
                    "megatron.core.datasets.helpers_cpp", "pydoc_data",
                    "torch.utils.cpp_extension")


def function_local_imports(path: str) -> List[str]:
    """``module (line)`` for every import inside a function of ``path``."""
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                if isinstance(child, ast.Import):
                    names = [a.name for a in child.names]
                else:
                    base = "." * child.level + (child.module or "")
                    names = [f"{base}.{a.name}" if child.module else base + a.name
                             for a in child.names]
                found.extend(f"{n} (line {child.lineno})" for n in names)
            visit(child, in_function or isinstance(child, (ast.FunctionDef,
                                                             ast.AsyncFunctionDef)))

    visit(ast.parse(open(path).read(), path), False)
    return found


def _optional(entry: str) -> bool:
    name = entry.split(" ")[0]
    return any(name == o or name.startswith(o + ".") for o in OPTIONAL_IMPORTS)


def test_function_local_imports_only_for_optional_dependencies():
    """No import hides in a function (a cycle, an upward call) unless the plugin must work
    without what it imports (issue 20: 95 function-local imports of the package's own modules
    before the family contract)."""
    paths = dict(modules())
    kernels = os.path.join(ROOT, "kernels")  # imported as megatron_ext_kernels (setup.py)
    paths.update({f"megatron_ext_kernels.{n[:-3]}": os.path.join(kernels, n)
                  for n in os.listdir(kernels) if n.endswith(".py")})
    local = {m: [e for e in function_local_imports(p) if not _optional(e)]
             for m, p in sorted(paths.items())}
    local = {m: found for m, found in local.items() if found}
    assert local == {}, "\n".join(f"{m}: {', '.join(f)}" for m, f in local.items())


def test_the_local_import_check_can_fail(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import os\n\ndef f():\n    import json\n    from . import x\n"
                    "    import triton\n    return json\n")
    found = function_local_imports(str(path))
    assert found == ["json (line 4)", ".x (line 5)", "triton (line 6)"]
    assert [e for e in found if not _optional(e)] == ["json (line 4)", ".x (line 5)"]


# The project's specified top-level layout (issue 52, goal 7), plus benchmarks/, scripts/ and the
# packaging files beside setup.py. The kernels' source is kernels/, imported as
# megatron_ext_kernels (setup.py's package_dir): a top-level "kernels" package would collide with
# the Hugging Face distribution of that name.
TOP_LEVEL = {"megatron_ext", "launch", "kernels", "tests", "setup.py", "docs", "README.md",
             "benchmarks", "scripts", "pyproject.toml", "requirements.txt"}


def top_level_entries() -> Set[str]:
    """The checkout's tracked top-level names (hidden ones aside); the folder's listing, ignored
    outputs aside, where it is not a git checkout."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             text=True, timeout=30)
    except OSError:
        out = None
    if out is not None and out.returncode == 0 and out.stdout:
        names = {p.split("/", 1)[0] for p in out.stdout.split("\0") if p}
    else:
        ignored = {".venv", "runs", "outputs", "build", "wheelhouse", "__pycache__"}
        names = {n for n in os.listdir(ROOT) if n not in ignored and not n.endswith(".egg-info")}
    return {n for n in names if not n.startswith(".")}


def test_top_level_layout_and_the_kernels_folder():
    assert top_level_entries() == TOP_LEVEL
    assert not os.path.exists(os.path.join(ROOT, "megatron_ext_kernels"))
    # The installed import name resolves to this checkout's kernels/ (an editable install maps it
    # there; a stale install of another checkout or of the old folder would not).
    spec = importlib.util.find_spec("megatron_ext_kernels")
    assert spec is not None and spec.origin is not None
    assert os.path.realpath(spec.origin) == os.path.realpath(
        os.path.join(ROOT, "kernels", "__init__.py"))


def stem_runtime_arrows(graph: Dict[str, Set[str]]) -> List[str]:
    """Imports that break STEM's split (issue 52): the table runtime (``stem/runtime/``) importing
    the model side (``stem/*.py``), or the MLP (``stem/mlp.py``) importing the runtime."""
    out = []
    for m, deps in graph.items():
        for d in deps:
            runtime_up = (m.startswith("megatron_ext.stem.runtime.")
                          and d.startswith("megatron_ext.stem.")
                          and not d.startswith("megatron_ext.stem.runtime"))
            mlp_down = m == "megatron_ext.stem.mlp" and d.startswith("megatron_ext.stem.runtime")
            if runtime_up or mlp_down:
                out.append(f"{m} -> {d}")
    return sorted(out)


def test_stem_runtime_is_beneath_its_model():
    mods = modules()
    graph = {m: imports_of(p, set(mods)) for m, p in mods.items()}
    assert any(m.startswith("megatron_ext.stem.runtime.") for m in graph)
    found = stem_runtime_arrows(graph)
    assert found == [], "\n".join(found)


def test_the_stem_runtime_check_can_fail():
    graph = {"megatron_ext.stem.runtime.store": {"megatron_ext.stem.config",
                                                 "megatron_ext.stem.runtime.tiers"},
             "megatron_ext.stem.mlp": {"megatron_ext.stem.runtime.worker",
                                       "megatron_ext.models.token_ids"},
             "megatron_ext.stem.run": {"megatron_ext.stem.runtime.tables"}}
    assert stem_runtime_arrows(graph) == [
        "megatron_ext.stem.mlp -> megatron_ext.stem.runtime.worker",
        "megatron_ext.stem.runtime.store -> megatron_ext.stem.config"]


# The module-level mutable objects the package keeps (compat/, the CPU backend's patch state,
# aside), each with a comment saying why it must be module-level. There were 13 in STEM's code
# and the trainer seam before the families' runs and the training session owned their state.
MODULE_STATE = {"megatron_ext.models.registry._FAMILIES",
                "megatron_ext.models.specs._CORE_ATTENTION",
                "megatron_ext.stem.runtime.worker._LIVE"}
_MUTABLE_CALLS = {"WeakSet", "WeakKeyDictionary", "WeakValueDictionary", "set", "dict", "list",
                  "defaultdict", "deque", "ContextVar", "SaveLock", "HostWorker", "Lock"}


def module_state(mods: Dict[str, str]) -> Dict[str, bool]:
    """``module.name`` of every module-level mutable object (an empty list, dict or set display,
    or a display under a name that is not a constant's; a container or context variable made by
    a call; a ``_name = None`` filled in later) -> whether a comment line is right above it.
    A non-empty display under an upper-case name is a constant table."""
    found = {}
    for module, path in mods.items():
        if module.startswith("megatron_ext.compat"):
            continue
        lines = open(path).read().splitlines()
        for node in ast.parse("\n".join(lines), path).body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                target, value = node.target, node.value
            else:
                continue
            if not isinstance(target, ast.Name):
                continue
            name = target.id
            constant = name.lstrip("_").isupper() and not isinstance(value, ast.Call)
            call = isinstance(value, ast.Call) and \
                ast.unparse(value.func).split(".")[-1] in _MUTABLE_CALLS
            empty = isinstance(value, ast.Dict) and not value.keys or \
                isinstance(value, (ast.List, ast.Set)) and not value.elts
            display = isinstance(value, (ast.List, ast.Dict, ast.Set)) and \
                (empty or not constant)
            filled_later = name.startswith("_") and isinstance(value, ast.Constant) and \
                value.value is None
            if call or display or filled_later:
                found[f"{module}.{name}"] = lines[node.lineno - 2].lstrip().startswith("#")
    return found


def test_module_level_state_is_the_listed_three_and_says_why():
    found = module_state(modules())
    assert set(found) == MODULE_STATE, sorted(set(found) ^ MODULE_STATE)
    assert all(found.values()), [k for k, v in found.items() if not v]
    assert not [p for p in modules().values() if not p.endswith(os.sep + "cpu.py") and
                any(isinstance(n, ast.Global) for n in ast.walk(ast.parse(open(p).read())))]


def test_the_module_state_check_can_fail(tmp_path):
    (tmp_path / "state.py").write_text("import weakref\nTABLE = {'a': 1}\n_CACHE = {}\n"
                                       "# why\n_LIVE = weakref.WeakSet()\n_LATER = None\n")
    assert module_state({"megatron_ext.x.state": str(tmp_path / "state.py")}) == {
        "megatron_ext.x.state._CACHE": False, "megatron_ext.x.state._LIVE": True,
        "megatron_ext.x.state._LATER": False}
