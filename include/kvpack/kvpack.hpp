#pragma once
/// \file kvpack.hpp
/// \brief The kvpack umbrella header: the cache, its shipped policies, and the executor.
/// Evaluation tools have their own umbrella (kvpack/eval.hpp) and are not pulled in here.

#include "kvpack/cache.hpp"
#include "kvpack/cache_config.hpp"
#include "kvpack/core/fp8.hpp"
#include "kvpack/core/rope.hpp"
#include "kvpack/core/half.hpp"
#include "kvpack/core/types.hpp"
#include "kvpack/dispatch.hpp"
#include "kvpack/error.hpp"
#include "kvpack/evict/keep_all.hpp"
#include "kvpack/executor.hpp"
#include "kvpack/layout/cross_layer.hpp"
#include "kvpack/layout/gqa.hpp"
#include "kvpack/quant/float.hpp"
#include "kvpack/quant/fp8.hpp"
#include "kvpack/quant/int8.hpp"
#include "kvpack/quant/kivi.hpp"
#include "kvpack/quant/kvquant.hpp"
#include "kvpack/quant/kvquant_calibration.hpp"
#include "kvpack/quant/mixed.hpp"
#include "kvpack/quant/q4_0.hpp"
#include "kvpack/quant/q8_0.hpp"
#include "kvpack/quant/turboquant.hpp"
#include "kvpack/select/dense.hpp"
#include "kvpack/version.hpp"
