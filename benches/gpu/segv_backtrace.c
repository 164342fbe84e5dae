/* LD_PRELOAD helper for crash hunting on the GPU host (no gdb there): on SIGSEGV, SIGBUS or
 * SIGABRT print the native backtrace to stderr, then die of the same signal.
 * Build: gcc -shared -fPIC -O0 -g -o segv_backtrace.so segv_backtrace.c */
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

static void on_fatal(int sig) {
  void *frames[96];
  const char *msg = "\n== slotpool segv_backtrace: fatal signal, native backtrace:\n";
  write(2, msg, strlen(msg));
  int n = backtrace(frames, 96);
  backtrace_symbols_fd(frames, n, 2);
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install_handlers(void) {
  signal(SIGSEGV, on_fatal);
  signal(SIGBUS, on_fatal);
  signal(SIGABRT, on_fatal);
}
