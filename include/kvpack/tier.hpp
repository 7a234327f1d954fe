#pragma once
/// \file tier.hpp
/// \brief Storage tiers for K/V beyond the page pool (issue 9, part 2): the Tier interface, host
///        memory and disk tiers, the fetch-or-recompute planner, and sequences stored in and
///        restored from a tier. The Redis tier needs hiredis: include kvpack/tier/redis_tier.hpp
///        and link kvpack::redis.

#include "kvpack/tier/disk_tier.hpp"
#include "kvpack/tier/fetch_planner.hpp"
#include "kvpack/tier/host_tier.hpp"
#include "kvpack/tier/prefix_chunks.hpp"
#include "kvpack/tier/recall.hpp"
#include "kvpack/tier/sealed_entry.hpp"
#include "kvpack/tier/sequence_store.hpp"
#include "kvpack/tier/tier.hpp"
