// smoke.cpp - the C ABI from C++17: the header's extern "C" guards, RAII over sp_alloc/sp_free,
// concurrent use from std::threads, pools by name, statistics and the snapshot as std::string.
// Built and run by crates/slotpool-capi/tests/c_programs.rs with SLOTPOOL_BACKEND=sim.
#include "slotpool.h"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

static_assert(sizeof(sp_pool_id) == 16, "sp_pool_id");
static_assert(sizeof(sp_pool_options) == 24, "sp_pool_options");
static_assert(sizeof(sp_stat) == 32, "sp_stat");
static_assert(sizeof(sp_stat_array) == 96, "sp_stat_array");
static_assert(sizeof(sp_memory_stats) == 1072, "sp_memory_stats");
static_assert(offsetof(sp_memory_stats, max_split_size) == 968, "max_split_size");

namespace {

// Throws with the library's message on any error.
void check(sp_status s, const char* what) {
    if (s != SP_OK) {
        throw std::runtime_error(std::string(what) + ": " + std::to_string(static_cast<int>(s)) +
                                 " " + sp_last_error_message());
    }
}

// One device allocation, freed on destruction.
class Buffer {
  public:
    Buffer(int device, std::size_t size, std::uint64_t stream) {
        check(sp_alloc(device, size, stream, &ptr_), "sp_alloc");
    }
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
    Buffer(Buffer&& other) noexcept : ptr_(std::exchange(other.ptr_, nullptr)) {}
    Buffer& operator=(Buffer&& other) noexcept {
        if (this != &other) {
            reset();
            ptr_ = std::exchange(other.ptr_, nullptr);
        }
        return *this;
    }
    ~Buffer() { reset(); }
    void reset() {
        if (ptr_ != nullptr) {
            sp_free(ptr_);
            ptr_ = nullptr;
        }
    }
    void* get() const { return ptr_; }

  private:
    void* ptr_ = nullptr;
};

std::string snapshot(int device) {
    char* json = nullptr;
    std::size_t len = 0;
    check(sp_snapshot_json(device, &json, &len), "sp_snapshot_json");
    std::string out(json, len);
    sp_string_free(json);
    return out;
}

int run() {
    int count = 0;
    check(sp_device_count(&count), "sp_device_count");
    if (count != 2) {
        throw std::runtime_error("expected 2 sim devices");
    }
    {
        Buffer a(0, 1 << 20, 1);
        Buffer b(1, 1 << 20, 2);
        sp_memory_stats st{};
        check(sp_memory_stats_get(0, &st), "sp_memory_stats_get");
        if (st.allocation.all.current != 1) {
            throw std::runtime_error("one allocation expected on device 0");
        }
        if (snapshot(0).find("active_allocated") == std::string::npos) {
            throw std::runtime_error("snapshot lacks the allocation");
        }
    }
    // Concurrent threads on both devices and several streams.
    std::atomic<int> errors{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
        threads.emplace_back([t, &errors] {
            try {
                std::vector<Buffer> live;
                for (int i = 0; i < 2000; ++i) {
                    if (live.size() > 8) {
                        live.erase(live.begin());
                    }
                    live.emplace_back(t % 2, static_cast<std::size_t>(512 * (1 + (i % 64))),
                                      static_cast<std::uint64_t>(t));
                }
            } catch (const std::exception& e) {
                std::fprintf(stderr, "thread %d: %s\n", t, e.what());
                ++errors;
            }
        });
    }
    for (auto& th : threads) {
        th.join();
    }
    if (errors != 0) {
        return 1;
    }
    // Pools by name, with options given as an aggregate.
    sp_pool_options opts{1, 0, 64u << 20, 0};
    sp_pool_id id{};
    check(sp_pool_named(0, "cpp-pool", &opts, &id), "sp_pool_named");
    void* p = nullptr;
    check(sp_pool_alloc(0, id, 4096, 0, &p), "sp_pool_alloc");
    check(sp_free(p), "sp_free");
    if (sp_free(p) != SP_ERR_UNKNOWN_POINTER) {
        throw std::runtime_error("double free not detected");
    }
    std::uint64_t left = 1;
    check(sp_pool_release(0, id, &left), "sp_pool_release");
    check(sp_empty_cache(-1), "sp_empty_cache");
    sp_memory_stats st{};
    check(sp_memory_stats_get(0, &st), "sp_memory_stats_get");
    if (st.allocation.all.current != 0 || st.reserved_bytes.all.current != 0) {
        throw std::runtime_error("memory left after empty_cache");
    }
    return 0;
}

}  // namespace

int main() {
    try {
        int rc = run();
        if (rc == 0) {
            std::printf("smoke.cpp: all checks passed\n");
        }
        return rc;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "smoke.cpp: %s\n", e.what());
        return 1;
    }
}
