/// \file test_tile_layout.cpp
/// \brief tile_layout.hpp: the byte and nibble maps are bijections onto the codes area of a plane,
///        and have the pairing properties the file documents (and the CPU kernels load).

#include <catch2/catch.hpp>
#include <cstddef>
#include <string>
#include <vector>

#include "kvpack/quant/tile_layout.hpp"
#include "quant_test_support.hpp"

namespace {

namespace tile = kvpack::quant::tile;
using namespace kvpack_test::quant;

std::string at(index_t t, index_t c) {
  return "t=" + std::to_string(t) + " c=" + std::to_string(c);
}

/// Geometries for the 8-bit maps: even page sizes and even head dims, including ones that are
/// not multiples of 16 or 32.
std::vector<PageGeometry> byte_geometries() {
  std::vector<PageGeometry> out;
  for (index_t p : {2, 6, 16, 32, 48, 64, 128}) {
    for (index_t d : {2, 10, 32, 64, 96, 128, 256}) out.push_back({p, d});
  }
  return out;
}

/// Geometries for the nibble maps (q4_0: head_dim a multiple of 32, page_size a multiple of 4).
std::vector<PageGeometry> nibble_geometries() {
  std::vector<PageGeometry> out;
  for (index_t p : {4, 16, 32, 48, 64, 128}) {
    for (index_t d : {32, 64, 96, 128, 256}) out.push_back({p, d});
  }
  return out;
}

template <class Map>
void check_byte_bijection(PageGeometry g, Map map) {
  const std::size_t n = static_cast<std::size_t>(g.page_size) * g.head_dim;
  std::vector<int> hits(n, 0);
  Mismatches m;
  for (index_t t = 0; t < g.page_size; ++t) {
    for (index_t c = 0; c < g.head_dim; ++c) {
      const std::size_t b = map(g, t, c);
      if (b >= n) {
        m.add(at(t, c) + " -> byte " + std::to_string(b) + " out of [0, " + std::to_string(n) + ")");
      } else {
        ++hits[b];
      }
    }
  }
  for (std::size_t b = 0; b < n; ++b) {
    if (hits[b] != 1) m.add("byte " + std::to_string(b) + " used " + std::to_string(hits[b]) + " times");
  }
  report(m);
}

template <class Map>
void check_nibble_bijection(PageGeometry g, Map map) {
  const std::size_t bytes = static_cast<std::size_t>(g.page_size) * g.head_dim / 2;
  std::vector<int> hits(2 * bytes, 0);
  Mismatches m;
  for (index_t t = 0; t < g.page_size; ++t) {
    for (index_t c = 0; c < g.head_dim; ++c) {
      const tile::NibbleAddress a = map(g, t, c);
      if (a.byte >= bytes || (a.nibble != 0 && a.nibble != 1)) {
        m.add(at(t, c) + " -> (" + std::to_string(a.byte) + ", " + std::to_string(a.nibble) +
              ") outside [0, " + std::to_string(bytes) + ") x {0, 1}");
      } else {
        ++hits[2 * a.byte + static_cast<std::size_t>(a.nibble)];
      }
    }
  }
  for (std::size_t i = 0; i < hits.size(); ++i) {
    if (hits[i] != 1) {
      m.add("(byte " + std::to_string(i / 2) + ", nibble " + std::to_string(i % 2) + ") used " +
            std::to_string(hits[i]) + " times");
    }
  }
  report(m);
}

}  // namespace

// The maps are usable in constant expressions.
static_assert(tile::key_byte({16, 32}, 0, 0) == 0);
static_assert(tile::value_byte({16, 32}, 0, 0) == 0);
static_assert(tile::key_nibble({16, 32}, 0, 0).byte == 0);
static_assert(tile::value_nibble({16, 32}, 0, 0).nibble == 0);

TEST_CASE("tile key_byte and value_byte are bijections onto the codes bytes", "[quant]") {
  for (PageGeometry g : byte_geometries()) {
    INFO(describe(g));
    check_byte_bijection(g, [](PageGeometry gg, index_t t, index_t c) { return tile::key_byte(gg, t, c); });
    check_byte_bijection(g, [](PageGeometry gg, index_t t, index_t c) { return tile::value_byte(gg, t, c); });
  }
}

TEST_CASE("tile key_nibble and value_nibble use each (byte, nibble) exactly once", "[quant]") {
  for (PageGeometry g : nibble_geometries()) {
    INFO(describe(g));
    check_nibble_bijection(g, [](PageGeometry gg, index_t t, index_t c) { return tile::key_nibble(gg, t, c); });
    check_nibble_bijection(g, [](PageGeometry gg, index_t t, index_t c) { return tile::value_nibble(gg, t, c); });
  }
}

TEST_CASE("tile key plane: channel pairs side by side, 16 tokens in 32 consecutive bytes", "[quant]") {
  for (PageGeometry g : byte_geometries()) {
    if (g.page_size % 16 != 0) continue;
    INFO(describe(g));
    Mismatches m;
    for (index_t j = 0; j < g.head_dim / 2; ++j) {
      for (index_t t0 = 0; t0 < g.page_size; t0 += 16) {
        const std::size_t base = tile::key_byte(g, t0, 2 * j);
        for (index_t k = 0; k < 16; ++k) {
          for (index_t s = 0; s < 2; ++s) {
            // byte (t, 2j+s) at base + 2 (t - t0) + s
            if (tile::key_byte(g, t0 + k, 2 * j + s) != base + 2 * static_cast<std::size_t>(k) + s) {
              m.add("pair " + std::to_string(j) + " " + at(t0 + k, 2 * j + s));
            }
          }
        }
      }
    }
    report(m);
  }
}

