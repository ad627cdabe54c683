"""Merge-patch helpers: what counts as drift, and the patches that repair it."""

from __future__ import annotations

from decimal import Decimal

from kvpilot.operator.diff import (
    contains,
    diff,
    drop_path,
    quantity,
    removals,
    still_present,
    union,
)

from support.kube_emulator_api import merge_patch


def test_contains_ignores_server_added_fields_but_not_changed_ones():
    desired = {"spec": {"replicas": 2, "template": {"containers": [{"name": "e", "args": ["--a", "1"]}]}}}
    actual = {"spec": {"replicas": 2, "revisionHistoryLimit": 10,
                       "template": {"containers": [{"name": "e", "args": ["--a", "1"],
                                                    "terminationMessagePath": "/dev/termination-log"}]}},
              "status": {"readyReplicas": 1}}
    assert contains(actual, desired)
    assert not contains(actual, {"spec": {"replicas": 3}})
    assert not contains(actual, {"spec": {"template": {"containers": [{"name": "e", "args": ["--a"]}]}}})
    assert not contains({"x": 1}, {"x": True}) and not contains({"x": True}, {"x": 1})


def test_quantities_compare_by_value():
    assert quantity("1536Mi") == quantity("1.5Gi") == Decimal(1536 * 2**20)
    assert quantity("500m") == Decimal("0.5") and quantity(2) == 2 and quantity("fast") is None
    assert contains({"memory": "1536Mi", "cpu": "500m", "gpu": "1"},
                    {"memory": "1.5Gi", "cpu": "0.5", "gpu": 1})
    assert not contains({"memory": "1Gi"}, {"memory": "2Gi"})


def test_removals_delete_what_was_applied_before_and_is_no_longer_wanted():
    previous = {"spec": {"nodeSelector": {"a": "1", "b": "2"}, "replicas": 2}, "metadata": {"labels": {"x": "y"}}}
    desired = {"spec": {"nodeSelector": {"a": "1"}, "replicas": 2}, "metadata": {}}
    patch = removals(previous, desired)
    assert patch == {"spec": {"nodeSelector": {"b": None}}, "metadata": {"labels": None}}
    actual = {"spec": {"nodeSelector": {"a": "1", "b": "2"}, "replicas": 2}, "metadata": {"labels": {"x": "y"}}}
    assert merge_patch(actual, patch) == {"spec": {"nodeSelector": {"a": "1"}, "replicas": 2}, "metadata": {}}


def test_diff_is_the_inverse_of_merge():
    current = {"a": 1, "b": {"c": [1, 2], "d": "x"}, "gone": True}
    desired = {"a": 1, "b": {"c": [1, 2, 3], "d": "x"}, "new": {"k": "v"}}
    patch = diff(current, desired)
    assert patch == {"gone": None, "b": {"c": [1, 2, 3]}, "new": {"k": "v"}}
    assert merge_patch(current, patch) == desired
    assert diff(desired, desired) == {}


def test_drop_path():
    assert drop_path({"spec": {"replicas": 3, "x": 1}}, "spec.replicas") == {"spec": {"x": 1}}
    assert drop_path({"spec": {}}, "spec.replicas.deep") == {"spec": {}}


def test_the_repair_patch_deletes_what_is_no_longer_wanted_and_sets_the_rest():
    removal = {"spec": {"nodeSelector": {"b": None}}}
    managed = {"spec": {"replicas": 2}, "metadata": {"name": "x"}}
    patch = union(removal, managed)
    assert patch == {"spec": {"nodeSelector": {"b": None}, "replicas": 2}, "metadata": {"name": "x"}}
    actual = {"spec": {"nodeSelector": {"a": "1", "b": "2"}, "replicas": 3}}
    assert still_present(actual, removal)
    stored = merge_patch(actual, patch)  # what the API server makes of the patch
    assert not still_present(stored, removal) and contains(stored, managed)
    assert stored["spec"]["nodeSelector"] == {"a": "1"}
