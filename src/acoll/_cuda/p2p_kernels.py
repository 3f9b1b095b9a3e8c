"""Collective kernels over peer-visible GPU memory (the intra-host P2P path).

Every rank of a P2P domain (see :mod:`acoll._p2p`) owns one device allocation: a *signal
area* of flags and descriptors, then a *data area* (its workspace). Each rank sees every
peer's allocation at some address of its own (peer access in one process, CUDA IPC
between processes); a device-side table ``tab`` lists them: ``tab[p]`` is rank ``p``'s
data area, ``tab[MAXR + p]`` its signal area, as this rank addresses them.

One kernel launch runs one step of one collective on every rank, with the same grid on
every rank. Its shape is: *start barrier* (publish my descriptor, tell every peer I
arrived, wait until every peer arrived, check that every peer runs the same step), the
data phase, and an *end barrier* (nobody leaves while a peer may still read its memory).
The two-shot all-reduce adds a *middle barrier* between its reduce-scatter and all-gather
halves. Barriers are per block: block ``b`` of every rank handles the same elements, so
a block only waits for the same block of its peers. Flags hold the step's *epoch*, a
counter every rank advances identically, written with ``st.release.sys`` and read with
``ld.acquire.sys``; one thread per peer signals and waits, then the block syncs.

Where each rank's data is (``own_ws``/``reg``, chosen per rank and call and published in
its descriptor): either the rank copied its input into its own data area at ``ws_off``
bytes (stream-ordered, before the launch) and peers read it there; or its buffers lie in
allocations registered with the communicator (every peer mapped them) and it publishes
(registration, offset); or (ranks all in one process) it publishes its user pointers.
Peers read the last two in place. A rank whose call would let
peers read memory it overwrites (in-place one-shot all-reduce, in-place all-to-all) takes
the workspace even then.

Bounded waits: a wait gives up after ``timeout_ns`` (GPU ``%globaltimer``) or as soon as
the host sets ``abort[0]`` (the communicator failed), recording ``(code, peer, phase,
value)`` in the block's row of ``err`` (host-mapped memory the host reads after the
step). Codes: :data:`ERR_TIMEOUT`, :data:`ERR_ABORTED`, :data:`ERR_MISMATCH` (a peer's
descriptor differs from mine: it is running another collective or size).

Reductions combine ranks in rank order 0, 1, ..., n-1 on every rank (so every rank gets
identical bits), with the element functions of :mod:`acoll._cuda.kernels`. AVG on
floating-point dtypes multiplies every operand by the rounded ``1/n`` as it loads it
(NCCL's PreMulSum: the bits of scaling each rank's input first, with no pass of its own);
on integers it divides once at the end. Loads use ``ld.global.cg`` (L2 only: peers' data
is never stale in L1).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._dtypes import DTYPE_NAMES, ReduceOp, parse_dtype, prescales
from .kernels import _CTYPES, _PRELUDE, _bits_code, _finish_code, _op_code, _scale_code

__all__ = [
    "ERR_ABORTED", "ERR_MISMATCH", "ERR_TIMEOUT", "ERR_WORDS", "MAXR", "MAX_BLOCKS",
    "MAX_REGS", "Mode", "P2PSource", "SIGNAL_BYTES", "THREADS", "copy_source", "reduce_source",
]

#: Most ranks in one domain, most blocks per launch, threads per block, registrations.
MAXR = 32
MAX_REGS = 256
MAX_BLOCKS = 128
THREADS = 512
#: Bytes of the signal area: start/mid/end flags [block][rank], then per-block descriptors
#: (8 words) and the per-block error rows are host memory (not here).
SIGNAL_BYTES = (3 * MAX_BLOCKS * MAXR + 8 * MAX_BLOCKS) * 8

ERR_TIMEOUT, ERR_ABORTED, ERR_MISMATCH = 1, 2, 3
#: Words per error row (one row per block): code, peer, phase, value, value2 (then
#: padding).
ERR_WORDS = 8
PHASES = ("start", "middle", "end")


class Mode:
    """What a launch computes (the ``mode`` kernel argument)."""

    ALL_REDUCE_ONE_SHOT = 0
    ALL_REDUCE_TWO_SHOT = 1
    REDUCE_SCATTER = 2
    REDUCE = 3
    ALL_GATHER = 4
    BROADCAST = 5
    ALL_TO_ALL = 6

    REDUCING = (0, 1, 2, 3)


@dataclass(frozen=True)
class P2PSource:
    """One generated translation unit; the kernel is ``extern "C"`` ``name``.

    Parameters: ``(const u64* tab, u64* err, const volatile unsigned* abort, int rank,
    int nranks, int root, int mode, int own_ws, u64 epoch, u64 timeout_ns, u64 sig,
    u64 sig2, const T* in, T* out, u64 n, u64 ws_off, u64 out_stride, u64 src_stride,
    u64 user_stride, const u64* regtab, u64 reg, u64 reg_in_off, u64 reg_out_off)``;
    ``src_stride`` is the distance between rank blocks in a workspace, ``user_stride`` in
    a user buffer; ``reg`` names the registrations holding ``in`` and ``out``
    (``(in_index + 1) | (out_index + 1) << 16``, 0: none) at those byte offsets, and
    ``regtab[index * MAXR + p]`` is rank ``p``'s registered allocation as mapped here;
    ``sig``/``sig2`` describe the step (every rank must pass the same); counts in
    elements of ``T`` (bytes for the copy kernel), ``ws_off`` in bytes.
    """

    name: str
    dtype: np.dtype[Any] | None  # None: the byte-copy kernel
    op: ReduceOp | None
    includes: tuple[str, ...]
    body: str

    @property
    def code(self) -> str:
        return "".join(f"#include <{h}>\n" for h in self.includes) + self.body


_COMMON = r"""
#define MAXR {maxr}
#define NB {nb}
#define SIG_START(b, p) ((u64)(b) * MAXR + (p))
#define SIG_MID(b, p) ((u64)NB * MAXR + (u64)(b) * MAXR + (p))
#define SIG_END(b, p) (2ull * NB * MAXR + (u64)(b) * MAXR + (p))
#define SIG_DESC(b, k) (3ull * NB * MAXR + (u64)(b) * 8 + (k))
#define ERR_WORDS {err_words}

