#!/usr/bin/env bash
# Set up a fresh Debian machine, build Tetra, and train the demo model (configs/demo.json) on the
# CPU: a small Llama-style model learning English from the State of the Union addresses, printing
# its training loss, its loss on held-out addresses and a sample of its text at each evaluation.
#
#   scripts/run.sh [tetra args...]       e.g. scripts/run.sh --set training.steps=50
#
# Steps, each skipped when already done: dependencies (scripts/setup.sh); a Release build in
# ${TETRA_BUILD_DIR:-build}; the corpus (scripts/data.sh); then, in the data directory
# (${TETRA_DATA_DIR:-~/.cache/tetra}/sotu-bpe4096/), a 4096-piece BPE tokenizer trained on the
# corpus (tokenizer.model) and the corpus tokenized with it, its addresses split 98:2 into training
# and validation sets (sotu_train, sotu_valid). Training writes runs/demo/ (metrics, final weights).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh

BUILD_DIR=${TETRA_BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release ${TETRA_CMAKE_ARGS:-} >/dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)" --target tetra

bash scripts/data.sh
DATA_DIR=$(bash scripts/data.sh --print-dir)

# ---- the demo's tokenizer and datasets (configs/demo.json reads them) -------------------------
PREP=$DATA_DIR/sotu-bpe4096
TOKENIZER=$PREP/tokenizer  # .model, .vocab
DATASET=$PREP/sotu         # _train.bin/.idx, _valid.bin/.idx
mkdir -p "$PREP"

if [ ! -f "$TOKENIZER.model" ]; then
  echo "run.sh: training a 4096-piece BPE tokenizer on $DATA_DIR/sotu"
  rm -f "$DATASET"_* "$PREP"/.tokenizer.*  # datasets made with an earlier tokenizer; a partial try
  "$BUILD_DIR/tetra" data train-tokenizer --input "$DATA_DIR/sotu" --vocab-size 4096 \
    --output "$PREP/.tokenizer"
  # SentencePiece writes its files in place: rename them only once both are complete, the model
  # last, so that an interrupted run trains again.
  mv "$PREP/.tokenizer.vocab" "$TOKENIZER.vocab"
  mv "$PREP/.tokenizer.model" "$TOKENIZER.model"
fi

datasets_present() {
  local f
  for f in "$DATASET"_{train,valid}.{bin,idx}; do [ -f "$f" ] || return 1; done
}
if ! datasets_present; then
  echo "run.sh: tokenizing $DATA_DIR/sotu (98% of the addresses to train on, 2% to validate)"
  # `tetra data` writes every part under a temporary name and renames them all at the end.
  "$BUILD_DIR/tetra" data tokenize --tokenizer "sentencepiece:$TOKENIZER.model" \
    --input "$DATA_DIR/sotu" --output "$DATASET" --split 98,2 --force  # an interrupted try may have left parts
fi

# configs/demo.json names the default data directory; point it at another one when
# TETRA_DATA_DIR chooses it.
ARGS=()
if [ "$PREP" != "$HOME/.cache/tetra/sotu-bpe4096" ]; then
  ARGS+=(--set "data.train=[\"${DATASET}_train\"]" --set "data.valid=[\"${DATASET}_valid\"]"
         --set "data.tokenizer=sentencepiece:$TOKENIZER.model")
fi

"$BUILD_DIR/tetra" --config configs/demo.json "${ARGS[@]}" "$@"

# The run's curves (loss, validation loss, learning rate, gradient norm, throughput), drawn from
# configs/demo.json's logging.dir.
if [ -f runs/demo/metrics.jsonl ]; then
  "$BUILD_DIR/tetra" plot runs/demo --out runs/demo/plot.svg --force >/dev/null &&
    echo "run.sh: the run's curves: runs/demo/plot.svg"
fi

# How to write more text with the weights just trained (after a plain run: extra arguments may
# change the model, or train nothing).
if [ $# -eq 0 ]; then
  GENERATE=("$BUILD_DIR/tetra" generate --config configs/demo.json "${ARGS[@]}")
  echo "run.sh: more text from the trained model: $(printf '%q ' "${GENERATE[@]}")--prompt 'Our nation'"
fi
