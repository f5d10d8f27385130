#!/usr/bin/env bash
# The wheels an offline GPU machine lacks to run fedfeat from a checkout (`make bench-gpu`).
#
#   bash scripts/device_wheels.sh              # here (network): -> .devwheels/*.whl + requirements.txt (~16 MiB)
#   PY=python3 bash scripts/device_wheels.sh install   # there (no network): install them (`make bench-gpu` does)
#
# The GPU machine brings Python 3.12, a CUDA torch + torchvision, numpy 2, numba, typer, rich, matplotlib,
# safetensors, fsspec, timm, huggingface_hub, regex and typing_extensions, and has no network. fedfeat also needs
# zarr and numcodecs (the store) and open_clip_torch (the encoders); of their requirements, donfig (zarr's
# config), google-crc32c (zarr's checksum codec), ftfy and wcwidth (open_clip's tokenizer) may be absent there.
# The versions are the ones `make install` put in .venv (tested here); override one with e.g. ZARR=3.1.5.
# Downloaded: CPython 3.12 manylinux x86_64 wheels, --no-deps (every requirement is named here). .devwheels/ is
# git-ignored: give it to the device run as a carried path.
#
# install: `pip install --no-index --no-deps --find-links .devwheels -r .devwheels/requirements.txt`; a
# requirement the machine already satisfies (the fallbacks below, which only guard against an older image) is left
# as it is. Where the interpreter has no pip (a uv-made environment), the wheels whose requirement is not met are
# unpacked into .devwheels/site instead, which `make bench-gpu` puts on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=${DEST:-.devwheels}

if [ "${1:-download}" = install ]; then
  PY=${PY:-python3}
  if [ ! -f "$DEST/requirements.txt" ]; then
    echo "device_wheels: no $DEST/requirements.txt: run 'bash scripts/device_wheels.sh' on a machine with network" \
      "first, and carry $DEST/ to this one" >&2
    exit 1
  fi
  if "$PY" -m pip --version > /dev/null 2>&1; then
    env -u PIP_CONSTRAINT PIP_DISABLE_PIP_VERSION_CHECK=1 "$PY" -m pip install --quiet --no-index --no-deps \
      --find-links "$DEST" -r "$DEST/requirements.txt"
  else
    echo "device_wheels: $PY has no pip: unpacking the missing wheels into $DEST/site"
    "$PY" - "$DEST" << 'EOF'
import glob, importlib.metadata as md, os, re, sys, zipfile

dest = sys.argv[1]
norm = lambda n: re.sub(r"[-_.]+", "_", n).lower()
for line in open(os.path.join(dest, "requirements.txt")):
    req = line.strip()
    if not req:
        continue
    name, op, ver = re.match(r"([A-Za-z0-9_.-]+)\s*(==|>=)?\s*(\S*)", req).groups()
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    if have is not None and (op != "==" or have == ver):
        continue  # satisfied (a lower bound is taken as met by any installed version)
    wheels = [w for w in glob.glob(os.path.join(dest, "*.whl")) if norm(os.path.basename(w).split("-")[0]) == norm(name)]
    if not wheels:
        sys.exit(f"device_wheels: no wheel for {req} in {dest}")
    zipfile.ZipFile(wheels[0]).extractall(os.path.join(dest, "site"))
    print(f"  {req}: unpacked {os.path.basename(wheels[0])}")
EOF
  fi
  exit 0
fi

PY=${PY:-.venv/bin/python}
PYVER=${PYVER:-3.12}
ZARR=${ZARR:-3.1.6}
NUMCODECS=${NUMCODECS:-0.16.6}
OPEN_CLIP=${OPEN_CLIP:-3.3.0}
DONFIG=${DONFIG:-0.8.1.post1}
CRC32C=${CRC32C:-1.9.0}
FTFY=${FTFY:-6.3.1}
WCWIDTH=${WCWIDTH:-0.9.4}

# installed with ==: the machine lacks them
needed=(
  "zarr==$ZARR"
  "numcodecs==$NUMCODECS"
  "open_clip_torch==$OPEN_CLIP"
  "donfig==$DONFIG"
  "google-crc32c==$CRC32C"
  "ftfy==$FTFY"
  "wcwidth==$WCWIDTH"
)
# "requirement|download": installed only where the image's own copy does not meet the requirement (zarr's,
# open_clip's and donfig's); downloaded at the .venv's versions
fallback=(
  "typing_extensions>=4.12|typing_extensions==4.16.0"
  "packaging>=22.0|packaging==26.4"
  "pyyaml|pyyaml==6.0.4"
  "timm>=1.0.17|timm==1.0.31"
)

rm -rf "$DEST"
mkdir -p "$DEST"
download() {
  "$PY" -m pip download --quiet --disable-pip-version-check --only-binary=:all: --no-deps \
    --python-version "$PYVER" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --dest "$DEST" "$@"
}
download "${needed[@]}"
reqs=("${needed[@]}")
for f in "${fallback[@]}"; do
  download "${f#*|}"
  reqs+=("${f%%|*}")
done
printf '%s\n' "${reqs[@]}" > "$DEST/requirements.txt"
ls -1 "$DEST"
du -sh "$DEST"
