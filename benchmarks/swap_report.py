"""`python -m benchmarks --swap`: from the rounds each case recorded to figures, targets, the
Markdown table and the timeline PNG. Pure data in, text/PNG out; nothing here touches a
device, so CI checks every branch of it on recorded results.

Definitions (decimal GB, as benchmarks/memory.py):
- a swap's time: from the earlier start of the two operations to the later end, on the
  system-wide monotonic clock both processes read;
- a sequential cycle's time: the outgoing sleep's time plus the incoming wake's, each
  measured alone (the gap between them, the parent's round trip, is not counted);
- GB/s: bytes both sides copied over the link / time;
- ratio to alone: the swap's time / max(A's sleep alone, B's wake alone), both measured in
  the same processes in rounds of their own; ratio to sequential: omni-seq's time / the swap's.
"""

from __future__ import annotations

import bisect
import statistics
from pathlib import Path
from typing import Any

GiB = float(1 << 30)
TARGET_DIRTY_VS_ALONE = 1.15  # swap of two dirty 16 GB stages <= 1.15 x max(A sleep, B wake) alone
TARGET_DIRTY_VS_SEQ = 1.7  # ... i.e. >= 1.7 x faster than sequential omni-core
TARGET_CLEAN_VS_WAKE = 1.1  # with clean weights: <= 1.1 x B's wake alone
SWAP_METHODS = (
    "omni-swap-dirty",
    "omni-swap-clean",
    "omni-swap-runs",
    "omni-swap-late",
    "omni-swap-runs-late",
    "engine-swap",
)
LABELS = {
    "limit": "host-link limit (pinned copies; duplex = both at once)",
    "vllm-seq": "vLLM CuMemAllocator, sequential (A sleeps, then B wakes)",
    "omni-seq": "omni-core fast, sequential",
    "omni-swap-dirty": "omni-core swap, dirty weights",
    "omni-swap-clean": "omni-core swap, clean weights",
    "omni-swap-runs": "omni-core swap, dirty weights, runs of 512 MiB",
    "omni-swap-late": "omni-core swap, dirty weights, A releases after its last copy when B fits",
    "omni-swap-runs-late": "omni-core swap, dirty weights, runs of 512 MiB, A releases late when B fits",
    "engine-swap": "Engine.swap (two stages, protocol included)",
}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def op_s(reply: dict[str, Any]) -> float:
    return reply["end_s"] - reply["start_s"]


def round_time_s(rnd: dict[str, Any]) -> float:
    """A round's time: overlapped for a swap, the sum of both operations otherwise."""
    if "time_s" in rnd:  # measured by the engine (Engine.swap's own duration)
        return rnd["time_s"]
    a, b = rnd["a"], rnd["b"]
    if rnd["kind"] == "swap":
        return max(a["end_s"], b["end_s"]) - min(a["start_s"], b["start_s"])
    return op_s(a) + op_s(b)


def round_copied_bytes(rnd: dict[str, Any]) -> int:
    return sum(rnd[side].get("copied_bytes") or 0 for side in ("a", "b"))


def _wakes(rnd: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in (rnd.get("b"), *rnd.get("reset", [])) if r and r.get("op") == "wake"]


# ---------------------------------------------------------------------- over-commit


def _level_at(series: list[list[float]], t: float, initial: float) -> float:
    """The step function `series` ([time, level], sorted) at `t`; `initial` before its first step."""
    times = [p[0] for p in series]
    k = bisect.bisect_right(times, t)
    return series[k - 1][1] if k else initial


def allocator_peak_growth(a: dict[str, Any], b: dict[str, Any]) -> int | None:
    """The most both processes' mapped bytes together ever exceeded what they held at the
    start, from each process's own records (an unmap counts when its call returned, a map
    from when its call began: the worst case). None when a side kept no per-map record."""
    a0, b0 = a.get("resident_before"), b.get("resident_before")
    sa, sb = (sorted(x.get("timeline", {}).get("mapped") or []) for x in (a, b))
    if a0 is None or b0 is None or not (sa or sb):
        return None
    growth = 0.0
    for t in sorted({p[0] for p in sa} | {p[0] for p in sb}):
        growth = max(growth, _level_at(sa, t, a0) + _level_at(sb, t, b0) - a0 - b0)
    return int(growth)