static __device__ __forceinline__ u64 acoll_ld_acquire(const u64* p) {{
  u64 v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}}
static __device__ __forceinline__ void acoll_st_release(u64* p, u64 v) {{
  asm volatile("st.release.sys.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}}
static __device__ __forceinline__ u64 acoll_now() {{
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}}

struct acoll_args {{
  const u64* tab; u64* err; const volatile unsigned* abort_flag;
  int rank, nranks, root, mode, own_ws;
  u64 epoch, timeout_ns, sig, sig2;
}};

// One failing thread per block records why; the host reads the rows after the step.
static __device__ void acoll_fail(const acoll_args& a, u64 code, int peer, int phase,
                                  u64 value, u64 value2 = 0) {{
  volatile u64* row = a.err + (u64)blockIdx.x * ERR_WORDS;
  row[1] = (u64)peer;
  row[2] = (u64)phase;
  row[3] = value;
  row[4] = value2;
  __threadfence_system();
  row[0] = code;
  a.err[(u64)NB * ERR_WORDS] = 1;  // the one word the host polls
}}

// Wait until *flag >= epoch; false (and a recorded error) on timeout or abort.
static __device__ bool acoll_wait(const acoll_args& a, const u64* flag, int peer,
                                  int phase) {{
  u64 spins = 0, t0 = 0;
  while (acoll_ld_acquire(flag) < a.epoch) {{
    if ((++spins & 255) == 0) {{
      if (*a.abort_flag) {{ acoll_fail(a, {aborted}, peer, phase, 0); return false; }}
      const u64 t = acoll_now();
      if (t0 == 0) t0 = t;
      else if (t - t0 > a.timeout_ns) {{
        acoll_fail(a, {timeout}, peer, phase, acoll_ld_acquire(flag));
        return false;
      }}
    }}
  }}
  return true;
}}

static __device__ __forceinline__ u64* acoll_sig(const acoll_args& a, int p) {{
  return reinterpret_cast<u64*>(a.tab[MAXR + p]);
}}

// All threads of the block call it. phase: 0 start, 1 middle, 2 end.
static __device__ bool acoll_barrier(const acoll_args& a, int phase, int* s_ok) {{
  // Writes peers will read (descriptor, two-shot halves) become visible system-wide
  // before this block's release below.
  if (phase != 2) __threadfence_system();
  __syncthreads();
  const int t = threadIdx.x;
  if (t == 0) *s_ok = 1;
  __syncthreads();
  if (t < a.nranks) {{
    const u64 slot = phase == 0 ? SIG_START(blockIdx.x, a.rank)
                   : phase == 1 ? SIG_MID(blockIdx.x, a.rank) : SIG_END(blockIdx.x, a.rank);
    acoll_st_release(acoll_sig(a, t) + slot, a.epoch);
    const u64 mine = phase == 0 ? SIG_START(blockIdx.x, t)
                   : phase == 1 ? SIG_MID(blockIdx.x, t) : SIG_END(blockIdx.x, t);
    if (!acoll_wait(a, acoll_sig(a, a.rank) + mine, t, phase)) *s_ok = 0;
  }}
  __syncthreads();
  return *s_ok != 0;
}}

// Loads through L2 only, in storage words.
static __device__ __forceinline__ uint4 acoll_ld16(const void* p) {{
  return __ldcg(reinterpret_cast<const uint4*>(p));
}}
"""

_REDUCE_FNS = r"""
union acoll_vec {{ uint4 v; S s[{V}]; }};

static __device__ __forceinline__ uint4 acoll_vop(uint4 x, uint4 y) {{
  acoll_vec xa, ya, r;
  xa.v = x;
  ya.v = y;
#pragma unroll
  for (int k = 0; k < {V}; ++k)
    r.s[k] = acoll_to(acoll_op(acoll_from(xa.s[k]), acoll_from(ya.s[k])));
  return r.v;
}}
static __device__ __forceinline__ T acoll_lds(const T* p) {{
  return acoll_from(__ldcg(reinterpret_cast<const S*>(p)));
}}
{pre}
// Reduce element/vector i of every source (rank order) -> value; each operand goes
// through acoll_vpre / acoll_spre first (AVG's scaling by f, or nothing).
static __device__ __forceinline__ uint4 acoll_vred(const T* const* src, int n, u64 i, F f) {{
  uint4 acc = acoll_vpre(acoll_ld16(src[0] + i * {V}), f);
  for (int p = 1; p < n; ++p)
    acc = acoll_vop(acc, acoll_vpre(acoll_ld16(src[p] + i * {V}), f));
  return acc;
}}
static __device__ __forceinline__ T acoll_sred(const T* const* src, int n, u64 j, F f) {{
  T acc = acoll_spre(acoll_lds(src[0] + j), f);
  for (int p = 1; p < n; ++p) acc = acoll_op(acc, acoll_spre(acoll_lds(src[p] + j), f));
  return acc;
}}
"""

_PRE_NONE = r"""
typedef float F;
static __device__ __forceinline__ F acoll_factor(int n) { (void)n; return 0.0f; }
static __device__ __forceinline__ uint4 acoll_vpre(uint4 v, F f) { (void)f; return v; }
static __device__ __forceinline__ T acoll_spre(T v, F f) { (void)f; return v; }
"""

# A floating-point AVG as NCCL's PreMulSum: every operand is multiplied by the rounded
# 1/n as it is loaded (the scaling kernel's element function, rounded to T), then summed;
# the same bits as scaling each rank's input first, without the pass or its memory.
_PRE_SCALE = r"""
typedef D F;
// 1/n as acoll._dtypes.avg_factor rounds it: in double (IEEE division), then {rounding}
static __device__ __forceinline__ F acoll_factor(int n) {{
  return {factor};
}}
static __device__ __forceinline__ uint4 acoll_vpre(uint4 v, F f) {{
  acoll_vec x;
  x.v = v;
#pragma unroll
  for (int k = 0; k < {V}; ++k) x.s[k] = acoll_to(acoll_scale(acoll_from(x.s[k]), f));
  return x.v;
}}
static __device__ __forceinline__ T acoll_spre(T v, F f) {{ return acoll_scale(v, f); }}
"""

_FIN_NONE = r"""
static __device__ __forceinline__ uint4 acoll_vdone(uint4 v, int n) { (void)n; return v; }
static __device__ __forceinline__ T acoll_sdone(T v, int n) { (void)n; return v; }
"""

_FIN_AVG = r"""
static __device__ __forceinline__ uint4 acoll_vdone(uint4 v, int n) {{
  acoll_vec x;
  x.v = v;
#pragma unroll
  for (int k = 0; k < {V}; ++k) x.s[k] = acoll_to(acoll_fin(acoll_from(x.s[k]), (D)n));
  return x.v;
}}
static __device__ __forceinline__ T acoll_sdone(T v, int n) {{ return acoll_fin(v, (D)n); }}
"""

# The kernel. Element ranges are split into vectors of V elements when every pointer
# involved is 16-byte aligned, with a scalar tail; the same (global thread -> element)
# mapping is used in every phase so that per-block barriers suffice.
_KERNEL = r"""
static __device__ __forceinline__ bool acoll_al(const void* p) {{
  return (reinterpret_cast<u64>(p) & 15) == 0;
}}

extern "C" __global__ void __launch_bounds__({threads}) {name}(
    const u64* tab, u64* err, const volatile unsigned* abort_flag, int rank, int nranks,
    int root, int mode, int own_ws, u64 epoch, u64 timeout_ns, u64 sig, u64 sig2,
    const T* in, T* out, u64 n, u64 ws_off, u64 out_stride, u64 src_stride,
    u64 user_stride, const u64* regtab, u64 reg, u64 reg_in_off, u64 reg_out_off) {{
  __shared__ int s_ok;
  __shared__ const T* s_src[MAXR];  // each rank's input, as this rank addresses it
  __shared__ const T* s_res[MAXR];  // each rank's two-shot result half
  __shared__ u64 s_stride[MAXR];    // distance between the rank blocks of each input
  acoll_args a;
  a.tab = tab; a.err = err; a.abort_flag = abort_flag; a.rank = rank; a.nranks = nranks;
  a.root = root; a.mode = mode; a.own_ws = own_ws; a.epoch = epoch;
  a.timeout_ns = timeout_ns; a.sig = sig; a.sig2 = sig2;
  const int t = threadIdx.x;
  u64* mysig = acoll_sig(a, rank);
  if (t == 0) {{
    volatile u64* d = mysig + SIG_DESC(blockIdx.x, 0);
    d[0] = sig;
    d[1] = reinterpret_cast<u64>(in);
    d[2] = reinterpret_cast<u64>(out);
    d[3] = sig2;
    d[4] = (u64)own_ws;
    d[5] = reg;
    d[6] = reg_in_off;
    d[7] = reg_out_off;
  }}
  if (!acoll_barrier(a, 0, &s_ok)) return;
  if (t < nranks) {{
    const volatile u64* d = acoll_sig(a, t) + SIG_DESC(blockIdx.x, 0);
    const u64 theirs = d[0], theirs2 = d[3];
    if (theirs != sig || theirs2 != sig2) {{
      acoll_fail(a, {mismatch}, t, 0, theirs, theirs2);
      s_ok = 0;
    }}
    const bool in_ws = t == rank ? own_ws != 0 : d[4] != 0;
    if (in_ws) {{
      const T* ws = reinterpret_cast<const T*>(tab[t] + ws_off);
      s_src[t] = ws;
      s_res[t] = ws;
      s_stride[t] = src_stride;
    }} else if (t == rank) {{
      s_src[t] = in;
      s_res[t] = out;
      s_stride[t] = user_stride;
    }} else if (d[5] != 0) {{  // registered: the peer's allocations as mapped here
      const u64 r = d[5];
      s_src[t] = reinterpret_cast<const T*>(regtab[((r & 0xffff) - 1) * MAXR + t] + d[6]);
      s_res[t] = reinterpret_cast<const T*>(regtab[((r >> 16) - 1) * MAXR + t] + d[7]);
      s_stride[t] = user_stride;
    }} else {{  // same process: the peer's own pointers
      s_src[t] = reinterpret_cast<const T*>(d[1]);
      s_res[t] = reinterpret_cast<const T*>(d[2]);
      s_stride[t] = user_stride;
    }}
  }}
  __syncthreads();
  if (!s_ok) return;
  const u64 g = (u64)blockIdx.x * blockDim.x + t, G = (u64)gridDim.x * blockDim.x;
  bool vec = acoll_al(out);
  for (int p = 0; p < nranks; ++p)
    vec = vec && acoll_al(s_src[p]) && acoll_al(s_res[p]) && (s_stride[p] * sizeof(T)) % 16 == 0;
  vec = vec && (out_stride * sizeof(T)) % 16 == 0;
  const u64 V = 16 / sizeof(T);
{body}
  acoll_barrier(a, 2, &s_ok);
}}
"""

# Data phases. "range(lo, hi)" walks [lo, hi): vectors over the aligned part, then the
# scalar tail, with global thread g owning vector lo/V + g + k*G.
_RANGE = r"""
#define ACOLL_RANGE(lo, hi, VSTMT, SSTMT) do {{ \
    const u64 lo_ = (lo), hi_ = (hi); \
    if (vec) {{ \
      const u64 v0 = lo_ / V, v1 = hi_ / V; \
      for (u64 i = v0 + g; i < v1; i += G) {{ VSTMT; }} \
      const u64 j = v1 * V + g; \
      if (j < hi_) {{ SSTMT; }} \
    }} else {{ \
      for (u64 j = lo_ + g; j < hi_; j += G) {{ SSTMT; }} \
    }} \
  }} while (0)
"""

_REDUCE_BODY = r"""
  const F pre_f = acoll_factor(nranks);
  const T* srcs[MAXR];
  if (mode == {rs}) {{
    for (int p = 0; p < nranks; ++p) srcs[p] = s_src[p] + (u64)rank * s_stride[p];
  }} else {{
    for (int p = 0; p < nranks; ++p) srcs[p] = s_src[p];
  }}
  if (mode == {one} || mode == {rs} || (mode == {red} && rank == root)) {{
    ACOLL_RANGE(0, n,
      reinterpret_cast<uint4*>(out)[i] = acoll_vdone(acoll_vred(srcs, nranks, i, pre_f), nranks),
      out[j] = acoll_sdone(acoll_sred(srcs, nranks, j, pre_f), nranks));
  }} else if (mode == {two}) {{
    // Slices in whole vectors; the last rank's slice takes the tail.
    const u64 nv = vec ? n / V : n, unit = vec ? V : 1;
    const u64 lo = nv * rank / nranks * unit;
    const u64 hi = rank == nranks - 1 ? n : nv * (rank + 1) / nranks * unit;
    T* res = const_cast<T*>(s_res[rank]);  // own_ws: my workspace, else out itself
    ACOLL_RANGE(lo, hi,
      {{ const uint4 v = acoll_vdone(acoll_vred(srcs, nranks, i, pre_f), nranks);
        reinterpret_cast<uint4*>(out)[i] = v;
        if (own_ws) reinterpret_cast<uint4*>(res)[i] = v; }},
      {{ const T v = acoll_sdone(acoll_sred(srcs, nranks, j, pre_f), nranks);
        out[j] = v;
        if (own_ws) res[j] = v; }});
    if (!acoll_barrier(a, 1, &s_ok)) return;
    for (int q = 0; q < nranks; ++q) {{
      if (q == rank) continue;
      const u64 qlo = nv * q / nranks * unit;
      const u64 qhi = q == nranks - 1 ? n : nv * (q + 1) / nranks * unit;
      const T* r = s_res[q];
      ACOLL_RANGE(qlo, qhi,
        reinterpret_cast<uint4*>(out)[i] = acoll_ld16(r + i * V),
        out[j] = acoll_lds(r + j));
    }}
  }}
"""

_COPY_BODY = r"""
  if (mode == {ag} || mode == {a2a}) {{
    for (int q = 0; q < nranks; ++q) {{
      const T* src = s_src[q] + (mode == {a2a} ? (u64)rank * s_stride[q] : 0);
      T* dst = out + (u64)q * out_stride;
      if (src == dst) continue;  // in place: my own block is already there
      ACOLL_RANGE(0, n,
        reinterpret_cast<uint4*>(dst)[i] = acoll_ld16(src + i * V),
        dst[j] = acoll_lds(src + j));
    }}
  }} else if (mode == {bc} && rank != root) {{
    const T* src = s_src[root];
    ACOLL_RANGE(0, n,
      reinterpret_cast<uint4*>(out)[i] = acoll_ld16(src + i * V),
      out[j] = acoll_lds(src + j));
  }}
"""


def _common() -> str:
    return _COMMON.format(maxr=MAXR, nb=MAX_BLOCKS, err_words=ERR_WORDS,
                          aborted=ERR_ABORTED, timeout=ERR_TIMEOUT)


def reduce_source(op: ReduceOp | str | int, dtype: Any) -> P2PSource:
    """The reducing kernel (all-reduce one/two-shot, reduce-scatter, reduce) for ``op`` on
    ``dtype``. AVG on floating-point dtypes scales every operand by the rounded ``1/n`` as
    it loads it, then sums (NCCL's PreMulSum: the bits of scaling each input first); on
    integers it sums, then divides by the rank count at the end."""
    return _reduce_source(ReduceOp.coerce(op), parse_dtype(dtype))


def _pre_scale(ct: Any, v: int) -> str:
    """The per-operand scaling of a floating-point AVG (:data:`_PRE_SCALE`) for ``ct``."""
    helpers, scale_fn, wide = _scale_code(ct)
    quotient = "__ddiv_rn(1.0, (double)n)"
    if ct.ctype == "double":
        factor, rounding = quotient, "nothing more (float64)"
    elif ct.ctype == "float":
        factor, rounding = f"__double2float_rn({quotient})", "to float32"
    else:
        factor = f"{ct.to_f}({ct.from_f}(__double2float_rn({quotient})))"
        rounding = f"to float32, then to {ct.ctype}, widened back"
    return (f"typedef {wide} D;\n" + helpers + scale_fn
            + _PRE_SCALE.format(V=v, factor=factor, rounding=rounding))


@functools.cache
def _reduce_source(rop: ReduceOp, dt: np.dtype[Any]) -> P2PSource:
    dname = DTYPE_NAMES[dt]
    ct = _CTYPES[dname]
    base = ReduceOp.SUM if rop == ReduceOp.AVG else rop
    helpers, opfn = _op_code(ct, dt.itemsize, base)
    v = 16 // dt.itemsize
    pre, fin_code = _PRE_NONE, _FIN_NONE
    if rop == ReduceOp.AVG and prescales(rop, dt):
        pre = _pre_scale(ct, v)
    elif rop == ReduceOp.AVG:
        fhelp, fin, dtype_c = _finish_code(ct)
        fin_code = f"typedef {dtype_c} D;\n" + fhelp + fin + _FIN_AVG.format(V=v)
    name = f"acoll_p2p_{rop.name.lower()}_{dname}"
    body = (_PRELUDE.format(ctype=ct.ctype) + _common() + helpers + opfn
            + _bits_code(ct, dt.itemsize)
            + _REDUCE_FNS.format(V=v, pre=pre)
            + fin_code + _RANGE.format()
            + _KERNEL.format(threads=THREADS, name=name, mismatch=ERR_MISMATCH,
                             body=_REDUCE_BODY.format(one=Mode.ALL_REDUCE_ONE_SHOT,
                                                      two=Mode.ALL_REDUCE_TWO_SHOT,
                                                      rs=Mode.REDUCE_SCATTER,
                                                      red=Mode.REDUCE)))
    return P2PSource(name, dt, rop, (ct.include,) if ct.include else (), body)


@functools.cache
def copy_source() -> P2PSource:
    """The data-moving kernel (all-gather, broadcast, all-to-all) on bytes."""
    name = "acoll_p2p_copy"
    body = (_PRELUDE.format(ctype="unsigned char") + _common() + _RANGE.format()
            + "static __device__ __forceinline__ unsigned char acoll_lds(const unsigned "
              "char* p) { return __ldcg(p); }\n"
            + _KERNEL.format(threads=THREADS, name=name, mismatch=ERR_MISMATCH,
                             body=_COPY_BODY.format(ag=Mode.ALL_GATHER, a2a=Mode.ALL_TO_ALL,
                                                    bc=Mode.BROADCAST)))
    return P2PSource(name, None, None, (), body)
