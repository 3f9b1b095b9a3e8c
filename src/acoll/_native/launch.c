/*
 * acoll's GPU launcher: the enqueue of prepared peer-to-peer calls in one C call.
 *
 * A prepared call (acoll/_p2p/fast.py) enqueues, for each rank of this process and loop
 * that makes it, a short fixed sequence of CUDA driver calls. Made one by one through
 * ctypes and CuPy each costs microseconds of Python, which is most of a small
 * collective's time when one task drives several GPUs. This file runs the whole sequence
 * of every such rank from one call.
 *
 * Contract (the Python side is acoll/_cuda/launcher.py):
 *
 *   acoll_ln_open(path)      loads the CUDA driver library at `path` (dlopen, so that this
 *                            file builds and loads on machines without CUDA). 0 on success,
 *                            -1 when the library cannot be loaded, -2 when a symbol is
 *                            missing. Call once before anything else; later calls return 0.
 *   acoll_ln_run(jobs, n)    runs n jobs in order (below) and returns how many failed. A
 *                            failed job stops at its first failed driver call; its `result`
 *                            holds that call's CUresult and `failed_at` which call it was
 *                            (LN_AT_*); the following jobs still run. The context current
 *                            on the calling thread when it was called is current again on
 *                            return (set again only if a job changed it).
 *   acoll_ln_record(ctx, event, stream)
 *                            records `event` on `stream` under context `ctx` (0: the
 *                            current one; switched to and back only when it differs);
 *                            CUresult.
 *   acoll_ln_spin(event, ns) queries `event` until it has passed or `ns` nanoseconds went
 *                            by; the last query's CUresult (0: passed, 600: not yet).
 *   acoll_ln_layout(out)     the structures' sizes and every field's offset (the Python side
 *                            checks its mirror against them when it loads the library);
 *                            returns how many words it wrote.
 *   acoll_ln_primary(dev)    device `dev`'s primary context, retained (0 on failure).
 *
 * One job, in this order, stopping at the first failure:
 *   1. make `ctx` current (skipped when current already: a switch costs; when 0, the job
 *      runs under whatever is current then, which may be an earlier job's context);
 *   2. make `stream` wait for `wait1`, then for `wait2` (each skipped when 0);
 *   3. for each of the `nsteps` steps: its copies (cuMemcpyAsync on `stream`, addresses
 *      as unified addressing resolves them), then write `epoch_base + i + 1` (i: the
 *      step's index) into the 64-bit word at the step's `epoch_field` and launch its
 *      kernel (`blocks` x `threads`, no shared memory, parameters `params`) on `stream`;
 *      the driver copies the parameters at the launch, so the next step may rewrite them;
 *   4. record `record` on `stream` (skipped when 0);
 *   5. make `then_stream` wait for `record` (skipped when either is 0: 0 means "none" here,
 *      so a job cannot name the legacy default stream, handle 0, in any field).
 *
 * Nothing here allocates, blocks on a lock of its own or keeps state besides the driver's
 * entry points. The structures' layouts are mirrored by ctypes in launcher.py: change both.
 */

#define _POSIX_C_SOURCE 200809L

#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

typedef int CUresult;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUevent;
typedef void *CUfunction;
typedef unsigned long long CUdeviceptr;

#define LN_NOT_READY 600 /* CUDA_ERROR_NOT_READY */
#define LN_NOT_OPEN 3    /* CUDA_ERROR_NOT_INITIALIZED: acoll_ln_open did not succeed */

enum { LN_AT_NONE = 0, LN_AT_CONTEXT, LN_AT_WAIT, LN_AT_COPY, LN_AT_LAUNCH, LN_AT_RECORD,
       LN_AT_THEN };

typedef struct {
    uint64_t dst, src, nbytes;
} ln_copy;

typedef struct {
    uint64_t fn;          /* CUfunction */
    uint64_t params;      /* void ** (cuLaunchKernel's kernelParams) */
    uint64_t epoch_field; /* uint64_t * inside the parameter block */
    uint32_t blocks, threads;
    uint32_t first_copy, ncopies; /* this step's copies: copies[first_copy ...] */
} ln_step;

