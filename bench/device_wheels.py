"""The wheels a GPU session carries to the device machine (`.whl/`, git-ignored), and a bitsandbytes wheel trimmed
to the device's CUDA.

    python bench/device_wheels.py            # writes .whl/ (about 20 MB); run from a venv with torch (deepspeed's build)

The device image has torch 2.11 + CUDA 13.0, transformers 5.x and no bitsandbytes; glmtune needs its own stack
(transformers 4.40.2, peft 0.11.1, DeepSpeed 0.19.8, Hydra 1.3.8, ...), carried as wheels for CPython 3.12 and
installed there with `pip install --no-index --no-deps --target /tmp/site .whl/*.whl`. bitsandbytes 0.50.2's wheel
is 43 MB (129 MB unpacked): it carries one native library per CUDA and ROCm version (21-27 MB each for CUDA 11.8-12.8),
and the device tool carries at most 64 MiB a call. bitsandbytes loads `libbitsandbytes_cuda<major><minor>.so` by
torch's CUDA version (13.0 there), so the trimmed wheel keeps only the CPU library and the CUDA 13.x ones (7.9 MB)
and drops the rest from the archive and from its RECORD (pip checks the hash of every file it installs, against
RECORD).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:"] + [
    arg
    for tag in (
        "manylinux_2_28_x86_64",
        "manylinux_2_27_x86_64",
        "manylinux_2_24_x86_64",
        "manylinux_2_17_x86_64",
        "manylinux2014_x86_64",
        "any",
    )
    for arg in ("--platform", tag)
]
BINARY = [
    "transformers==4.40.2",
    "tokenizers==0.19.1",
    "huggingface_hub==0.36.2",
    "peft==0.11.1",
    "hydra-core==1.3.8",
    "omegaconf==2.3.1",
    "datasets==5.0.1",
    "dill==0.4.1",
    "multiprocess==0.70.19",
    "hjson==3.1.0",
    "pydantic==2.14.3",
    "pydantic_core==2.50.4",
    "annotated-types",
    "typing-inspection",
]
SOURCE = ["antlr4-python3-runtime==4.9.3"]  # an sdist only: built here (pure Python)
WITH_TORCH = ["deepspeed==0.19.8"]  # its setup.py imports torch: built in this venv, no build isolation
KEEP_NATIVE = re.compile(r"libbitsandbytes_(cpu|cuda13\d)\.so$")


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def trim_bitsandbytes(wheel: Path, out: Path) -> Path:
    """A copy of `wheel` without the native libraries KEEP_NATIVE does not match (nor their RECORD lines)."""
    target = out / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            name = info.filename
            if name.endswith(".so") and not KEEP_NATIVE.search(name):
                continue
            data = src.read(name)
            if name.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = (
                    "\n".join(
                        line
                        for line in lines
                        if not (line.split(",")[0].endswith(".so") and not KEEP_NATIVE.search(line.split(",")[0]))
                    )
                    + "\n"
                ).encode()
            dst.writestr(info, data)
    return target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / ".whl"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pip("download", "-q", "--no-deps", *PLATFORM, "-d", str(out), *BINARY)
    pip("wheel", "-q", "--no-deps", "-w", str(out), *SOURCE)
    pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), *WITH_TORCH)
    full = out / "full"
    pip("download", "-q", "--no-deps", *PLATFORM, "-d", str(full), "bitsandbytes==0.50.2")
    for wheel in full.glob("bitsandbytes-*.whl"):
        trimmed = trim_bitsandbytes(wheel, out)
        print(f"{wheel.name}: {wheel.stat().st_size / 2**20:.1f} MB -> {trimmed.stat().st_size / 2**20:.1f} MB")
        wheel.unlink()
    full.rmdir()
    total = sum(p.stat().st_size for p in out.glob("*.whl"))
    print(f"{out}: {len(list(out.glob('*.whl')))} wheels, {total / 2**20:.1f} MB")


if __name__ == "__main__":
    main()
