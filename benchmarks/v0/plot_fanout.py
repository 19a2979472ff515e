# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Plots fan-out speedup vs k against the ideal curve.

Reads the JSON that `fanout_latency.py` writes and draws, per child length
m, the ideal speedup (a + k*m + n) / (a + m + 1 + n), the step speedup
(sequential steps / hooked steps) and the wall-time speedups over one
sequence of the hooked engine and of the client-side join.

Usage: .venv/bin/python benchmarks/plot_fanout.py fanout_latency.json
    [--out fanout_speedup.png]
"""

import argparse
import json
from pathlib import Path


def plot_one_m(axis, cases) -> None:
    """Draws the curves of one child length's cases (sorted by k)."""
    ks = [row["k"] for row in cases]
    curves = [
        (lambda row: row["ideal_speedup"], "ideal", "k--"),
        (lambda row: row["sequential_steps"] / row["hooks_steps"],
         "hooks, engine steps", "g:"),
        (lambda row: row["speedup"], "hooks, wall time", "b-"),
        (lambda row: row["sequential_s"] / row["client_join_s"],
         "client-side join, wall time", "r-"),
    ]
    for value, label, style in curves:
        axis.plot(ks, [value(row) for row in cases],
                  style,
                  label=label,
                  marker="o")
    axis.set_xscale("log", base=2)
    axis.set_xticks(ks, [str(k) for k in ks])
    axis.set_xlabel("children k")
    axis.set_ylabel("speedup over one sequence")
    axis.set_title(f"children of m = {cases[0]['m']} tokens")
    axis.grid(True, alpha=0.3)
    axis.legend()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="fanout_latency.py's JSON")
    parser.add_argument("--out", default="fanout_speedup.png")
    args = parser.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot

    rows = json.loads(Path(args.results).read_text())
    ms = sorted({row["m"] for row in rows})
    figure, axes = pyplot.subplots(1,
                                   len(ms),
                                   figsize=(5 * len(ms), 4),
                                   squeeze=False)
    for axis, m in zip(axes[0], ms):
        plot_one_m(
            axis,
            sorted((row for row in rows if row["m"] == m),
                   key=lambda row: row["k"]))
    figure.tight_layout()
    figure.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