typedef struct {
    uint64_t ctx, stream, wait1, wait2, record, then_stream;
    uint64_t epoch_base;
    uint64_t steps;  /* const ln_step * */
    uint64_t copies; /* const ln_copy * */
    int32_t nsteps;
    int32_t result;    /* out: CUresult of the failed call, 0 */
    int32_t failed_at; /* out: LN_AT_* */
    int32_t reserved;
} ln_job;

static CUresult (*ctx_get)(CUcontext *);
static CUresult (*ctx_set)(CUcontext);
static CUresult (*stream_wait)(CUstream, CUevent, unsigned int);
static CUresult (*copy_async)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
static CUresult (*launch)(CUfunction, unsigned int, unsigned int, unsigned int, unsigned int,
                          unsigned int, unsigned int, unsigned int, CUstream, void **,
                          void **);
static CUresult (*event_record)(CUevent, CUstream);
static CUresult (*event_query)(CUevent);
static CUresult (*device_get)(int *, int);
static CUresult (*primary_retain)(CUcontext *, int);
static int opened;

int acoll_ln_version(void) { return 1; }

/* Sizes and every field's offset, for the Python side to check its mirror. */
#define OFF(t, f) out[k++] = offsetof(t, f)
int acoll_ln_layout(uint64_t out[32]) {
    int k = 0;
    out[k++] = sizeof(ln_copy);
    out[k++] = sizeof(ln_step);
    out[k++] = sizeof(ln_job);
    OFF(ln_copy, dst); OFF(ln_copy, src); OFF(ln_copy, nbytes);
    OFF(ln_step, fn); OFF(ln_step, params); OFF(ln_step, epoch_field); OFF(ln_step, blocks);
    OFF(ln_step, threads); OFF(ln_step, first_copy); OFF(ln_step, ncopies);
    OFF(ln_job, ctx); OFF(ln_job, stream); OFF(ln_job, wait1); OFF(ln_job, wait2);
    OFF(ln_job, record); OFF(ln_job, then_stream); OFF(ln_job, epoch_base);
    OFF(ln_job, steps); OFF(ln_job, copies); OFF(ln_job, nsteps); OFF(ln_job, result);
    OFF(ln_job, failed_at); OFF(ln_job, reserved);
    return k;
}

int acoll_ln_open(const char *path) {
    if (opened) return 0;
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) return -1;
    *(void **)&ctx_get = dlsym(lib, "cuCtxGetCurrent");
    *(void **)&ctx_set = dlsym(lib, "cuCtxSetCurrent");
    *(void **)&stream_wait = dlsym(lib, "cuStreamWaitEvent");
    *(void **)&copy_async = dlsym(lib, "cuMemcpyAsync");
    *(void **)&launch = dlsym(lib, "cuLaunchKernel");
    *(void **)&event_record = dlsym(lib, "cuEventRecord");
    *(void **)&event_query = dlsym(lib, "cuEventQuery");
    *(void **)&device_get = dlsym(lib, "cuDeviceGet");
    *(void **)&primary_retain = dlsym(lib, "cuDevicePrimaryCtxRetain");
    if (!ctx_get || !ctx_set || !stream_wait || !copy_async || !launch || !event_record ||
        !event_query || !device_get || !primary_retain) {
        dlclose(lib);
        return -2;
    }
    opened = 1;
    return 0;
}

/* Device `ordinal`'s primary context, retained (0 on failure). The runtime binds it to a
 * thread lazily on some CUDA versions, so the thread's current context after
 * cudaSetDevice is not a reliable way to learn it. */
uint64_t acoll_ln_primary(int ordinal) {
    int dev = 0;
    CUcontext ctx = NULL;
    if (!opened || device_get(&dev, ordinal) != 0 || primary_retain(&ctx, dev) != 0) return 0;
    return (uint64_t)(uintptr_t)ctx;
}

