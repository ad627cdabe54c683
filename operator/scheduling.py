"""Why engine pods stay Pending, read from kube-scheduler's own words.

kube-scheduler puts one message on a pod it cannot place (its ``PodScheduled=False,
reason=Unschedulable`` condition, and the ``FailedScheduling`` Event): a histogram of the
reasons the nodes were rejected for, each with the number of nodes it applies to, sorted as
strings, then what preemption found::

    0/2 nodes are available: 1 Insufficient nvidia.com/gpu, 1 node(s) didn't match Pod's node
    affinity/selector. preemption: 0/2 nodes are available: 1 No preemption victims found for
    incoming pod, 1 Preemption is not helpful for scheduling.

A PreFilter failure (an unbound claim, say) comes as a sentence without a count before the
histogram. The filters run in a fixed order and a node leaves at the first one it fails:
taints and node affinity come before resources, so a node counted under ``Insufficient
<resource>`` or ``Too many pods`` matched the pod's placement and is full.

Hence the classification:

- ``Unschedulable`` (capacity) when any node is rejected for capacity alone: the placement is
  right, the matching nodes are full (wait, free GPUs, add nodes);
- ``NoMatchingNodes`` only when every node is rejected for its labels or taints (node
  affinity / selector, an untolerated taint): no node has what the pods require;
- ``Unschedulable`` for anything else (a cordoned node, volumes, pod anti-affinity), with the
  scheduler's message.

A cluster of several node types always rejects some nodes for their labels, so a message
merely containing "didn't match" says nothing about the nodes that do match.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

NO_MATCH = "NoMatchingNodes"
UNSCHEDULABLE = "Unschedulable"
# kube-scheduler's reason strings (NodeAffinity, TaintToleration; NodeResourcesFit)
_MISMATCH = ("didn't match Pod's node affinity/selector", "had untolerated taint", "had taint")
_CAPACITY_PREFIX = "Insufficient "
_TOO_MANY_PODS = "Too many pods"
_HEAD = re.compile(r"^\s*0/(\d+) nodes are available:\s*")
_COUNTED = re.compile(r"^(\d+) (.+)$")
_ITEM_SPLIT = re.compile(r",\s+(?=\d+ )")   # "1 a, 2 b": a reason itself may hold ", "


@dataclass(frozen=True, slots=True)
class FitFailure:
    """One FailedScheduling message, parsed.

    Args:
        nodes: the N of "0/N nodes are available" (None: not the scheduler's histogram).
        reasons: (node count, reason) pairs of the filters, as the scheduler listed them.
        prefilter: the sentence a PreFilter plugin gave instead (or before) them, if any.
    """

    nodes: int | None
    reasons: tuple[tuple[int, str], ...]
    prefilter: str = ""

    @classmethod
    def parse(cls, message: str) -> FitFailure:
        head = _HEAD.match(message)
        if head is None:
            return cls(None, ())
        body = message[head.end():].split(" preemption:", 1)[0].strip().rstrip(".")
        reasons, prefilter = [], []
        for item in _ITEM_SPLIT.split(body):
            counted = _COUNTED.match(item.strip())
            if counted:
                reasons.append((int(counted[1]), counted[2].strip().rstrip(".")))
            elif item.strip():
                prefilter.append(item.strip())
        return cls(int(head[1]), tuple(reasons), ". ".join(prefilter))

    @property
    def capacity(self) -> tuple[tuple[int, str], ...]:
        """The reasons that say a node matched and is full."""
        return tuple((n, r) for n, r in self.reasons if r.startswith(_CAPACITY_PREFIX) or r == _TOO_MANY_PODS)

    @property
    def only_mismatch(self) -> bool:
        """Every node was rejected for its labels or taints (and nothing else was said)."""
        return bool(self.reasons) and not self.prefilter and \
            all(any(m in r for m in _MISMATCH) for _, r in self.reasons)


@dataclass(frozen=True, slots=True)
class SchedulingProblem:
    """Engine pods the scheduler cannot place: ``reason`` is ``NoMatchingNodes`` when no
    node has the labels (or tolerations) they require, else ``Unschedulable``; the message
    carries the detail that changes (pod count, the scheduler's text)."""

    reason: str
    message: str


def unschedulable_messages(pods: Iterable[Mapping[str, Any]]) -> list[str]:
    """The scheduler's messages on the Pending pods it gave up on (``PodScheduled=False,
    reason=Unschedulable``), in the order listed."""
    messages = []
    for pod in pods:
        status = pod.get("status") or {}
        if status.get("phase", "Pending") != "Pending":
            continue
        for cond in status.get("conditions") or ():
            if (cond.get("type"), cond.get("status"), cond.get("reason")) == \
                    ("PodScheduled", "False", "Unschedulable"):
                messages.append(cond.get("message") or "")
    return messages


def scheduling_problem(pods: Iterable[Mapping[str, Any]], placement: str = "") -> SchedulingProblem | None:
    """What keeps Pending ``pods`` off the nodes, from their PodScheduled conditions.

    Args:
        pods: the engine pods as listed (any phase).
        placement: what the pods require, for the message (``nvidia.com/gpu.product in (...)``).
    Returns:
        None when no pod is Pending with ``PodScheduled=False, reason=Unschedulable``;
        ``NoMatchingNodes`` when every such pod was refused by every node for its labels
        or taints, else ``Unschedulable`` (the first capacity message when there is one).
    """
    messages = unschedulable_messages(pods)
    if not messages:
        return None
    parsed = [FitFailure.parse(m) for m in messages]
    pending = f"{len(messages)} pod(s) Pending"
    full = next(((m, f) for m, f in zip(messages, parsed, strict=True) if f.capacity), None)
    if full is not None:
        message, fit = full
        lacking = ", ".join(f"{n} {r}" for n, r in fit.capacity)
        return SchedulingProblem(UNSCHEDULABLE, f"{pending}: the nodes that match their placement are full "
                                                f"({lacking}). Scheduler: {message}")
    if all(f.only_mismatch for f in parsed):
        need = f"; the pods require {placement}" if placement else ""
        return SchedulingProblem(NO_MATCH, f"{pending}: no node matches their placement{need}. "
                                           f"Scheduler: {messages[0]}")
    return SchedulingProblem(UNSCHEDULABLE, f"{pending}. Scheduler: {messages[0]}")
