#pragma once
/// \file eval.hpp
/// \brief The evaluation umbrella (DESIGN.md §5): synthetic workloads, K/V dumps, exact
///        attention, metrics, the needle failure case and run-time policy selection.
/// Not pulled in by kvpack/kvpack.hpp: engines that only store KV need none of it.

#include "kvpack/eval/attention_error.hpp"
#include "kvpack/eval/exact_attention.hpp"
#include "kvpack/eval/kv_dump.hpp"
#include "kvpack/eval/metrics.hpp"
#include "kvpack/eval/needle.hpp"
#include "kvpack/eval/policies.hpp"
#include "kvpack/eval/reconstruction_error.hpp"
#include "kvpack/eval/synthetic.hpp"
