"""A PNG of memory over time with the stage markers on it (matplotlib, headless)."""

from __future__ import annotations

from ..errors import UserError
from .readings import StageReading, subtracts_baseline


def write_timeline(result, path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--timeline needs matplotlib: pip install 'vramcal[plot]'") from None
    series = result.series
    pts = [(s["t"], s[series]) for s in result.samples if series and s.get(series) is not None]
    if not pts:
        reasons = sorted({why for s in result.samples for k, why in (s.get("missing") or {}).items() if k == series})
        raise UserError("no samples to plot: " + ("every reading of " + series + " was unavailable ("
                                                  + "; ".join(reasons) + ")" if reasons else
                                                  "NVML unavailable, or the child died at once")
                        + "; the probe's result is still shown and recorded")
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=120)
    ax.plot([t for t, _ in pts], [v / 1024**3 for _, v in pts], lw=1.2,
            label=f"{series} ({'resident set' if series == 'rss' else 'NVML memory.used'})")
    top = max(v for _, v in pts) / 1024**3
    for name, st in result.stages.items():
        if st.t is not None:
            ax.axvline(st.t, color="grey", ls="--", lw=0.8)
            ax.text(st.t, top, f" {name}", rotation=90, va="top", fontsize=8)
    est = result.estimate.main_stages() if result.estimate is not None else {}
    # the estimate is compared with readings above the baseline on the CPU (readings.subtracts_baseline);
    # the plot shows absolute samples, so the line goes back up by the baseline there
    base = 0
    if subtracts_baseline(series):
        base = result.stages.get("baseline", StageReading("baseline", series)).used_bytes
    if est.get("first_token") and base is not None:
        ax.axhline((est["first_token"] + base) / 1024**3, color="tab:red", lw=0.8, ls=":",
                   label="estimated first-token peak" + (" (+ baseline)" if series == "rss" else ""))
    ax.set_xlabel("seconds since the child started")
    ax.set_ylabel("GiB")
    ax.set_title(f"{result.model}  {result.quant}  ctx={result.ctx} batch={result.batch}  status={result.status}",
                 fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
