#!/usr/bin/env python
"""The wheels a GPU machine without internet lacks for tools/gpu_check.sh, built and fetched here (run by
tools/gpu_wheels.sh), for CPython 3.12 on manylinux x86_64.

    python tools/gpu_wheels.py DIR            # what the lent image (tools/gpu_image.txt) lacks: a few MB
    python tools/gpu_wheels.py DIR --full     # every dependency but torch, triton and nvidia-*: a bare Python 3.12
    python tools/gpu_wheels.py DIR --check    # ... then install them here without an index and import them

What: moe_scale's requirements (pyproject.toml: its dependencies and the `test` extra), DeepSpeed pinned to
DEEPSPEED_VERSION and built from its source archive (`pip wheel --no-deps`: PyPI has no DeepSpeed wheel), resolved
by pip for the target (`pip install --dry-run --report`, binary wheels only) with the image's known versions as
constraints and torch and triton as empty stand-in wheels of the image's versions, so that their own dependencies
(CUDA's libraries) are never fetched. Every package of the resolution is downloaded (`pip download --no-deps`) into
the cache; DIR gets those the image lacks, plus the small pure-Python ones the image has at a version not known
here (a pin may need ours; pip keeps the installed one where it fits), or with --full all of them. DIR also gets
requirements.txt (what tools/gpu_check.sh installs, resolved there against what is installed) and wheels.json
(each wheel's size and why it is there). A lent machine takes at most 64 MiB of working tree per call: DIR's
total is printed.

pip runs under a Python 3.12 (PYTHON312, else python3.12 on PATH or pyenv's). --check: a virtual environment of
it with torch from PyPI at the image's version (standing in for the image's), then tools/gpu_check.sh's env stage
(REHEARSE=1: no GPU here) twice: with every wheel (--full's set) on that bare environment, and with DIR's on the
image's packages of the resolution (installed from the cache into a prefix of their own), each installing without an
index and importing torch, deepspeed, datasets, moe_scale, transformers, tokenizers and triton.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IMAGE = REPO / "tools" / "gpu_image.txt"
NEVER = ("torch", "triton")   # the image's own builds; with their CUDA libraries (nvidia-*) never carried
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux2014_x86_64",
             "manylinux2010_x86_64", "manylinux1_x86_64")
TARGET = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
          *[f"--platform={p}" for p in PLATFORMS]]
SMALL_PURE = 1 << 20   # bytes


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def python312() -> str:
    """A Python 3.12 to run pip with: requirement markers (`; python_version ...`) are read from the interpreter
    running pip, whatever --python-version says (run by 3.11, pip backtracked to pyarrow 15, which needs numpy < 2)."""
    candidates = [os.environ.get("PYTHON312"), shutil.which("python3.12"),
                  *sorted(str(p) for p in Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))]
    for candidate in filter(None, candidates):
        if subprocess.run([candidate, "-c", "import sys; assert sys.version_info[:2] == (3, 12)"],
                          capture_output=True).returncode == 0:
            return candidate
    raise SystemExit("gpu_wheels.py: error: no Python 3.12 here (pip reads the requirements' markers from the Python "
                     "that runs it); set PYTHON312")


PY312 = None


def pip(*args: str, python: str | None = None) -> None:
    global PY312
    if python is None:
        PY312 = PY312 or python312()
        python = PY312
    cmd = [python, "-m", "pip", "--disable-pip-version-check", "--timeout", "60", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def requirements() -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return list(project["dependencies"]) + list(project["optional-dependencies"]["test"])


def image_packages() -> dict[str, str | None]:
    """{canonical name: pinned version or None} of the lent image."""
    packages = {}
    for line in IMAGE.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            packages[canonical(name)] = version or None
    return packages


def stub_wheel(name: str, version: str, folder: Path) -> None:
    """An empty wheel NAME-VERSION+image: the resolver takes it for the image's build and fetches no dependency."""
    dist = f"{name}-{version}+image.dist-info"
    files = {f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}+image\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: moe_scale\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{dist}/RECORD"])
    with zipfile.ZipFile(folder / f"{name}-{version}+image-py3-none-any.whl", "w") as z:
        for path, text in files.items():
            z.writestr(path, text)


