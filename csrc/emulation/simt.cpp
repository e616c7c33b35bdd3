// The runtime of the SIMT emulator (simt.h): fibers and their scheduler, the
// warp collectives, launches, and the guard-page buffers of debug mode.
// Plain C++ and POSIX; no torch header.

#include "emulation/simt.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#if !defined(__x86_64__) || defined(SIMT_PORTABLE_CONTEXT)
#include <ucontext.h>
#endif

namespace simt {
namespace {

// ---- configuration and errors ----------------------------------------------------

std::atomic<uint64_t> g_seed{1};
std::atomic<bool> g_debug{false};
std::atomic<int> g_multiprocessors{2};

thread_local cudaError_t t_last_error = cudaSuccess;
thread_local std::string t_error_detail;

void set_error(cudaError_t code, std::string detail) {
  t_last_error = code;
  t_error_detail = std::move(detail);
}

struct KernelError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// splitmix64: seeds and draws of the scheduler (quality enough for shuffles,
// and cheap to seed per block).
struct Random {
  uint64_t state;
  explicit Random(uint64_t seed) : state(seed) {}
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  size_t below(size_t n) { return static_cast<size_t>(next() % n); }
};

uint64_t hash_text(const char* text) {  // FNV-1a: a stable per-kernel seed
  uint64_t h = 0xcbf29ce484222325ull;
  for (; *text; ++text) h = (h ^ static_cast<unsigned char>(*text)) * 0x100000001b3ull;
  return h;
}

const size_t kPage = static_cast<size_t>(sysconf(_SC_PAGESIZE));

// ---- launch log ----------------------------------------------------------------------

std::mutex g_log_mutex;
std::map<std::pair<std::string, std::string>, long> g_launches;
std::string g_log_text;

std::string base_name(const char* written) {  // "k<T, U>" -> "k"
  std::string name(written);
  name = name.substr(0, name.find('<'));
  name.erase(std::remove_if(name.begin(), name.end(), [](char c) { return c == ' ' || c == '('; }), name.end());
  return name;
}

std::string instantiation(const char* pretty) {  // "... [with auto Kernel = k<float, float>]" -> "k<float, float>"
  std::string text(pretty);
  const std::string marker = "Kernel = ";
  const size_t at = text.find(marker);
  if (at == std::string::npos) return text;
  text = text.substr(at + marker.size());
  const size_t end = text.rfind(']');
  return end == std::string::npos ? text : text.substr(0, end);
}

// ---- guard-page buffers (debug mode) -------------------------------------------------

constexpr size_t kMaxGuarded = 1 << 16;
constexpr unsigned char kSentinel = 0xa5;
constexpr unsigned char kPoison = 0xff;

// Read by the SIGSEGV handler without a lock: `base` is published last.
struct GuardEntry {
  std::atomic<uintptr_t> base{0};
  size_t total = 0;       // the whole mapping, both guard pages included
  uintptr_t data = 0;     // the buffer, ending at base + total - kPage
  size_t bytes = 0;
  std::atomic<unsigned char> opened{0};  // guard pages a fault made accessible: 1 front, 2 back
};

GuardEntry g_guards[kMaxGuarded];
std::atomic<size_t> g_guard_high{0};  // entries in use lie below this
std::mutex g_guard_mutex;
std::unordered_map<uintptr_t, size_t> g_guard_slot;  // data -> entry
size_t g_guard_hint = 0;

// Faults in guard pages during device code, for the launch to report.
constexpr int kMaxFaults = 8;
std::atomic<int> g_fault_count{0};
uintptr_t g_fault_address[kMaxFaults];
size_t g_fault_entry[kMaxFaults];
std::atomic<int> g_in_device_code{0};

// Fiber stacks' guard pages (overflow is fatal, but said so).
constexpr int kMaxStackGuards = 4096;
std::atomic<uintptr_t> g_stack_guard[kMaxStackGuards];
std::atomic<int> g_stack_guards{0};

struct sigaction g_previous_segv;
std::once_flag g_handler_once;

void write_stderr(const char* text) {
  const ssize_t ignored = write(STDERR_FILENO, text, strlen(text));
  (void)ignored;
}

void on_segv(int, siginfo_t* info, void*) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(info->si_addr);
  if (g_in_device_code.load() > 0) {
    const size_t high = g_guard_high.load(std::memory_order_acquire);
    for (size_t i = 0; i < high; ++i) {
      const uintptr_t base = g_guards[i].base.load(std::memory_order_acquire);
      if (base == 0) continue;
      const uintptr_t back = base + g_guards[i].total - kPage;
      const bool front_hit = address >= base && address < base + kPage;
      const bool back_hit = address >= back && address < back + kPage;
      if (!front_hit && !back_hit) continue;
      const int slot = g_fault_count.fetch_add(1);
      if (slot < kMaxFaults) {
        g_fault_address[slot] = address;
        g_fault_entry[slot] = i;
      }
      // Let the access complete, into the guard page, so the launch can
      // finish and report; the page is closed again after the launch.
      g_guards[i].opened.fetch_or(front_hit ? 1 : 2);
      mprotect(reinterpret_cast<void*>(front_hit ? base : back), kPage, PROT_READ | PROT_WRITE);
      return;
    }
  }
  const int stacks = g_stack_guards.load();
  for (int i = 0; i < stacks; ++i) {
    const uintptr_t guard = g_stack_guard[i].load();
    if (address >= guard && address < guard + kPage) {
      write_stderr("simt: a kernel thread overflowed its fiber stack (simt.cpp kStackBytes)\n");
      abort();
    }
  }
  // Not ours: hand the fault to whoever handled SIGSEGV before us.
  sigaction(SIGSEGV, &g_previous_segv, nullptr);
}

void install_handler() {
  std::call_once(g_handler_once, [] {
    struct sigaction action;
    memset(&action, 0, sizeof(action));
    action.sa_sigaction = on_segv;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    sigaction(SIGSEGV, &action, &g_previous_segv);
  });
}

// After device code ran: close the guard pages faults opened, and describe
// the faults and any write into the sentinel bytes before a buffer.
std::string check_guards() {
  std::ostringstream out;
  const int faults = g_fault_count.exchange(0);
  for (int k = 0; k < std::min(faults, kMaxFaults); ++k) {
    const GuardEntry& e = g_guards[g_fault_entry[k]];
    const uintptr_t address = g_fault_address[k], end = e.data + e.bytes;
    out << "out-of-bounds global memory access: address 0x" << std::hex << address << std::dec << " is ";
    if (address >= end) {
      out << address - end << " bytes past the end";
    } else {
      out << e.data - address << " bytes before the start";
    }
    out << " of a " << e.bytes << "-byte buffer at 0x" << std::hex << e.data << std::dec << "; ";
  }
  if (faults > kMaxFaults) out << faults - kMaxFaults << " more faults; ";
  const size_t high = g_guard_high.load();
  for (size_t i = 0; i < high; ++i) {
    GuardEntry& e = g_guards[i];
    const uintptr_t base = e.base.load();
    if (base == 0) continue;
    const unsigned char opened = e.opened.exchange(0);
    if (opened & 1) mprotect(reinterpret_cast<void*>(base), kPage, PROT_NONE);
    if (opened & 2) mprotect(reinterpret_cast<void*>(base + e.total - kPage), kPage, PROT_NONE);
    const auto* slack = reinterpret_cast<const unsigned char*>(base + kPage);
    const size_t slack_bytes = e.data - (base + kPage);
    for (size_t b = 0; b < slack_bytes; ++b) {
      if (slack[b] != kSentinel) {
        out << "out-of-bounds global memory write " << slack_bytes - b << " bytes before the start of a " << e.bytes
            << "-byte buffer at 0x" << std::hex << e.data << std::dec << "; ";
        memset(const_cast<unsigned char*>(slack), kSentinel, slack_bytes);
        break;
      }
    }
  }
  return out.str();
}

// Runs host-side device work (a launch, a memset) with guard faults
// recorded rather than fatal; returns their description.
template <typename F>
std::string in_device_code(F&& work) {
  g_in_device_code.fetch_add(1);
  work();
  g_in_device_code.fetch_sub(1);
  // Faults are checked after debug mode was switched off too: a guarded
  // buffer outlives the mode.
  return g_debug.load() || g_fault_count.load() > 0 ? check_guards() : std::string();
}

// ---- context switching -----------------------------------------------------------------

void fiber_main();

#if defined(__x86_64__) && !defined(SIMT_PORTABLE_CONTEXT)
// Saves the callee-saved registers and the floating-point control words on
// the current stack, stores its pointer in *save, and resumes the stack at
// `load` (System V ABI: everything else is caller-saved). A new fiber's
// stack is laid out so that the first switch "returns" into
// simt_fiber_trampoline, which calls the entry held in r12.
extern "C" void simt_switch_context(void** save, void* load);
extern "C" void simt_fiber_trampoline();
asm(R"(
  .text
  .p2align 4
  .hidden simt_switch_context
  .type simt_switch_context, @function
simt_switch_context:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size simt_switch_context, .-simt_switch_context

  .p2align 4
  .hidden simt_fiber_trampoline
  .type simt_fiber_trampoline, @function
simt_fiber_trampoline:
  callq *%r12
  ud2
  .size simt_fiber_trampoline, .-simt_fiber_trampoline
)");

struct Context {
  void* sp = nullptr;
};

void make_context(Context& context, char* stack_low, size_t bytes) {
  auto top = reinterpret_cast<uintptr_t>(stack_low + bytes) & ~uintptr_t(15);
  auto* slots = reinterpret_cast<uint64_t*>(top - 80);  // 16-aligned: the trampoline's call sees the ABI alignment
  uint32_t mxcsr;
  uint16_t fpu_control;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpu_control));
  slots[0] = mxcsr | (static_cast<uint64_t>(fpu_control) << 32);
  slots[1] = 0;                                               // r15
  slots[2] = 0;                                               // r14
  slots[3] = 0;                                               // r13
  slots[4] = reinterpret_cast<uint64_t>(&fiber_main);         // r12
  slots[5] = 0;                                               // rbx
  slots[6] = 0;                                               // rbp
  slots[7] = reinterpret_cast<uint64_t>(&simt_fiber_trampoline);  // return address
  context.sp = slots;
}

