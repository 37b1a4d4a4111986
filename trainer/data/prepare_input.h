// The raw side of dataset preparation (`tetra data`, trainer/cli/data_command.cpp): which files
// the inputs name, reading them as documents, and checking that what is read is UTF-8 text or JSON
// lines.
//
// Two document formats:
//   TEXT   one document per file: the whole file is the document's text.
//   JSONL  one document per line: each line is a JSON object whose string field KEY (default
//          "text") is the document's text. Blank lines are skipped (a trailing "\n\n" is common
//          and harmless); "\r\n" line ends are accepted.
//
// Reading is split in two so the expensive half runs in parallel: DocumentReader (one thread)
// cuts the input into RawDocuments that remember where they came from; document_text() (any
// thread) validates one and returns its text. Every problem is an InputError that names the file
// and the line, plus the byte offset for bad UTF-8.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

namespace tetra {

enum class DocumentFormat { TEXT, JSONL };

struct InputFile {
  std::string path;
  int64_t size = 0;  // bytes
};

// The regular files the inputs name, in order: a file stands for itself; a directory for every
// regular file beneath it (recursively, sorted by path, names starting with '.' skipped, and only
// names ending in `dir_extension` when that is not empty). InputError for a path that does not
// exist, is neither file nor directory, or is a directory without such files.
std::vector<InputFile> list_input_files(const std::vector<std::string>& inputs,
                                        std::string_view dir_extension = "");

// The files' paths.
std::vector<std::string> input_paths(const std::vector<InputFile>& files);

// InputError unless every file has at least one byte ("<path>: the file is empty").
void check_files_not_empty(const std::vector<InputFile>& files);

// InputError unless `prefix` can be the prefix of a dataset written here: no ".bin"/".idx"
// extension (a prefix names two files), its directory exists and is writable. `what` names the
// option in messages ("--output").
void check_output_prefix(const std::string& prefix, std::string_view what);

// Offset of the first byte of the first ill-formed sequence in `s` (Unicode's table 3-7: no
// overlong forms, no surrogates, nothing above U+10FFFF, no truncated sequence), or -1 when all of
// `s` is well-formed UTF-8.
int64_t find_invalid_utf8(std::string_view s);

// InputError if `text` is not UTF-8: "<file>:<line>: invalid UTF-8 at byte <offset> ...", where
// `text` starts at line `first_line` and byte `file_offset` of `file`.
void check_utf8(std::string_view text, std::string_view file, int64_t first_line,
                int64_t file_offset);

// Every file is non-empty, UTF-8 text: what a tokenizer trainer needs of its inputs.
void check_text_files(const std::vector<InputFile>& files);

// One document as read, before validation: TEXT, a whole file; JSONL, one line (no line end).
struct RawDocument {
  std::string data;
  std::string_view file;  // points into the reader's file list
  int64_t line = 1;       // 1-based line of the document's first byte
  int64_t offset = 0;     // byte offset of the document in the file
};

// Cuts the files into documents, in order. Not thread-safe: one reader, one thread.
class DocumentReader {
 public:
  DocumentReader(std::vector<InputFile> files, DocumentFormat format);
  ~DocumentReader();
  DocumentReader(const DocumentReader&) = delete;
  DocumentReader& operator=(const DocumentReader&) = delete;

  // Replaces `out` with the next documents: at least one, then more while fewer than `max_docs`
  // and fewer than `max_bytes` bytes were taken. Returns false (and leaves `out` empty) at the end.
  bool next_batch(std::vector<RawDocument>& out, size_t max_docs, int64_t max_bytes);

  int64_t bytes_read() const { return bytes_read_; }
  int64_t bytes_total() const { return bytes_total_; }

 private:
  bool next_document(RawDocument& doc);
  bool next_line(RawDocument& doc);

  std::vector<InputFile> files_;
  DocumentFormat format_;
  size_t next_file_ = 0;
  // JSONL: the file being read, its position, and how many documents it gave so far.
  std::FILE* current_ = nullptr;
  size_t current_index_ = 0;
  int64_t line_ = 0;
  int64_t offset_ = 0;
  int64_t documents_in_file_ = 0;
  char* line_buf_ = nullptr;
  size_t line_cap_ = 0;
  int64_t bytes_read_ = 0;
  int64_t bytes_total_ = 0;
};

// The text of `doc`, validated: UTF-8 always; for JSONL also a JSON object with a string field
// `json_key`. The result views `doc.data` (TEXT) or `storage` (JSONL). Thread-safe.
std::string_view document_text(const RawDocument& doc, DocumentFormat format,
                               const std::string& json_key, std::string& storage);

}  // namespace tetra