def resolve(cache: Path, image: dict[str, str | None], deepspeed: str) -> list[tuple[str, str]]:
    """[(name, version)] of moe_scale's requirements for the target, torch and triton left out."""
    stubs, built = cache / "stubs", cache / "built"
    stubs.mkdir(parents=True, exist_ok=True)
    built.mkdir(exist_ok=True)
    for name in NEVER:
        stub_wheel(name, image[name], stubs)
    if not list(built.glob(f"deepspeed-{deepspeed}-*.whl")):
        pip("wheel", "--no-deps", "--no-binary", "deepspeed", f"deepspeed=={deepspeed}", "-w", str(built))
    reqs = [f"deepspeed=={deepspeed}" if canonical(re.split(r"[<>=!~; \[]", r, maxsplit=1)[0]) == "deepspeed" else r
            for r in requirements()]
    (cache / "requirements.txt").write_text("\n".join(reqs) + "\n")
    (cache / "constraints.txt").write_text("".join(
        f"{name}=={version}{'+image' if name in NEVER else ''}\n" for name, version in image.items() if version))
    report = cache / "resolution.json"
    pip("install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report), *TARGET,
        "--target", str(cache / "unused"), "--find-links", str(built), "--find-links", str(stubs),
        "-r", str(cache / "requirements.txt"), "-c", str(cache / "constraints.txt"))
    resolved = [(i["metadata"]["name"], i["metadata"]["version"]) for i in json.loads(report.read_text())["install"]]
    leaked = [n for n, _ in resolved if canonical(n).startswith("nvidia-") and canonical(n) != "nvidia-ml-py"]
    if leaked:
        raise SystemExit(f"gpu_wheels.py: error: the resolution reached CUDA's libraries {leaked}")
    return [(n, v) for n, v in resolved if canonical(n) not in NEVER]


def fetch(cache: Path, resolved: list[tuple[str, str]]) -> dict[str, Path]:
    """{canonical name: its wheel in the cache}, downloaded where missing."""
    folder = cache / "all"
    folder.mkdir(exist_ok=True)
    for wheel in (cache / "built").glob("*.whl"):
        shutil.copy2(wheel, folder / wheel.name)

    def wheel_of(name: str, version: str) -> Path | None:
        stem = re.sub(r"[-_.]+", "_", name).lower()
        return next((w for w in folder.glob("*.whl") if w.name.lower().startswith(f"{stem}-{version}-")), None)

    missing = [f"{n}=={v}" for n, v in resolved if wheel_of(n, v) is None]
    if missing:
        pip("download", "--no-deps", "--quiet", *TARGET, "-d", str(folder), *missing)
    wheels = {canonical(n): wheel_of(n, v) for n, v in resolved}
    absent = [n for n, w in wheels.items() if w is None]
    if absent:
        raise SystemExit(f"gpu_wheels.py: error: no wheel downloaded for {absent}")
    return wheels


def select(wheels: dict[str, Path], image: dict[str, str | None], full: bool) -> dict[str, str]:
    """{wheel file name: why it is carried}."""
    chosen = {}
    for name, wheel in sorted(wheels.items()):
        pure = wheel.name.endswith("-none-any.whl")
        if full:
            chosen[wheel.name] = "--full"
        elif name not in image:
            chosen[wheel.name] = "not in the image"
        elif pure and image[name] is None and wheel.stat().st_size < SMALL_PURE:
            chosen[wheel.name] = "small, pure Python; its version in the image is not known"
    return chosen


def fill(folder: Path, cache: Path, chosen: dict[str, str]) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.whl"):
        old.unlink()
    for name in chosen:
        shutil.copy2(cache / "all" / name, folder / name)
    shutil.copy2(cache / "requirements.txt", folder / "requirements.txt")
    sizes = {name: (folder / name).stat().st_size for name in chosen}
    (folder / "wheels.json").write_text(json.dumps(
        {name: {"bytes": sizes[name], "why": why} for name, why in chosen.items()}, indent=1) + "\n")
    return sum(sizes.values())


