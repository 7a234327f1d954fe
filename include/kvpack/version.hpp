#pragma once
/// \file version.hpp
/// \brief kvpack version macros and the ABI namespace.

#define KVPACK_VERSION_MAJOR 0
#define KVPACK_VERSION_MINOR 1
#define KVPACK_VERSION_PATCH 0
/// major * 10000 + minor * 100 + patch, for preprocessor comparisons.
#define KVPACK_VERSION (KVPACK_VERSION_MAJOR * 10000 + KVPACK_VERSION_MINOR * 100 + KVPACK_VERSION_PATCH)

// Everything lives in `kvpack::inline v0`, so translation units built against an incompatible
// future version fail to link instead of silently breaking the one-definition rule.
