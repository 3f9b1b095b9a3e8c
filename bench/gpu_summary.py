"""Summarise the GPU batch (bench/gpu_batch.sh) against issue 9's targets.

    python bench/gpu_summary.py DIR     # reads DIR/*.json, writes DIR/gpu_summary.txt

- busbw of GPU buffers >= 0.9 x host buffers at >= 1 MiB (same run, 2 and 4 ranks);
- awaited 8 B all_reduce latency on GPU <= host + 30 us;
- no loop stall > 2 ms during 64 MiB GPU all_reduces.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _records(path: Path) -> dict[tuple[int, bool], dict[str, Any]]:
    doc = json.loads(path.read_text())
    return {(r["size"], r["inplace"]): r for r in doc["records"] if r["busbw"] is not None}


def main(out: Path) -> int:
    lines: list[str] = []
    for n in (2, 4):
        gpu, host = out / f"busbw_gpu_{n}ranks.json", out / f"busbw_host_{n}ranks.json"
        if not (gpu.exists() and host.exists()):
            lines.append(f"{n} ranks: busbw results missing")
            continue
        g, h = _records(gpu), _records(host)
        lines.append(f"== all_reduce busbw, {n} ranks over TCP (GB/s): size mode gpu host "
                     "ratio (target >= 0.90)")
        for key in sorted(set(g) & set(h)):
            size, inplace = key
            if size < 1 << 20:
                continue
            ratio = g[key]["busbw"] / h[key]["busbw"] if h[key]["busbw"] else float("nan")
            lines.append(f"  {size >> 20:5d} MiB {'in ' if inplace else 'out'}  "
                         f"{g[key]['busbw']:7.2f} {h[key]['busbw']:7.2f}  {ratio:5.2f} "
                         f"{'ok' if ratio >= 0.9 else 'MISSED'}")
    for n in (2, 4):
        gpu, host = out / f"lat_gpu_{n}ranks.json", out / f"lat_host_{n}ranks.json"
        if gpu.exists() and host.exists():
            g, h = _records(gpu), _records(host)
            for key in sorted(set(g) & set(h)):
                delta = g[key]["time_us"] - h[key]["time_us"]
                lines.append(f"== 8 B all_reduce, {n} ranks, {'in' if key[1] else 'out of'} "
                             f"place: gpu {g[key]['time_us']:.1f} us, host "
                             f"{h[key]['time_us']:.1f} us, delta {delta:+.1f} us "
                             f"(target <= +30) {'ok' if delta <= 30 else 'MISSED'}")
    lag = out / "loop_lag.json"
    if lag.exists():
        d = json.loads(lag.read_text())
        worst = d["gpu_lag"]["worst_ms"]
        lines.append(f"== loop lag during {d['mib']} MiB GPU all_reduces ({d['nranks']} ranks, "
                     f"{d['loop']}): worst {worst:.2f} ms, p99 {d['gpu_lag']['p99_ms']:.3f} ms "
                     f"(target <= 2 ms) {'ok' if worst <= 2 else 'MISSED'}; host buffers: "
                     f"worst {d['host_lag']['worst_ms']:.2f} ms")
        lines.append(f"== awaited 8 B latency (single ops, median): gpu "
                     f"{d['gpu_latency_8B']['median_us']:.1f} us, host "
                     f"{d['host_latency_8B']['median_us']:.1f} us, delta "
                     f"{d['latency_delta_us']:+.1f} us")
    text = "\n".join(lines) + "\n"
    (out / "gpu_summary.txt").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else ".")))
