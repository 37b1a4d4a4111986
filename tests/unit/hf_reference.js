// The reference of the hf: tokenizer tests (tests/unit/test_tokenizer_hf.cpp): @lenml/tokenizers,
// a JavaScript port of the Hugging Face tokenizers (transformers.js), on the tokenizer.json files
// scripts/data.sh fetches into DATA_DIR/hf/<name>/. It shares no code with Tetra's.
//
//   node hf_reference.js DATA_DIR IN.json OUT.json
//       IN.json  {"tokenizers": ["llama3", ...], "texts": ["...", ...]}
//       OUT.json {"llama3": {"ids": [[...], ...], "decoded": ["...", ...]}, ...}
//     ids: encode(text) with the special tokens the tokenizer adds (add_special_tokens, the
//     default); decoded: decode(ids) keeping special tokens, without transformers' clean-up of
//     spaces (clean_up_tokenization_spaces false).
//
//   node hf_reference.js DATA_DIR --corpus [NAME...]
//     Encodes DATA_DIR/sotu/*.txt file by file, in name order, with each tokenizer and prints
//     the number of tokens and the FNV-1a hash of the 32-bit ids: the figures the corpus tests
//     pin. (Llama-2 takes some minutes: the port's BPE is slow on words as long as a paragraph.)
"use strict";
const fs = require("fs");
const path = require("path");

const dataDir = process.argv[2];
if (!dataDir) {
  console.error("usage: node hf_reference.js DATA_DIR (IN.json OUT.json | --corpus [NAME...])");
  process.exit(2);
}
console.warn = () => {};  // the port warns about tokenizer classes it does not know
const { TokenizerLoader } = require(path.join(dataDir, "hf", "tokenizers-js", "main.js"));

function load(name) {
  const dir = path.join(dataDir, "hf", name);
  const read = (f) => JSON.parse(fs.readFileSync(path.join(dir, f), "utf8"));
  return TokenizerLoader.fromPreTrained({
    tokenizerJSON: read("tokenizer.json"),
    tokenizerConfig: read("tokenizer_config.json"),
  });
}

function fnv1a(ids, h) {
  for (const id of ids) {
    h ^= id;
    h = Math.imul(h, 16777619) >>> 0;
  }
  return h >>> 0;
}

if (process.argv[3] === "--corpus") {
  const names = process.argv.length > 4 ? process.argv.slice(4) : ["llama3", "qwen3", "llama2", "gpt2"];
  const sotu = path.join(dataDir, "sotu");
  const files = fs.readdirSync(sotu).filter((f) => f.endsWith(".txt")).sort();
  for (const name of names) {
    const tok = load(name);
    let tokens = 0, h = 2166136261;
    for (const f of files) {
      const ids = tok.encode(fs.readFileSync(path.join(sotu, f), "utf8"));
      tokens += ids.length;
      h = fnv1a(ids, h);
    }
    console.log(`${name}: ${files.length} files, ${tokens} tokens, FNV-1a ${h}`);
  }
} else {
  const input = JSON.parse(fs.readFileSync(process.argv[3], "utf8"));
  const out = {};
  for (const name of input.tokenizers) {
    const tok = load(name);
    const ids = input.texts.map((t) => tok.encode(t));
    const decoded = ids.map((x) =>
      x.length === 0 ? "" : tok.decode(x, { skip_special_tokens: false, clean_up_tokenization_spaces: false }));
    out[name] = { ids, decoded };
  }
  fs.writeFileSync(process.argv[4], JSON.stringify(out));
}
