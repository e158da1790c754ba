"""Step time and resident memory against step, from a `finetune` run's `metrics.jsonl`.

    python docs/plot_long_run.py checkpoints/long/metrics.jsonl docs/long_run_tiny_medpix.png

Top: seconds per optimizer step (each step, and a 25-step rolling median). Bottom: the
process's resident set (`rss_mb`, Linux `VmRSS` after the step) and its peak (`peak_rss_mb`,
`VmHWM`). Prints the figures the README quotes: median step time of steps 10-100 and
900-1000 (or the last 100 steps of a shorter run) and peak RSS at step 100 and at the end.
Needs matplotlib.
"""

import json
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
    rows = [r for r in rows if "seconds" in r]
    if not rows:
        raise SystemExit(f"{sys.argv[1]}: no step lines")
    step = [r["step"] for r in rows]
    secs = [r["seconds"] for r in rows]
    rss = [r.get("rss_mb") for r in rows]
    peak = [r.get("peak_rss_mb") for r in rows]
    by_step = {r["step"]: r for r in rows}

    def window(lo, hi):
        return [by_step[s]["seconds"] for s in range(lo, hi + 1) if s in by_step]

    last = step[-1]
    early = window(10, 100)
    late = window(max(last - 100, 1), last) if last < 1000 else window(900, 1000)
    early_med, late_med = statistics.median(early), statistics.median(late)
    print(f"median step time: steps 10-100 {early_med:.3f} s, steps {max(last - 100, 1) if last < 1000 else 900}-"
          f"{min(last, 1000)} {late_med:.3f} s ({late_med / early_med:.2f}x)")
    if 100 in by_step:
        p100, pend = by_step[100]["peak_rss_mb"], peak[-1]
        print(f"peak RSS: step 100 {p100:.0f} MB, step {last} {pend:.0f} MB ({pend / p100:.2f}x)")

    roll = [statistics.median(secs[max(0, i - 24):i + 1]) for i in range(len(secs))]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    ax1.plot(step, secs, ".", ms=2, color="#9db7d5", label="step")
    ax1.plot(step, roll, "-", color="#1f4e8c", label="rolling median (25 steps)")
    ax1.set_ylabel("seconds per step")
    ax1.set_ylim(0, max(secs) * 1.1)
    ax1.legend(loc="upper right")
    ax1.grid(alpha=0.3)
    ax2.plot(step, rss, "-", color="#2e7d32", label="resident set (VmRSS)")
    ax2.plot(step, peak, "--", color="#c62828", label="peak resident set (VmHWM)")
    ax2.set_ylabel("MB")
    ax2.set_ylim(0, max(p for p in peak if p is not None) * 1.2)
    ax2.set_xlabel("optimizer step")
    ax2.legend(loc="lower right")
    ax2.grid(alpha=0.3)
    fig.suptitle(f"finetune, {last} steps: step time and memory")
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=100)


if __name__ == "__main__":
    main()
