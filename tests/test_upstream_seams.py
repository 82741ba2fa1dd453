"""Every replacement in an upstream module is a row of ``training/upstream_seams.py``'s table, made
by ``compat/seam.py``; the training run's state lives in its ``TrainingSession``.

Read from the source with ``ast``: no assignment onto an imported upstream (``megatron.*``)
module, class or function anywhere else in the package (the CPU backend's own list aside), no
``global`` statement in ``training/``, no private name of another module in ``teardown.py``.
Then the table itself: install puts the replacements in place in the table's order, twice is once,
restore puts back the very objects that were there; the documentation lists every row."""

from __future__ import annotations

import ast
import os
from typing import List, Set

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "megatron_ext")
# The one module that assigns (compat/seam.py) and the CPU backend, which keeps its own list of
# patches (compat/cpu.py's PATCHES, installed only without CUDA).
ALLOWED = {os.path.join(PACKAGE, "compat", "seam.py"), os.path.join(PACKAGE, "compat", "cpu.py")}
UPSTREAM = ("megatron",)


def _upstream(module: str) -> bool:
    return module.split(".")[0] in UPSTREAM


def _root(node):
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def upstream_assignments(source: str, path: str = "<source>") -> List[str]:
    """``name.attr (line N)`` for every assignment, deletion, ``setattr`` or ``delattr`` onto an
    object reached from a name bound to an upstream import, or to an alias of one
    (``cls = module.Class``)."""
    nodes = list(ast.walk(ast.parse(source, path)))
    bound: Set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            bound |= {a.asname or a.name.split(".")[0] for a in node.names if _upstream(a.name)}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and \
                _upstream(node.module):
            bound |= {a.asname or a.name for a in node.names}
    aliases = [(n.value, [t.id for t in n.targets if isinstance(t, ast.Name)]) for n in nodes
               if isinstance(n, ast.Assign) and isinstance(n.value, (ast.Name, ast.Attribute))]
    changed = True
    while changed:  # aliases of aliases
        changed = False
        for value, names in aliases:
            if _root(value) in bound and not set(names) <= bound:
                bound |= set(names)
                changed = True
    found = []
    for node in nodes:
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("setattr", "delattr") and node.args and \
                _root(node.args[0]) in bound:
            found.append((node.lineno, ast.unparse(node)))
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, (ast.Attribute, ast.Subscript)) and _root(t) in bound:
                    found.append((node.lineno, ast.unparse(t)))
                    break
    return [f"{text} (line {line})" for line, text in sorted(found)]


def package_sources():
    for folder in ("megatron_ext", "kernels", "launch"):
        for root, dirs, files in os.walk(os.path.join(ROOT, folder)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in sorted(files):
                if name.endswith(".py"):
                    yield os.path.join(root, name)


def test_no_assignment_onto_upstream_outside_the_seam_table():
    found = {}
    for path in package_sources():
        if path in ALLOWED:
            continue
        hits = upstream_assignments(open(path).read(), path)
        if hits:
            found[os.path.relpath(path, ROOT)] = hits
    assert found == {}, ("assign through training/upstream_seams.py's table (compat/seam.py): "
                         f"{found}")


def test_the_assignment_check_can_fail():
    source = (
        "import megatron.training.training as mt\n"
        "from megatron.core import parallel_state\n"
        "from megatron.core.optimizer import distrib_optimizer\n"
        "from megatron.training import get_args\n"
        "import torch\n"
        "mt.training_log = print\n"
        "cls = distrib_optimizer.DistributedOptimizer\n"
        "klass = cls\n"
        "def f():\n"
        "    klass.state_dict = None\n"
        "    setattr(parallel_state, '_X', None)\n"
        "    del mt.pretrain\n"
        "    mt.__dict__['y'] = 1\n"
        "    args = get_args()\n"
        "    args.eval_interval = 3\n"  # Megatron's args object: not a module attribute
        "    torch.x = 1\n"  # not megatron
    )
    assert upstream_assignments(source) == [
        "mt.training_log (line 6)", "klass.state_dict (line 10)",
        "setattr(parallel_state, '_X', None) (line 11)", "mt.pretrain (line 12)",
        "mt.__dict__['y'] (line 13)"]


def _modules(folder: str):
    base = os.path.join(PACKAGE, folder)
    return [os.path.join(base, n) for n in sorted(os.listdir(base)) if n.endswith(".py")]


def test_no_global_statement_in_the_trainer_seam():
    found = [f"{os.path.basename(p)}:{n.lineno}" for p in _modules("training")
             for n in ast.walk(ast.parse(open(p).read())) if isinstance(n, ast.Global)]
    assert found == []


def test_teardown_uses_public_names_of_the_package_only():
    path = os.path.join(PACKAGE, "training", "teardown.py")
    tree = ast.parse(open(path).read())
    ours = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron_ext"):
            for a in node.names:
                assert not a.name.startswith("_"), a.name
                ours.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            ours |= {a.asname or a.name for a in node.names if a.name.startswith("megatron_ext")}
    private = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute)
               and n.attr.startswith("_") and _root(n) in ours]
    assert ours and private == []


