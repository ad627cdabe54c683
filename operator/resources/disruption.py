"""A PodDisruptionBudget so voluntary evictions (node drains) take one engine pod at a time."""

from __future__ import annotations

from kvpilot.operator.resources.common import Owner


def build_pdb(owner: Owner) -> dict:
    """``maxUnavailable: 1`` over the engine pods (only built when there is more than one)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": owner.metadata("disruption-budget"),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": owner.selector_labels}},
    }
