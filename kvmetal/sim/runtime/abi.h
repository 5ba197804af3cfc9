// kvmetal.sim: the C ABI between Python (ctypes), the runtime library (rt.cpp:
// fibers, scheduler, worker threads) and each compiled kernel .so.
// Keep in sync with kvmetal/sim/launch.py (ctypes mirrors of these structs).
#pragma once
#include <stdint.h>

extern "C" {

// Error kinds reported by a launch (0 = success).
enum KmslErrorKind {
  KMSL_OK = 0,
  KMSL_OUT_OF_BOUNDS = 1,
  KMSL_DIVERGENT_BARRIER = 2,
  KMSL_DIVERGENT_COLLECTIVE = 3,
  KMSL_THREADGROUP_MEMORY = 4,
  KMSL_THREADGROUP_SIZE = 5,
  KMSL_MISALIGNED = 6,
  KMSL_INTERNAL = 7,
  KMSL_TIMEOUT = 8,          // the watchdog: the launch ran past its time limit or was cancelled
  KMSL_ARITHMETIC = 9,       // SIGFPE: integer division or modulo by zero (or INT_MIN / -1)
};

// Cost counters (what a Metal GPU would issue), per worker, summed per launch.
// Collectives and barriers count once per simdgroup / threadgroup execution;
// math functions count once per lane and vector component (divide by 32 for
// simdgroup instructions at full occupancy). Names: kmsl_rt_stat_name().
#define KMSL_NCOLLECTIVE 40
#define KMSL_NMATH 24
// The counted transcendental functions, in counter-index order: one list for the
// indices (msl_math.h counts KMSL_MATH_<name>) and the names (rt.cpp).
#define KMSL_MATH_FUNCS(X)                                                                  \
  X(exp) X(exp2) X(exp10) X(expm1) X(log) X(log2) X(log10) X(log1p) X(pow) X(powr) X(sin)    \
  X(cos) X(tan) X(asin) X(acos) X(atan) X(atan2) X(sinh) X(cosh) X(tanh) X(asinh) X(acosh)   \
  X(atanh) X(erf)
#define KMSL_MATH_ENUM_ENTRY(name) KMSL_MATH_##name,
enum KmslMathIndex { KMSL_MATH_FUNCS(KMSL_MATH_ENUM_ENTRY) KMSL_MATH_COUNT };
#undef KMSL_MATH_ENUM_ENTRY
struct KmslStats {
  uint64_t barriers;                       // threadgroup_barrier executions (per threadgroup)
  uint64_t collectives[KMSL_NCOLLECTIVE];  // simd/quad collectives (per simdgroup), by op
  uint64_t math[KMSL_NMATH];               // transcendental calls (per lane), by function
  int64_t tick_budget;                     // loop iterations until the next watchdog check
};

// One device/constant buffer bound to the kernel (shape/strides buffers included).
struct KmslBuf {
  char* data;        // lowest byte the kernel may touch
  int64_t size;      // bytes the kernel may touch, from data
  int64_t start;     // byte offset of element 0 (what the kernel's pointer points to)
  const char* name;  // parameter name, for error messages
  uint8_t* touched;  // one byte per byte of [data, data+size): set when loaded
  uint8_t* written;  // likewise, set when stored
};

// Per worker (OS thread) and per buffer traffic counters: no sharing, no atomics.
struct KmslCounter {
  uint64_t loads;
  uint64_t stores;
  const KmslBuf* buf;
  uint64_t load_ops;   // load instructions (one per element access, whatever its width)
  uint64_t store_ops;
};

// Thread-position values of one Metal thread (everything MLX can pass).
struct KmslAttrs {
  uint32_t thread_position_in_grid[3];
  uint32_t thread_position_in_threadgroup[3];
  uint32_t threadgroup_position_in_grid[3];
  uint32_t threads_per_threadgroup[3];
  uint32_t dispatch_threads_per_threadgroup[3];
  uint32_t threadgroups_per_grid[3];
  uint32_t threads_per_grid[3];
  uint32_t thread_index_in_threadgroup;
  uint32_t thread_index_in_simdgroup;
  uint32_t simdgroup_index_in_threadgroup;
  uint32_t simdgroups_per_threadgroup;
  uint32_t dispatch_simdgroups_per_threadgroup;
  uint32_t thread_index_in_quadgroup;
  uint32_t quadgroup_index_in_threadgroup;
  uint32_t quadgroups_per_threadgroup;
  uint32_t dispatch_quadgroups_per_threadgroup;
  uint32_t threads_per_simdgroup;
};

// Runs one Metal thread: the kernel .so builds its arguments and calls the body.
typedef void (*KmslEntry)(const KmslAttrs* attrs, KmslCounter* counters);

struct KmslLaunch {
  uint32_t grid[3];          // threads, as MLX's `grid`
  uint32_t threadgroup[3];   // already clamped to the grid, as MLX does
  int32_t nbufs;
  KmslBuf* bufs;
  uint64_t seed;             // 0: natural order; else shuffle threadgroups and fibers
  int32_t strict;            // report collectives reached by part of a simdgroup
  int32_t nworkers;          // OS threads
  const char* kernel_name;
  // results
  uint64_t* loads;           // [nbufs]
  uint64_t* stores;          // [nbufs]
  uint64_t tg_memory;        // threadgroup bytes used by the last threadgroup
  int32_t err_kind;
  char err_msg[1024];
  uint64_t* load_ops;        // [nbufs]
  uint64_t* store_ops;       // [nbufs]
  KmslStats stats;           // summed over workers
  double timeout_s;          // watchdog: fail with KMSL_TIMEOUT past this wall time (<= 0: none)
  volatile int32_t cancel;   // set by the host (Ctrl-C): fail with KMSL_TIMEOUT at the next check
};

int kmsl_rt_launch(KmslLaunch* launch, KmslEntry entry);

// ---- called by kernel code running on a fiber ----

// A simd collective waiting for its simdgroup. `resolve` runs once per group
// of lanes that reached the same call site, and fills every lane's `out`.
struct KmslCollective;
struct KmslGroup {
  KmslCollective* lanes[32];  // null where the lane did not take part
  uint32_t active;            // lanes that reached this call site
  uint32_t existing;          // lanes that exist in this simdgroup
  int32_t strict;
  char* err;                  // resolve writes a message here and returns nonzero
};
struct KmslCollective {
  const void* site;
  const char* op;
  int (*resolve)(KmslGroup* group);
  const void* in;
  void* out;
  int64_t arg;                // lane index, delta or mask, depending on op
  int32_t words;              // instructions it counts as (a value collective: its 32-bit words)
};

void kmsl_rt_collective(KmslCollective* c);
void kmsl_rt_barrier(const void* site, const char* op);
// Linear index in the threadgroup of the Metal thread running now (lane = index % 32).
uint32_t kmsl_rt_thread_index(void);
void* kmsl_rt_tg_alloc(int slot, uint64_t bytes, uint64_t align, const char* name);
[[noreturn]] void kmsl_rt_fail(int kind, const char* msg);
const char* kmsl_rt_kernel_name(void);
// The current worker's counters (math calls, loop ticks); set for every fiber.
extern __thread KmslStats* kmsl_tls_stats;
// Loop back-edges call this when tick_budget runs out: checks the watchdog.
void kmsl_rt_tick(void);
// kind 0: collective op names, kind 1: math function names; null past the end.
const char* kmsl_rt_stat_name(int kind, int index);
}