# -- the table ------------------------------------------------------------------------------------


@pytest.fixture
def seams(monkeypatch):
    """The table with every upstream attribute as this test found it put back afterwards, and
    every row restored to upstream's own function at the start."""
    from megatron_ext.training import upstream_seams

    for row in upstream_seams.SEAMS:
        monkeypatch.setattr(row.owner, row.name, getattr(row.owner, row.name))
    upstream_seams.restore()
    return upstream_seams


class Run:
    """What the per-run rows read of a ``TrainingSession``."""

    def __init__(self):
        self.log_hooks = []
        self.manifests = object()
        self.family_run = object()
        self.model_chunks = []
        self.save_lock = object()


def test_install_then_restore_gives_back_the_originals(seams):
    from megatron_ext.compat import seam

    pristine = [getattr(r.owner, r.name) for r in seams.SEAMS]
    assert not any(seam.is_installed(r) for r in seams.SEAMS)
    run = Run()
    installed = seams.install(run)
    applies = [r for r in seams.SEAMS if r.applies()]
    assert installed == applies and len(applies) >= len(seams.HOOKS)
    for row, before in zip(seams.SEAMS, pristine):
        assert (getattr(row.owner, row.name) is not before) == (row in applies), row.where
        assert seam.is_installed(row) == (row in applies), row.where
    placed = [getattr(r.owner, r.name) for r in seams.SEAMS]

    assert seams.install(run) == []  # twice is once: the very same replacements
    assert all(getattr(r.owner, r.name) is p for r, p in zip(seams.SEAMS, placed))

    restored = seams.restore()
    assert restored == list(reversed(applies))
    assert all(getattr(r.owner, r.name) is b for r, b in zip(seams.SEAMS, pristine))
    assert seams.restore() == []


def test_training_log_fix_inside_the_hooks(seams):
    """The run's log hooks wrap the fix of the first logged loss, which wraps upstream's
    (the order the entry point installed them in before the table)."""
    from megatron.training import training

    from megatron_ext.compat import seam, upstream_fixes

    upstream = training.training_log
    fix = upstream_fixes.FIXES["first_logged_loss_after_resume"][0]
    hooks = next(r for r in seams.HOOKS if r.name == "training_log")
    assert seams.SEAMS.index(fix) < seams.SEAMS.index(hooks)
    seams.install(Run())
    assert seam.original(hooks) is getattr(seam.original(hooks), seam.MARK).replacement
    assert getattr(seam.original(hooks), seam.MARK).seam is fix
    assert seam.original(fix) is upstream
    # Restoring the fixes alone would drop the hooks above them: refused, naming the attribute.
    with pytest.raises(RuntimeError, match="training_log was replaced again"):
        seam.restore([fix])


def test_a_per_run_row_is_made_again_for_another_run(seams):
    from megatron.training import training

    from megatron_ext.compat import seam

    upstream_log, upstream_load = training.training_log, training.load_checkpoint
    first, second = Run(), Run()
    seams.install(first)
    log, load = training.training_log, training.load_checkpoint
    hooks = next(r for r in seams.HOOKS if r.name == "training_log")
    fix_of_log = seam.original(hooks)
    assert seams.install(second) == [r for r in seams.SEAMS if r.per_run]
    assert training.training_log is not log and seam.original(hooks) is fix_of_log
    assert training.load_checkpoint is load  # not per run: left in place
    seams.restore()
    assert training.training_log is upstream_log
    assert training.load_checkpoint is upstream_load


def test_the_session_restores_the_hooks_and_keeps_the_fixes(seams, tmp_path):
    from megatron_ext.compat import seam
    from megatron_ext.models.family import FamilyRun
    from megatron_ext.training.session import TrainingSession

    class Run(FamilyRun):
        closed = 0

        def log_report(self, *args):
            pass

        def close(self):
            self.closed += 1

    run = Run()
    session = TrainingSession(run, report_path=str(tmp_path / "report.json")).open()
    assert session.log_hooks == [run.log_report, session.report.hook]
    assert all(seam.is_installed(r) for r in seams.SEAMS if r.applies())
    session.close()
    session.close()  # once
    assert run.closed == 1
    assert session.log_hooks == [] and not (tmp_path / "report.json").exists()  # never started
    assert not any(seam.is_installed(r) for r in seams.HOOKS)
    assert all(seam.is_installed(r) for r in seams.SEAMS if r.applies() and r not in seams.HOOKS)


def test_every_row_is_in_the_documentation():
    from megatron_ext.training import upstream_seams

    text = open(os.path.join(ROOT, "docs", "architecture.md")).read()
    missing = [r.where for r in upstream_seams.SEAMS if f"`{r.where}`" not in text]
    missing += [r.what for r in upstream_seams.RESETS if r.what not in text]
    assert missing == []
