"""The environment the suite's launches compare with the rank server's stays as it was while the
in-process tests import their libraries (tests/conftest.py): a launch whose environment differs
from the server's is exec'd, not forked (tests/rank_server.py), so one import that set a
variable made every later launch of its worker pay its ranks' imports."""

from __future__ import annotations

from rank_server import _without_rank_vars, suite_env


def test_library_imports_leave_the_launch_environment_unchanged():
    """What test_lm_eval_hf.py and test_convert_to_hf.py's evaluation import (lm_eval, its
    metrics' scikit-learn) and inductor's cache (a compiled function's first run) leave
    ``suite_env()`` as it was: failed with conftest's PINNED_ENV and cache_dir() removed
    (KMP_DUPLICATE_LIB_OK, KMP_INIT_AT_FORK, HF_XET_HIGH_PERFORMANCE, TORCHINDUCTOR_CACHE_DIR
    added)."""
    before = _without_rank_vars(suite_env())
    import lm_eval  # noqa: F401
    import sklearn  # noqa: F401
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    cache_dir()
    after = _without_rank_vars(suite_env())
    assert after == before, {k: (before.get(k), after.get(k))
                             for k in set(before) | set(after) if before.get(k) != after.get(k)}
