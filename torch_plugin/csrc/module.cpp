// Python bindings of the slotpool_torch extension (the `_C` of the Python package).
#include <torch/extension.h>

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include "phases.h"
#include "pyint.h"
#include "slotpool_allocator.h"

namespace py = pybind11;
namespace sp = slotpool_torch;

namespace {

using Pool = std::pair<uint64_t, uint64_t>;

sp_pool_id pool_of(const Pool& p) {
  return sp_pool_id{p.first, p.second};
}

sp::SlotpoolAllocator& alloc() {
  sp::SlotpoolAllocator* a = sp::instance();
  TORCH_CHECK(a != nullptr,
              "slotpool_torch: the allocator is not installed; call slotpool_torch.install() "
              "before CUDA is initialised");
  a->ensure_initialized();
  return *a;
}

py::list ptr_sizes(const std::vector<sp::PtrSize>& v) {
  py::list out;
  for (const auto& [p, s] : v) {
    out.append(py::make_tuple(reinterpret_cast<uintptr_t>(p), s));
  }
  return out;
}

// A list (or any sequence) of StorageImpl addresses, as Python holds them (`storage._cdata`),
// into `out` (cleared; its capacity is kept, so a caller that keeps it allocates nothing).
void storage_ptrs(const py::handle& seq, const char* what, std::vector<c10::StorageImpl*>& out) {
  py::object fast = py::reinterpret_steal<py::object>(PySequence_Fast(seq.ptr(), what));
  if (!fast) {
    throw py::error_already_set();
  }
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast.ptr());
  PyObject** items = PySequence_Fast_ITEMS(fast.ptr());
  out.clear();
  out.reserve(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; i++) {
    uintptr_t v = 0;
    void* p = sp::int_as_address(items[i], &v) ? reinterpret_cast<void*>(v)
                                                : PyLong_AsVoidPtr(items[i]);
    if (p == nullptr && PyErr_Occurred()) {
      throw py::error_already_set();
    }
    out.push_back(static_cast<c10::StorageImpl*>(p));
  }
}

py::dict restore_dict(const sp::RestoreResult& r) {
  py::dict d;
  d["freed"] = ptr_sizes(r.freed);
  d["created"] = ptr_sizes(r.created);
  return d;
}