# ---------------------------------------------------------------- --check


def prefix_site(prefix: Path) -> Path:
    found = sorted(prefix.glob("lib*/python3*/site-packages")) + sorted(prefix.glob("local/lib*/python3*/*-packages"))
    if not found:
        raise SystemExit(f"gpu_wheels.py: error: nothing was installed under {prefix}")
    return found[0]


def env_stage(label: str, cache: Path, wheels: Path, python: Path, pythonpath: str = "") -> dict:
    """tools/gpu_check.sh's env stage (REHEARSE=1) with WHEELS=wheels: its summary entry."""
    out, work = cache / f"check_{label}", cache / f"check_{label}_work"
    shutil.rmtree(work, ignore_errors=True)
    env = {**os.environ, "WHEELS": str(wheels), "PYTHON": str(python), "REHEARSE": "1", "STAGES": "env",
           "WORK": str(work), "GPU_CHECK_WARM": "0", "PYTHONPATH": pythonpath}
    proc = subprocess.run(["bash", str(REPO / "tools" / "gpu_check.sh"), str(out)], env=env, text=True,
                          capture_output=True)
    print(proc.stdout[-3000:], proc.stderr[-3000:], sep="", flush=True)
    stage = json.loads((out / "summary.json").read_text())["stages"][0]
    return {"check": label, "status": stage["status"], "seconds": stage["seconds"], "python": stage.get("python"),
            "versions": stage.get("versions"), "error": stage.get("error")}


def check(folder: Path, cache: Path, wheels: dict[str, Path], image: dict[str, str | None], python312: str) -> int:
    venv = cache / "venv312"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([python312, "-m", "venv", str(venv)], check=True)
    if subprocess.run([str(python), "-c", f"import torch; assert torch.__version__.startswith('{image['torch']}')"],
                      capture_output=True).returncode:
        pip("install", "--quiet", f"torch=={image['torch']}", python=str(python))
    full = cache / "full"
    fill(full, cache, select(wheels, image, full=True))
    results = [env_stage("full", cache, full, python)]
    stand_in = cache / "image"   # the image's packages of the resolution, as the lent machine has them
    shutil.rmtree(stand_in, ignore_errors=True)
    image_wheels = [str(w) for n, w in wheels.items() if n in image]
    pip("install", "--quiet", "--no-index", "--no-deps", "--no-compile", "--prefix", str(stand_in), *image_wheels,
        python=str(python))
    results.append(env_stage("image", cache, folder, python, str(prefix_site(stand_in))))
    print(json.dumps(results, indent=1))
    return 0 if all(r["status"] == "ok" for r in results) else 1


def main(argv: list[str]) -> int:
    args = [a for a in argv if not a.startswith("--")]
    flags = {a for a in argv if a.startswith("--")}
    if len(args) != 1 or flags - {"--full", "--check"}:
        print("gpu_wheels.py: error: usage: gpu_wheels.py DIR [--full] [--check]", file=sys.stderr)
        return 2
    folder = Path(args[0]).resolve()
    cache = Path(os.environ.get("WHEELS_CACHE", Path(os.environ.get("TMPDIR", "/tmp")) / "moe_scale_wheels"))
    image = image_packages()
    resolved = resolve(cache, image, os.environ.get("DEEPSPEED_VERSION", "0.19.8"))
    wheels = fetch(cache, resolved)
    chosen = select(wheels, image, full="--full" in flags)
    total = fill(folder, cache, chosen)
    for name, why in chosen.items():
        print(f"{(folder / name).stat().st_size / 2**20:8.2f} MiB  {name}  ({why})")
    print(f"{len(chosen)} wheels, {total / 2**20:.1f} MiB in {folder} (resolved: {len(resolved)} packages)")
    if "--check" in flags:
        return check(folder, cache, wheels, image, PY312 or python312())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
