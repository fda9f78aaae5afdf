#!/usr/bin/env bash
# Semantic against mlx_lm.server on a synthetic Llama-3-8B shape (4-bit) on an NVIDIA GPU,
# in two calls of the device tool, the second right after the first (the machine keeps
# /tmp only while it stays warm, ~30 s):
#
#   bash benchmarks/device/gpu_check.sh stage1   # carry .device/part1: copy it to /tmp/dev, install its wheels but mlx
#   bash benchmarks/device/gpu_check.sh stage2   # carry .device/part2: join mlx-cuda-13, install it with mlx, measure
#   bash benchmarks/device/gpu_check.sh rehearse # here, on the CPU: the same flow on .venv, the tiny shape, small turns
#
# With the device tool (15 minutes of device time a session; ~10 of them for this):
#   1. here: bash benchmarks/device/bundle.sh    (~2.5 min; .device/part1 and part2, ~51 MiB each)
#   2. run  command "bash benchmarks/device/gpu_check.sh stage1"   carry [".device/part1"]  timeout_s 200
#   3. at once (the machine stays warm ~30 s):
#      run  command "SEMANTIC_COMMIT=<git rev-parse --short HEAD> bash benchmarks/device/gpu_check.sh stage2"
#           carry [".device/part2"]  timeout_s 590
#      The files under $OUT come back (7 of the 8 allowed): gpu-llama3-8b.json/.png, its -drafts
#      pair, restore-gpu-llama3-8b.json/.png, and logs.tar.gz (gpu_check.log, warmup.json,
#      shapes.json, boot_parts.json, the servers' logs); copy the results into benchmarks/results/.
#   4. give_back unless another call follows at once.
#
# .device/ (not committed; `bash benchmarks/device/bundle.sh` makes it, and its README lists
# the files) holds the wheels the GPU image lacks,
# for Python 3.12: mlx and mlx-cuda-13 0.32.4 (the latter's files as one .tar.xz split in two), mlx-lm
# 0.32.2, the project's pinned pure-Python dependencies and transformers 5.23.0; and
# SmolLM2's tokenizer files. The image's own numpy, tokenizers, safetensors, jinja2 and the
# NVIDIA CUDA 13 libraries (site-packages/nvidia/*/lib: on LD_LIBRARY_PATH, and linked as
# /tmp/site/nvidia, where libmlx.so's RPATH looks) are used. mlx and mlx-cuda-13 both
# write mlx/: mlx is installed by pip, then mlx-cuda-13's files unpacked over it (a second
# `pip --target --upgrade` would replace the folder).
#
# stage2: prints mx.default_device(), makes the model (benchmarks/synthetic.py), compiles
# the kernels in process and times that first run (benchmarks/device/warmup.py), then runs
# benchmarks/peers.py: mlx_lm.server then Semantic (`python -m app serve`, a scratch
# SEMANTIC_HOME, KV format q8), each: start-up, a cold ~8K-token turn, two warm turns of
# +850 tokens, a short turn, SIGKILL, start-up again and a short turn; streamed OpenAI chat,
# greedy, 64-token replies; then the probes shapes.py and boot_parts.py; then Semantic once more
# with drafts on, and mlx_lm.server again, its kernels compiled (gpu-llama3-8b-drafts).
# Every phase has a timeout and the whole a budget (GPU_CHECK_BUDGET_S, 540 s); every line is
# logged with its time to gpu_check.log, the results to $OUT/gpu-llama3-8b.json; at the end
# the logs and warmup.json are packed into $OUT/logs.tar.gz.
# SEMANTIC_COMMIT=<hash> names the commit where the tree travels without its .git.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
MODE=${1:-}
DEV=/tmp/dev
SITE=/tmp/site
START=$(date +%s)
BUDGET_S=${GPU_CHECK_BUDGET_S:-540}

