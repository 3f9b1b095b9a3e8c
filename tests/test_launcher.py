"""The native launcher (``src/acoll/_native/launch.c`` through ``acoll._cuda.launcher``)
against a recording stand-in for the CUDA driver (``tests/fake_libcuda.c``): the order of
its driver calls, the epochs it writes, the copies it makes, what it skips, how a failed
call is reported and that the jobs after it still run, the context it leaves current,
the spin, and its refusals. Needs a C compiler (as the native ring does); the GPU tests
(``tests/test_p2p_gpu.py``) run it against the real driver."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path
from typing import Any

import pytest

from acoll._cuda import launcher as L
from fake_driver import FakeDriver, build_launcher_and_fake, compiler


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build_launcher_and_fake(tmp_path_factory.mktemp("launcher"))


@pytest.fixture(scope="module")
def pair(built: tuple[Path, Path]) -> tuple[L.Launcher, FakeDriver]:
    lib, fake = built
    return L.Launcher(str(lib), driver=str(fake)), FakeDriver(fake)


class _Call:
    """One prepared call's steps and copies, in host memory."""

    def __init__(self, steps: list[tuple[int, int, list[tuple[int, int, int]]]]) -> None:
        n_copies = sum(len(c) for _, _, c in steps)
        self.steps = (L.Step * len(steps))()
        self.copies = (L.Copy * max(1, n_copies))()
        self.blocks = [(ctypes.c_uint64 * 2)() for _ in steps]  # [epoch, other]
        self.params = [(ctypes.c_void_p * 1)(ctypes.addressof(b)) for b in self.blocks]
        k = 0
        for i, (fn, blocks, copies) in enumerate(steps):
            s = self.steps[i]
            s.fn, s.blocks, s.threads = fn, blocks, 512
            s.params = ctypes.addressof(self.params[i])
            s.epoch_field = ctypes.addressof(self.blocks[i])
            s.first_copy, s.ncopies = k, len(copies)
            for dst, src, n in copies:
                self.copies[k].dst, self.copies[k].src, self.copies[k].nbytes = dst, src, n
                k += 1

    def fill(self, job: Any, *, ctx: int = 0, stream: int = 0, wait1: int = 0,
             wait2: int = 0, record: int = 0, then: int = 0, epoch: int = 0) -> None:
        job.ctx, job.stream, job.wait1, job.wait2 = ctx, stream, wait1, wait2
        job.record, job.then_stream, job.epoch_base = record, then, epoch
        job.steps, job.copies = ctypes.addressof(self.steps), ctypes.addressof(self.copies)
        job.nsteps = len(self.steps)
        job.result = job.failed_at = -1  # (the call overwrites both)


def test_the_python_mirror_matches_the_c_structures(pair: Any) -> None:
    lau, _ = pair
    layout = (ctypes.c_uint64 * 32)()
    written = ctypes.CDLL(lau.path).acoll_ln_layout(layout)
    assert list(layout)[:written] == L.LAYOUT
    assert written == 3 + 3 + 7 + 13  # (sizes, then every field of the three)


def test_a_job_makes_its_driver_calls_in_the_contracts_order(pair: Any) -> None:
    lau, fake = pair
    src = (ctypes.c_uint8 * 64)(*range(64))
    dst = (ctypes.c_uint8 * 64)()
    a, b = ctypes.addressof(src), ctypes.addressof(dst)
    call = _Call([(0xF1, 4, [(b, a, 16), (b + 16, a + 16, 16)]), (0xF2, 2, []),
                  (0xF1, 8, [(b + 32, a + 32, 32)])])
    fake.reset(ctx=0xC0)
    fake.lib.fake_real_copies(1)
    jobs = lau.jobs(1)
    call.fill(jobs[0], ctx=0xC1, stream=0x51, wait1=0xE1, wait2=0xE2, record=0xE3,
              then=0x52, epoch=10)
    assert lau.run(jobs, 1) == 0
    assert (jobs[0].result, jobs[0].failed_at) == (0, 0)
    assert fake.log() == [
        ("G", 0xC0),                                   # the caller's context, kept
        ("S", 0xC1),                                   # the job's device
        ("W", 0x51, 0xE1, 0, 0xC1), ("W", 0x51, 0xE2, 0, 0xC1),
        ("C", b, a, 16, 0x51, 0xC1), ("C", b + 16, a + 16, 16, 0x51, 0xC1),
        ("L", 0xF1, 4, 512, 0x51, 11),                 # epoch written before the launch
        ("L", 0xF2, 2, 512, 0x51, 12),
        ("C", b + 32, a + 32, 32, 0x51, 0xC1),
        ("L", 0xF1, 8, 512, 0x51, 13),
        ("R", 0xE3, 0x51, 0xC1), ("W", 0x52, 0xE3, 0, 0xC1),
        ("S", 0xC0)]                                   # and the caller's context back
    assert bytes(dst) == bytes(src)
    assert [blk[0] for blk in call.blocks] == [11, 12, 13]
    assert fake.current == 0xC0


