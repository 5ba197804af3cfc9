// kvmetal.sim runtime: runs a kernel launch as fibers (one per Metal thread)
// on a few OS threads (one threadgroup in flight per thread). Compiled once
// into libkmslrt.so and loaded RTLD_GLOBAL, so kernel .so files stay lean.
#include "abi.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

// ---------------------------------------------------------------------------
// Context switch: saves callee-saved registers on the current stack, stores
// the stack pointer in *save, and resumes the stack `next`. About 10x cheaper
// than swapcontext, which makes a syscall for the signal mask.
extern "C" void kmsl_switch(void** save, void* next);

#if defined(__x86_64__) && !defined(__APPLE__)
asm(R"(
.text
.globl kmsl_switch
.type kmsl_switch,@function
kmsl_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size kmsl_switch,.-kmsl_switch
)");
static const int kSavedWords = 6;  // words popped before `ret`
#elif defined(__aarch64__)
#if defined(__APPLE__)
#define KMSL_ASM_HEAD ".text\n.globl _kmsl_switch\n.p2align 2\n_kmsl_switch:\n"
#define KMSL_ASM_TAIL ""
#else
#define KMSL_ASM_HEAD ".text\n.globl kmsl_switch\n.type kmsl_switch,%function\nkmsl_switch:\n"
#define KMSL_ASM_TAIL ".size kmsl_switch,.-kmsl_switch\n"
#endif
asm(KMSL_ASM_HEAD
    "  sub sp, sp, #160\n"
    "  stp x19, x20, [sp, #0]\n"
    "  stp x21, x22, [sp, #16]\n"
    "  stp x23, x24, [sp, #32]\n"
    "  stp x25, x26, [sp, #48]\n"
    "  stp x27, x28, [sp, #64]\n"
    "  stp x29, x30, [sp, #80]\n"
    "  stp d8, d9, [sp, #96]\n"
    "  stp d10, d11, [sp, #112]\n"
    "  stp d12, d13, [sp, #128]\n"
    "  stp d14, d15, [sp, #144]\n"
    "  mov x2, sp\n"
    "  str x2, [x0]\n"
    "  mov sp, x1\n"
    "  ldp x19, x20, [sp, #0]\n"
    "  ldp x21, x22, [sp, #16]\n"
    "  ldp x23, x24, [sp, #32]\n"
    "  ldp x25, x26, [sp, #48]\n"
    "  ldp x27, x28, [sp, #64]\n"
    "  ldp x29, x30, [sp, #80]\n"
    "  ldp d8, d9, [sp, #96]\n"
    "  ldp d10, d11, [sp, #112]\n"
    "  ldp d12, d13, [sp, #128]\n"
    "  ldp d14, d15, [sp, #144]\n"
    "  add sp, sp, #160\n"
    "  ret\n" KMSL_ASM_TAIL);
#else
#error "kvmetal.sim: context switch implemented for x86-64 Linux and aarch64 (Linux, macOS) only"
#endif

