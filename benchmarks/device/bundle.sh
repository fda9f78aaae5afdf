#!/usr/bin/env bash
# Build .device/ (gitignored), the wheel bundle gpu_check.sh carries to a GPU machine:
#
#   bash benchmarks/device/bundle.sh        # ~1 min with a warm pip cache; prints the two parts' sizes
#
# A device call carries at most 64 MiB with the working tree, and mlx-cuda-13 alone is ~86 MiB,
# so the bundle is two parts, each carried by one call (stage1, then stage2 at once):
#   .device/part1/  the wheels the GPU image lacks (mlx, mlx-lm, the project's pinned
#                   dependencies, transformers), SmolLM2's tokenizer files (tokenizer.json
#                   gzipped), SHA256SUMS, and the
#                   head of mlx-cuda-13's wheel (<wheel>.part1), filled up to PART_MIB;
#   .device/part2/  the rest of that wheel (<wheel>.part2).
# stage2 joins the halves, checks the joined wheel against SHA256SUMS and installs it with mlx.
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
PART_MIB=${PART_MIB:-58}  # each part's size; the working tree (~5 MiB) travels beside it
CACHE=${BUNDLE_CACHE:-/tmp/semantic-bundle-wheels}

# In the image at versions that serve (pip's normalized names, '-' as '_').
IMAGE_HAS='^(nvidia_.*|numpy|tokenizers|safetensors|jinja2|markupsafe|hf_xet|typer|click|rich|pygments|markdown_it_py|mdurl|shellingham|sentencepiece|protobuf|certifi|idna|urllib3|charset_normalizer|requests|pyyaml|packaging|filelock|fsspec|tqdm|typing_extensions|anyio|h11|annotated_doc)$'

PLATFORMS=()
for v in $(seq 17 35); do PLATFORMS+=(--platform "manylinux_2_${v}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64)

mkdir -p "$CACHE"
echo "downloading the wheels of .[cuda] for CPython 3.12 on manylinux x86-64 into $CACHE" >&2
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --abi none "${PLATFORMS[@]}" -d "$CACHE" "$ROOT[cuda]" 2>&1 \
  | grep -v '^WARNING: Location' >&2 || true

# The newest file of each distribution the resolution asked for (the cache may hold older ones).
rm -rf "$OUT"
mkdir -p "$OUT/part1/tokenizer" "$OUT/part2"
"$PY" - "$ROOT" "$CACHE" "$OUT/part1" "$IMAGE_HAS" <<'EOF'
import re, shutil, sys, tomllib
from pathlib import Path
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

root, cache, part1, image_has = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), re.compile(sys.argv[4])
project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
pins = {canonicalize_name(r.name): r for r in map(Requirement, project["dependencies"] + project["optional-dependencies"]["cuda"])}
wheels: dict[str, tuple] = {}
for path in cache.glob("*.whl"):
    name, version, _, _ = parse_wheel_filename(path.name)
    pin = pins.get(name)
    if pin is not None and pin.specifier and version not in pin.specifier:
        continue
    if name not in wheels or version > wheels[name][0]:
        wheels[name] = (version, path)
for name, (version, path) in sorted(wheels.items()):
    if image_has.match(name.replace("-", "_")):
        continue
    if name == "mlx-cuda-13":
        (part1 / "mlx-cuda-13").write_text(path.name)
    shutil.copy2(path, part1 / path.name)
EOF

# SmolLM2's tokenizer files (the synthetic models' tokenizer).
TOK=$("$PY" -c "from benchmarks.synthetic import tokenizer_dir; print(tokenizer_dir())")
cp "$TOK/tokenizer_config.json" "$OUT/part1/tokenizer/"
gzip -9 -c "$TOK/tokenizer.json" > "$OUT/part1/tokenizer/tokenizer.json.gz"  # 3.4 MiB -> 0.6: stage1 unpacks it

# Split mlx-cuda-13: part1 is filled up to PART_MIB, part2 holds the rest.
WHEEL=$(cat "$OUT/part1/mlx-cuda-13"); rm "$OUT/part1/mlx-cuda-13"
(cd "$OUT/part1" && sha256sum "$WHEEL" *.whl | sort -u -k2 > SHA256SUMS)
mv "$OUT/part1/$WHEEL" "$OUT/$WHEEL"
LIMIT=$(( PART_MIB * 1024 * 1024 ))
USED=$(du -sb "$OUT/part1" | cut -f1)
HEAD=$(( LIMIT - USED ))
SIZE=$(stat -c %s "$OUT/$WHEEL")
if (( HEAD <= 0 || SIZE - HEAD > LIMIT )); then
  echo "the bundle does not fit in two parts of ${PART_MIB} MiB: $(( USED >> 20 )) MiB of wheels beside a $(( SIZE >> 20 )) MiB mlx-cuda-13" >&2
  exit 1
fi
head -c "$HEAD" "$OUT/$WHEEL" > "$OUT/part1/$WHEEL.part1"
tail -c +"$(( HEAD + 1 ))" "$OUT/$WHEEL" > "$OUT/part2/$WHEEL.part2"
cat "$OUT/part1/$WHEEL.part1" "$OUT/part2/$WHEEL.part2" | cmp - "$OUT/$WHEEL"
rm "$OUT/$WHEEL"
{
  echo "The wheel bundle of benchmarks/device/gpu_check.sh, made by benchmarks/device/bundle.sh"
  echo "at $(git rev-parse --short HEAD 2>/dev/null || echo unknown) on $(date -u +%F)."
  echo
  echo "part1 ($(du -sh "$OUT/part1" | cut -f1)):"; (cd "$OUT/part1" && ls -1 | sed 's/^/  /')
  echo "part2 ($(du -sh "$OUT/part2" | cut -f1)):"; (cd "$OUT/part2" && ls -1 | sed 's/^/  /')
} > "$OUT/README"
cat "$OUT/README"
echo "carry .device/part1 with stage1, then .device/part2 with stage2 (benchmarks/device/gpu_check.sh)" >&2