// torch.cuda.memory_stats()'s flat keys ("allocated_bytes.all.current", ...) for an sp_memory_stats.
py::dict flat_stats(const sp_memory_stats& s) {
  py::dict d;
  auto stat = [&](const std::string& name, const sp_stat& st) {
    d[py::str(name + ".current")] = st.current;
    d[py::str(name + ".peak")] = st.peak;
    d[py::str(name + ".allocated")] = st.allocated;
    d[py::str(name + ".freed")] = st.freed;
  };
  auto arr = [&](const std::string& name, const sp_stat_array& a) {
    stat(name + ".all", a.all);
    stat(name + ".small_pool", a.small_pool);
    stat(name + ".large_pool", a.large_pool);
  };
  arr("allocation", s.allocation);
  arr("segment", s.segment);
  arr("active", s.active);
  arr("inactive_split", s.inactive_split);
  arr("allocated_bytes", s.allocated_bytes);
  arr("reserved_bytes", s.reserved_bytes);
  arr("active_bytes", s.active_bytes);
  arr("inactive_split_bytes", s.inactive_split_bytes);
  arr("requested_bytes", s.requested_bytes);
  arr("reserved_paused_bytes", s.reserved_paused_bytes);
  stat("oversize_allocations", s.oversize_allocations);
  stat("oversize_segments", s.oversize_segments);
  d["num_alloc_retries"] = s.num_alloc_retries;
  d["num_ooms"] = s.num_ooms;
  d["num_sync_all_streams"] = s.num_sync_all_streams;
  d["num_device_alloc"] = s.num_device_alloc;
  d["num_device_free"] = s.num_device_free;
  d["max_split_size"] = s.max_split_size;
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "slotpool beneath PyTorch: the C++ allocator and slotpool's own API";

  // ---- build and library facts ----
  m.def("built_for_torch", []() { return std::string(sp::built_for_torch()); },
        "torch.__version__ this extension was compiled against");
  m.def("headers_version", []() {
    return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
           std::to_string(TORCH_VERSION_PATCH);
  });
  m.def("slotpool_version", []() {
    int a = 0, b = 0, c = 0;
    sp::check(sp_version(&a, &b, &c), "sp_version");
    return py::make_tuple(a, b, c);
  });
  m.def("header_version", []() {
    return py::make_tuple(SP_VERSION_MAJOR, SP_VERSION_MINOR, SP_VERSION_PATCH);
  });
  m.def("has_feature", [](const std::string& name) { return sp_has_feature(name.c_str()) != 0; });
  m.def("backend_name", []() {
    alloc();
    const char* name = nullptr;
    sp::check(sp_backend_name(&name), "sp_backend_name");
    return std::string(name != nullptr ? name : "");
  });
  m.def("last_error", &sp::last_error);

  // ---- installation ----
  m.def(
      "install",
      [](std::optional<std::string> backend, std::optional<std::string> conf) {
        sp::install(std::move(backend), std::move(conf));
      },
      py::arg("backend") = py::none(), py::arg("conf") = py::none(),
      "Install slotpool as PyTorch's CUDA allocator (before CUDA is initialised).");
  m.def("is_installed", []() { return sp::instance() != nullptr; });
  m.def("registry_is_ours", &sp::registry_is_ours);
  m.def("routes", [](int device) {
    py::list out;
    for (const auto& [id, kind] : alloc().routes(device)) {
      out.append(py::make_tuple(py::make_tuple(id.first, id.second), kind));
    }
    return out;
  });
  m.def("orphan_count", []() { return alloc().orphan_count(); });
  m.def("mark_reusable", [](uintptr_t ptr) {
    return alloc().mark_reusable(reinterpret_cast<void*>(ptr));
  });
  m.def("process_events", [](int device) {
    alloc();
    sp::check(sp_process_events(device), "sp_process_events");
  });

  // ---- pools ----
  m.def(
      "pool_named",
      [](int device, const std::string& name, bool no_split, bool use_on_oom,
         uint64_t limit_bytes, bool pausable) {
        alloc();
        sp_pool_options o{};
        o.no_split = no_split ? 1 : 0;
        o.use_on_oom = use_on_oom ? 1 : 0;
        o.limit_bytes = limit_bytes;
        o.pausable = pausable ? 1 : 0;
        sp_pool_id id{};
        sp::check(sp_pool_named(device, name.c_str(), &o, &id), "sp_pool_named");
        return Pool{id.a, id.b};
      },
      py::arg("device"), py::arg("name"), py::arg("no_split") = false,
      py::arg("use_on_oom") = false, py::arg("limit_bytes") = 0, py::arg("pausable") = false);
  m.def("pool_create_or_incref", [](int device, const Pool& pool) {
    alloc();
    uint64_t n = 0;
    sp::check(sp_pool_create_or_incref(device, pool_of(pool), nullptr, &n),
              "sp_pool_create_or_incref");
    return n;
  });
  m.def("pool_release", [](int device, const Pool& pool) {
    alloc();
    uint64_t left = 0;
    sp::check(sp_pool_release(device, pool_of(pool), &left), "sp_pool_release");
    return left;
  });
  m.def("pool_use_count", [](int device, const Pool& pool) {
    alloc();
    uint64_t n = 0;
    sp_status st = sp_pool_use_count(device, pool_of(pool), &n);
    if (st == SP_ERR_UNKNOWN_POOL) {
      return uint64_t{0};
    }
    sp::check(st, "sp_pool_use_count");
    return n;
  });
  m.def(
      "pool_set_options",
      [](int device, const Pool& pool, bool no_split, bool use_on_oom, uint64_t limit_bytes) {
        // pausable stays as the pool has it (fixed when the pool is created).
        sp::check(alloc().update_pool_options(device, pool_of(pool),
                                              [&](sp_pool_options& o) {
                                                o.no_split = no_split ? 1 : 0;
                                                o.use_on_oom = use_on_oom ? 1 : 0;
                                                o.limit_bytes = limit_bytes;
                                              }),
                  "sp_pool_set_options");
      },
      py::arg("device"), py::arg("pool"), py::arg("no_split") = false,
      py::arg("use_on_oom") = false, py::arg("limit_bytes") = 0);
  m.def("pool_empty_cache", [](int device, const Pool& pool) {
    alloc();
    sp::check(sp_pool_empty_cache(device, pool_of(pool)), "sp_pool_empty_cache");
  });
  m.def("backend_calls", [](int device) {
    sp_backend_calls c{};
    sp::check(sp_backend_calls_get(device, &c), "sp_backend_calls_get");
    py::dict d;
    d["alloc_segment"] = c.alloc_segment;
    d["free_segment"] = c.free_segment;
    d["reserve"] = c.reserve;
    d["release_reservation"] = c.release_reservation;
    d["create_page"] = c.create_page;
    d["release_page"] = c.release_page;
    d["map"] = c.map;
    d["unmap"] = c.unmap;
    d["create_event"] = c.create_event;
    d["record_event"] = c.record_event;
    d["query_event"] = c.query_event;
    d["synchronize"] = c.synchronize;
    return d;
  }, "the driver calls slotpool made on device, by kind (sp_backend_calls_get)");
  // ---- pausing pools ----
  m.def(
      "pool_pause",
      [](int device, const Pool& pool, bool backup) {
        alloc();
        py::gil_scoped_release nogil;  // synchronises the device and may copy gigabytes
        sp::check(sp_pool_pause(device, pool_of(pool), backup ? SP_PAUSE_BACKUP : 0u),
                  "sp_pool_pause");
      },
      py::arg("device"), py::arg("pool"), py::arg("backup") = false);
  m.def("pool_resume", [](int device, const Pool& pool) {
    alloc();
    py::gil_scoped_release nogil;
    sp::check(sp_pool_resume(device, pool_of(pool)), "sp_pool_resume");
  });
  m.def("pool_pause_info", [](int device, const Pool& pool) {
    alloc();
    int paused = 0;
    uint64_t bytes = 0;
    uint64_t host = 0;
    sp::check(sp_pool_pause_info(device, pool_of(pool), &paused, &bytes, &host),
              "sp_pool_pause_info");
    return py::make_tuple(paused != 0, bytes, host);
  });
  m.def("pool_stats", [](int device, const Pool& pool) {
    alloc();
    sp_memory_stats s{};
    sp::check(sp_pool_stats_get(device, pool_of(pool), &s), "sp_pool_stats_get");
    return flat_stats(s);
  });
  m.def("device_stats", [](int device) {
    alloc();
    sp_memory_stats s{};
    sp::check(sp_memory_stats_get(device, &s), "sp_memory_stats_get");
    return flat_stats(s);
  });
  m.def("pool_live", [](int device, const Pool& pool) {
    py::list out;
    for (const sp_allocation& a : alloc().pool_live_allocations(device, pool_of(pool))) {
      out.append(reinterpret_cast<uintptr_t>(a.ptr));
    }
    return out;
  });
  m.def("verify_live", [](int device, const Pool& pool, const std::vector<uintptr_t>& ptrs) {
    alloc();
    std::vector<void*> v;
    v.reserve(ptrs.size());
    for (uintptr_t p : ptrs) {
      v.push_back(reinterpret_cast<void*>(p));
    }
    void* none[1] = {nullptr};
    sp_status st = sp_pool_verify_live(device, pool_of(pool), v.empty() ? none : v.data(), v.size());
    if (st == SP_OK) {
      return py::make_tuple(true, std::string());
    }
    std::string why = sp::describe(st);
    if (st == SP_ERR_INVALID_STATE || st == SP_ERR_UNKNOWN_POOL) {
      return py::make_tuple(false, why);
    }
    TORCH_CHECK(false, "slotpool: sp_pool_verify_live failed: ", why);
  });

  // ---- checkpoints ----
  // Declared as a subclass of torch's AllocatorState binding: torch._C._cuda_getCheckpointState
  // returns our state, pybind11 finds this (most derived) registration, and the object must still
  // be accepted by torch._C._cuda_setCheckpointPoolState (graph trees, reduce-overhead).
  py::class_<sp::CheckpointState, c10::cuda::CUDACachingAllocator::AllocatorState,
             std::shared_ptr<sp::CheckpointState>>(m, "Checkpoint")
      .def_property_readonly("device", [](const sp::CheckpointState& c) { return c.device; })
      .def_property_readonly("pool",
                             [](const sp::CheckpointState& c) { return Pool{c.pool.a, c.pool.b}; })
      .def("free", [](sp::CheckpointState& c) {
        if (c.cp != nullptr) {
          sp_checkpoint_free(c.cp);
          c.cp = nullptr;
        }
      });
  // torch._C._cuda_setCheckpointPoolState's replacement (graph_state.cpp), same arguments.
  m.def(
      "set_checkpoint_pool_state",
      [](c10::DeviceIndex device, const std::shared_ptr<sp::CCA::AllocatorState>& state,
         const py::handle& stale, const py::handle& add) {
        sp::phase("start", true);
        // Kept from call to call, as the binding's own buffers (graph trees call this at every
        // branch switch).
        thread_local std::vector<c10::StorageImpl*> stale_v, add_v;
        storage_ptrs(stale, "stale_storages_ptr: a sequence of ints", stale_v);
        storage_ptrs(add, "storages_to_add_deleters_to: a sequence of ints", add_v);
        sp::phase("ints");
        sp::set_checkpoint_pool_state(alloc(), device, state, stale_v, add_v);
      },
      py::arg("device"), py::arg("state"), py::arg("stale_storages_ptr"),
      py::arg("storages_to_add_deleters_to") = py::list());
  // The last set_checkpoint_pool_state's steps on this thread, (step, microseconds), when built
  // with SLOTPOOL_TORCH_PHASES=1 (phases.h); else empty.
  m.def("graph_state_phases", []() {
    std::vector<std::pair<std::string, double>> out;
#ifdef SLOTPOOL_TORCH_PHASES
    const auto& v = sp::phase_stamps();
    for (size_t i = 1; i < v.size(); ++i) {
      out.emplace_back(v[i].first, v[i].second - v[i - 1].second);
    }
#endif
    return out;
  });
  m.def("checkpoint", [](int device, const Pool& pool) {
    return alloc().take_checkpoint(device, pool_of(pool));
  });
  m.def(
      "restore",
      [](int device, const Pool& pool, const sp::CheckpointState& cp,
         const std::vector<uintptr_t>& keep, bool free_created) {
        std::vector<void*> v;
        v.reserve(keep.size());
        for (uintptr_t p : keep) {
          v.push_back(reinterpret_cast<void*>(p));
        }
        return restore_dict(alloc().restore(device, pool_of(pool), cp, v, free_created));
      },
      py::arg("device"), py::arg("pool"), py::arg("checkpoint"), py::arg("keep_live"),
      py::arg("free_created") = true);

  // ---- variant groups ----
  py::class_<sp::VariantGroup, std::shared_ptr<sp::VariantGroup>>(m, "VariantGroup")
      .def_property_readonly("device", [](const sp::VariantGroup& g) { return g.device; })
      .def_property_readonly("pool",
                             [](const sp::VariantGroup& g) { return Pool{g.pool.a, g.pool.b}; })
      .def_property_readonly("count", [](const sp::VariantGroup& g) { return g.count; })
      .def_property_readonly("active",
                             [](sp::VariantGroup& g) -> std::optional<size_t> {
                               std::lock_guard<std::mutex> lk(g.mu);
                               return g.active;
                             })
      .def("begin",
           [](sp::VariantGroup& g, size_t k, bool free_created) {
             return restore_dict(g.begin(k, free_created));
           },
           py::arg("k"), py::arg("free_created") = true)
      .def("end", &sp::VariantGroup::end)
      .def("close", &sp::VariantGroup::close);
  m.def("variant_group", [](int device, const Pool& pool, size_t count) {
    alloc();
    sp_variant_group* g = nullptr;
    sp::check(sp_variant_group_create(device, pool_of(pool), count, &g), "sp_variant_group_create");
    return std::make_shared<sp::VariantGroup>(device, pool_of(pool), count, g);
  });

  m.def("variant_route_begin", [](int device, const Pool& pool) {
    alloc().begin_variant_route(device, c10::MempoolId_t{pool.first, pool.second});
  });
  m.def("variant_route_end", [](int device) { alloc().end_variant_route(device); });

  // ---- arenas ----
  m.def("arena_create", [](int device, const Pool& pool, uint64_t stream) {
    alloc();
    uint64_t arena = 0;
    sp::check(sp_arena_create(device, pool_of(pool), stream, &arena), "sp_arena_create");
    return arena;
  });
  m.def("arena_alloc", [](int device, uint64_t arena, uint32_t branch, uint32_t slot,
                          size_t size) {
    alloc();
    void* p = nullptr;
    sp::check(sp_arena_alloc(device, arena, branch, slot, size, &p), "sp_arena_alloc");
    return reinterpret_cast<uintptr_t>(p);
  });
  m.def("arena_free", [](int device, uint64_t arena, uint32_t branch, uint32_t slot) {
    alloc();
    sp::check(sp_arena_free(device, arena, branch, slot), "sp_arena_free");
  });
  m.def("arena_destroy", [](int device, uint64_t arena) {
    alloc();
    sp::check(sp_arena_destroy(device, arena), "sp_arena_destroy");
  });
  m.def(
      "arena_tensor",
      [](int device, uint64_t arena, uint32_t branch, uint32_t slot, int64_t nbytes) {
        alloc();
        TORCH_CHECK(nbytes > 0, "slotpool: an arena tensor needs a positive size");
        void* p = nullptr;
        sp::check(sp_arena_alloc(device, arena, branch, slot, static_cast<size_t>(nbytes), &p),
                  "sp_arena_alloc");
        // The slot is freed when the last tensor viewing it dies; after arena_destroy the free
        // is refused and ignored.
        auto deleter = [device, arena, branch, slot](void*) {
          (void)sp_arena_free(device, arena, branch, slot);
        };
        return torch::from_blob(p, {nbytes}, deleter,
                                torch::TensorOptions()
                                    .dtype(torch::kUInt8)
                                    .device(torch::Device(torch::kCUDA,
                                                          static_cast<c10::DeviceIndex>(device))));
      },
      py::arg("device"), py::arg("arena"), py::arg("branch"), py::arg("slot"), py::arg("nbytes"));
}
