"""The markdown tables of the two checkpoint benchmarks: ``throughput.py`` (one
process, every contender) and ``sharded.py`` (FSDP2 ranks, DCP against cadence)."""

from __future__ import annotations


def _s(row: dict, kind: str) -> str:
    if f"{kind}_s_median" not in row:
        return "—"
    return f"{row[f'{kind}_s_median']:.2f} ({row[f'{kind}_s_min']:.2f})"


def _ratio(row: dict, kind: str) -> str:
    if f"{kind}_ratio_median" not in row:
        return "—"
    return f"{row[f'{kind}_ratio_median']:.2f} ({row[f'{kind}_ratio_min']:.2f})"


def _target(t: dict) -> str:
    verdict = "met" if t["met"] else "**missed**"
    return f"{t['value']:.2f}x (>= {t['bound']:.2f}x: {verdict})"


TARGET_NAMES = {"save_vs_raw": "save vs raw", "save_vs_dcp": "save vs DCP", "load_vs_raw": "load vs raw",
                "load_vs_dcp": "load vs DCP"}


def checkpoint_lines(r: dict) -> list[str]:
    """The tables of ``benchmarks/checkpoint/throughput.py``'s result ``r``, one section per size."""
    if "sizes" not in r:  # written by an older version of this benchmark
        return ["## Checkpoint save and load\n", "(Old format: rerun `python benchmarks/run.py --only checkpoint`.)\n"]
    lines = []
    for size in r["sizes"]:
        lines += [(f"## Checkpoint save and load, {size['label']} ({size['state_gib']:.2f} GiB: {size['layers']} layers of "
                   f"{size['width']}x{size['width']} float32 + Adam state; {size['repeats']} interleaved repeats"
                   f"{', quick' if r.get('quick') else ''})\n"),
                  "| contender | save s | save × raw | load s | load × raw |", "|---|---|---|---|---|"]
        lines += [f"| {row['contender']} | {_s(row, 'save')} | {_ratio(row, 'save')} | {_s(row, 'load')} | "
                  f"{_ratio(row, 'load')} |" for row in size["rows"]]
        lines += ["\nSeconds: median (min). × raw: raw time / contender time (> 1: faster than raw), of the medians "
                  "(of the minimums). Saves include the fsync of every file; loads go into the live model and "
                  "optimizer, from the files just written (page cache). † the optimizer state it loads maps the "
                  "file: its pages are read on first use, after the clock stops. Asynchronous saves: the stall "
                  "benchmark's section.\n",
                  "Targets, cadence (crc32c): " + "; ".join(f"{TARGET_NAMES[t['name']]} {_target(t)}"
                                                          for t in size["targets"] if t["name"] in TARGET_NAMES)
                  + ".\n"]  # (older results also held the asynchronous save's, now the stall benchmark's)
    return lines + load_lines(r.get("loads") or [], quick=bool(r.get("quick")))


def load_lines(loads: list[dict], *, quick: bool = False) -> list[str]:
    """The table of ``checkpoint_throughput.measure_loads``' results (the loads alone, another shape)."""
    if not loads:
        return []
    lines = [(f"## Checkpoint load alone, layers of {loads[0]['width']}x{loads[0]['width']} float32 + Adam state "
              f"(into the live optimizer, and into a new one without state{', quick' if quick else ''})\n"),
             "| state | contender | live: load s | live: × raw | new optimizer: load s | new optimizer: × raw |",
             "|---|---|---|---|---|---|"]
    for shape in loads:
        for row in shape["rows"]:
            lines.append(f"| {shape['label']}: {shape['layers']} layers, {shape['state_gib']:.2f} GiB, "
                         f"{shape['repeats']} repeats | {row['contender']} | {_s(row, 'live')} | {_ratio(row, 'live')} | "
                         f"{_s(row, 'fresh')} | {_ratio(row, 'fresh')} |")
    lines.append("\nSeconds: median (min); × raw as above. Live: into the model and optimizer that saved the state "
                 "(cadence writes the optimizer's state into its tensors); new optimizer: the same model, an "
                 "optimizer without state (a resume in a new process: the load allocates the state; DCP's "
                 "get_state_dict creates it first, within its time). Targets, cadence (crc32c), live: "
                 + "; ".join(f"{shape['label']} {_target(shape['target'])}" for shape in loads)
                 + ".\n")
    return lines


def _phases(phases: dict, names: tuple[str, ...]) -> str:
    return " / ".join("—" if phases.get(name) is None else f"{phases[name]:.2f}" for name in names)


def sharded_lines(r: dict) -> list[str]:
    """The tables of ``benchmarks/checkpoint/sharded.py``'s result ``r``."""
    rows = r["rows"]
    sizes = sorted({f"{row['state_gib']:.2f}" for row in rows})
    lines = [(f"## Sharded checkpoint save and load under FSDP2 ({' / '.join(sizes)} GiB: {r['layers']} layers of "
              f"{r['width']}x{r['width']} float32 + AdamW state; torchrun ranks, gloo, CPU; {r['repeats']} alternating "
              f"repeats after a warm-up round{', quick' if r.get('quick') else ''})\n"),
             "| ranks | contender | written GiB | save s | write GiB/s | load s | read GiB/s |",
             "|---|---|---|---|---|---|---|"]
    names = {"dcp": "plain DCP (dcp.save / dcp.load)", "cadence": "cadence (CheckpointSession, crc32c)"}
    for row in rows:
        for key in ("dcp", "cadence"):
            c = row["contenders"][key]
            lines.append(f"| {row['world_size']} | {names[key]} | {c['bytes_written'] / 2**30:.2f} | "
                         f"{c['save_s_median']:.2f} ({c['save_s_min']:.2f}) | {c['write_gib_per_s']:.2f} | "
                         f"{c['load_s_median']:.2f} ({c['load_s_min']:.2f}) | {c['read_gib_per_s']:.2f} |")
    lines += ["\n| ranks | save: cadence / DCP | load: cadence / DCP | checksum share of cadence's save | "
              "verification share of cadence's load | cadence save: write_shards / DCP write / read-back checksum / "
              "commit s | cadence load: verify / DCP read s |",
              "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['world_size']} | {row['save_ratio']:.2f}x | {row['load_ratio']:.2f}x | "
                     f"{row['checksum_save_share'] * 100:.1f}% | {row['verify_load_share'] * 100:.1f}% | "
                     f"{_phases(row['phases']['save'], ('write_shards', 'dcp_write', 'checksum', 'commit'))} | "
                     f"{_phases(row['phases']['load'], ('verify', 'dcp_read'))} |")
    lines.append("\nSeconds: median (min), wall clock from a barrier of all ranks to one after. Write (read) GiB/s: "
                 "the bytes of every rank's files together / the median save (load). cadence / DCP: of the median "
                 "times (> 1: cadence is slower). Shares and phases: the slowest rank's seconds in the phase (median "
                 "over repeats), as a share of the wall time; the read-back checksum is inside write_shards, the DCP "
                 "write too; commit is the chief's. Saves fsync every file (both contenders); loads read the files "
                 "just written, from the page cache (not dropped: no root). On 1 rank the model is sharded over a "
                 "one-rank group (a cadence run on one process does not shard: it writes safetensors files, see the "
                 "checkpoint benchmark). The ranks share the machine's cores, OMP_NUM_THREADS=1.\n")
    return lines