case "$MODE" in
  stage1|stage2) OUT=${OUT:-/tmp/gpu-check-out}; PY=${PYTHON:-python3} ;;
  rehearse) OUT=${OUT:-/tmp/gpu-check-rehearse}; PY=${PYTHON:-$ROOT/.venv/bin/python}; BUDGET_S=${GPU_CHECK_BUDGET_S:-240} ;;
  *) echo "usage: $0 stage1|stage2|rehearse" >&2; exit 2 ;;
esac
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
export PYTHONUNBUFFERED=1

log() { echo "$(date +%H:%M:%S) [gpu_check +$(( $(date +%s) - START ))s] $*" | tee -a "$LOG" >&2; }

# phase NAME LIMIT_S COMMAND...: run COMMAND under `timeout` (LIMIT_S, or what is left of
# the budget if less), its output timestamped into the log; returns its status.
phase() {
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET_S - ($(date +%s) - START) ))
  if (( left < limit )); then limit=$left; fi
  if (( limit < 5 )); then log "SKIP $name: the budget of ${BUDGET_S}s is spent"; return 124; fi
  log "BEGIN $name (timeout ${limit}s): $*"
  local t0=$EPOCHREALTIME
  timeout -k 10 "$limit" "$@" 2>&1 | while IFS= read -r line; do echo "$(date +%H:%M:%S) $name| $line"; done | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  log "END $name: exit $rc$( ((rc == 124)) && echo ' (timed out)') after $(awk "BEGIN { printf \"%.1f\", $EPOCHREALTIME - $t0 }")s"
  return "$rc"
}

# Wheels into $SITE: no dependencies, no index.
# GPU_CHECK_PIP_ARGS: more pip arguments, for a rehearsal of stage1 and stage2's installs on another
# Python here (they stop at the device phase): --python-version 3.12 --platform
# manylinux_2_35_x86_64 --platform manylinux_2_31_x86_64 ... --only-binary=:all:
# shellcheck disable=SC2206
PIP=("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE"
     ${GPU_CHECK_PIP_ARGS:-})

if [ "$MODE" = stage1 ]; then
  log "stage1 on $(uname -n): $(nvidia-smi -L 2>/dev/null | head -1); $("$PY" --version 2>&1)"
  [ -d .device/part1 ] || { log "no .device/part1 here: carry it (carry: [\".device/part1\"])"; exit 1; }
  rm -rf "$DEV" "$SITE"; mkdir -p "$DEV" "$SITE"
  cp -r .device/part1/. "$DEV"/
  log "copied $(du -sh "$DEV" | cut -f1) to $DEV"
  if [ -f "$DEV/tokenizer/tokenizer.json.gz" ]; then gunzip -f "$DEV/tokenizer/tokenizer.json.gz"; fi
  phase install-part1 120 "${PIP[@]}" $(ls "$DEV"/*.whl | grep -v '/mlx-[0-9]') || exit 1
  log "stage1 done: now stage2 at once (carry .device/part2)"
  exit 0
fi

if [ "$MODE" = stage2 ]; then
  log "stage2 on $(uname -n); $("$PY" --version 2>&1)"
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG"
  if [ ! -d "$DEV" ] || [ ! -d "$SITE" ]; then
    log "$DEV or $SITE is missing: the machine was given back since stage1; run stage1 again, then stage2 at once"
    exit 1
  fi
  [ -d .device/part2 ] || { log "no .device/part2 here: carry it (carry: [\".device/part2\"])"; exit 1; }
  STREAM=$(cd .device/part2 && ls mlx_cuda_13-*.tar.xz.part2 | sed 's/\.part2$//')
  cat "$DEV/$STREAM.part1" ".device/part2/$STREAM.part2" > "$DEV/$STREAM"
  (cd "$DEV" && grep " $STREAM\$" SHA256SUMS | sha256sum -c -) 2>&1 | tee -a "$LOG" || { log "the joined stream is not the one split"; exit 1; }
  shopt -s nullglob
  phase install-part2 150 "${PIP[@]}" "$DEV"/mlx-[0-9]*.whl .device/part2/*.whl || exit 1
  shopt -u nullglob
  # mlx-cuda-13's files over mlx's (mlx/ holds both), as pip installs them from the wheel.
  phase unpack-mlx-cuda 120 "$PY" -c "import sys, tarfile; tarfile.open(sys.argv[1], 'r:xz').extractall(sys.argv[2], filter='data')" \
    "$DEV/$STREAM" "$SITE" || exit 1
  # The image's NVIDIA libraries (CUDA 13: cublas, cudnn, nccl, nvrtc, cufft, cusolver, runtime).
  NVIDIA=$("$PY" -c "
import glob, os, sys
print(next((os.path.join(p, 'nvidia') for p in sys.path if p and glob.glob(os.path.join(p, 'nvidia', '*', 'lib'))), ''))")
  [ -n "$NVIDIA" ] && [ ! -e "$SITE/nvidia" ] && ln -s "$NVIDIA" "$SITE/nvidia"
  NVLIBS=$(ls -d "$NVIDIA"/*/lib 2>/dev/null | tr '\n' ':')
  export LD_LIBRARY_PATH=${NVLIBS%:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}
  log "nvidia libraries: $NVIDIA; LD_LIBRARY_PATH: $LD_LIBRARY_PATH"
  TOKENIZER=(--tokenizer "$DEV/tokenizer")
  SHAPE=(llama3-8b)
  WARM_TOKENS=8192
  PEERS=(--system-tokens 7100 --turn-tokens 850 --max-context 9700 --short-tokens 20 --reply-tokens 64)
  NAME=gpu-llama3-8b
