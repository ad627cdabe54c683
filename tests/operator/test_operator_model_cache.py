"""The real operator process against the API emulator: the model cache claim of an hf:// service."""

from __future__ import annotations

import json

import pytest

from support.harness import wait_for
from support.operator_cluster import SMALL

pytestmark = pytest.mark.slow


def test_the_model_cache_claim_is_created_once_and_removed_with_the_cache(cluster):
    children = cluster.create("cached", SMALL)
    claim = wait_for(lambda: cluster.children("cached").get("PersistentVolumeClaim"), what="the cache claim")
    assert claim["metadata"]["name"] == "cached-model-cache"
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    (ref,) = claim["metadata"]["ownerReferences"]
    assert ref["uid"] == cluster.cr("cached")["metadata"]["uid"]  # it goes with the service
    volumes = children["Deployment"]["spec"]["template"]["spec"]["volumes"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "cached-model-cache"}} in volumes
    mark = cluster.writes()
    cluster.kubectl("patch", "inferenceservice", "cached", "--type", "merge",
                    "-p", json.dumps({"spec": {"model": {"cache": {"sizeGiB": 40}}}}))
    wait_for(lambda: cluster.cr("cached")["status"]["observedGeneration"] == 2, what="generation 2 seen")
    cluster.settle(2)
    # a claim's spec is set at creation: a new size is not patched into it
    assert [w.path for w in cluster.writes_since(mark) if "/persistentvolumeclaims/" in w.path] == []
    assert cluster.obj("persistentvolumeclaims", "cached-model-cache")["spec"] == claim["spec"]
    cluster.kubectl("patch", "inferenceservice", "cached", "--type", "merge",
                    "-p", json.dumps({"spec": {"model": {"cache": {"enabled": False, "sizeGiB": None}}}}))
    wait_for(lambda: "PersistentVolumeClaim" not in cluster.children("cached"), what="the claim removed")
    volumes = cluster.children("cached")["Deployment"]["spec"]["template"]["spec"]["volumes"]
    assert {"name": "model", "emptyDir": {}} in volumes
