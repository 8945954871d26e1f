"""Tables, target checks, knob summaries and charts of a benchmark matrix run (matrix.json).

``write_outputs(result, out)`` writes ``out/matrix.md`` and one chart per axis:
``matrix-shard-size.png``, ``matrix-sample-size.png``, ``matrix-mode.png`` (each loader
mode as a share of its cell's ceiling), ``matrix-cold-warm.png`` (against the best peer, cold
and warm) and ``matrix-first-batch.png``; returns the Markdown.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from benchmarks.matrix_data import KINDS, MODES

__all__ = ["write_outputs", "markdown", "checks", "knob_summary", "rss_table", "charts"]

BATCHED = ("workers", "threads", "zero_copy")  # the StreamingDataLoader modes


def _sps(row: dict[str, Any] | None, phase: str) -> float | None:
    p = (row or {}).get(phase) or {}
    return p.get("samples_per_s") if p.get("status") == "ok" else None


def _cells(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in result["cells"] if "payload_bytes" in c]


def _rows(result: dict[str, Any], cell: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in result["rows"] if r["shard"] == cell["shard"] and r["kind"] == cell["kind"]]


def _mode(rows: list[dict[str, Any]], mode: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["tool"] == "shardkit" and r["mode"] == mode and not r["knobs"]), None)


def _best_peer(rows: list[dict[str, Any]], phase: str) -> tuple[str, float] | None:
    got = [(r["name"], _sps(r, phase)) for r in rows if r["mode"] == "peer"]
    ok = [(n, v) for n, v in got if v]
    return max(ok, key=lambda x: x[1]) if ok else None


def _ceiling_sps(cell: dict[str, Any], which: str) -> float | None:
    c = cell.get("ceiling" if which == "get" else "cat") or {}
    s = c.get("get_seconds" if which == "get" else "seconds")
    return cell["count"] / s if s else None


def _fmt(v: float | None, digits: int = 0) -> str:
    if v is None:
        return "-"
    return f"{v:,.{digits}f}" if v >= 10 or digits else f"{v:.2f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _mark(v: float | None, target: float, below: bool = False) -> str:
    if v is None:
        return "-"
    ok = v <= target if below else v >= target
    return f"{v:.2f} {'yes' if ok else '**no**'}"


def _cell_name(cell: dict[str, Any]) -> str:
    return f"{cell['shard']} / {KINDS[cell['kind']].label}" if cell["kind"] in KINDS else f"{cell['shard']} / {cell['kind']}"


def cell_table(result: dict[str, Any], cell: dict[str, Any]) -> list[str]:
    """The Markdown rows of one cell: every loader row, its ratios, then the ceilings."""
    rows = _rows(result, cell)
    get, cat = _ceiling_sps(cell, "get"), _ceiling_sps(cell, "cat")
    peer_cold, peer_warm = _best_peer(rows, "cold"), _best_peer(rows, "warm")
    ceil = cell.get("ceiling") or {}
    out = [f"**{_cell_name(cell)}**: {cell['count']:,} samples, {cell.get('pack', {}).get('num_shards', '?')} shards, "
           f"{cell['payload_bytes'] / 1e6:,.0f} MB of payload, batch {cell['batch']}; best peer cold: "
           f"{peer_cold[0] if peer_cold else '-'}, warm: {peer_warm[0] if peer_warm else '-'}", "",
           "| row | cold samples/s | cold MB/s | warm samples/s | first batch cold (s) | peak RSS MB: main / worker (anon) "
           "| cold / GET ceiling | cold / best peer | warm / best peer |",
           "|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in [r for r in rows if not r["knobs"]]:
        if r["mode"] == "pack":
            continue
        cold, warm = _sps(r, "cold"), _sps(r, "warm")
        rss = r.get("rss") or {}
        mem = (f"{rss.get('main_hwm_mb', '-')} ({rss.get('main_anon_mb', '-')}) / "
               f"{rss.get('worker_hwm_mb') or '-'} ({rss.get('worker_anon_mb') or '-'})") if rss else "-"
        name = f"**shardkit {r['name']}**" if r["tool"] == "shardkit" else r["name"]
        if r["status"] != "ok":
            name += f" (FAILED: {r.get('reason', '')[:120]})"
        first = ((r.get("cold") or {}).get("first_batch_s"))
        out.append(f"| {name} | {_fmt(cold)} | {_fmt((r.get('cold') or {}).get('mb_per_s'))} | {_fmt(warm)} | "
                   f"{_fmt(first, 3) if first else '-'} | {mem} | {_x(_ratio(cold, get))} | "
                   f"{_x(_ratio(cold, peer_cold[1] if peer_cold else None))} | "
                   f"{_x(_ratio(warm, peer_warm[1] if peer_warm else None))} |")
    out.append(f"| ceiling: ranged GET x8 ({ceil.get('get_part_mib', '?')} MiB parts) | {_fmt(get)} | "
               f"{_fmt(cell['payload_bytes'] / ceil['get_seconds'] / 1e6 if ceil.get('get_seconds') else None)} | | | | | | |")
    out.append(f"| ceiling: `cat` of the cached shards | | | {_fmt(cat)} | | | | | |")
    out.append(f"| bare GET of the first batch's {ceil.get('first_batch_bytes', 0) / 1e6:.1f} MB | | | | "
               f"{_fmt(ceil.get('first_batch_get_s'), 3)} | | | | |")
    return out


def checks(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per cell, the issue's targets as ratios (None where a row failed or did not run)."""
    out = []
    for cell in _cells(result):
        rows = _rows(result, cell)
        get = _ceiling_sps(cell, "get")
        pc, pw = _best_peer(rows, "cold"), _best_peer(rows, "warm")
        batched_cold = max((_sps(_mode(rows, m), "cold") or 0 for m in BATCHED), default=0) or None
        batched_warm = max((_sps(_mode(rows, m), "warm") or 0 for m in BATCHED), default=0) or None
        workers = _mode(rows, "workers")
        first = ((workers or {}).get("cold") or {}).get("first_batch_s")
        bare = (cell.get("ceiling") or {}).get("first_batch_get_s")
        per = _mode(rows, "per_sample")
        wds_nc = next((r for r in rows if r["name"] == "webdataset, no cache"), None)
        out.append({"cell": _cell_name(cell), "shard": cell["shard"], "kind": cell["kind"],
                    "first_batch_s": first, "first_batch_vs_get": _ratio(first, bare),
                    "cold_vs_get": _ratio(batched_cold, get), "cold_vs_peer": _ratio(batched_cold, pc and pc[1]),
                    "per_sample_cold_vs_peer": _ratio(_sps(per, "cold"), pc and pc[1]),
                    "per_sample_warm_vs_peer": _ratio(_sps(per, "warm"), pw and pw[1]),
                    "nocache_vs_wds": _ratio(_sps(_mode(rows, "nocache"), "cold"), _sps(wds_nc, "cold")),
                    "warm_vs_peer": _ratio(batched_warm, pw and pw[1])})
    return out


