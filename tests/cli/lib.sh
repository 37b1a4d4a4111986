# Shared by the command-line tests: sourced with the test's own arguments
#   <tetra binary> <source dir> <scratch dir>
# it sets $tetra, $src and a fresh $scratch, and fail() counts a failure of the current $case;
# finish prints the verdict and exits.
set -u
tetra="$(realpath "$1")"
src="$(realpath "$2")"
scratch="$(realpath -m "$3")"
rm -rf "$scratch"
mkdir -p "$scratch"
failures=0
case=""
fail() { echo "FAIL [$case]: $*"; failures=$((failures + 1)); }
finish() {  # finish <what passed>
  if [[ $failures -ne 0 ]]; then echo "$failures failure(s)"; exit 1; fi
  echo "all $1 passed"
}
py=/usr/bin/python3  # Debian's, with numpy (whatever python3 comes first on PATH)

# with_mpi: for the tests that launch mpirun: it may run as root (containers, CI), one OpenMP
# thread per rank, and $mpirun is $MPIRUN or else mpirun.
with_mpi() {
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
  mpirun="${MPIRUN:-mpirun}"
}

# write_hf_tokenizer <dir>: a small Hugging Face tokenizer in <dir> (tokenizer.json and
# tokenizer_config.json): byte-level BPE, byte b is id b, one merge ("t" "h" -> 256), <|end|> (257)
# the end of document.
write_hf_tokenizer() {
  $py - "$1" <<'PY'
import json, os, sys
d = sys.argv[1]
os.makedirs(d, exist_ok=True)
printable = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
cp, n = {}, 0
for b in range(256):
    if b in printable:
        cp[b] = b
    else:
        cp[b] = 256 + n
        n += 1
vocab = {chr(cp[b]): b for b in range(256)}
vocab["th"] = 256
byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
tok = {"version": "1.0", "truncation": None, "padding": None,
       "added_tokens": [{"id": 257, "content": "<|end|>", "single_word": False, "lstrip": False,
                         "rstrip": False, "normalized": False, "special": True}],
       "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
       "model": {"type": "BPE", "dropout": None, "unk_token": None, "fuse_unk": False,
                 "byte_fallback": False, "vocab": vocab, "merges": [["t", "h"]]}}
json.dump(tok, open(os.path.join(d, "tokenizer.json"), "w"))
json.dump({"eos_token": "<|end|>"}, open(os.path.join(d, "tokenizer_config.json"), "w"))
PY
}