namespace {

constexpr size_t kStackBytes = 64 * 1024;
#ifndef KMSL_MAX_THREADGROUP_MEMORY
#error "build with -DKMSL_MAX_THREADGROUP_MEMORY=<bytes>: kvmetal/sim/build.py passes Metal's limit (kvmetal/chips.py)"
#endif
constexpr uint32_t kMaxThreadgroupMemory = KMSL_MAX_THREADGROUP_MEMORY;
constexpr int kMaxSlots = 128;
// Poisoned guard bytes around every threadgroup array: a write past either end
// is reported at the next barrier or when the threadgroup finishes.
constexpr uint32_t kGuard = 256;
constexpr uint32_t kArenaBytes = kMaxThreadgroupMemory + kMaxSlots * (kGuard + 64) + kGuard;

constexpr int64_t kTickBudget = 1 << 16;  // loop iterations between watchdog checks

// Counter names, indexed like KmslStats (kmsl_rt_stat_name exposes them).
const char* const kCollectiveNames[] = {
    "simd_sum", "simd_product", "simd_max", "simd_min", "simd_and", "simd_or", "simd_xor",
    "quad_sum", "quad_product", "quad_max", "quad_min",
    "simd_prefix_inclusive_sum", "simd_prefix_exclusive_sum", "simd_prefix_inclusive_product",
    "simd_prefix_exclusive_product",
    "simd_shuffle", "simd_shuffle_xor", "simd_shuffle_up", "simd_shuffle_down", "simd_shuffle_rotate_down",
    "simd_shuffle_rotate_up", "simd_broadcast", "quad_shuffle", "quad_shuffle_xor", "quad_shuffle_up",
    "quad_shuffle_down", "quad_broadcast", "simd_broadcast_first",
    "simd_ballot", "simd_all", "simd_any", "simd_active_threads_mask", "simd_is_first", "simdgroup_barrier",
    "simdgroup_load", "simdgroup_store", "simdgroup_multiply_accumulate", "simdgroup_multiply",  // msl_simdgroup_matrix.h
    "simd_shuffle_lanes",  // a simd_shuffle whose active lanes name different source lanes (shuffle_lanes)
    "other", nullptr};
#define KMSL_MATH_NAME(name) #name,
const char* const kMathNames[] = {KMSL_MATH_FUNCS(KMSL_MATH_NAME) nullptr};  // by KMSL_MATH_<name>
#undef KMSL_MATH_NAME
static_assert(sizeof(kCollectiveNames) / sizeof(kCollectiveNames[0]) <= KMSL_NCOLLECTIVE + 1, "collectives");
static_assert(KMSL_MATH_COUNT == KMSL_NMATH, "one counter per function in KMSL_MATH_FUNCS");

// A simd_shuffle whose active lanes do not all name the same source lane: not a
// broadcast but a permutation, which Apple GPUs run as an instruction sequence
// (metal-benchmarks: SHUFFLE_RANDOM_DIFF32, throughput 32 cycles vs 2 for a broadcast).
bool shuffle_lanes(const KmslGroup& g) {
  int64_t first = -1;
  for (int l = 0; l < 32; l++) {
    if (!((g.active >> l) & 1u)) continue;
    if (first < 0) first = g.lanes[l]->arg;
    else if (g.lanes[l]->arg != first) return true;
  }
  return false;
}

int collective_index(const char* op) {
  int k = 0;
  for (; kCollectiveNames[k + 1]; k++)
    if (strcmp(kCollectiveNames[k], op) == 0) return k;
  return k;  // "other"
}

enum FiberState { READY, AT_BARRIER, AT_COLLECTIVE, DONE };

struct Fiber {  // kept small: the scheduler scans these every round
  void* sp = nullptr;
  char* stack_top = nullptr;
  FiberState state = DONE;
  uint32_t index = 0;  // linear thread index in the threadgroup
  const void* site = nullptr;
  const char* op = nullptr;
  KmslCollective* coll = nullptr;
};

struct Shared {
  KmslLaunch* launch;
  KmslEntry entry;
  std::vector<uint32_t> tg_order;
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex err_mutex;
  std::chrono::steady_clock::time_point started;
};

struct Worker;
thread_local Worker* tls_worker = nullptr;

void fiber_main();

struct Worker {
  Shared* shared;
  std::vector<KmslCounter> counters;
  std::vector<Fiber> fibers;
  std::vector<KmslAttrs> attrs;      // per fiber, read once when it starts
  uint32_t n_coll = 0;               // fibers waiting at a collective
  uint32_t n_barrier = 0;            // fibers waiting at a barrier
  uint32_t sg_coll[32];              // per simdgroup: lanes waiting at a collective
  char* stacks = nullptr;
  size_t stacks_bytes = 0;
  void* sched_sp = nullptr;
  Fiber* current = nullptr;
  alignas(64) unsigned char arena[kArenaBytes];
  uint64_t arena_used = 0;     // arena bytes in use (arrays, guards, padding)
  uint64_t arena_dirty = kArenaBytes;  // bytes to re-poison for the next threadgroup
  uint64_t tg_bytes = 0;       // threadgroup memory as Metal counts it
  int64_t slot_offset[kMaxSlots];
  uint64_t slot_bytes[kMaxSlots];
  const char* slot_name[kMaxSlots];
  int alloc_order[kMaxSlots];
  int nallocs = 0;
  std::mt19937_64 rng;
  std::vector<uint32_t> order;
  bool aborted = false;
  KmslStats stats{};

  ~Worker() {
    if (stacks) munmap(stacks, stacks_bytes);
  }