def checks_table(result: dict[str, Any]) -> list[str]:
    out = ["| cell | first batch cold, 2 workers (s) <= 0.5 | / bare GET <= 1.2 | raw cold / GET >= 0.8 "
           "| raw cold / best peer >= 1.5 | per-sample cold / best peer >= 1.2 | per-sample warm / best peer >= 1.2 "
           "| no cache / webdataset no cache >= 1.0 | warm / best peer >= 5 |",
           "|---|---|---|---|---|---|---|---|---|"]
    for c in checks(result):
        out.append(f"| {c['cell']} | {_mark(c['first_batch_s'], 0.5, True)} | {_mark(c['first_batch_vs_get'], 1.2, True)} "
                   f"| {_mark(c['cold_vs_get'], 0.8)} | {_mark(c['cold_vs_peer'], 1.5)} "
                   f"| {_mark(c['per_sample_cold_vs_peer'], 1.2)} | {_mark(c['per_sample_warm_vs_peer'], 1.2)} "
                   f"| {_mark(c['nocache_vs_wds'], 1.0)} | {_mark(c['warm_vs_peer'], 5.0)} |")
    return out


def _geo(vals: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def knob_summary(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each knob row against its mode's defaults in the same cell (cold, and warm where run):
    the geometric mean of the mode's row and its "defaults again" row when the run has one.
    The "again" rows against the mode's rows come first, as ``knob="defaults again"``: the
    spread a knob must clear to mean anything."""
    by: dict[tuple[str, str, Any, str], list[tuple[str, float]]] = {}
    for cell in _cells(result):
        rows = _rows(result, cell)
        for r in rows:
            if not r["knobs"] or r["status"] != "ok":
                continue
            main = _mode(rows, r["mode"])
            again = next((x for x in rows if x["mode"] == r["mode"] and "again" in x["knobs"] and x["status"] == "ok"), None)
            knob, value = next(iter(r["knobs"].items()))
            for phase in ("cold", "warm"):
                if "again" in r["knobs"]:
                    ratio = _ratio(_sps(r, phase), _sps(main, phase))
                    knob, value = "defaults again", ""
                else:
                    bases = [v for v in (_sps(main, phase), _sps(again, phase)) if v]
                    ratio = _ratio(_sps(r, phase), _geo(bases) if bases else None)
                if ratio:
                    by.setdefault((r["mode"], knob, value, phase), []).append((_cell_name(cell), ratio))
    out = []
    for (mode, knob, value, phase), got in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1] != "defaults again",
                                                                             str(kv[0][1:]))):
        vals = [v for _, v in got]
        out.append({"mode": mode, "knob": knob, "value": value, "phase": phase, "cells": len(vals),
                    "geomean": _geo(vals), "min": min(vals), "max": max(vals),
                    "better": [c for c, v in got if v > 1.05], "worse": [c for c, v in got if v < 0.95]})
    return out


def knobs_table(result: dict[str, Any]) -> list[str]:
    out = ["| mode | knob = value (vs the defaults) | phase | cells | geo-mean | min | max | >5% faster in | >5% slower in |",
           "|---|---|---|---:|---:|---:|---:|---|---|"]
    for k in knob_summary(result):
        what = k["knob"] if k["knob"] == "defaults again" else f"{k['knob']} = {k['value']}"
        out.append(f"| {MODES[k['mode']]} | {what} | {k['phase']} | {k['cells']} | {k['geomean']:.2f}x "
                   f"| {k['min']:.2f}x | {k['max']:.2f}x | {'; '.join(k['better']) or '-'} | {'; '.join(k['worse']) or '-'} |")
    return out


def rss_table(result: dict[str, Any]) -> list[str]:
    """Peak RSS per loader row across shard sizes (whose datasets differ in size: 2-4 shards)."""
    shards = list(result["settings"]["shards"])
    out = ["| sample size | row | " + " | ".join(f"{s} shards: dataset MB; main / worker peak RSS (anon) MB" for s in shards)
           + " |", "|---|---|" + "---|" * len(shards)]
    cells = {(c["shard"], c["kind"]): c for c in _cells(result)}
    names = list(dict.fromkeys(r["name"] for r in result["rows"] if not r["knobs"] and r["mode"] != "pack"))
    for kind in [k for k in KINDS if k in result["settings"]["kinds"]]:
        for name in names:
            parts = []
            for s in shards:
                r = next((r for r in result["rows"] if r["shard"] == s and r["kind"] == kind and r["name"] == name
                          and not r["knobs"]), None)
                rss, cell = (r or {}).get("rss"), cells.get((s, kind))
                if not rss or not cell:
                    parts.append("-")
                    continue
                worker = f"{rss['worker_hwm_mb']} ({rss['worker_anon_mb']})" if rss.get("worker_hwm_mb") else "-"
                parts.append(f"{cell.get('shard_bytes_total', 0) / 1e6:,.0f}; {rss['main_hwm_mb']} ({rss['main_anon_mb']}) "
                             f"/ {worker}")
            if any(p != "-" for p in parts):
                label = f"**shardkit {name}**" if name in MODES.values() else name
                out.append(f"| {KINDS[kind].label} | {label} | " + " | ".join(parts) + " |")
    return out


def markdown(result: dict[str, Any]) -> str:
    """The whole report: settings, target checks, knob summary, then one table per cell."""
    st = result["settings"]
    lines = [f"Command: `{result['command']}`, {result['created']}, {result['wall_seconds']:.0f} s wall, "
             f"load average {result['load_avg_start'][0]:.1f} at the start, {result['load_avg_end'][0]:.1f} at the end; "
             f"{result['machine']['cpu_count']} cores, {result['machine']['memory_gib']:.0f} GiB. "
             f"Warm rows: best of {st['warm_epochs']} epochs; 2 DataLoader workers where workers are used.", ""]
    if result.get("partial"):
        lines += ["- note: PARTIAL: the run ended before its last cell; the cells below are those it finished"]
    lines += [f"- note: {n}" for n in result.get("notes", [])]
    lines += ["", "Targets (issue 22), per cell; 'raw cold/warm' is the best StreamingDataLoader mode:", ""]
    lines += checks_table(result)
    if st.get("knobs"):
        lines += ["", "Knobs against the defaults (samples/s of the knob row / of the mode's default row, or the "
                  "geometric mean of it and its 'defaults again' row where the run has one; same cell). The "
                  "'defaults again' line is the noise: the same settings measured twice.", ""]
        lines += knobs_table(result)
    lines += ["", "Peak memory per process (VmHWM, with RssAnon, the private part, in brackets; every "
              "process starts from the pages of the one it was forked from, torch imported):", ""]
    lines += rss_table(result)
    for cell in _cells(result):
        lines += [""] + cell_table(result, cell)
    failed = [c for c in result["cells"] if "payload_bytes" not in c]
    for c in failed:
        lines += ["", f"Cell {c['shard']} / {c['kind']} FAILED: {c.get('error') or c.get('pack', {}).get('reason')}"]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- charts


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


_STYLE = {"per_sample": ("#ff7f0e", "o"), "workers": ("#d62728", "s"), "threads": ("#9467bd", "^"),
          "zero_copy": ("#8c564b", "D"), "nocache": ("#e377c2", "v"), "peer": ("#1f77b4", "x"),
          "ceiling": ("#7f7f7f", "")}


def _series(result: dict[str, Any], phase: str = "cold") -> dict[tuple[str, str], dict[str, float | None]]:
    """(shard, kind) -> {mode or 'peer' or 'get': samples/s}."""
    out = {}
    for cell in _cells(result):
        rows = _rows(result, cell)
        vals: dict[str, float | None] = {m: _sps(_mode(rows, m), phase) for m in MODES}
        best = _best_peer(rows, phase)
        vals["peer"] = best[1] if best else None
        vals["get"] = _ceiling_sps(cell, "get" if phase == "cold" else "cat")
        vals["first_get"] = (cell.get("ceiling") or {}).get("first_batch_get_s")
        for m in MODES:
            vals[f"first_{m}"] = ((_mode(rows, m) or {}).get("cold") or {}).get("first_batch_s")
        firsts = [((r.get("cold") or {}).get("first_batch_s")) for r in rows if r["mode"] == "peer"]
        vals["first_peer"] = min([f for f in firsts if f], default=None)
        vals["mb"] = cell["payload_bytes"] / cell["count"] / 1e6
        out[(cell["shard"], cell["kind"])] = vals
    return out


def _axis_chart(result: dict[str, Any], path: Path, by_shard: bool) -> None:
    plt = _plt()
    shards = list(result["settings"]["shards"])
    kinds = [k for k in KINDS if k in result["settings"]["kinds"]]
    panels, xs = (kinds, shards) if by_shard else (shards, kinds)
    cold, warm = _series(result, "cold"), _series(result, "warm")
    fig, axes = plt.subplots(2, len(panels), figsize=(4.6 * len(panels), 7.2), squeeze=False)
    for col, panel in enumerate(panels):
        for row, (phase, data) in enumerate((("cold", cold), ("warm", warm))):
            ax = axes[row, col]
            for key in [*MODES, "peer", "get"]:
                if phase == "warm" and key == "nocache":
                    continue
                pts = [(i, data.get((x, panel) if by_shard else (panel, x), {}).get(key)) for i, x in enumerate(xs)]
                pts = [(i, v * (data[(xs[i], panel) if by_shard else (panel, xs[i])]["mb"] or 0.0)) for i, v in pts if v]
                if not pts:
                    continue
                color, marker = _STYLE.get(key if key in _STYLE else "ceiling", _STYLE["ceiling"])
                label = {"peer": "best peer", "get": "GET ceiling" if phase == "cold" else "cat ceiling"}.get(key, MODES.get(key))
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker or None, color=color, label=label,
                        linestyle="--" if key in ("get", "peer") else "-")
            ax.set_xticks(range(len(xs)))
            ax.set_xticklabels(xs if by_shard else [KINDS[x].label for x in xs], fontsize=8)
            ax.set_yscale("log")
            ax.set_title(f"{phase}: {KINDS[panel].label if by_shard else panel + ' shards'}", fontsize=9)
            ax.set_ylabel("payload MB/s (log)", fontsize=8)
            ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7, loc="best")
    axes[1, 0].legend(fontsize=7, loc="best")
    what = "shard size" if by_shard else "sample size"
    fig.suptitle(f"Benchmark matrix by {what} ({result['created'][:16]}Z, {result['machine']['cpu_count']} cores)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


def _bars_chart(result: dict[str, Any], path: Path, against: str) -> None:
    """Grouped bars per cell: each mode's samples/s over the ceiling (``against='ceiling'``) or
    over the best peer (``'peer'``), cold and warm panels."""
    plt = _plt()
    cold, warm = _series(result, "cold"), _series(result, "warm")
    cells = list(cold)
    modes = [m for m in MODES if m != "nocache" or against == "peer"]
    fig, axes = plt.subplots(2, 1, figsize=(max(8.0, 1.3 * len(cells) + 2), 7.5), squeeze=False)
    width = 0.8 / len(modes)
    for row, (phase, data) in enumerate((("cold", cold), ("warm", warm))):
        ax = axes[row, 0]
        for j, m in enumerate(modes):
            base = "get" if against == "ceiling" else "peer"
            vals = [_ratio(data[c].get(m), data[c].get(base)) or 0 for c in cells]
            ax.bar([i + (j - len(modes) / 2 + 0.5) * width for i in range(len(cells))], vals, width,
                   color=_STYLE[m][0], label=MODES[m])
        ax.axhline(1.0, color="black", linewidth=0.8)
        for target in ((0.8,) if against == "ceiling" and phase == "cold" else (1.5,) if against == "peer" and phase == "cold"
                       else (5.0,) if against == "peer" else ()):
            ax.axhline(target, color="green", linestyle=":", linewidth=1, label=f"target {target}x")
        ax.set_xticks(range(len(cells)))
        ax.set_xticklabels([f"{s}\n{KINDS[k].label}" for s, k in cells], fontsize=7.5)
        ref = ("GET ceiling" if phase == "cold" else "cat ceiling") if against == "ceiling" else "best peer"
        ax.set_ylabel(f"samples/s / {ref}", fontsize=8)
        ax.set_title(f"{phase}: shardkit's loader modes over the {ref} of the same cell", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0, 0].legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


def _first_batch_chart(result: dict[str, Any], path: Path) -> None:
    plt = _plt()
    data = _series(result, "cold")
    shards = list(result["settings"]["shards"])
    kinds = [k for k in KINDS if k in result["settings"]["kinds"]]
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.6 * len(kinds), 3.8), squeeze=False)
    for col, kind in enumerate(kinds):
        ax = axes[0, col]
        for key, label in [*((f"first_{m}", MODES[m]) for m in MODES), ("first_peer", "fastest peer"),
                           ("first_get", "bare GET of the first batch")]:
            pts = [(i, data.get((s, kind), {}).get(key)) for i, s in enumerate(shards)]
            pts = [(i, v) for i, v in pts if v]
            if pts:
                m = key.removeprefix("first_")
                color, marker = _STYLE.get(m, _STYLE["ceiling"])
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker or "o", color=color, label=label,
                        linestyle="--" if m in ("get", "peer") else "-")
        ax.axhline(0.5, color="green", linestyle=":", linewidth=1, label="target 0.5 s")
        ax.set_xticks(range(len(shards)))
        ax.set_xticklabels(shards, fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("seconds to the first batch, cold (log)", fontsize=8)
        ax.set_title(KINDS[kind].label, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=6.5)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


def charts(result: dict[str, Any], out: Path) -> list[Path]:
    """Write the five charts; returns their paths."""
    paths = [out / f"matrix-{n}.png" for n in ("shard-size", "sample-size", "mode", "cold-warm", "first-batch")]
    _axis_chart(result, paths[0], by_shard=True)
    _axis_chart(result, paths[1], by_shard=False)
    _bars_chart(result, paths[2], "ceiling")
    _bars_chart(result, paths[3], "peer")
    _first_batch_chart(result, paths[4])
    return paths


def write_outputs(result: dict[str, Any], out: Path) -> str:
    """Write ``matrix.md`` and the charts into ``out``; returns the Markdown."""
    text = markdown(result)
    out.mkdir(parents=True, exist_ok=True)
    (out / "matrix.md").write_text(text)
    charts(result, out)
    return text