inline void switch_context(Context& from, Context& to) { simt_switch_context(&from.sp, to.sp); }
#else
// Portable fallback: ucontext (a signal-mask system call per switch, so
// slower); -DSIMT_PORTABLE_CONTEXT selects it on x86-64 too, to test it.
struct Context {
  ucontext_t uc;
};

void make_context(Context& context, char* stack_low, size_t bytes) {
  getcontext(&context.uc);
  context.uc.uc_stack.ss_sp = stack_low;
  context.uc.uc_stack.ss_size = bytes;
  context.uc.uc_link = nullptr;
  makecontext(&context.uc, &fiber_main, 0);
}

inline void switch_context(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
#endif

// ---- fibers and the block scheduler ---------------------------------------------------

constexpr size_t kStackBytes = 128 * 1024;
constexpr int kMaxThreadsPerBlock = 1024;

const char* collective_name(Collective kind) {
  switch (kind) {
    case Collective::SyncWarp: return "__syncwarp";
    case Collective::Shfl: return "__shfl_sync";
    case Collective::ShflUp: return "__shfl_up_sync";
    case Collective::ShflDown: return "__shfl_down_sync";
    case Collective::ShflXor: return "__shfl_xor_sync";
    case Collective::Ballot: return "__ballot_sync";
    case Collective::Any: return "__any_sync";
    case Collective::All: return "__all_sync";
    case Collective::ReduceAdd: return "__reduce_add_sync";
  }
  return "?";
}

enum class State : uint8_t { Ready, Barrier, Warp, Done };

struct Fiber {
  Context context;
  char* stack = nullptr;  // lowest usable byte; a guard page lies below
  uint3 index{0, 0, 0};
  int linear = 0;
  State state = State::Ready;
  // The collective the fiber waits in, and what it gets back.
  Collective kind = Collective::SyncWarp;
  unsigned mask = 0;
  int width = 32, arg = 0;
  uint64_t value = 0, result = 0;
};

// The lanes of one warp waiting in one collective.
struct Group {
  unsigned mask, arrived;
  Collective kind;
  int width;
};

std::string thread_text(const uint3& t) {
  std::ostringstream out;
  out << "thread (" << t.x << "," << t.y << "," << t.z << ")";
  return out.str();
}

std::string lanes_text(unsigned lanes) {
  std::ostringstream out;
  out << "{";
  bool first = true;
  for (int l = 0; l < 32; ++l) {
    if (lanes & (1u << l)) {
      out << (first ? "" : ",") << l;
      first = false;
    }
  }
  out << "}";
  return out.str();
}

// One per OS thread: the fibers (their stacks are kept between launches) and
// the state of the block being run.
class BlockRunner {
 public:
  KernelBody body = nullptr;
  void* closure = nullptr;
  Fiber* current = nullptr;
  Context scheduler;
  std::string error;

  void prepare(int threads) {
    if (!alternate_stack_checked_) {
      // The SIGSEGV handler must have a stack of its own to report an
      // overflowed fiber stack; keep one already set (Python's faulthandler
      // sets one on the main thread).
      alternate_stack_checked_ = true;
      stack_t current;
      if (sigaltstack(nullptr, &current) == 0 && (current.ss_flags & SS_DISABLE)) {
        alternate_stack_ = static_cast<char*>(malloc(64 * 1024));
        stack_t alt;
        alt.ss_sp = alternate_stack_;
        alt.ss_size = 64 * 1024;
        alt.ss_flags = 0;
        sigaltstack(&alt, nullptr);
      }
    }
    while (static_cast<int>(fibers_.size()) < threads) {
      Fiber fiber;
      void* mapping = mmap(nullptr, kStackBytes + kPage, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (mapping == MAP_FAILED) throw std::runtime_error("simt: no memory for a fiber stack");
      mprotect(mapping, kPage, PROT_NONE);
      const int slot = g_stack_guards.fetch_add(1);
      if (slot < kMaxStackGuards) g_stack_guard[slot].store(reinterpret_cast<uintptr_t>(mapping));
      fiber.stack = static_cast<char*>(mapping) + kPage;
      fibers_.push_back(fiber);
    }
  }

  // Runs every thread of the current block (blockIdx, blockDim set);
  // returns false with `error` set when the block fails.
  bool run_block(int threads, Random& random) {
    const int warps = (threads + 31) / 32;
    groups_.assign(warps, {});
    ready_.resize(threads);
    std::iota(ready_.begin(), ready_.end(), 0);
    for (int i = 0; i < threads; ++i) {
      Fiber& f = fibers_[i];
      f.linear = i;
      f.index = {static_cast<unsigned>(i % blockDim.x), static_cast<unsigned>((i / blockDim.x) % blockDim.y),
                 static_cast<unsigned>(i / (blockDim.x * blockDim.y))};
      f.state = State::Ready;
      make_context(f.context, f.stack, kStackBytes);
    }
    threads_ = threads;
    int done = 0, at_barrier = 0;
    while (error.empty()) {
      if (ready_.empty()) {
        if (done == threads) return true;
        if (done == 0 && at_barrier == threads) {  // everyone reached __syncthreads
          for (int i = 0; i < threads; ++i) fibers_[i].state = State::Ready;
          ready_.resize(threads);
          std::iota(ready_.begin(), ready_.end(), 0);
          at_barrier = 0;
          continue;
        }
        error = describe_stall(done, at_barrier);
        return false;
      }
      const size_t pick = random.below(ready_.size());
      Fiber& f = fibers_[ready_[pick]];
      ready_[pick] = ready_.back();
      ready_.pop_back();
      current = &f;
      threadIdx = f.index;
      switch_context(scheduler, f.context);
      current = nullptr;
      switch (f.state) {
        case State::Barrier: ++at_barrier; break;
        case State::Done: ++done; break;
        case State::Warp: arrive(f); break;
        case State::Ready: break;
      }
    }
    return false;
  }

  void fail(const std::string& what) {
    if (error.empty()) error = what;
  }

 private:
  // A lane arrived at a collective: join the group of its mask, and complete
  // the group once all the lanes it names are there.
  void arrive(Fiber& f) {
    const int warp = f.linear / 32, lane = f.linear % 32;
    std::vector<Group>& groups = groups_[warp];
    for (size_t g = 0; g < groups.size(); ++g) {
      Group& group = groups[g];
      if ((group.mask & f.mask) == 0) continue;
      if (group.mask != f.mask || group.kind != f.kind || group.width != f.width) {
        std::ostringstream out;
        out << thread_text(f.index) << " (warp " << warp << ", lane " << lane << ") calls " << collective_name(f.kind)
            << " with mask 0x" << std::hex << f.mask << " while lanes " << lanes_text(group.arrived) << " wait in "
            << collective_name(group.kind) << " with mask 0x" << group.mask << std::dec
            << " (divergent warp collectives)";
        fail(out.str());
        return;
      }
      group.arrived |= 1u << lane;
      if (group.arrived == group.mask) {
        complete(warp, group);
        groups.erase(groups.begin() + static_cast<std::ptrdiff_t>(g));
      }
      return;
    }
    Group group{f.mask, 1u << lane, f.kind, f.width};
    if (group.arrived == group.mask) {
      complete(warp, group);
    } else {
      groups.push_back(group);
    }
  }

  void complete(int warp, const Group& group) {
    Fiber* lanes = &fibers_[warp * 32];
    unsigned ballot = 0;
    uint32_t sum = 0;
    for (int l = 0; l < 32; ++l) {
      if (group.mask & (1u << l)) {
        if (lanes[l].value != 0) ballot |= 1u << l;
        sum += static_cast<uint32_t>(lanes[l].value);
      }
    }
    const int w = group.width;
    for (int l = 0; l < 32; ++l) {
      if (!(group.mask & (1u << l))) continue;
      Fiber& f = lanes[l];
      const int segment = l & ~(w - 1), in_segment = l & (w - 1);
      int source = l;
      switch (group.kind) {
        case Collective::Shfl: source = segment + (f.arg & (w - 1)); break;
        case Collective::ShflUp: source = in_segment - f.arg >= 0 ? l - f.arg : l; break;
        case Collective::ShflDown: source = in_segment + f.arg < w ? l + f.arg : l; break;
        case Collective::ShflXor: source = (l ^ f.arg) < segment + w ? (l ^ f.arg) : l; break;
        default: break;
      }
      switch (group.kind) {
        case Collective::SyncWarp: f.result = 0; break;
        case Collective::Ballot: f.result = ballot; break;
        case Collective::Any: f.result = ballot != 0; break;
        case Collective::All: f.result = ballot == group.mask; break;
        case Collective::ReduceAdd: f.result = sum; break;
        default:
          // A lane outside the mask has no defined value to give: a NaN
          // pattern makes its use visible.
          f.result = (group.mask >> source) & 1u ? lanes[source].value : 0x7ff4dead7ff4deadull;
      }
      f.state = State::Ready;
      ready_.push_back(warp * 32 + l);
    }
  }

  std::string describe_stall(int done, int at_barrier) {
    std::ostringstream out;
    if (at_barrier > 0 && at_barrier + done == threads_) {
      out << "__syncthreads() is not reached by every thread of the block: " << done << " of " << threads_
          << " threads exited while " << at_barrier << " wait at the barrier (first waiting: ";
      for (int i = 0; i < threads_; ++i) {
        if (fibers_[i].state == State::Barrier) {
          out << thread_text(fibers_[i].index);
          break;
        }
      }
      out << ")";
      return out.str();
    }
    out << "deadlock:";
    for (size_t warp = 0; warp < groups_.size(); ++warp) {
      for (const Group& group : groups_[warp]) {
        const unsigned missing = group.mask & ~group.arrived;
        out << " warp " << warp << " lanes " << lanes_text(group.arrived) << " wait in "
            << collective_name(group.kind) << " for lanes " << lanes_text(missing);
        for (int l = 0; l < 32; ++l) {
          if (!(missing & (1u << l))) continue;
          const State s = fibers_[warp * 32 + l].state;
          const char* where = s == State::Done      ? " has exited"
                              : s == State::Barrier ? " waits at __syncthreads"
                                                    : " waits in another collective";
          out << " (lane " << l << where << ")";
          break;
        }
        out << ";";
      }
    }
    return out.str();
  }

  std::vector<Fiber> fibers_;
  std::vector<std::vector<Group>> groups_;
  std::vector<int> ready_;
  int threads_ = 0;
  char* alternate_stack_ = nullptr;
  bool alternate_stack_checked_ = false;
};

thread_local BlockRunner t_runner;

void fiber_main() {
  BlockRunner& runner = t_runner;
  Fiber& f = *runner.current;
  try {
    runner.body(runner.closure);
  } catch (const std::exception& e) {
    runner.fail(thread_text(f.index) + ": " + e.what());
  } catch (...) {
    runner.fail(thread_text(f.index) + ": unknown exception");
  }
  f.state = State::Done;
  switch_context(f.context, runner.scheduler);
  abort();  // a finished fiber is never resumed
}

Fiber& current_fiber(const char* what) {
  Fiber* f = t_runner.current;
  if (f == nullptr) throw KernelError(std::string(what) + " called outside a kernel");
  return *f;
}

void yield(Fiber& f) { switch_context(f.context, t_runner.scheduler); }

}  // namespace

// ---- public API ---------------------------------------------------------------------------

void set_seed(uint64_t seed) { g_seed.store(seed); }

void set_multiprocessors(int count) {
  if (count < 1) throw std::invalid_argument("simt: multiprocessors must be at least 1");
  g_multiprocessors.store(count);
}

void set_debug(bool on) {
  if (on) install_handler();
  g_debug.store(on);
}

const char* launch_log() {
  std::lock_guard<std::mutex> lock(g_log_mutex);
  std::ostringstream out;
  for (const auto& [key, count] : g_launches) out << key.first << '\t' << key.second << '\t' << count << '\n';
  g_log_text = out.str();
  return g_log_text.c_str();
}

void reset_launch_log() {
  std::lock_guard<std::mutex> lock(g_log_mutex);
  g_launches.clear();
}

const char* last_error_detail() { return t_error_detail.c_str(); }

void* guarded_alloc(size_t bytes) {
  if (bytes == 0) return nullptr;
  install_handler();
  const size_t body = (bytes + kPage - 1) / kPage * kPage, total = body + 2 * kPage;
  void* mapping = mmap(nullptr, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapping == MAP_FAILED) return nullptr;
  const auto base = reinterpret_cast<uintptr_t>(mapping);
  if (mprotect(reinterpret_cast<void*>(base + kPage), body, PROT_READ | PROT_WRITE) != 0) {
    munmap(mapping, total);
    return nullptr;
  }
  const uintptr_t data = base + kPage + body - bytes;
  memset(reinterpret_cast<void*>(base + kPage), kSentinel, data - (base + kPage));
  // All bits set is a NaN in every float dtype: an output element no kernel
  // writes fails the comparison with its reference.
  memset(reinterpret_cast<void*>(data), kPoison, bytes);
  std::lock_guard<std::mutex> lock(g_guard_mutex);
  for (size_t tries = 0; tries < kMaxGuarded; ++tries) {
    const size_t i = (g_guard_hint + tries) % kMaxGuarded;
    if (g_guards[i].base.load() != 0) continue;
    g_guards[i].total = total;
    g_guards[i].data = data;
    g_guards[i].bytes = bytes;
    g_guards[i].opened.store(0);
    g_guards[i].base.store(base, std::memory_order_release);
    if (i + 1 > g_guard_high.load()) g_guard_high.store(i + 1, std::memory_order_release);
    g_guard_slot[data] = i;
    g_guard_hint = i + 1;
    return reinterpret_cast<void*>(data);
  }
  munmap(mapping, total);
  return nullptr;  // more live guarded buffers than the table holds
}

void guarded_free(void* data) {
  if (data == nullptr) return;
  std::lock_guard<std::mutex> lock(g_guard_mutex);
  const auto found = g_guard_slot.find(reinterpret_cast<uintptr_t>(data));
  if (found == g_guard_slot.end()) return;
  GuardEntry& e = g_guards[found->second];
  const uintptr_t base = e.base.load();
  e.base.store(0);
  munmap(reinterpret_cast<void*>(base), e.total);
  g_guard_slot.erase(found);
}

void syncthreads() {
  Fiber& f = current_fiber("__syncthreads");
  f.state = State::Barrier;
  yield(f);
}

uint64_t warp_collective(Collective kind, unsigned mask, uint64_t value, int arg, int width) {
  Fiber& f = current_fiber(collective_name(kind));
  const int lane = f.linear % 32, warp_base = f.linear - lane;
  const int threads = static_cast<int>(blockDim.x * blockDim.y * blockDim.z);
  const int lanes_present = std::min(32, threads - warp_base);
  const unsigned present = lanes_present == 32 ? 0xffffffffu : (1u << lanes_present) - 1;
  const bool bad_width = width < 1 || width > 32 || (width & (width - 1)) != 0;
  if (!(mask & (1u << lane)) || (mask & ~present) || bad_width) {
    std::ostringstream problem;
    problem << collective_name(kind);
    if (!(mask & (1u << lane))) {
      problem << ": mask 0x" << std::hex << mask << " leaves out the calling lane " << std::dec << lane;
    } else if (mask & ~present) {
      problem << ": mask 0x" << std::hex << mask << " names lanes " << std::dec << lanes_text(mask & ~present)
              << " that this warp does not have (" << threads << " threads per block)";
    } else {
      problem << ": width " << width << " is not a power of two up to 32";
    }
    throw KernelError(problem.str());
  }
  f.kind = kind;
  f.mask = mask;
  f.value = value;
  f.arg = arg;
  f.width = width;
  f.state = State::Warp;
  yield(f);
  return f.result;
}

cudaError_t launch(const char* written_name, const char* pretty, dim3 grid, dim3 block, size_t shared_bytes,
                   cudaStream_t, KernelBody body, void* closure) {
  const std::string name = base_name(written_name), instance = instantiation(pretty);
  {
    std::lock_guard<std::mutex> lock(g_log_mutex);
    ++g_launches[{name, instance}];
  }
  const uint64_t threads = static_cast<uint64_t>(block.x) * block.y * block.z;
  if (threads == 0 || threads > kMaxThreadsPerBlock || block.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
      grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535 || shared_bytes > 0) {
    std::ostringstream out;
    out << name << ": invalid launch configuration grid (" << grid.x << "," << grid.y << "," << grid.z << ") block ("
        << block.x << "," << block.y << "," << block.z << ")";
    set_error(cudaErrorInvalidConfiguration, out.str());
    return cudaErrorInvalidConfiguration;
  }
  BlockRunner& runner = t_runner;
  if (runner.current != nullptr) {
    set_error(cudaErrorLaunchFailure, name + ": launched from device code (dynamic parallelism is not emulated)");
    return cudaErrorLaunchFailure;
  }
  runner.prepare(static_cast<int>(threads));
  runner.body = body;
  runner.closure = closure;
  runner.error.clear();
  install_handler();

  // Blocks run one at a time in a seeded order; each block's thread order
  // has its own seed, so a result depends on the seed, not on what ran before.
  const uint64_t seed = g_seed.load() ^ hash_text(instance.c_str());
  const uint64_t blocks = static_cast<uint64_t>(grid.x) * grid.y * grid.z;
  std::vector<uint64_t> order(blocks);
  std::iota(order.begin(), order.end(), uint64_t(0));
  Random block_order(seed);
  for (uint64_t i = blocks; i > 1; --i) std::swap(order[i - 1], order[block_order.below(i)]);
  gridDim = grid;
  blockDim = block;
  std::string failed_block;
  const std::string guard_report = in_device_code([&] {
    for (const uint64_t b : order) {
      blockIdx = {static_cast<unsigned>(b % grid.x), static_cast<unsigned>((b / grid.x) % grid.y),
                  static_cast<unsigned>(b / (static_cast<uint64_t>(grid.x) * grid.y))};
      Random thread_order(seed ^ (0x2545f4914f6cdd1dull * (b + 1)));
      if (!runner.run_block(static_cast<int>(threads), thread_order)) {
        std::ostringstream out;
        out << "block (" << blockIdx.x << "," << blockIdx.y << "," << blockIdx.z << ")";
        failed_block = out.str();
        break;
      }
    }
  });
  if (!runner.error.empty()) {
    set_error(cudaErrorLaunchFailure, instance + ", " + failed_block + ": " + runner.error);
    return cudaErrorLaunchFailure;
  }
  if (!guard_report.empty()) {
    set_error(cudaErrorIllegalAddress, instance + ": " + guard_report);
    return cudaErrorIllegalAddress;
  }
  return cudaSuccess;
}

}  // namespace simt