def overcommit(rnd: dict[str, Any]) -> dict[str, Any]:
    """The zero-over-commit evidence of one swap round: (1) the processes' mapped bytes never
    grew past the free memory at the start (allocator records); (2) the device's sampled used
    bytes never passed its total; (3) the driver never refused a map the gate admitted."""
    a, b, samples = rnd["a"], rnd["b"], rnd.get("samples") or {}
    out: dict[str, Any] = {
        "free_before": b.get("free_before"),
        "growth": allocator_peak_growth(a, b),
        "max_used": samples.get("max_used"),
        "total": samples.get("total"),
        "samples": samples.get("count", 0),
        "driver_refusals": (b.get("gate") or {}).get("driver_refusals"),
    }
    checks = []
    if out["growth"] is not None and out["free_before"] is not None:
        checks.append(out["growth"] <= out["free_before"])
    if out["max_used"] is not None and out["total"]:
        checks.append(out["max_used"] <= out["total"])
    if out["driver_refusals"] is not None:
        checks.append(out["driver_refusals"] == 0)
    out["checks"] = len(checks)
    out["ok"] = bool(checks) and all(checks)
    return out


# ---------------------------------------------------------------------- per case


def summarize(case: dict[str, Any]) -> dict[str, Any]:
    """Figures of one (pair, method) case; {} when it has no rounds."""
    forward = [r for r in case.get("rounds", []) if r["kind"] in ("swap", "seq")]
    if case.get("error") or case.get("skipped") or not forward:
        return {}
    times = [round_time_s(r) for r in forward]
    later = times[1:] or times
    out: dict[str, Any] = {
        "first_s": times[0],
        "later_s": statistics.median(later),
        "later_min_s": min(later),
        "later_max_s": max(later),
        "reps": len(times),
        "later_GBps": statistics.median(
            [round_copied_bytes(r) / round_time_s(r) / 1e9 for r in forward[1:] or forward]
        ),
    }
    alone = [r for r in case.get("rounds", []) if r["kind"] == "alone"]
    if not alone:  # a sequential case: its own later rounds (the first may pin) are the alone figures
        alone = [r for r in forward if r["kind"] == "seq"][1:] or forward
    a_alone = _median([r["a_s"] if "a_s" in r else op_s(r["a"]) for r in alone])
    b_alone = _median([r["b_s"] if "b_s" in r else op_s(r["b"]) for r in alone])
    out.update(a_alone_s=a_alone, b_alone_s=b_alone)
    if a_alone is not None and b_alone is not None and forward[0]["kind"] == "swap":
        out["vs_alone"] = out["later_s"] / max(a_alone, b_alone)
        out["vs_b_wake"] = out["later_s"] / b_alone
    wakes = [w for r in case["rounds"] for w in _wakes(r)]
    exact = [w.get("exact") for w in wakes if "exact" in w]
    out["bit_exact"] = bool(exact) and all(exact)
    out["wakes_checked"] = len(exact)
    swaps = [r for r in forward if r["kind"] == "swap"]
    if swaps:
        checks = [overcommit(r) for r in swaps]
        out["overcommit"] = {
            "ok": all(c["ok"] for c in checks),
            "rounds": len(checks),
            "max_used": max((c["max_used"] for c in checks if c["max_used"] is not None), default=None),
            "total": next((c["total"] for c in checks if c["total"]), None),
            "max_growth": max((c["growth"] for c in checks if c["growth"] is not None), default=None),
            "free_before": min((c["free_before"] for c in checks if c["free_before"] is not None), default=None),
            "driver_refusals": sum(c["driver_refusals"] or 0 for c in checks),
            "waited_s": max(((r["b"].get("gate") or {}).get("waited_s", 0.0) for r in swaps), default=0.0),
        }
        timed = [r for r in swaps if "time_s" not in r]  # the engine's swaps start in its own loop
        if timed:
            out["skew_ms"] = max(abs(r["a"]["start_s"] - r["b"]["start_s"]) * 1e3 for r in timed)
    if case["method"] == "limit":
        out.update(_limit_figures(case))
    return out