else  # rehearse
  export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
  TOKENIZER=()
  if [ -f .device/part1/tokenizer/tokenizer.json ]; then TOKENIZER=(--tokenizer .device/part1/tokenizer); fi
  SHAPE=(tiny)
  WARM_TOKENS=512
  PEERS=(--system-tokens 500 --turn-tokens 120 --max-context 800 --short-tokens 20 --reply-tokens 16)
  NAME=rehearse-tiny
fi
export SEMANTIC_COMMIT=${SEMANTIC_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
log "commit $SEMANTIC_COMMIT"
MODEL=/tmp/gpu-check-model
SCRATCH=/tmp/gpu-check-scratch

phase device 90 "$PY" -c "
import mlx.core as mx, mlx_lm, transformers, tokenizers, numpy
print('mx.default_device():', mx.default_device())
print('mlx', mx.__version__, 'mlx_lm', mlx_lm.__version__, 'transformers', transformers.__version__,
      'tokenizers', tokenizers.__version__, 'numpy', numpy.__version__)
a = mx.random.normal((1024, 1024)); mx.eval(a @ a); print('a 1024x1024 matmul ran')
import app.main, falcon, waitress, sqlalchemy, alembic, huey, pydantic
print('the app imports')" || {
  log "MLX or the app does not import; the libraries MLX cannot find:"
  find "$SITE/mlx" -name '*.so*' -exec ldd {} \; 2>/dev/null | grep 'not found' | sort -u | tee -a "$LOG"
  exit 1
}
phase make-model 150 "$PY" -m benchmarks.synthetic "${SHAPE[@]}" "$MODEL" "${TOKENIZER[@]}" || exit 1
phase warmup 200 "$PY" benchmarks/device/warmup.py "$MODEL" --tokens "$WARM_TOKENS" --json "$OUT/warmup.json"
if [ "$MODE" = stage2 ]; then RESTORE=(--shape llama3-8b --tokens 10000 32768); else RESTORE=(--shape tiny --tokens 2048); fi
phase restore 180 "$PY" -m benchmarks.restore "${RESTORE[@]}" --runs 2 --name "$NAME" --out "$OUT"
phase peers 330 "$PY" benchmarks/peers.py --model "$MODEL" --servers mlx_lm semantic "${PEERS[@]}" \
  --restarts SIGKILL --semantic-env SEMANTIC_KV_FORMAT=q8 --name "$NAME" --out "$OUT" --scratch "$SCRATCH"