  void alloc_stacks(size_t n) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    const size_t per = kStackBytes + page;  // guard page below each stack
    stacks_bytes = per * n;
    void* mem = mmap(nullptr, stacks_bytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (mem == MAP_FAILED) {
      stacks = nullptr;
      return;
    }
    stacks = (char*)mem;
    fibers.resize(n);
    attrs.resize(n);
    for (size_t i = 0; i < n; i++) {
      char* base = stacks + i * per;
      mprotect(base, page, PROT_NONE);
      fibers[i].stack_top = base + per;
    }
  }

  void prepare_fiber(Fiber& f) {
    // Initial frame: kSavedWords zeroed registers, then the "return address"
    // fiber_main, then a fake return address for fiber_main itself, so the
    // ABI's stack alignment holds on entry.
    uintptr_t top = (uintptr_t)f.stack_top & ~(uintptr_t)15;
    void** sp = (void**)top;
    *--sp = nullptr;
#if defined(__x86_64__)
    *--sp = (void*)&fiber_main;
    for (int i = 0; i < kSavedWords; i++) *--sp = nullptr;
#else
    sp -= 1;  // keep 16-byte alignment
    sp -= 20;
    for (int i = 0; i < 20; i++) sp[i] = nullptr;
    sp[11] = (void*)&fiber_main;  // x30 slot
#endif
    f.sp = sp;
    f.state = READY;
    f.site = nullptr;
    f.coll = nullptr;
  }

  void fail(int kind, const char* msg) {
    KmslLaunch* L = shared->launch;
    std::lock_guard<std::mutex> lock(shared->err_mutex);
    if (!shared->failed.load()) {
      L->err_kind = kind;
      snprintf(L->err_msg, sizeof(L->err_msg), "%s", msg);
      shared->failed.store(true);
    }
    aborted = true;
  }

  void run_fiber(Fiber& f) {
    current = &f;
    kmsl_switch(&sched_sp, f.sp);
    current = nullptr;
  }

  void resolve_collectives(uint32_t n) {
    KmslLaunch* L = shared->launch;
    char err[512];
    for (uint32_t sg = 0; sg * 32 < n && !aborted; sg++) {
      uint32_t first = sg * 32, count = std::min<uint32_t>(32, n - first);
      uint32_t existing = count == 32 ? 0xffffffffu : ((1u << count) - 1);
      uint32_t pending = sg_coll[sg];
      sg_coll[sg] = 0;
      while (pending && !aborted) {
        int lead = __builtin_ctz(pending);
        const void* site = fibers[first + lead].site;
        KmslGroup g{};
        g.existing = existing;
        g.strict = L->strict;
        g.err = err;
        err[0] = 0;
        for (uint32_t l = 0; l < count; l++) {
          Fiber& f = fibers[first + l];
          if ((pending >> l & 1) && f.site == site) {
            g.lanes[l] = f.coll;
            g.active |= 1u << l;
          }
        }
        pending &= ~g.active;
        const KmslCollective* c = g.lanes[lead];
        if (L->strict && g.active != existing) {
          snprintf(err, sizeof(err),
                   "[%s] %s reached by only part of simdgroup %u of threadgroup (%u,%u,%u): "
                   "active lanes mask 0x%08x of 0x%08x (strict mode)",
                   L->kernel_name, c->op, sg, attrs[0].threadgroup_position_in_grid[0],
                   attrs[0].threadgroup_position_in_grid[1], attrs[0].threadgroup_position_in_grid[2], g.active,
                   existing);
          fail(KMSL_DIVERGENT_COLLECTIVE, err);
          return;
        }
        const bool lanes = strcmp(c->op, "simd_shuffle") == 0 && shuffle_lanes(g);
        stats.collectives[collective_index(lanes ? "simd_shuffle_lanes" : c->op)] += uint64_t(c->words > 0 ? c->words : 1);
        if (c->resolve && c->resolve(&g) != 0) {
          char msg[768];
          snprintf(msg, sizeof(msg), "[%s] %s in simdgroup %u: %s", L->kernel_name, c->op, sg, err);
          fail(KMSL_DIVERGENT_COLLECTIVE, msg);
          return;
        }
        for (uint32_t l = 0; l < count; l++)
          if (g.active >> l & 1) fibers[first + l].state = READY;
      }
    }
    n_coll = 0;
  }