// ---- the runtime API ------------------------------------------------------------------

cudaError_t cudaGetLastError() {
  const cudaError_t error = simt::t_last_error;
  simt::t_last_error = cudaSuccess;
  return error;
}

cudaError_t cudaPeekAtLastError() { return simt::t_last_error; }

const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
  }
  return "cudaErrorUnknown";
}

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
  }
  return "unknown error";
}

cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int) {
  switch (attribute) {
    case cudaDevAttrMultiProcessorCount: *value = simt::g_multiprocessors.load(); return cudaSuccess;
    case cudaDevAttrMaxThreadsPerBlock: *value = 1024; return cudaSuccess;
    case cudaDevAttrWarpSize: *value = 32; return cudaSuccess;
  }
  return cudaErrorInvalidValue;
}

cudaError_t cudaMemsetAsync(void* destination, int value, size_t bytes, cudaStream_t) {
  const std::string report = simt::in_device_code([&] { memset(destination, value, bytes); });
  if (!report.empty()) {
    simt::set_error(cudaErrorIllegalAddress, "cudaMemsetAsync: " + report);
    return cudaErrorIllegalAddress;
  }
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* destination, const void* source, size_t bytes, cudaMemcpyKind, cudaStream_t) {
  const std::string report = simt::in_device_code([&] { memcpy(destination, source, bytes); });
  if (!report.empty()) {
    simt::set_error(cudaErrorIllegalAddress, "cudaMemcpyAsync: " + report);
    return cudaErrorIllegalAddress;
  }
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
