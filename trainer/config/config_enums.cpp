// The typed values of the keys that are not a plain enum: data.tokenizer's "<kind>:<path>" and
// checkpoint.resume's "auto" / "none" / path, to and from their JSON spellings; and the dtype of
// each precision.
#include "trainer/config/config.h"

namespace tetra {

std::string to_string(const TokenizerSpec& t) {
  if (t.empty()) return "";
  return std::string(to_string(t.kind)) + ":" + t.path;
}

std::optional<TokenizerSpec> parse_tokenizer_spec(std::string_view spec) {
  if (spec.empty()) return TokenizerSpec{};
  const size_t colon = spec.find(':');
  if (colon == std::string_view::npos) return std::nullopt;
  const std::optional<TokenizerKind> kind = enum_from_string<TokenizerKind>(spec.substr(0, colon));
  if (!kind) return std::nullopt;
  return TokenizerSpec{*kind, std::string(spec.substr(colon + 1))};
}

std::string to_string(const ResumeSpec& r) {
  switch (r.kind) {
    case ResumeKind::AUTO: return "auto";
    case ResumeKind::NONE: return "none";
    case ResumeKind::PATH: break;
  }
  return r.path;
}

ResumeSpec parse_resume_spec(std::string_view spec) {
  if (spec == "auto") return ResumeSpec{ResumeKind::AUTO, ""};
  if (spec == "none") return ResumeSpec{ResumeKind::NONE, ""};
  return ResumeSpec{ResumeKind::PATH, std::string(spec)};
}

DType precision_dtype(Precision p) {
  switch (p) {
    case Precision::BF16: return DType::BF16;
    case Precision::FP16: return DType::F16;
    case Precision::FP32: break;
  }
  return DType::F32;
}

}  // namespace tetra