def _limit_figures(case: dict[str, Any]) -> dict[str, Any]:
    swaps = [r for r in case["rounds"] if r["kind"] == "swap"]
    duplex = swaps[1:] or swaps
    alone = [r for r in case["rounds"] if r["kind"] == "alone"]

    def gbps(replies: list[dict[str, Any]]) -> float | None:
        return _median([r["copied_bytes"] / op_s(r) / 1e9 for r in replies])

    d2h, h2d = gbps([r["a"] for r in duplex]), gbps([r["b"] for r in duplex])
    return {
        "d2h_alone_GBps": gbps([r["a"] for r in alone]),
        "h2d_alone_GBps": gbps([r["b"] for r in alone]),
        "duplex_d2h_GBps": d2h,
        "duplex_h2d_GBps": h2d,
        "duplex_total_GBps": d2h + h2d if d2h is not None and h2d is not None else None,
    }


def _case(results: list[dict[str, Any]], pair: str, method: str) -> dict[str, Any] | None:
    return next((c for c in results if c["pair"] == pair and c["method"] == method), None)


def targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets, met or missed by how much: the timing targets on pairs of two
    equal stages without a filler; zero over-commit on every swap (binding where filled);
    bit-exactness everywhere."""
    rows: list[dict[str, Any]] = []

    def row(pair: str, method: str, label: str, value: float | None, bound: float, op: str) -> None:
        if value is None:
            rows.append(
                {"pair": pair, "method": method, "target": label, "value": None, "met": False, "by": "not measured"}
            )
            return
        met = value <= bound if op == "<=" else value >= bound
        by = "" if met else f"{abs(value - bound):.3g} ({abs(value - bound) / bound:.0%})"
        rows.append({"pair": pair, "method": method, "target": label, "value": value, "met": met, "by": by})

    for pair in data["pairs"]:
        a, b, fill = parse_pair(pair)
        equal = a == b and not fill
        seq = summarize(_case(data["results"], pair, "omni-seq") or {})
        for method in ("omni-swap-dirty", "omni-swap-clean", "omni-swap-runs", "omni-swap-late", "omni-swap-runs-late"):
            s = summarize(_case(data["results"], pair, method) or {})
            if not s or not equal:
                continue
            if method != "omni-swap-clean":
                row(
                    pair,
                    method,
                    f"swap <= {TARGET_DIRTY_VS_ALONE} x max(A sleep, B wake) alone",
                    s.get("vs_alone"),
                    TARGET_DIRTY_VS_ALONE,
                    "<=",
                )
                row(
                    pair,
                    method,
                    f"swap >= {TARGET_DIRTY_VS_SEQ} x faster than omni-seq",
                    seq["later_s"] / s["later_s"] if seq else None,
                    TARGET_DIRTY_VS_SEQ,
                    ">=",
                )
            else:
                row(
                    pair,
                    method,
                    f"swap <= {TARGET_CLEAN_VS_WAKE} x B's wake alone",
                    s.get("vs_b_wake"),
                    TARGET_CLEAN_VS_WAKE,
                    "<=",
                )
        for case in (c for c in data["results"] if c["pair"] == pair):
            s = summarize(case)
            if not s:
                continue
            if "overcommit" in s and case["method"] != "limit" and (fill or case["method"] in SWAP_METHODS):
                oc = s["overcommit"]
                rows.append(
                    {
                        "pair": pair,
                        "method": case["method"],
                        "target": "zero over-commit",
                        "value": None,
                        "met": oc["ok"],
                        "by": "" if oc["ok"] else _overcommit_text(oc),
                    }
                )
            row(pair, case["method"], "bit-exact after every wake", 1.0 if s["bit_exact"] else 0.0, 1.0, ">=")
    return rows


# ---------------------------------------------------------------------- rendering


def parse_pair(spec: str) -> tuple[str, str, bool]:
    """'8g:16g+fill' -> ('8g', '16g', True); '16g' -> ('16g', '16g', False)."""
    body, plus, flag = spec.partition("+")
    if plus and flag != "fill":
        raise ValueError(f"pair {spec!r}: the only option is '+fill' (a third process takes the free memory)")
    a, colon, b = body.partition(":")
    if not a or (colon and not b):
        raise ValueError(f"pair {spec!r} is not A:B (e.g. 16g:16g or 8g:16g+fill)")
    return a, (b or a), bool(plus)


def _f(value: Any, fmt: str = "{:.3f}") -> str:
    return "-" if value is None else fmt.format(value)


def size_text(nbytes: Any) -> str:
    """Bytes in GiB, or MiB below one GiB (the CPU smoke runs are MiB-sized)."""
    if nbytes is None:
        return "-"
    return f"{nbytes / GiB:.2f} GiB" if abs(nbytes) >= GiB else f"{nbytes / 2**20:.2f} MiB"


def _overcommit_text(oc: dict[str, Any]) -> str:
    if not oc:
        return "-"
    used = f"max used {size_text(oc['max_used'])} of {size_text(oc['total'])}" if oc.get("max_used") is not None else ""
    growth = (
        f"mapped +{size_text(oc['max_growth'])} with {size_text(oc['free_before'])} free"
        if oc.get("max_growth") is not None
        else ""
    )
    parts = [p for p in (used, growth, f"driver refusals {oc['driver_refusals']}") if p]
    return ("none: " if oc["ok"] else "**OVER-COMMIT**: ") + "; ".join(parts)


def render_markdown(data: dict[str, Any]) -> str:
    m = data["machine"]
    lines = [
        "# Swap: one stage sleeps while another wakes (issue 14 item 4)",
        "",
        f"Device: {m.get('gpu') or data.get('device')}; {m.get('cpus')} CPUs, {m.get('host_memory_GiB')} GiB host "
        f"memory; torch {m.get('torch')}, vLLM {m.get('vllm')}; commit `{m.get('commit')}`"
        f"{' (+ uncommitted changes)' if m.get('dirty') else ''}.",
        f"Command: `{data['command']}` ({data['reps']} swaps per case after loading, the first reported apart; "
        f"each case in fresh processes, one per stage; whole run {data.get('wall_s', 0):.0f} s).",
        "",
        "Time of a swap: from the earlier start to the later end of A's sleep and B's wake, started together on "
        "a barrier of the system-wide monotonic clock. Sequential: A's sleep + B's wake, each alone. Later: "
        "median [min-max] of swaps 2..n. GB/s: bytes both copied / time. vs alone: swap / max(A sleep, B wake) "
        "measured alone in the same processes; vs seq: omni-seq / swap. Over-commit: device used bytes sampled "
        "every ~1 ms, the processes' own mapped bytes (maps counted from their start, unmaps from their end), "
        "and the driver's refusals of maps the memory gate admitted.",
        "",
    ]
    for pair in data["pairs"]:
        a, b, fill = parse_pair(pair)
        cases = [c for c in data["results"] if c["pair"] == pair]
        if not cases:
            continue
        what = data.get("workloads", {})
        lines += [f"## A = {a}, B = {b}{' + filler (B must wait for A)' if fill else ''}", ""]
        if what:
            lines += [f"A: {what.get(a, a)}. B: {what.get(b, b)}.", ""]
        lines += [
            "| method | first s | later s | later GB/s | A sleep alone s | B wake alone s | vs alone | "
            "vs seq | bit-exact | over-commit | notes |",
            "|---" * 11 + "|",
        ]
        seq = summarize(_case(data["results"], pair, "omni-seq") or {})
        for case in cases:
            label = LABELS.get(case["method"], case["method"])
            if case.get("skipped") or case.get("error"):
                why = case.get("skipped") or f"error: {case['error']}"
                lines.append(f"| {label} | {'skipped' if case.get('skipped') else 'error'}: {why} ||||||||||")
                continue
            s = summarize(case)
            if not s:
                lines.append(f"| {label} | no rounds ||||||||||")
                continue
            vs_seq = seq["later_s"] / s["later_s"] if seq and case["method"] in SWAP_METHODS else None
            notes = list(case.get("notes", []))
            if "skew_ms" in s:
                notes.append(f"start skew {s['skew_ms']:.2f} ms")
            if s.get("overcommit", {}).get("waited_s"):
                notes.append(f"B's gate waited up to {s['overcommit']['waited_s'] * 1e3:.0f} ms")
            swaps = [r for r in case.get("rounds", []) if r.get("kind") == "swap"]
            if any("release_late" in r["a"] for r in swaps):
                late = sum(bool(r["a"].get("release_late")) for r in swaps)
                notes.append(f"A released after its last copy in {late} of {len(swaps)} swaps")
            if case["method"] == "limit":
                g = {
                    k: _f(s[k], "{:.1f}")
                    for k in (
                        "d2h_alone_GBps",
                        "h2d_alone_GBps",
                        "duplex_d2h_GBps",
                        "duplex_h2d_GBps",
                        "duplex_total_GBps",
                    )
                }
                notes.append(
                    f"D2H alone {g['d2h_alone_GBps']}, H2D alone {g['h2d_alone_GBps']}, duplex "
                    f"{g['duplex_d2h_GBps']} + {g['duplex_h2d_GBps']} = {g['duplex_total_GBps']} GB/s"
                )
            later = f"{s['later_s']:.3f} [{s['later_min_s']:.3f}-{s['later_max_s']:.3f}]"
            exact = f"{'yes' if s['bit_exact'] else '**NO**'} ({s['wakes_checked']})"
            lines.append(
                f"| {label} | {s['first_s']:.3f} | {later} | {s['later_GBps']:.1f} | {_f(s['a_alone_s'])} | "
                f"{_f(s['b_alone_s'])} | {_f(s.get('vs_alone'), '{:.2f}')} | {_f(vs_seq, '{:.2f}')} | {exact} | "
                f"{_overcommit_text(s.get('overcommit', {}))} | {'; '.join(notes)} |"
            )
        lines.append("")
    rows = targets(data)
    if rows:
        lines += ["## Targets", "", "| pair | method | target | measured | met |", "|---|---|---|---|---|"]
        for t in rows:
            value = _f(t["value"], "{:.3f}")
            if t["target"].startswith("bit-exact"):
                value = "yes" if t["value"] else "no"
            met = "yes" if t["met"] else "missed by " + t["by"] if t["by"] != "not measured" else "not measured"
            if t["target"] == "zero over-commit":
                value, met = ("none" if t["met"] else t["by"]), ("yes" if t["met"] else "**no**")
            lines.append(f"| {t['pair']} | {t['method']} | {t['target']} | {value} | {met} |")
        lines.append("")
    if data.get("notes"):
        lines += ["## Notes", "", *data["notes"], ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------- timeline PNG


def rate_series(copies: list[list[float]], t0: float, bin_s: float, bins: int) -> list[float]:
    """GB/s per time bin from [start, end, bytes, stream] copies, each copy's bytes spread
    evenly over its interval (a copy of no duration lands in its bin)."""
    totals = [0.0] * bins
    for start, end, nbytes, *_ in copies:
        lo, hi = start - t0, end - t0
        if hi <= lo:
            k = int(lo / bin_s)
            if 0 <= k < bins:
                totals[k] += nbytes
            continue
        k = max(0, int(lo / bin_s))
        while k < bins and k * bin_s < hi:
            overlap = min(hi, (k + 1) * bin_s) - max(lo, k * bin_s)
            if overlap > 0:
                totals[k] += nbytes * overlap / (hi - lo)
            k += 1
    return [t / bin_s / 1e9 for t in totals]


def timeline_round(data: dict[str, Any], pair: str) -> tuple[str, dict[str, Any]] | None:
    """The swap drawn for `pair`: the second swap (the first later one) of the dirty swap,
    else of the clean one, else its first."""
    for method in ("omni-swap-dirty", "omni-swap-clean"):
        case = _case(data["results"], pair, method)
        swaps = [r for r in (case or {}).get("rounds", []) if r["kind"] == "swap"]
        if swaps:
            return method, swaps[1] if len(swaps) > 1 else swaps[0]
    return None


def render_png(data: dict[str, Any], path: Path) -> str | None:
    """One column per pair: A's device->host and B's host->device GB/s over one swap, against
    the link's one-way and duplex capacity (the limit case); below, both processes' mapped
    bytes, the device's sampled used bytes and its total. None when drawn, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no PNG (pip install -e '.[bench]'; then --swap --render swap_*.json)"
    drawn = [(pair, found) for pair in data["pairs"] if (found := timeline_round(data, pair))]
    if not drawn:
        return "no swap round to draw (every swap case skipped or failed)"
    fig, axes = plt.subplots(2, len(drawn), figsize=(7.5 * len(drawn), 8.5), squeeze=False)
    for col, (pair, (method, rnd)) in enumerate(drawn):
        a, b = rnd["a"], rnd["b"]
        t0 = min(a["start_s"], b["start_s"])
        span = max(a["end_s"], b["end_s"]) - t0
        bin_s = max(span / 120, 2e-4)
        bins = int(span / bin_s) + 2
        xs = [(k + 0.5) * bin_s * 1e3 for k in range(bins)]
        ra = rate_series(a["timeline"]["copies"], t0, bin_s, bins)
        rb = rate_series(b["timeline"]["copies"], t0, bin_s, bins)
        ax = axes[0][col]
        ax.plot(xs, ra, label="A sleep: device->host", color="tab:orange")
        ax.plot(xs, rb, label="B wake: host->device", color="tab:blue")
        ax.plot(xs, [x + y for x, y in zip(ra, rb, strict=True)], label="both", color="black", linewidth=0.8)
        limit = summarize(_case(data["results"], pair, "limit") or {})
        for key, style, text in (
            ("d2h_alone_GBps", ":", "D2H alone"),
            ("h2d_alone_GBps", "--", "H2D alone"),
            ("duplex_total_GBps", "-.", "duplex (both ways)"),
        ):
            if limit.get(key):
                ax.axhline(limit[key], color="grey", linestyle=style, linewidth=1, label=f"link: {text}")
        per_copy = a["timeline"].get("per_copy") and b["timeline"].get("per_copy")
        ax.set_title(
            f"{pair}: {method}, one swap ({span * 1e3:.0f} ms)"
            + ("" if per_copy else " — op-level, no per-copy events")
        )
        ax.set_xlabel("ms since the swap began")
        ax.set_ylabel("GB/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
        ax = axes[1][col]
        samples = rnd.get("samples") or {}
        unit, unit_name = (GiB, "GiB") if (samples.get("total") or GiB) >= GiB else (2.0**20, "MiB")
        for side, reply, color in (("A", a, "tab:orange"), ("B", b, "tab:blue")):
            series = sorted(reply["timeline"].get("mapped") or [])
            start = reply.get("resident_before")
            if start is None:
                continue
            pts = [(reply["start_s"], start), *[(t, v) for t, v in series]]
            pts.append((max(reply["end_s"], pts[-1][0]), pts[-1][1]))  # the level holds to the op's end
            ax.step(
                [(t - t0) * 1e3 for t, _ in pts],
                [v / unit for _, v in pts],
                where="post",
                color=color,
                label=f"{side} mapped (its allocator)",
            )
        if samples.get("series"):
            ax.plot(
                [(t - t0) * 1e3 for t, _ in samples["series"]],
                [u / unit for _, u in samples["series"]],
                ".",
                markersize=2,
                color="black",
                label="device used (sampled)",
            )
        if samples.get("total"):
            ax.axhline(samples["total"] / unit, color="red", linewidth=1, label="device total")
        ax.set_xlabel("ms since the swap began")
        ax.set_ylabel(unit_name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="center right")
    where = (data["machine"].get("gpu") or f"{data.get('device', '?')} (simulated device)").split(",")[0]
    fig.suptitle(f"Swap timeline — {where}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None
