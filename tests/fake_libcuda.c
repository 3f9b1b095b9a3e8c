/*
 * A stand-in for the CUDA driver library, for tests of acoll's native launcher
 * (src/acoll/_native/launch.c) on machines without a GPU. It has the nine entry points
 * the launcher loads; each records its call in a log the test reads back (fake_log), and
 * any one of them can be told to fail (fake_fail). cuMemcpyAsync really copies once
 * fake_real_copies(1) said so (the tests then pass host memory); cuLaunchKernel records the 64-bit word its first parameter
 * points to (the tests make that the epoch); cuEventQuery answers "not ready" a set
 * number of times before "done".
 */
#include <stdint.h>
#include <string.h>

typedef struct {
    int64_t kind; /* 'G' get, 'S' set, 'W' wait, 'C' copy, 'L' launch, 'R' record, 'Q' query,
                     'D' device, 'P' primary context */
    uint64_t a, b, c, d, e;
} entry;

#define MOST 256
static entry entries[MOST];
static int count;
static uint64_t current = 0xC0;
static int fail_kind, fail_nth, fail_code, seen_of_kind;
static int not_ready_left;
static int real_copies;

static int log_call(int kind, uint64_t a, uint64_t b, uint64_t c, uint64_t d, uint64_t e) {
    if (count < MOST) entries[count++] = (entry){kind, a, b, c, d, e};
    if (kind == fail_kind && ++seen_of_kind == fail_nth) return fail_code;
    return 0;
}

void fake_reset(uint64_t ctx) {
    count = 0;
    current = ctx;
    fail_kind = fail_nth = fail_code = seen_of_kind = 0;
    not_ready_left = 0;
    real_copies = 0;
}
void fake_real_copies(int on) { real_copies = on; }
void fake_fail(int kind, int nth, int code) {
    fail_kind = kind;
    fail_nth = nth;
    fail_code = code;
    seen_of_kind = 0;
}
void fake_not_ready(int times) { not_ready_left = times; }
int fake_log(entry *out, int most) {
    int n = count < most ? count : most;
    memcpy(out, entries, (size_t)n * sizeof(entry));
    return n;
}
uint64_t fake_current(void) { return current; }

int cuCtxGetCurrent(void **ctx) {
    int rc = log_call('G', current, 0, 0, 0, 0);
    if (rc == 0) *ctx = (void *)(uintptr_t)current;
    return rc;
}
int cuCtxSetCurrent(void *ctx) {
    int rc = log_call('S', (uint64_t)(uintptr_t)ctx, 0, 0, 0, 0);
    if (rc == 0) current = (uint64_t)(uintptr_t)ctx;
    return rc;
}
int cuStreamWaitEvent(void *stream, void *event, unsigned int flags) {
    return log_call('W', (uint64_t)(uintptr_t)stream, (uint64_t)(uintptr_t)event, flags,
                    current, 0);
}
int cuMemcpyAsync(uint64_t dst, uint64_t src, size_t n, void *stream) {
    int rc = log_call('C', dst, src, n, (uint64_t)(uintptr_t)stream, current);
    if (rc == 0 && real_copies) memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    return rc;
}
int cuLaunchKernel(void *fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned shared, void *stream, void **params, void **extra) {
    (void)gy; (void)gz; (void)by; (void)bz; (void)shared; (void)extra;
    uint64_t first = params ? *(uint64_t *)params[0] : 0;
    return log_call('L', (uint64_t)(uintptr_t)fn, gx, bx, (uint64_t)(uintptr_t)stream, first);
}
int cuEventRecord(void *event, void *stream) {
    return log_call('R', (uint64_t)(uintptr_t)event, (uint64_t)(uintptr_t)stream, current,
                    0, 0);
}
int cuDeviceGet(int *dev, int ordinal) {
    int rc = log_call('D', (uint64_t)ordinal, 0, 0, 0, 0);
    if (rc == 0) *dev = ordinal;
    return rc;
}
int cuDevicePrimaryCtxRetain(void **ctx, int dev) {
    int rc = log_call('P', (uint64_t)dev, 0, 0, 0, 0);
    if (rc == 0) *ctx = (void *)(uintptr_t)(0xD0 + dev);
    return rc;
}
int cuEventQuery(void *event) {
    int rc = log_call('Q', (uint64_t)(uintptr_t)event, 0, 0, 0, 0);
    if (rc) return rc;
    if (not_ready_left > 0) {
        not_ready_left--;
        return 600;
    }
    return 0;
}