def test_zero_fields_are_skipped(pair: Any) -> None:
    lau, fake = pair
    call = _Call([(0xF1, 1, [])])
    fake.reset(ctx=0xC0)
    jobs = lau.jobs(1)
    call.fill(jobs[0], stream=0x51)  # no context, waits, record or caller's stream
    assert lau.run(jobs, 1) == 0
    assert fake.log() == [("G", 0xC0), ("L", 0xF1, 1, 512, 0x51, 1)]
    # a record without a caller's stream to order: no second wait
    call.fill(jobs[0], stream=0x51, record=0xE3, epoch=5)
    fake.reset(ctx=0xC0)
    assert lau.run(jobs, 1) == 0
    assert fake.log()[1:] == [("L", 0xF1, 1, 512, 0x51, 6), ("R", 0xE3, 0x51, 0xC0)]
    # a job under the context already current switches nothing
    call.fill(jobs[0], ctx=0xC0, stream=0x51, epoch=1)
    fake.reset(ctx=0xC0)
    assert lau.run(jobs, 1) == 0
    assert fake.log() == [("G", 0xC0), ("L", 0xF1, 1, 512, 0x51, 2)]


def test_several_jobs_run_in_order_each_under_its_context(pair: Any) -> None:
    lau, fake = pair
    calls = [_Call([(0xF1, 2, [])]), _Call([(0xF2, 2, [])])]
    fake.reset(ctx=0)
    jobs = lau.jobs(2)
    calls[0].fill(jobs[0], ctx=0xC1, stream=0x51, record=0xE1, epoch=7)
    calls[1].fill(jobs[1], ctx=0xC2, stream=0x61, record=0xE2, epoch=3)
    assert lau.run(jobs, 2) == 0
    assert fake.log() == [
        ("G", 0), ("S", 0xC1), ("L", 0xF1, 2, 512, 0x51, 8), ("R", 0xE1, 0x51, 0xC1),
        ("S", 0xC2), ("L", 0xF2, 2, 512, 0x61, 4), ("R", 0xE2, 0x61, 0xC2), ("S", 0)]
    assert lau.jobs(2) is jobs  # (reused, not allocated per call)


@pytest.mark.parametrize(("kind", "nth", "at"), [
    ("S", 1, "cuCtxSetCurrent"), ("W", 2, "cuStreamWaitEvent"), ("C", 1, "cuMemcpyAsync"),
    ("L", 2, "cuLaunchKernel"), ("R", 1, "cuEventRecord"),
    ("W", 3, "cuStreamWaitEvent (caller's stream)")])
def test_a_failed_call_stops_its_job_is_named_and_the_next_job_still_runs(
        pair: Any, kind: str, nth: int, at: str) -> None:
    lau, fake = pair
    src = (ctypes.c_uint8 * 8)()
    a = ctypes.addressof(src)
    first = _Call([(0xF1, 1, [(a, a, 8)]), (0xF1, 1, [])])
    second = _Call([(0xF3, 1, [])])
    fake.reset(ctx=0xC0)
    fake.fail(kind, nth, 700)
    jobs = lau.jobs(2)
    first.fill(jobs[0], ctx=0xC1, stream=0x51, wait1=0xE1, wait2=0xE2, record=0xE3,
               then=0x52)
    second.fill(jobs[1], ctx=0xC2, stream=0x61, record=0xE4)
    assert lau.run(jobs, 2) == 1
    assert jobs[0].result == 700
    assert L.AT[jobs[0].failed_at] == at
    assert (jobs[1].result, jobs[1].failed_at) == (0, 0)
    log = fake.log()
    assert ("L", 0xF3, 1, 512, 0x61, 1) in log  # the second job ran
    failed = [row for row in log if row[0] == kind][nth - 1]
    later = log[log.index(failed) + 1:]
    assert later[0] == ("S", 0xC2)  # nothing more of the first job after its failure
    assert log[-1] == ("S", 0xC0)


def test_spin_returns_once_the_event_passed_or_its_time_ran_out(pair: Any) -> None:
    lau, fake = pair
    fake.reset()
    fake.lib.fake_not_ready(3)
    assert lau.spin(0xE1, 1.0) == 0
    assert fake.log() == [("Q", 0xE1)] * 4
    fake.reset()
    fake.lib.fake_not_ready(10**9)
    assert lau.spin(0xE1, 50e-6) == L.NOT_READY
    fake.reset()
    fake.fail("Q", 1, 400)  # an error is returned as it is, at once
    assert lau.spin(0xE1, 1.0) == 400
    assert len(fake.log()) == 1


