"""How the plugin replaces an attribute of an upstream module and puts it back.

The one module that assigns onto Megatron's modules and classes (the CPU backend, ``cpu.py``, keeps
its own list of patches): every replacement is a row (:class:`Seam`) of a table, which
``training/upstream_seams.py`` lists in full (``compat/upstream_fixes.py``'s fixes of upstream
bugs, then the trainer's hooks); ``docs/architecture.md`` shows it.

A replacement carries its row and the original it replaced (``__ext_seam__``), so the state of
the seams is the upstream attribute itself: :func:`install` skips a row whose replacement is in
place, :func:`restore` puts back the original that was there when the row was installed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, Optional, Sequence

MARK = "__ext_seam__"
_MISSING = object()  # the owner had no attribute of its own (a class inheriting it)


def _always() -> bool:
    return True


@dataclass(frozen=True)
class Seam:
    """``owner.name`` replaced by ``make(original)`` (``make(original, run)`` for a row that
    uses a training run's state: ``per_run``), where ``applies()`` holds."""

    owner: Any  # an upstream module or class
    name: str
    make: Callable[..., Callable]
    # The upstream hook this stands in for, or why none exists (docs/architecture.md's table).
    why: str
    applies: Callable[[], bool] = _always
    per_run: bool = False

    @property
    def where(self) -> str:
        module = getattr(self.owner, "__module__", None) if isinstance(self.owner, type) else None
        owner = f"{module}.{self.owner.__qualname__}" if module else self.owner.__name__
        return f"{owner}.{self.name}"


@dataclass(frozen=True)
class _Installed:
    seam: Seam
    original: Any
    run: Any
    replacement: Any  # a wrapper made with functools.wraps over ours copies the mark, not this


def _mark(fn: Any, seam: Seam) -> Optional[_Installed]:
    mark = getattr(fn, MARK, None)
    ok = isinstance(mark, _Installed) and mark.seam is seam and mark.replacement is fn
    return mark if ok else None


def _installed(seam: Seam) -> Optional[_Installed]:
    """The row's mark when its replacement is the attribute now."""
    return _mark(getattr(seam.owner, seam.name, None), seam)


def _below(fn: Any) -> Any:
    """What ``fn`` wraps: the original a row's replacement was made from, or ``__wrapped__``
    (``functools.wraps``) of someone else's wrapper."""
    mark = getattr(fn, MARK, None)
    if isinstance(mark, _Installed) and mark.replacement is fn:
        return mark.original
    return getattr(fn, "__wrapped__", None)


def _find(seam: Seam) -> Optional[_Installed]:
    """The row's mark where its replacement is in place: the attribute itself, or under later
    wrappers of it (a later row's, e.g. the run's log hooks over the fix of ``training_log``, or
    someone else's)."""
    fn = getattr(seam.owner, seam.name, None)
    for _ in range(32):
        if fn is None or fn is _MISSING:
            return None
        mark = _mark(fn, seam)
        if mark is not None:
            return mark
        fn = _below(fn)
    return None


def _buried(seam: Seam) -> bool:
    return _installed(seam) is None and _find(seam) is not None


def is_installed(seam: Seam) -> bool:
    """The row's replacement is in place: the attribute, or under a later wrapper of it."""
    return _find(seam) is not None


def original(seam: Seam) -> Any:
    """What ``owner.name`` was before this row replaced it (the attribute now when it did not)."""
    mark = _find(seam)
    return getattr(seam.owner, seam.name) if mark is None else mark.original


def install(seams: Iterable[Seam], run: Any = None) -> List[Seam]:
    """Replace, in order, every row that applies and is not in place; a ``per_run`` row in place
    for another run is made again for ``run`` over the same original. Returns the rows replaced
    now."""
    done = []
    for seam in seams:
        mark = _installed(seam)
        if mark is not None and (not seam.per_run or mark.run is run):
            continue
        if mark is None and (_buried(seam) or not seam.applies()):
            continue  # in place under a later row (or not needed here)
        if mark is not None:
            before = mark.original
        else:
            before = vars(seam.owner).get(seam.name, _MISSING) if isinstance(seam.owner, type) \
                else getattr(seam.owner, seam.name)
        current = getattr(seam.owner, seam.name) if before is _MISSING else before
        replacement = seam.make(current, run) if seam.per_run else seam.make(current)
        setattr(replacement, MARK,
                _Installed(seam, before, run if seam.per_run else None, replacement))
        setattr(seam.owner, seam.name, replacement)
        done.append(seam)
    return done


def restore(seams: Sequence[Seam]) -> List[Seam]:
    """Put the originals back, last row first (two rows on one attribute unwind in order).
    Returns the rows restored. A row replaced again since by someone else cannot be unwound:
    ``RuntimeError`` naming it."""
    done = []
    for seam in reversed(list(seams)):
        mark = _installed(seam)
        if mark is None:
            if _buried(seam):
                raise RuntimeError(f"{seam.where} was replaced again over the plugin's "
                                   "replacement; cannot put its original back")
            continue
        if mark.original is _MISSING:
            delattr(seam.owner, seam.name)
        else:
            setattr(seam.owner, seam.name, mark.original)
        done.append(seam)
    return done


def reset(owner: Any, name: str, value: Any = None) -> None:
    """Set upstream state that upstream's own teardown leaves behind (``upstream_seams.RESETS``)."""
    setattr(owner, name, value)