  void release_barrier(uint32_t n) {
    KmslLaunch* L = shared->launch;
    const void* site = nullptr;
    const char* op = nullptr;
    uint32_t waiting = 0, done = 0, other_site = 0;
    for (uint32_t i = 0; i < n; i++) {
      Fiber& f = fibers[i];
      if (f.state == DONE) {
        done++;
      } else {  // AT_BARRIER
        if (!site) {
          site = f.site;
          op = f.op;
        }
        if (f.site != site) other_site++;
        waiting++;
      }
    }
    if (done || other_site) {
      char msg[512];
      snprintf(msg, sizeof(msg),
               "[%s] divergent %s in threadgroup (%u,%u,%u): %u of %u threads wait at it, "
               "%u exited, %u wait at a different barrier",
               L->kernel_name, op, attrs[0].threadgroup_position_in_grid[0],
               attrs[0].threadgroup_position_in_grid[1], attrs[0].threadgroup_position_in_grid[2],
               waiting - other_site, n, done, other_site);
      fail(KMSL_DIVERGENT_BARRIER, msg);
      return;
    }
    check_guards("at a threadgroup_barrier");
    stats.barriers++;
    for (uint32_t i = 0; i < n; i++) fibers[i].state = READY;
    n_barrier = 0;
  }

  void run_threadgroup(uint32_t linear_tg) {
    KmslLaunch* L = shared->launch;
    uint32_t ntg[3], tgc[3], size[3];
    for (int d = 0; d < 3; d++) ntg[d] = (L->grid[d] + L->threadgroup[d] - 1) / L->threadgroup[d];
    tgc[0] = linear_tg % ntg[0];
    tgc[1] = (linear_tg / ntg[0]) % ntg[1];
    tgc[2] = linear_tg / (ntg[0] * ntg[1]);
    // dispatchThreads: edge threadgroups are smaller (non-uniform threadgroups).
    for (int d = 0; d < 3; d++)
      size[d] = std::min(L->threadgroup[d], L->grid[d] - tgc[d] * L->threadgroup[d]);
    uint32_t n = size[0] * size[1] * size[2];
    uint32_t dispatch_n = L->threadgroup[0] * L->threadgroup[1] * L->threadgroup[2];
    for (uint32_t i = 0; i < n; i++) {
      Fiber& f = fibers[i];
      prepare_fiber(f);
      f.index = i;
      KmslAttrs& a = attrs[i];
      uint32_t p[3] = {i % size[0], (i / size[0]) % size[1], i / (size[0] * size[1])};
      for (int d = 0; d < 3; d++) {
        a.thread_position_in_threadgroup[d] = p[d];
        a.threadgroup_position_in_grid[d] = tgc[d];
        a.thread_position_in_grid[d] = tgc[d] * L->threadgroup[d] + p[d];
        a.threads_per_threadgroup[d] = size[d];
        a.dispatch_threads_per_threadgroup[d] = L->threadgroup[d];
        a.threadgroups_per_grid[d] = ntg[d];
        a.threads_per_grid[d] = L->grid[d];
      }
      a.thread_index_in_threadgroup = i;
      a.thread_index_in_simdgroup = i % 32;
      a.simdgroup_index_in_threadgroup = i / 32;
      a.simdgroups_per_threadgroup = (n + 31) / 32;
      a.dispatch_simdgroups_per_threadgroup = (dispatch_n + 31) / 32;
      a.thread_index_in_quadgroup = i % 4;
      a.quadgroup_index_in_threadgroup = i / 4;
      a.quadgroups_per_threadgroup = (n + 3) / 4;
      a.dispatch_quadgroups_per_threadgroup = (dispatch_n + 3) / 4;
      a.threads_per_simdgroup = 32;
    }
    // Poison threadgroup memory: a missing barrier or an unwritten slot reads NaN / -1.
    memset(arena, 0xff, std::min<uint64_t>(arena_dirty, kArenaBytes));
    arena_used = 0;
    tg_bytes = 0;
    nallocs = 0;
    for (int s = 0; s < kMaxSlots; s++) slot_offset[s] = -1;
    n_coll = n_barrier = 0;
    for (int k = 0; k < 32; k++) sg_coll[k] = 0;

    order.resize(n);
    for (uint32_t i = 0; i < n; i++) order[i] = i;
    const bool shuffle = L->seed != 0;
    for (;;) {
      if (shuffle) std::shuffle(order.begin(), order.end(), rng);
      bool any_ready = true;
      while (any_ready) {
        any_ready = false;
        for (uint32_t k = 0; k < n; k++) {
          Fiber& f = fibers[order[k]];
          if (f.state == READY) {
            run_fiber(f);
            if (aborted || shared->failed.load(std::memory_order_relaxed)) {
              aborted = true;
              return;
            }
            any_ready = any_ready || f.state == READY;
          }
        }
      }
      if (n_coll) {
        resolve_collectives(n);
      } else if (n_barrier) {
        release_barrier(n);
      } else {
        break;  // every thread finished
      }
      if (aborted) return;
    }
    check_guards("at the end of the threadgroup");
    arena_dirty = arena_used + kGuard;
    L->tg_memory = tg_bytes;
  }

