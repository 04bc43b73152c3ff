#!/usr/bin/env bash
# Rebuild the shipped default pair: the target (scripts/train_target.py) and its EAGLE-3 drafter
# (specserve train-draft). Run from the repo root on a CUDA machine; on the H200 the target takes ~1.5 min
# (1500 steps, ~1M tokens/s) and the drafter ~6 min (self-distillation included): 400-460 s in all.
# The data steps (stdlib, packages) need this Python's stdlib and the package index: run them where both
# are, e.g. `DATA_ONLY=1 bash scripts/build_default_pair.sh`, and carry OUT/stdlib and OUT/packages (~30 MB,
# 4 MB as tar.xz) to a GPU machine that has neither; the training steps skip what is there. The shipped pair
# was built so: data on the development machine (CPython 3.11.7's stdlib, the pinned packages of
# scripts/corpus_packages.json), training on the H200 (torch 2.11).
# Knobs (the defaults rebuild the shipped pair):
# PACKAGES=0 trains on the stdlib alone (the first shipped pair's corpus); PACKAGE_CAP=N keeps at most N bytes of
# each training package's code (default 1000000: pygments and networkx are half the packages' bytes uncapped;
# 0 keeps everything); TARGET_SHAPE="..." gives train_target.py's shape flags (default: 8 layers of hidden 320,
# 10 heads / 2 KV heads, 9.9M parameters); TARGET_STEPS=N (default 1500) sets the target's training steps;
# SEED=N (default 0) seeds both trainings; TARGET_ONLY=1 stops after the target, so that several targets can
# train side by side (drafters are best trained one at a time: two at once ran ~10x slower on the H200); a
# second run then trains the drafter of the target it finds; DRAFT_ARGS="..." adds `specserve train-draft`
# flags (a later flag wins: DRAFT_ARGS="--intermediate-size 2048").
#   bash scripts/build_default_pair.sh [OUT]   then copy OUT/target and OUT/eagle3 (config.json,
#   model.safetensors) into specserve/assets/default/{target,eagle3}, and eagle3/train_log.jsonl's last line
#   into eagle3/final_step.json.
set -euo pipefail
PY=${PYTHON:-python3}
OUT=${1:-build/default-pair}
mkdir -p "$OUT"
[ -d "$OUT/stdlib" ] || $PY scripts/pair_data.py stdlib --out "$OUT/stdlib"
PKG=()
if [ "${PACKAGES:-1}" != 0 ]; then
  CAP=()
  [ "${PACKAGE_CAP:-1000000}" != 0 ] && CAP=(--max-package-bytes "${PACKAGE_CAP:-1000000}")
  [ -f "$OUT/packages/manifest.json" ] || $PY scripts/pair_data.py packages --out "$OUT/packages" ${CAP[@]+"${CAP[@]}"}
  PKG=(--packages "$OUT/packages")
fi
[ "${DATA_ONLY:-0}" != 0 ] && exit 0
# the target's shape: the shipped one unless TARGET_SHAPE gives train_target.py's shape flags
read -r -a SHAPE <<< "${TARGET_SHAPE:---hidden-size 320 --intermediate-size 864 --num-hidden-layers 8 --num-attention-heads 10 --num-key-value-heads 2}"
[ -f "$OUT/target/model.safetensors" ] || $PY scripts/train_target.py --stdlib "$OUT/stdlib" ${PKG[@]+"${PKG[@]}"} \
  --out "$OUT/target" --device cuda "${SHAPE[@]}" --batch-size 64 --seq-len 512 --steps "${TARGET_STEPS:-1500}" --lr 3e-3 \
  --warmup-steps 100 --log-every 200 --eval-every 250 --eval-windows 256 --eval-ast 50 --seed "${SEED:-0}"
[ "${TARGET_ONLY:-0}" != 0 ] && exit 0
$PY scripts/pair_data.py distill --stdlib "$OUT/stdlib" ${PKG[@]+"${PKG[@]}"} --out "$OUT/distill.txt"
PYTHONPATH=. $PY -m specserve.cli train-draft --target "$OUT/target" --data "$OUT/distill.txt" \
  --out "$OUT/eagle3" --steps 2200 --batch-size 32 --seq-len 256 --ttt-steps 4 --lr 1e-3 \
  --intermediate-size 1024 --device cuda --self-distill 64 --save-every 200 --no-progress --seed "${SEED:-0}" \
  ${DRAFT_ARGS:-}
