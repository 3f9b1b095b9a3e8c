"""Plot busbw against size, acoll's intra-host GPU path vs NCCL, from p2p_bench.py JSON.

    python bench/p2p_plot.py OUT.png RUN.json [RUN.json ...]
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

FACTOR = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5}  # 2 ranks


def main() -> None:
    out, runs = sys.argv[1], sys.argv[2:]
    colls = ["all_reduce", "all_gather", "reduce_scatter"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8), sharey=True)
    nccl_drawn: set[str] = set()
    for path in runs:
        rows = json.load(open(path))
        label = path.rsplit("/", 1)[-1].removesuffix(".json")
        for ax, coll in zip(axes, colls, strict=True):
            for lib in ("acoll", "nccl"):
                pts = sorted((r["bytes"], r["bytes"] / r["pipe_s"] * FACTOR[coll] / 1e9)
                             for r in rows if r["coll"] == coll and r["lib"] == lib)
                if not pts:
                    continue
                if lib == "nccl":
                    key = f"{coll}-{rows[0]['n']}-{next(r['mode'] for r in rows if r['lib'] == 'nccl')}"
                    if key in nccl_drawn:
                        continue
                    nccl_drawn.add(key)
                    name = f"NCCL ({next(r['mode'] for r in rows if r['lib'] == 'nccl')})"
                    style = "--"
                else:
                    name = f"acoll {label}"
                    style = "-o"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, ms=3, label=name)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{coll}, 2x H200 (NVLink), float32")
            ax.set_xlabel("bytes")
            ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("busbw GB/s (stream-pipelined)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
