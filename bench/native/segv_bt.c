/* A SIGSEGV/SIGBUS reporter for device probes (LD_PRELOAD): prints the faulting address,
 * the instruction pointer's library and symbol, and a native backtrace to stderr, then
 * lets the signal kill the process as before. Build: cc -O1 -g -shared -fPIC -o
 * segv_bt.so segv_bt.c -ldl. Run without PYTHONFAULTHANDLER (it would take the signal
 * first). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

static void report(int sig, siginfo_t *info, void *uc_) {
    ucontext_t *uc = uc_;
    void *ip = (void *)uc->uc_mcontext.gregs[REG_RIP];
    Dl_info di;
    memset(&di, 0, sizeof di);
    dladdr(ip, &di);
    dprintf(2, "\n=== segv_bt: signal %d at address %p, thread %ld, ip %p in %s (%s+%#lx)\n",
            sig, info->si_addr, (long)syscall(SYS_gettid), ip,
            di.dli_fname ? di.dli_fname : "?", di.dli_sname ? di.dli_sname : "?",
            di.dli_saddr ? (unsigned long)((char *)ip - (char *)di.dli_saddr)
                         : (unsigned long)((char *)ip - (char *)di.dli_fbase));
    void *frames[48];
    int n = backtrace(frames, 48);
    backtrace_symbols_fd(frames, n, 2);
    dprintf(2, "=== segv_bt: end\n");
    signal(sig, SIG_DFL);
    raise(sig);
}

__attribute__((constructor)) static void install(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = report;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigaction(SIGSEGV, &sa, NULL);
    sigaction(SIGBUS, &sa, NULL);
}