static int run_job(ln_job *job, CUcontext *cur) {
    CUstream stream = (CUstream)(uintptr_t)job->stream;
    CUresult rc;
    CUcontext want = (CUcontext)(uintptr_t)job->ctx;
    if (want && want != *cur) { /* (a context switch costs: only when it changes) */
        if ((rc = ctx_set(want)) != 0) {
            job->failed_at = LN_AT_CONTEXT;
            return rc;
        }
        *cur = want;
    }
    if (job->wait1 && (rc = stream_wait(stream, (CUevent)(uintptr_t)job->wait1, 0)) != 0) {
        job->failed_at = LN_AT_WAIT;
        return rc;
    }
    if (job->wait2 && (rc = stream_wait(stream, (CUevent)(uintptr_t)job->wait2, 0)) != 0) {
        job->failed_at = LN_AT_WAIT;
        return rc;
    }
    const ln_step *steps = (const ln_step *)(uintptr_t)job->steps;
    const ln_copy *copies = (const ln_copy *)(uintptr_t)job->copies;
    for (int32_t i = 0; i < job->nsteps; i++) {
        const ln_step *s = &steps[i];
        for (uint32_t c = 0; c < s->ncopies; c++) {
            const ln_copy *cp = &copies[s->first_copy + c];
            if ((rc = copy_async((CUdeviceptr)cp->dst, (CUdeviceptr)cp->src,
                                 (size_t)cp->nbytes, stream)) != 0) {
                job->failed_at = LN_AT_COPY;
                return rc;
            }
        }
        *(uint64_t *)(uintptr_t)s->epoch_field = job->epoch_base + (uint64_t)i + 1;
        if ((rc = launch((CUfunction)(uintptr_t)s->fn, s->blocks, 1, 1, s->threads, 1, 1, 0,
                         stream, (void **)(uintptr_t)s->params, NULL)) != 0) {
            job->failed_at = LN_AT_LAUNCH;
            return rc;
        }
    }
    if (job->record) {
        CUevent ev = (CUevent)(uintptr_t)job->record;
        if ((rc = event_record(ev, stream)) != 0) {
            job->failed_at = LN_AT_RECORD;
            return rc;
        }
        if (job->then_stream &&
            (rc = stream_wait((CUstream)(uintptr_t)job->then_stream, ev, 0)) != 0) {
            job->failed_at = LN_AT_THEN;
            return rc;
        }
    }
    return 0;
}

int acoll_ln_run(ln_job *jobs, int n) {
    if (!opened) {
        for (int k = 0; k < n; k++) {
            jobs[k].result = LN_NOT_OPEN;
            jobs[k].failed_at = LN_AT_CONTEXT;
        }
        return n;
    }
    CUcontext before = NULL;
    int known = ctx_get(&before) == 0; /* (unknown: never "restore" a guess) */
    CUcontext cur = known ? before : NULL;
    int failed = 0;
    for (int k = 0; k < n; k++) {
        jobs[k].failed_at = LN_AT_NONE;
        jobs[k].result = run_job(&jobs[k], &cur);
        failed += jobs[k].result != 0;
    }
    if (known && cur != before) ctx_set(before);
    return failed;
}

int acoll_ln_record(uint64_t ctx, uint64_t event, uint64_t stream) {
    if (!opened) return LN_NOT_OPEN;
    CUcontext before = NULL;
    int known = ctx_get(&before) == 0;
    CUcontext want = (CUcontext)(uintptr_t)ctx;
    int switch_ = want != NULL && (!known || want != before);
    CUresult rc = switch_ ? ctx_set(want) : 0;
    if (rc == 0) rc = event_record((CUevent)(uintptr_t)event, (CUstream)(uintptr_t)stream);
    if (switch_ && known) ctx_set(before);
    return rc;
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int acoll_ln_spin(uint64_t event, int64_t ns) {
    if (!opened) return LN_NOT_OPEN;
    CUevent ev = (CUevent)(uintptr_t)event;
    int64_t end = now_ns() + ns;
    for (;;) {
        CUresult rc = event_query(ev);
        if (rc != LN_NOT_READY || now_ns() >= end) return rc;
    }
}