def test_record_switches_to_the_context_and_back(pair: Any) -> None:
    lau, fake = pair
    fake.reset(ctx=0xC0)
    assert lau.record(0xC1, 0xE1, 0x51) == 0
    assert fake.log() == [("G", 0xC0), ("S", 0xC1), ("R", 0xE1, 0x51, 0xC1), ("S", 0xC0)]
    fake.reset(ctx=0xC0)
    fake.fail("R", 1, 201)
    assert lau.record(0xC1, 0xE1, 0x51) == 201
    assert fake.current == 0xC0
    fake.reset(ctx=0xC1)  # already current, or 0 (the current one): no switch
    assert lau.record(0xC1, 0xE1, 0x51) == 0
    assert lau.record(0, 0xE2, 0x51) == 0
    assert fake.log() == [("G", 0xC1), ("R", 0xE1, 0x51, 0xC1), ("G", 0xC1),
                          ("R", 0xE2, 0x51, 0xC1)]


def test_an_unopened_library_refuses_every_job(built: tuple[Path, Path],
                                                tmp_path: Path) -> None:
    lib = tmp_path / "unopened.so"
    shutil.copy(built[0], lib)
    raw = ctypes.CDLL(str(lib))
    jobs = (L.Job * 2)()
    assert raw.acoll_ln_run(ctypes.c_void_p(ctypes.addressof(jobs)), 2) == 2
    assert [j.result for j in jobs] == [3, 3]
    assert raw.acoll_ln_spin(ctypes.c_uint64(1), ctypes.c_int64(0)) == 3


def test_a_driver_that_cannot_be_loaded_or_lacks_a_function_is_refused_by_name(
        built: tuple[Path, Path], tmp_path: Path) -> None:
    for i, (driver, words) in enumerate([(str(tmp_path / "missing.so"), "cannot be loaded"),
                                         ("libm.so.6", "lacks a function")]):
        lib = tmp_path / f"refusing{i}.so"
        shutil.copy(built[0], lib)
        with pytest.raises(OSError, match=words):
            L.Launcher(str(lib), driver=driver)


def test_a_library_whose_structures_differ_is_refused(built: tuple[Path, Path],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(L, "LAYOUT", [*L.LAYOUT[:-1], L.LAYOUT[-1] + 4])
    with pytest.raises(OSError, match="structures"):
        L.Launcher(str(built[0]), driver=str(built[1]))


def test_load_gives_none_and_says_why_without_a_driver(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture
                                                       ) -> None:
    compiler()
    monkeypatch.setattr(L, "_loaded", [])

    def no_driver(path: str, driver: str = "libcuda.so.1") -> L.Launcher:
        raise OSError(f"{path}: the CUDA driver library {driver!r} cannot be loaded")

    monkeypatch.setattr(L, "Launcher", no_driver)
    with caplog.at_level("INFO", logger="acoll"):
        assert L.load() is None
    assert "native launcher unavailable" in caplog.text
    assert L._loaded == [None]  # (and it is not tried again)


def test_primary_context_of_a_device(pair: Any) -> None:
    lau, fake = pair
    fake.reset()
    assert lau.primary_context(3) == 0xD3
    assert fake.log() == [("D", 3), ("P", 3)]
    fake.reset()
    fake.fail("P", 1, 101)
    assert lau.primary_context(3) == 0


def test_an_unknown_current_context_is_never_restored_to_a_guess(pair: Any) -> None:
    lau, fake = pair
    call = _Call([(0xF1, 1, [])])
    fake.reset(ctx=0xC0)
    fake.fail("G", 1, 201)  # cuCtxGetCurrent fails: what was current is unknown
    jobs = lau.jobs(1)
    call.fill(jobs[0], ctx=0xC1, stream=0x51)
    assert lau.run(jobs, 1) == 0
    assert fake.log() == [("G", 0xC0), ("S", 0xC1), ("L", 0xF1, 1, 512, 0x51, 1)]
    fake.reset(ctx=0xC0)
    fake.fail("G", 1, 201)
    assert lau.record(0xC1, 0xE1, 0x51) == 0
    assert fake.log() == [("G", 0xC0), ("S", 0xC1), ("R", 0xE1, 0x51, 0xC1)]


def test_each_thread_fills_job_arrays_of_its_own(pair: Any) -> None:
    import threading
    lau, _ = pair
    mine = lau.jobs(2)
    theirs: list[Any] = []
    t = threading.Thread(target=lambda: theirs.append(lau.jobs(2)))
    t.start()
    t.join()
    assert theirs[0] is not mine
    assert lau.jobs(2) is mine
