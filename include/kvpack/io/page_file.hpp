#pragma once
/// \file page_file.hpp
/// \brief KV page files (issue 9): a versioned, self-describing, little-endian file of one
///        sequence's pages. write_page_file writes one; PageFile maps one read-only and
///        verifies it; PageFileView reads one from any buffer; load_page_file puts one back
///        into a cache; quantizer_from_file rebuilds the quantizer a file was written with. The format: page_file_format.hpp
///        and the README's "KV page files" section.

#include <string>
#include <utility>

#include "kvpack/io/mapped_file.hpp"
#include "kvpack/io/page_file_decode.hpp"
#include "kvpack/io/page_file_loader.hpp"
#include "kvpack/io/page_file_quantizer.hpp"
#include "kvpack/io/page_file_reader.hpp"
#include "kvpack/io/page_file_writer.hpp"

namespace kvpack::inline v0::io {

/// A page file mapped read-only and verified: its views point into the mapping, which lives
/// as long as this object (moving it keeps them valid; the mapping does not move).
class PageFile {
 public:
  /// \throws kvpack::Error as PageFileView::parse, naming the path.
  explicit PageFile(const std::string& path)
      : mapping_(path), view_(PageFileView::parse(mapping_.bytes(), "page file '" + path + "'")) {}

  [[nodiscard]] const PageFileView& view() const noexcept { return view_; }
  [[nodiscard]] const PageFileHeader& header() const noexcept { return view_.header(); }

 private:
  MappedFile mapping_;
  PageFileView view_;
};

}  // namespace kvpack::inline v0::io