  // Every byte outside the threadgroup arrays must still hold the 0xFF poison.
  void check_guards(const char* when) {
    if (aborted) return;
    uint64_t prev_end = 0;
    for (int k = 0; k <= nallocs; k++) {
      uint64_t lo = prev_end, hi;
      if (k < nallocs) {
        hi = (uint64_t)slot_offset[alloc_order[k]];
      } else {
        hi = arena_used + kGuard;
      }
      for (uint64_t b = lo; b < hi; b++) {
        if (arena[b] != 0xff) {
          // Name the nearest array: the one ending before b, else the one starting after it.
          int before = k > 0 ? alloc_order[k - 1] : -1, after = k < nallocs ? alloc_order[k] : -1;
          bool past_end = before >= 0 && (after < 0 || b - prev_end < hi - b);
          int s = past_end ? before : after;
          int64_t dist = past_end ? (int64_t)(b - prev_end) : (int64_t)(hi - b);
          char msg[512];
          snprintf(msg, sizeof(msg),
                   "[%s] threadgroup array '%s' (%llu bytes) written out of bounds: byte %lld %s it was "
                   "modified; detected %s in threadgroup (%u,%u,%u)",
                   shared->launch->kernel_name, slot_name[s], (unsigned long long)slot_bytes[s],
                   (long long)(past_end ? dist : dist), past_end ? "past its end" : "before its start", when,
                   attrs[0].threadgroup_position_in_grid[0], attrs[0].threadgroup_position_in_grid[1],
                   attrs[0].threadgroup_position_in_grid[2]);
          fail(KMSL_OUT_OF_BOUNDS, msg);
          return;
        }
      }
      if (k < nallocs) prev_end = slot_offset[alloc_order[k]] + slot_bytes[alloc_order[k]];
    }
  }

  void run() {
    KmslLaunch* L = shared->launch;
    tls_worker = this;
    kmsl_tls_stats = &stats;
    stats.tick_budget = kTickBudget;
    uint32_t max_n = L->threadgroup[0] * L->threadgroup[1] * L->threadgroup[2];
    alloc_stacks(max_n);
    if (!stacks) {
      fail(KMSL_INTERNAL, "[kvmetal.sim] could not allocate fiber stacks");
      return;
    }
    counters.resize(L->nbufs);
    for (int b = 0; b < L->nbufs; b++) counters[b] = KmslCounter{0, 0, &L->bufs[b], 0, 0};
    for (;;) {
      size_t k = shared->next.fetch_add(1);
      if (k >= shared->tg_order.size() || shared->failed.load()) break;
      run_threadgroup(shared->tg_order[k]);
      if (aborted) break;
    }
    tls_worker = nullptr;
    kmsl_tls_stats = nullptr;
  }

  // The watchdog, run from loop back-edges every kTickBudget iterations.
  void tick() {
    stats.tick_budget = kTickBudget;
    KmslLaunch* L = shared->launch;
    if (shared->failed.load(std::memory_order_relaxed)) {
      // Another worker failed: stop this fiber too instead of finishing a doomed launch.
      Fiber* f = current;
      aborted = true;
      f->state = DONE;
      kmsl_switch(&f->sp, sched_sp);
      __builtin_trap();
    }
    double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - shared->started).count();
    char msg[512];
    if (L->cancel) {
      snprintf(msg, sizeof(msg), "[%s] cancelled (KeyboardInterrupt) after %.1f s", L->kernel_name, elapsed);
      kmsl_rt_fail(KMSL_TIMEOUT, msg);
    }
    if (L->timeout_s > 0 && elapsed > L->timeout_s) {
      snprintf(msg, sizeof(msg),
               "[%s] watchdog: the launch ran past its %.3g s limit (an infinite loop? thread %u of threadgroup "
               "(%u,%u,%u)); raise it with kvmetal.sim.trace(timeout=...) or KVMETAL_SIM_TIMEOUT",
               L->kernel_name, L->timeout_s, current ? current->index : 0u, attrs[0].threadgroup_position_in_grid[0],
               attrs[0].threadgroup_position_in_grid[1], attrs[0].threadgroup_position_in_grid[2]);
      kmsl_rt_fail(KMSL_TIMEOUT, msg);
    }
  }
};

