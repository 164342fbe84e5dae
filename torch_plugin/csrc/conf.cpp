// PyTorch's allocator settings (PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF) as slotpool
// configuration, sp_init with them, and configuration values read back from slotpool.
#include "slotpool_allocator.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <initializer_list>
#include <iterator>

namespace slotpool_torch {

std::string torch_conf_from_env() {
  for (const char* name : {"PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"}) {
    const char* v = std::getenv(name);
    if (v != nullptr && *v != '\0') {
      return v;
    }
  }
  return "";
}

namespace {
// Configuration strings after one another, comma-separated, empty ones left out.
std::string join_conf(std::initializer_list<std::string> parts) {
  std::string out;
  for (const std::string& p : parts) {
    if (!p.empty()) {
      out += (out.empty() ? "" : ",") + p;
    }
  }
  return out;
}
}  // namespace

std::string torch_conf_for_slotpool(const std::string& torch_conf,
                                    std::vector<std::string>* skipped) {
  static const char* const kSame[] = {"max_split_size_mb",        "max_non_split_rounding_mb",
                                      "roundup_power2_divisions", "garbage_collection_threshold",
                                      "expandable_segments",      "per_process_memory_fraction"};
  std::string out;
  std::string part;
  int depth = 0;
  auto flush = [&]() {
    size_t b = part.find_first_not_of(" \t");
    size_t e = part.find_last_not_of(" \t");
    std::string item = b == std::string::npos ? "" : part.substr(b, e - b + 1);
    part.clear();
    if (item.empty()) {
      return;
    }
    size_t colon = item.find(':');
    std::string key = item.substr(0, colon);
    key.erase(key.find_last_not_of(" \t") + 1);
    if (std::find(std::begin(kSame), std::end(kSame), key) != std::end(kSame) &&
        colon != std::string::npos) {
      out = join_conf({out, item});
    } else if (skipped != nullptr) {
      skipped->push_back(key);
    }
  };
  for (char c : torch_conf) {
    depth += c == '[' ? 1 : c == ']' ? -1 : 0;
    if (c == ',' && depth <= 0) {
      flush();
    } else {
      part += c;
    }
  }
  flush();
  return out;
}

void SlotpoolAllocator::ensure_initialized() {
  if (sp_ready_.load(std::memory_order_acquire)) {
    return;
  }
  std::lock_guard<std::mutex> lk(init_mu_);
  if (sp_ready_.load(std::memory_order_relaxed)) {
    return;
  }
  int is_init = 0;
  check(sp_is_initialized(&is_init), "sp_is_initialized");
  if (is_init == 0) {
    // PyTorch's own settings first, then $SLOTPOOL_CONF, then install(conf=): the library applies
    // its `conf` over $SLOTPOOL_CONF, so the variable is repeated after PyTorch's keys.
    std::vector<std::string> skipped;
    std::string from_torch = torch_conf_for_slotpool(torch_conf_from_env(), &skipped);
    const char* env = std::getenv("SLOTPOOL_CONF");
    std::string env_conf = env != nullptr ? env : "";
    std::string full = join_conf({from_torch, env_conf, conf_.value_or("")});
    const char* backend = backend_ ? backend_->c_str() : nullptr;
    sp_status st = sp_init(backend, full.c_str());
    if (st == SP_ERR_CONFIG && !from_torch.empty()) {
      // A value PyTorch accepts that slotpool refuses: run without PyTorch's keys, and say so.
      std::string why = describe(st);
      st = sp_init(backend, conf_ ? conf_->c_str() : nullptr);
      if (st == SP_OK) {
        TORCH_WARN("slotpool: PyTorch's allocator settings (", from_torch,
                   ") were not applied: ", why);
      }
    }
    if (st != SP_OK && st != SP_ERR_INVALID_STATE) {  // INVALID_STATE: initialised meanwhile
      std::string msg = describe(st);
      TORCH_CHECK(false, "slotpool: sp_init(backend=", backend_.value_or("<env>"),
                  ", conf=", full, ") failed: ", msg);
    }
    if (!skipped.empty()) {
      std::string names;
      for (const auto& k : skipped) {
        names += (names.empty() ? "" : ", ") + k;
      }
      // pinned_* keys still reach PyTorch's pinned host allocator, which slotpool leaves alone.
      TORCH_WARN_ONCE("slotpool: PyTorch allocator settings with no slotpool meaning left to "
                      "PyTorch: ", names);
    }
  }
  const char* bname = nullptr;
  if (sp_backend_name(&bname) == SP_OK && bname != nullptr && std::string(bname) != "cuda") {
    TORCH_WARN("slotpool: backend is '", bname,
               "', not 'cuda': PyTorch kernels cannot use its memory. Set SLOTPOOL_BACKEND=cuda "
               "or install(backend='cuda').");
  }
  sp_ready_.store(true, std::memory_order_release);
}

// ------------------------------------------------------------------------------------------------
// Configuration values in effect, as slotpool reads them

double config_number(const char* key) {
  double v = 0.0;
  sp_status st = sp_config_get_f64(key, &v);
  if (st != SP_OK) {
    std::string msg = describe(st);
    TORCH_CHECK(false, "slotpool: sp_config_get_f64(\"", key, "\") failed: ", msg);
  }
  return v;
}

std::string config_string(const char* key) {
  // One call with room for a typical value, a second with the length the first reported.
  std::string out(256, '\0');
  for (int attempt = 0; attempt < 2; ++attempt) {
    size_t len = 0;
    sp_status st = sp_config_get_str(key, out.data(), out.size(), &len);
    if (st != SP_OK) {
      std::string msg = describe(st);
      TORCH_CHECK(false, "slotpool: sp_config_get_str(\"", key, "\") failed: ", msg);
    }
    if (len < out.size()) {
      out.resize(len);
      return out;
    }
    out.assign(len + 1, '\0');
  }
  TORCH_CHECK(false, "slotpool: sp_config_get_str(\"", key, "\"): the value kept growing");
}

}  // namespace slotpool_torch
