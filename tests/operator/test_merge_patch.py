"""The status merge patch, and quantities compared by value."""

from __future__ import annotations

from decimal import Decimal

from kvpilot.operator.merge_patch import diff
from kvpilot.operator.quantity import quantity

from support.kube_emulator_api import merge_patch


def test_quantities_compare_by_value():
    assert quantity("1536Mi") == quantity("1.5Gi") == Decimal(1536 * 2**20)
    assert quantity("500m") == Decimal("0.5") and quantity(2) == 2 and quantity("fast") is None
    assert quantity(True) is None and quantity(1.5) is None


def test_diff_is_the_inverse_of_merge():
    current = {"a": 1, "b": {"c": [1, 2], "d": "x"}, "gone": True}
    desired = {"a": 1, "b": {"c": [1, 2, 3], "d": "x"}, "new": {"k": "v"}}
    patch = diff(current, desired)
    assert patch == {"gone": None, "b": {"c": [1, 2, 3]}, "new": {"k": "v"}}
    assert merge_patch(current, patch) == desired
    assert diff(desired, desired) == {}
    assert diff({"x": 1}, {"x": True}) == {"x": True}  # True is not 1