// Arithmetic traps inside a kernel fiber fail the launch with a SimError
// instead of killing the process: SIGFPE (x86 integer division or modulo by
// zero, INT_MIN / -1) and the SIGILL / SIGTRAP of the division-by-zero checks
// the kernels are compiled with (build.py). The handler never returns into the
// fiber: it switches to the scheduler (SA_NODEFER keeps the signal unblocked
// afterwards). Outside a kernel fiber the previous action runs.
const int kTrapSignals[] = {SIGFPE, SIGILL, SIGTRAP};
struct sigaction previous_action[3];
std::once_flag trap_once;

void on_trap(int sig, siginfo_t* info, void* uctx) {
  Worker* w = tls_worker;
  if (w && w->current) {
    char msg[512];
    const KmslAttrs& a = w->attrs[w->current->index];
    snprintf(msg, sizeof(msg),
             "[%s] integer division or modulo by zero (%s) in thread %u of threadgroup (%u,%u,%u)",
             w->shared->launch->kernel_name, sig == SIGFPE ? "SIGFPE" : sig == SIGILL ? "SIGILL trap" : "SIGTRAP",
             a.thread_index_in_threadgroup, a.threadgroup_position_in_grid[0], a.threadgroup_position_in_grid[1],
             a.threadgroup_position_in_grid[2]);
    kmsl_rt_fail(KMSL_ARITHMETIC, msg);
  }
  int k = sig == SIGFPE ? 0 : sig == SIGILL ? 1 : 2;
  struct sigaction& prev = previous_action[k];
  if (prev.sa_flags & SA_SIGINFO) {
    if (prev.sa_sigaction) prev.sa_sigaction(sig, info, uctx);
    return;
  }
  if (prev.sa_handler == SIG_IGN) return;
  if (prev.sa_handler != SIG_DFL && prev.sa_handler) {
    prev.sa_handler(sig);
    return;
  }
  sigaction(sig, &prev, nullptr);  // default: returning re-executes the fault and dies
}

void install_trap_handlers() {
  std::call_once(trap_once, [] {
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = on_trap;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    for (int k = 0; k < 3; k++) sigaction(kTrapSignals[k], &sa, &previous_action[k]);
  });
}

void fiber_main() {
  Worker* w = tls_worker;
  Fiber* f = w->current;
  w->shared->entry(&w->attrs[f->index], w->counters.data());
  f->state = DONE;
  kmsl_switch(&f->sp, w->sched_sp);
  __builtin_trap();  // a finished fiber is never resumed
}

void yield_to_scheduler(Worker* w, Fiber* f) { kmsl_switch(&f->sp, w->sched_sp); }

}  // namespace