rc=$?
# The server's own account of each turn (requests: time to first token and its parts), for
# comparison with the client's figures above.
phase requests 30 "$PY" -c "
import sqlite3, sys
db = sqlite3.connect(sys.argv[1])
names = [r[1] for r in db.execute('PRAGMA table_info(requests)')]
wanted = [c for c in ('created_at', 'n_input_tokens', 'n_cached_tokens', 'reuse_reason', 'ttft_ms', 'queue_ms',
                      'restore_ms', 'prefill_ms') if c in names]
print(*wanted, sep='  ')
for row in db.execute(f'SELECT {\", \".join(wanted)} FROM requests ORDER BY created_at'):
    print(*row, sep='  ')" "$SCRATCH/semantic/semantic.db"
cp "$SCRATCH/mlx_lm.log" "$OUT/mlx_lm.log" 2>/dev/null
cp "$SCRATCH/semantic/server.log" "$OUT/semantic.log" 2>/dev/null
for earlier in "$SCRATCH"/semantic/server.log.*; do  # the starts before the last (tests/support/servers.py)
  [ -f "$earlier" ] && cp "$earlier" "$OUT/semantic-start${earlier##*.}.log"
done
# Where a few tokens' forward pass goes (benchmarks/device/shapes.py: a cuDNN graph per key
# length?) and where a start's 5 s of "tokenizer and fingerprint" go (boot_parts.py), each in a
# fresh process: what GPU run 3 (75fbdf5) left open.
if [ "$MODE" = stage2 ]; then SHAPES=(--context 8192); else SHAPES=(--context 300 --passes 2 --queries 1 5 20); fi
phase shapes 90 "$PY" benchmarks/device/shapes.py "$MODEL" "${SHAPES[@]}" --json "$OUT/shapes.json"
phase boot-parts 60 "$PY" benchmarks/device/boot_parts.py "$MODEL" --json "$OUT/boot_parts.json"
# Semantic again with drafts of up to 8 (off by default on an NVIDIA GPU since 75fbdf5: they made
# decode 3.6x slower there), then mlx_lm.server again: its first run above compiled kernels for
# its shapes (a 20-token turn took 36-48 s on a fresh machine), so this one is its figure with
# the kernels compiled, the reference for the goals. Last, so the budget skips it first.
phase peers-drafts 200 "$PY" benchmarks/peers.py --model "$MODEL" --servers semantic mlx_lm "${PEERS[@]}" \
  --restarts SIGKILL --semantic-env SEMANTIC_KV_FORMAT=q8 --semantic-env SEMANTIC_SPECULATIVE_TOKENS=8 \
  --name "$NAME-drafts" --out "$OUT" --scratch "$SCRATCH-drafts"
cp "$SCRATCH-drafts/semantic/server.log" "$OUT/semantic-drafts.log" 2>/dev/null
for earlier in "$SCRATCH"-drafts/semantic/server.log.*; do
  [ -f "$earlier" ] && cp "$earlier" "$OUT/semantic-drafts-start${earlier##*.}.log"
done
cp "$SCRATCH-drafts/mlx_lm.log" "$OUT/mlx_lm-again.log" 2>/dev/null
log "done (peers exit $rc); the logs and the probes' JSON go into logs.tar.gz"
# The device tool brings back at most 8 files from $OUT: the results and plots, and one archive.
(cd "$OUT" && tar -czf logs.tar.gz --remove-files warmup.json shapes.json boot_parts.json ./*.log 2>/dev/null)
echo "in $OUT ($(ls "$OUT" | wc -l) files; 8 come back from a device): $(cd "$OUT" && ls | tr '\n' ' ')" >&2
exit $rc
