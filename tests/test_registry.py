"""The model-family registry."""

from __future__ import annotations

import pytest

from megatron_ext.models.registry import Family, get_family, register_family, registered_families


def test_families_of_this_version():
    assert set(registered_families()) >= {"gpt", "stem"}
    assert get_family("stem").heterogeneous_layers
    assert not get_family("gpt").heterogeneous_layers


def test_unknown_and_duplicate_families_are_refused():
    with pytest.raises(ValueError, match="--model-family=nope: not available"):
        get_family("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_family(Family("gpt", "again", lambda *a, **k: None, False))
