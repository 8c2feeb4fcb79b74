/* A native backtrace on SIGSEGV for a process that has no debugger at hand:
 *   gcc -shared -fPIC -o /tmp/segv_backtrace.so scripts/segv_backtrace.c
 *   LD_PRELOAD=/tmp/segv_backtrace.so python3 script.py
 * prints the frames (library and offset) to stderr, then lets the signal
 * end the process as it would have. Map an offset in lowbit's library to
 * its function with addr2line -f -C -e build/liblowbit_ops.so 0xOFFSET. */
#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

static void on_segv(int sig) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) { signal(SIGSEGV, on_segv); }