extern "C" {

__thread KmslStats* kmsl_tls_stats = nullptr;

void kmsl_rt_tick(void) { tls_worker->tick(); }

const char* kmsl_rt_stat_name(int kind, int index) {
  const char* const* names = kind == 0 ? kCollectiveNames : kMathNames;
  int n = kind == 0 ? KMSL_NCOLLECTIVE : KMSL_NMATH;
  for (int k = 0; k < n; k++) {
    if (!names[k]) return nullptr;
    if (k == index) return names[k];
  }
  return nullptr;
}

void kmsl_rt_collective(KmslCollective* c) {
  Worker* w = tls_worker;
  Fiber* f = w->current;
  f->coll = c;
  f->site = c->site;
  f->op = c->op;
  f->state = AT_COLLECTIVE;
  w->n_coll++;
  w->sg_coll[f->index / 32] |= 1u << (f->index % 32);
  yield_to_scheduler(w, f);
}

uint32_t kmsl_rt_thread_index(void) { return tls_worker->current->index; }

void kmsl_rt_barrier(const void* site, const char* op) {
  Worker* w = tls_worker;
  Fiber* f = w->current;
  f->site = site;
  f->op = op;
  f->state = AT_BARRIER;
  w->n_barrier++;
  yield_to_scheduler(w, f);
}

void* kmsl_rt_tg_alloc(int slot, uint64_t bytes, uint64_t align, const char* name) {
  Worker* w = tls_worker;
  if (slot < 0 || slot >= kMaxSlots) kmsl_rt_fail(KMSL_INTERNAL, "[kvmetal.sim] too many threadgroup declarations");
  if (w->slot_offset[slot] < 0) {
    if (align < 16) align = 16;
    if (align > 64) align = 64;  // the arena itself is 64-byte aligned
    uint64_t counted = w->tg_bytes + ((bytes + 15) & ~15ull);  // Metal allocates in 16-byte units
    if (counted > kMaxThreadgroupMemory) {
      char msg[256];
      snprintf(msg, sizeof(msg),
               "[%s] threadgroup memory exceeds Metal's %u KiB limit: %llu bytes with '%s'",
               w->shared->launch->kernel_name, kMaxThreadgroupMemory / 1024, (unsigned long long)counted, name);
      kmsl_rt_fail(KMSL_THREADGROUP_MEMORY, msg);
    }
    uint64_t off = (w->arena_used + kGuard + align - 1) & ~(align - 1);
    w->tg_bytes = counted;
    w->slot_offset[slot] = (int64_t)off;
    w->slot_bytes[slot] = bytes;
    w->slot_name[slot] = name;
    w->alloc_order[w->nallocs++] = slot;
    w->arena_used = off + bytes;
  }
  return w->arena + w->slot_offset[slot];
}

void kmsl_rt_fail(int kind, const char* msg) {
  Worker* w = tls_worker;
  w->fail(kind, msg);
  Fiber* f = w->current;
  f->state = DONE;
  yield_to_scheduler(w, f);
  __builtin_trap();
}

const char* kmsl_rt_kernel_name(void) { return tls_worker->shared->launch->kernel_name; }

int kmsl_rt_launch(KmslLaunch* L, KmslEntry entry) {
  L->err_kind = KMSL_OK;
  L->err_msg[0] = 0;
  memset(&L->stats, 0, sizeof(L->stats));
  for (int b = 0; b < L->nbufs; b++) L->loads[b] = L->stores[b] = L->load_ops[b] = L->store_ops[b] = 0;
  install_trap_handlers();
  for (int d = 0; d < 3; d++)
    if (L->grid[d] == 0 || L->threadgroup[d] == 0) return KMSL_OK;
  Shared shared;
  shared.launch = L;
  shared.entry = entry;
  shared.started = std::chrono::steady_clock::now();
  uint32_t ntg = 1;
  for (int d = 0; d < 3; d++) ntg *= (L->grid[d] + L->threadgroup[d] - 1) / L->threadgroup[d];
  shared.tg_order.resize(ntg);
  for (uint32_t i = 0; i < ntg; i++) shared.tg_order[i] = i;
  if (L->seed) {
    std::mt19937_64 rng(L->seed);
    std::shuffle(shared.tg_order.begin(), shared.tg_order.end(), rng);
  }
  int nworkers = std::max(1, std::min<int>(L->nworkers, (int)ntg));
  std::vector<Worker*> workers;
  for (int i = 0; i < nworkers; i++) {
    Worker* w = new Worker();
    w->shared = &shared;
    w->rng.seed(L->seed * 0x9e3779b97f4a7c15ull + i);
    workers.push_back(w);
  }
  if (nworkers == 1) {
    workers[0]->run();
  } else {
    std::vector<std::thread> threads;
    for (Worker* w : workers) threads.emplace_back([w] { w->run(); });
    for (auto& t : threads) t.join();
  }
  for (Worker* w : workers) {
    for (int b = 0; b < L->nbufs && b < (int)w->counters.size(); b++) {
      L->loads[b] += w->counters[b].loads;
      L->stores[b] += w->counters[b].stores;
      L->load_ops[b] += w->counters[b].load_ops;
      L->store_ops[b] += w->counters[b].store_ops;
    }
    L->stats.barriers += w->stats.barriers;
    for (int k = 0; k < KMSL_NCOLLECTIVE; k++) L->stats.collectives[k] += w->stats.collectives[k];
    for (int k = 0; k < KMSL_NMATH; k++) L->stats.math[k] += w->stats.math[k];
    delete w;
  }
  return L->err_kind;
}

}  // extern "C"
