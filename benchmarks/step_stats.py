"""bench_step.py's statistics: pure arithmetic over the timed steps, importing nothing of the
benchmarks (tests/unit/test_bench_stats.py loads this file by its path)."""

from __future__ import annotations

import statistics


def finish_flags(order: list[tuple[int, str]]) -> list[bool]:
    """For each (batch, contender) of `order`: True where another contender (or none) runs next,
    so the step's work still in flight is finished, and timed, before it does."""
    return [k + 1 == len(order) or order[k + 1][1] != name for k, (_, name) in enumerate(order)]


def summarize(results: dict, args, peers: dict[str, list[str]]) -> dict:
    """Per contender: median step time, spread, tokens/s, memory (max over ranks), ratios;
    `peers`: each of ours and the peers it is paired with (contenders.PEERS)."""
    tokens = args.nproc * args.batch * args.seq
    rows = {}
    for name, r in results.items():
        if r.get("error") or not r["times"]:
            continue
        times = r["times"]
        median = statistics.median(times)
        q1, _, q3 = (
            statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else [median] * 3
        )
        memory = {k: max(m[k] for m in r["memory_per_rank"]) for k in r["memory_per_rank"][0]}
        rows[name] = {
            "median_s": median,
            "p25_s": q1,
            "p75_s": q3,
            "cpu_median_s": statistics.median(r["cpu_times"]),
            "tokens_per_s": tokens / median,
            "memory_bytes": memory,
            "final_loss": r["loss"],
        }
    bound = rows.get("bound")
    for name, row in rows.items():
        row["vs_bound"] = row["median_s"] / bound["median_s"] if bound else None
        row["vs_bound_paired"] = paired_ratio(results, name, "bound") if bound else None
    pairs = [
        {
            "ours": o,
            "peer": p,
            "ratio": rows[o]["median_s"] / rows[p]["median_s"],
            "paired": paired_ratio(results, o, p),
        }
        for o, theirs in peers.items()
        for p in theirs
        if o in rows and p in rows
    ]
    # Each of ours over its old- twin: the cost of a change, measured side by side.
    versus_old = [
        {
            "new": name,
            "old": old,
            "ratio": rows[name]["median_s"] / rows[old]["median_s"],
            "paired": paired_ratio(results, name, old),
            "paired_cpu": paired_ratio(results, name, old, key="cpu_times"),
        }
        for name in rows
        if (old := f"old-{name}") in rows
    ]
    return {"rows": rows, "pairs": pairs, "versus_old": versus_old, "tokens_per_step": tokens}


def paired_ratio(results: dict, a: str, b: str, key: str = "times") -> float | None:
    """Median over timed steps of a's step time over b's at the same step of the same round.

    With `--interleave step` the two steps ran moments apart, so drift of the machine cancels
    in each ratio; None when the two did not run the same steps. `key="cpu_times"` pairs the
    process CPU times instead.
    """
    ta, tb = results[a][key], results[b][key]
    if len(ta) != len(tb) or not ta:
        return None
    return statistics.median(x / y for x, y in zip(ta, tb, strict=True))
