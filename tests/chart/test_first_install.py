"""The first-install steps, followed as written, end in an InferenceService with status and Events.

Issue 43: the README's "Install on a cluster" (now docs/operator.md's, linked from the
README) and the chart's NOTES said ``kubectl apply -f
crds/examples/qwen3-0.6b.yaml`` with no namespace; it landed in ``default``, which the
chart's default install does not watch: no status, no Event, nothing said why. Here every
command of that page's block, and then every command the rendered NOTES print, is run:
``helm install`` as ``support.release.install`` (the real ``helm`` renders it; the emulator
stores what it serves; the real operator runs with the chart's arguments, environment and
ServiceAccount token), each ``kubectl`` line with the real kubectl as a new user would
(the admin's kubeconfig, current namespace ``default``), from the repository root. One
word is added: ``--validate=false`` to ``kubectl apply``, since the emulator serves no
OpenAPI document for kubectl's client-side check (the emulator admits the object against
the CRD's schema and CEL rules itself, as the API server does).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess

import pytest

from kvpilot.operator import constants as c

from support import crd_schema
from support.chart import ROOT, helm
from support.docs_pages import OPERATOR_PAGE
from support.harness import KUBECTL, EmulatorThread, wait_for
from support.release import example, install

pytestmark = pytest.mark.slow
EXAMPLE = example("qwen3-0.6b")["metadata"]["name"]


def readme_steps() -> list[str]:
    """The commands of the first bash block of docs/operator.md's "Install on a cluster"."""
    section = OPERATOR_PAGE.read_text().split("## Install on a cluster", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL)[1]
    return [line.split("  #", 1)[0].strip() for line in block.splitlines() if line.strip()
            and not line.startswith("#")]


def notes_steps(release: str, namespace: str, sets: list[str]) -> list[str]:
    """The kubectl commands the chart's NOTES print after that install."""
    run = helm("install", release, "--namespace", namespace, "--dry-run=client",
               *[a for s in sets for a in ("--set", s)])
    assert run.returncode == 0, run.stderr
    notes = run.stdout.split("NOTES:", 1)[1]
    return [line.split("  #", 1)[0].strip() for line in notes.splitlines() if line.startswith("  kubectl ")]


def _helm_install(command: str) -> tuple[str, str, list[str]]:
    """(release, namespace, --set values) of ``helm install RELEASE charts/kvpilot ...``."""
    words = shlex.split(command)
    assert words[:2] == ["helm", "install"] and words[3] == "charts/kvpilot", command
    namespace = words[words.index("-n") + 1] if "-n" in words else words[words.index("--namespace") + 1]
    assert "--create-namespace" in words, "a fresh cluster has no such namespace"
    sets = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
    return words[2], namespace, sets


def _kubectl(kubeconfig, workdir, command: str) -> subprocess.CompletedProcess:
    words = shlex.split(command)
    assert words[0] == "kubectl", command
    if words[1] == "apply":
        words.insert(2, "--validate=false")
    run = subprocess.run([KUBECTL, "--kubeconfig", str(kubeconfig), "--cache-dir", str(workdir / "kcache"),
                          *words[1:]], capture_output=True, text=True, cwd=ROOT, timeout=60,
                         env={**os.environ, "HOME": str(workdir)})
    assert run.returncode == 0, f"{command}: {run.stderr}"
    return run


def _where(emu, name: str) -> list[dict]:
    return emu.run(lambda e: [o for k, o in e.objects.items() if k[1] == c.PLURAL and k[3] == name])


def _has_status_and_events(emu, namespace: str, name: str) -> bool:
    obj = emu.run(lambda e: e.objects.get((c.GROUP, c.PLURAL, namespace, name)))
    events = emu.run(lambda e: [o["reason"] for k, o in e.objects.items() if k[:3] == ("", "events", namespace)
                                and o["involvedObject"].get("name") == name])
    conditions = {cd["type"]: cd["status"] for cd in ((obj or {}).get("status") or {}).get("conditions", ())}
    return conditions.get("Planned") == "True" and "Ready" in conditions and "Planned" in events


@pytest.mark.parametrize("source", ["docs", "NOTES"])
def test_the_first_install_steps_end_in_a_service_with_status_and_events(tmp_path, source):
    steps = readme_steps()
    assert steps[0].startswith("helm install "), steps
    release_name, namespace, sets = _helm_install(steps[0])
    if source == "NOTES":
        steps = notes_steps(release_name, namespace, sets)
        assert any(" apply " in s and "crds/examples/qwen3-0.6b.yaml" in s for s in steps), steps
    else:
        steps = steps[1:]
    with EmulatorThread([crd_schema.load_crd()]) as emu:
        release = install(emu, tmp_path, release_name, namespace, tuple(sets))
        kubeconfig = release.kubectl.kubeconfig
        with release.operator:
            outputs = {}
            for step in steps:
                if " get kvis" in step or " describe kvis" in step:   # read once the operator wrote
                    (placed,) = _where(emu, EXAMPLE)
                    wait_for(lambda p=placed: _has_status_and_events(emu, p["metadata"]["namespace"], EXAMPLE),
                             30, 0.2, f"{EXAMPLE} with status and Events")
                outputs[step] = _kubectl(kubeconfig, tmp_path, step).stdout
            (placed,) = _where(emu, EXAMPLE)
            assert placed["metadata"]["namespace"] in release.watched, (placed["metadata"]["namespace"],
                                                                        release.watched)
            assert _has_status_and_events(emu, placed["metadata"]["namespace"], EXAMPLE)
            listed = next(out for step, out in outputs.items() if " get kvis" in step and "-o" not in step)
            header, row = listed.splitlines()[:2]
            assert header.split()[:3] == ["NAME", "MODEL", "GPU"] and "ADAPTERS" in header
            assert row.split()[0] == EXAMPLE and "False" in row.split()        # READY: no pod ready yet
            described = next((out for step, out in outputs.items() if " describe " in step), "")
            assert source == "NOTES" or ("Planned" in described and "Events:" in described)
