"""``metaps meta-io inspect``: what a built Meta-IO dataset holds.

:func:`inspect_dataset` returns a summary dict computed from the index (and
cross-checked against the manifest); :func:`format_summary` renders it for a
terminal. Opening every data file's footer (``check_files=True``) also proves
the files are present, complete and agree with the index; ``verify=True``
(``metaps meta-io inspect --verify``) reads every byte and checks the crc32
of every record batch and file frame (see :mod:`meta_io.integrity`).

Example::

    >>> s = inspect_dataset("runs/main/metaio")
    >>> s["rows"]["support"] + s["rows"]["query"] + s["rows"]["leftover"] == s["rows"]["input"]
    True
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from meta_io.layout import BatchKind
from meta_io.reader import MetaIODataset


def inspect_dataset(path: str | Path, check_files: bool = True, verify: bool = False) -> dict[str, Any]:
    """Summary of the dataset at ``path``.

    Args:
        path: a dataset folder.
        check_files: open every data file (footer and, with checksums, frame) to check it.
        verify: read every byte of every file and check it against the
            checksums (``--verify``); each bad file becomes a problem naming the
            file and the record batch.

    Returns:
        layout, files, batches, tasks, episodes, rows (input/support/query/
        leftover/plain), fill ratios, per-scenario rows, a bucket histogram and
        ``problems`` (index vs manifest disagreements; empty when consistent).
    """
    ds = MetaIODataset(path)
    m, idx = ds.manifest, ds.index
    totals = m["totals"]
    c = idx.cols
    meta = idx.kind == BatchKind.META.value
    buckets = []
    if meta.any():
        caps, inv = np.unique(c["capacity"][meta], return_inverse=True)
        for i, cap in enumerate(caps.tolist()):
            sel = np.flatnonzero(meta)[inv == i]
            slots = int(c["n_slots"][sel].sum())
            n_rows = int(c["n_rows"][sel].sum())
            buckets.append(
                dict(
                    capacity=cap,
                    support=int(c["support"][sel[0]]),
                    query=int(c["query"][sel[0]]),
                    tasks_per_batch=int(c["task_slots"][sel[0]]),
                    batches=int(sel.size),
                    episodes=int(c["n_tasks"][sel].sum()),
                    rows=n_rows,
                    fill_ratio=round(n_rows / slots, 4) if slots else 0.0,
                )
            )
        buckets.sort(key=lambda b: -b["capacity"])
    rows = dict(
        input=int(totals["input_rows"]),
        support=idx.sum("n_support_rows", BatchKind.META),
        query=idx.sum("n_query_rows", BatchKind.META),
        leftover=idx.sum("n_rows", BatchKind.LEFTOVER),
        plain=idx.sum("n_rows", BatchKind.PLAIN),
    )
    problems = []
    for key, name in (("support", "support_rows"), ("query", "query_rows"), ("leftover", "leftover_rows"),
                      ("plain", "plain_rows")):
        if rows[key] != int(totals.get(name, 0)):
            problems.append(f"index has {rows[key]} {key} rows, manifest says {totals.get(name)}")
    placed = rows["support"] + rows["query"] + rows["leftover"] + rows["plain"]
    if placed != rows["input"]:
        problems.append(f"index places {placed} rows, input had {rows['input']}")
    if check_files and not verify:
        ds.check_files()
    if verify:
        problems += ds.verify()
    checksums = "verified" if verify and not problems else ("present" if ds.has_checksums else "absent")
    summary: dict[str, Any] = dict(
        path=str(ds.path),
        layout=ds.layout,
        task_key=m.get("task_key"),
        support=m.get("support"),
        query=m.get("query"),
        split=m.get("split"),
        seed=m.get("seed"),
        rows_per_batch=m.get("rows_per_batch"),
        bucketing=m.get("bucketing"),
        files=ds.num_files,
        batches=ds.total_batches,
        leftover_files=len(m.get("leftover_files", [])),
        leftover_batches=int((idx.kind == BatchKind.LEFTOVER.value).sum()),
        bytes=int(totals.get("bytes", 0)),
        tasks=int(totals.get("tasks", 0)),
        leftover_tasks=int(totals.get("leftover_tasks", 0)),
        episodes=idx.sum("n_tasks", BatchKind.META),
        rows=rows,
        fill_ratio=totals.get("fill_ratio"),
        fill_ratio_without_buckets=totals.get("fill_ratio_without_buckets"),
        episode_fill_ratio=totals.get("episode_fill_ratio"),
        episode_fill_ratio_without_buckets=totals.get("episode_fill_ratio_without_buckets"),
        scenario_rows=m.get("scenario_rows", {}),
        buckets=buckets,
        build_seconds=totals.get("build_seconds"),
        problems=problems,
        checksums=checksums,
        verified=bool(verify),
    )
    return summary


def format_summary(s: dict[str, Any]) -> str:
    """A readable multi-line rendering of :func:`inspect_dataset`'s dict."""
    r = s["rows"]
    lines = [
        f"Meta-IO dataset  {s['path']}",
        f"  layout          {s['layout']}"
        + (f"  (task key {s['task_key']}, S={s['support']} Q={s['query']}, split {s['split']}, seed {s['seed']})"
           if s["layout"] == "meta" else f"  (seed {s['seed']})"),
        f"  files           {s['files']} data ({s['batches']} batches)"
        + (f", {s['leftover_files']} leftover ({s['leftover_batches']} batches)" if s["leftover_files"] else "")
        + f", {s['bytes'] / 2**20:.1f} MiB",
        f"  rows            input {r['input']:,}",
    ]
    if s["layout"] == "meta":
        lines += [
            f"                  support {r['support']:,}  query {r['query']:,}  leftover {r['leftover']:,}",
            f"  tasks           {s['tasks']:,} ({s['episodes']:,} episodes); {s['leftover_tasks']:,} one-row tasks in leftover",
            f"  fill ratio      {s['fill_ratio']:.3f} with buckets, {s['fill_ratio_without_buckets']:.3f} without "
            f"(per episode: {s['episode_fill_ratio']:.3f} vs {s['episode_fill_ratio_without_buckets']:.3f})",
            "  buckets         capacity  S   Q   tasks/batch  batches  episodes      rows   fill",
        ]
        for b in s["buckets"]:
            lines.append(
                f"                  {b['capacity']:>8} {b['support']:>3} {b['query']:>3} {b['tasks_per_batch']:>12}"
                f" {b['batches']:>8} {b['episodes']:>9,} {b['rows']:>9,} {b['fill_ratio']:>6.3f}"
            )
    else:
        lines.append(f"                  plain {r['plain']:,}  fill ratio {s['fill_ratio']:.3f}")
    if s["scenario_rows"]:
        lines.append("  scenario rows   " + "  ".join(f"{k}: {v:,}" for k, v in s["scenario_rows"].items()))
    if s.get("build_seconds") is not None:
        lines.append(f"  build time      {s['build_seconds']:.2f} s")
    if s["problems"]:
        lines.append("  consistency     " + "; ".join(s["problems"]))
    elif s.get("verified"):
        lines.append("  consistency     ok (index and manifest agree; every byte matches its crc32)")
    else:
        note = ("file contents not read: --verify checks every crc32" if s.get("checksums") == "present"
                else "no checksums (older build): contents cannot be verified; rebuild")
        lines.append(f"  consistency     ok (index and manifest agree; {note})")
    return "\n".join(lines)