TEST_CASE("tile value plane: token pairs side by side, 16 channels in 32 consecutive bytes", "[quant]") {
  for (PageGeometry g : byte_geometries()) {
    if (g.head_dim % 16 != 0) continue;
    INFO(describe(g));
    Mismatches m;
    for (index_t i = 0; i < g.page_size / 2; ++i) {
      for (index_t c0 = 0; c0 < g.head_dim; c0 += 16) {
        const std::size_t base = tile::value_byte(g, 2 * i, c0);
        for (index_t k = 0; k < 16; ++k) {
          for (index_t s = 0; s < 2; ++s) {
            // byte (2i+s, c) at base + 2 (c - c0) + s
            if (tile::value_byte(g, 2 * i + s, c0 + k) != base + 2 * static_cast<std::size_t>(k) + s) {
              m.add("token pair " + std::to_string(i) + " " + at(2 * i + s, c0 + k));
            }
          }
        }
      }
    }
    report(m);
  }
}

TEST_CASE("tile q4_0 key plane: channel quads, low nibble c, high nibble c + 16, 16 tokens in 64 bytes",
          "[quant]") {
  for (PageGeometry g : nibble_geometries()) {
    if (g.page_size % 16 != 0) continue;
    INFO(describe(g));
    Mismatches m;
    for (index_t b = 0; b < g.head_dim / 32; ++b) {
      for (index_t j = 0; j < 4; ++j) {
        for (index_t t0 = 0; t0 < g.page_size; t0 += 16) {
          const std::size_t base = tile::key_nibble(g, t0, 32 * b + 4 * j).byte;
          for (index_t k = 0; k < 16; ++k) {
            for (index_t s = 0; s < 4; ++s) {
              const std::size_t want = base + 4 * static_cast<std::size_t>(k) + s;
              const tile::NibbleAddress lo = tile::key_nibble(g, t0 + k, 32 * b + 4 * j + s);
              const tile::NibbleAddress hi = tile::key_nibble(g, t0 + k, 32 * b + 16 + 4 * j + s);
              if (lo.byte != want || lo.nibble != 0) m.add("low " + at(t0 + k, 32 * b + 4 * j + s));
              if (hi.byte != want || hi.nibble != 1) m.add("high " + at(t0 + k, 32 * b + 16 + 4 * j + s));
            }
          }
        }
      }
    }
    report(m);
  }
}

TEST_CASE("tile q4_0 value plane: a 64-byte row holds channels 32b..32b+15 low, 32b+16..32b+31 high",
          "[quant]") {
  for (PageGeometry g : nibble_geometries()) {
    INFO(describe(g));
    Mismatches m;
    for (index_t i = 0; i < g.page_size / 4; ++i) {
      for (index_t b = 0; b < g.head_dim / 32; ++b) {
        const std::size_t base = tile::value_nibble(g, 4 * i, 32 * b).byte;
        for (index_t k = 0; k < 16; ++k) {
          for (index_t s = 0; s < 4; ++s) {
            const std::size_t want = base + 4 * static_cast<std::size_t>(k) + s;
            const tile::NibbleAddress lo = tile::value_nibble(g, 4 * i + s, 32 * b + k);
            const tile::NibbleAddress hi = tile::value_nibble(g, 4 * i + s, 32 * b + 16 + k);
            if (lo.byte != want || lo.nibble != 0) m.add("low " + at(4 * i + s, 32 * b + k));
            if (hi.byte != want || hi.nibble != 1) m.add("high " + at(4 * i + s, 32 * b + 16 + k));
          }
        }
      }
    }
    report(m);
  }
}

// The CPU kernels (kernels/cpu/integer.hpp) load whole rows: key codes of channel pair j for
// tokens t0.. at byte 2 (j P + t0), q4_0 key nibbles of block b, quad j at 4 ((4b + j) P + t0),
// value codes of token pair i at 2 (i d + c0), q4_0 value nibbles of token quad i, block b at
// 64 (i d/32 + b). These pin the row order the pairing properties above leave open.
TEST_CASE("tile rows are in the order the CPU kernels load them", "[quant]") {
  for (PageGeometry g : nibble_geometries()) {
    INFO(describe(g));
    const auto P = static_cast<std::size_t>(g.page_size);
    const auto d = static_cast<std::size_t>(g.head_dim);
    Mismatches m;
    for (index_t t = 0; t < g.page_size; ++t) {
      for (index_t c = 0; c < g.head_dim; ++c) {
        const auto tu = static_cast<std::size_t>(t);
        const auto cu = static_cast<std::size_t>(c);
        if (tile::key_byte(g, t, c) != 2 * ((cu / 2) * P + tu) + cu % 2) m.add("key_byte " + at(t, c));
        if (tile::value_byte(g, t, c) != 2 * ((tu / 2) * d + cu) + tu % 2) m.add("value_byte " + at(t, c));
        const std::size_t b = cu / 32;
        const std::size_t j = (cu % 16) / 4;
        if (tile::key_nibble(g, t, c).byte != 4 * ((4 * b + j) * P + tu) + cu % 4) {
          m.add("key_nibble " + at(t, c));
        }
        if (tile::value_nibble(g, t, c).byte != 64 * ((tu / 4) * (d / 32) + b) + 4 * (cu % 16) + tu % 4) {
          m.add("value_nibble " + at(t, c));
        }
      }
    }
    report(m);
  }
}
