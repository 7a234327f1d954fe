#pragma once
/// \file model_files.hpp
/// \brief Where the stories260K checkpoint and tokenizer are looked for, and what to tell the
///        user when they are not there. The files are never part of the repository.

#include <fmt/core.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>

#include "../common/cli.hpp"

#ifndef LLAMA2C_DEFAULT_MODEL_DIR
#error "define LLAMA2C_DEFAULT_MODEL_DIR, the directory searched when KVPACK_MODEL_DIR is unset (CMake does)"
#endif

namespace llama2c {

/// Environment variable naming the model directory; it overrides LLAMA2C_DEFAULT_MODEL_DIR.
inline constexpr const char* kModelDirVariable = "KVPACK_MODEL_DIR";
/// Exit status for "model missing": CTest counts it as skipped (SKIP_RETURN_CODE 77).
inline constexpr int kExitModelMissing = 77;

struct ModelFiles {
  std::filesystem::path checkpoint;  ///< stories260K.bin
  std::filesystem::path tokenizer;   ///< tok512.bin

  [[nodiscard]] bool present() const {
    return std::filesystem::is_regular_file(checkpoint) && std::filesystem::is_regular_file(tokenizer);
  }
};

/// $KVPACK_MODEL_DIR when set, else the directory compiled in.
inline std::filesystem::path default_model_dir() {
  const char* from_environment = std::getenv(kModelDirVariable);
  if (from_environment != nullptr && *from_environment != '\0') return from_environment;
  return LLAMA2C_DEFAULT_MODEL_DIR;
}

inline ModelFiles model_files(const std::filesystem::path& dir) {
  return {dir / "stories260K.bin", dir / "tok512.bin"};
}

/// What is missing and how to get it.
inline std::string missing_model_message(const ModelFiles& files) {
  return fmt::format(
      "stories260K model not found: need {} and {}.\n"
      "Download stories260K/stories260K.bin (1,056,540 bytes, sha256 "
      "b0a507e7ad0f626624f17112325e66691f9076d622e1d3274d103d00299f2696)\n"
      "and stories260K/tok512.bin (6,227 bytes, sha256 "
      "037cb335abb25d1fa9e8ecae30ed2a3a8ace9302862ebcdc05d51a6bbb10c312)\n"
      "from https://huggingface.co/karpathy/tinyllamas into one directory, and point {} (or --model-dir) at it.",
      files.checkpoint.string(), files.tokenizer.string(), kModelDirVariable);
}

/// The directory a --model-dir option names: it must hold the model, since a directory named on
/// purpose that lacks it is a mistake, not a reason to run without the model (as the default
/// directory's absence is). \throws kvpack::examples::UsageError otherwise.
inline std::string given_model_dir(std::string_view dir) {
  const ModelFiles files = model_files(dir);
  if (!files.present()) throw kvpack::examples::UsageError{"--model-dir: " + missing_model_message(files)};
  return std::string(dir);
}

}  // namespace llama2c
