"""`mtrain timeline-summary`: what a timeline file says, as a table and a picture.

Reads the Chrome trace the ranks write (``ringreduce/observe/timeline.py``, Horovod's layout: one
process per op name, B/E spans per phase with the activities nested in the op's span, one
thread per rank, STEP events per training step on pid 0), a Horovod timeline (rank 0's
events alone, no thread ids), and the layout of earlier mtrain versions (one process per
rank, one thread row per op name, complete events per phase); also a file a crashed job left
without its closing bracket. A phase's time is its own, less the activities nested in it, so
an op's phases add up to its time. Stdlib only; matplotlib is imported when a picture is
asked for.
"""
from __future__ import annotations

import json
import statistics
from collections import defaultdict
from typing import Any, NamedTuple

STEP = "STEP"
# The picture has one panel per rank; past this many it shows the first ones only.
MAX_DRAWN_RANKS = 32


class TimelineError(ValueError):
    """The file is missing or is not a timeline: one line for the user."""


class OpTotal(NamedTuple):
    """One op name's time over every rank."""

    name: str
    runs: int                       # times it ran, summed over ranks
    total_us: float
    phases: "dict[str, float]"      # phase -> µs


class Step(NamedTuple):
    rank: int
    number: int        # the step's index, as the rank counted it
    compute_s: float
    wait_s: float
    total_s: float


class RankSteps(NamedTuple):
    rank: int
    steps: int
    compute_s: float   # medians
    wait_s: float
    total_s: float


class Summary(NamedTuple):
    ranks: "list[int]"
    ops: "list[OpTotal]"            # by total time, most first
    steps: "list[Step]"


def load_events(path: str) -> "list[dict]":
    """The events of a timeline file; a file cut short (no closing bracket, a half line) too."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as error:
        raise TimelineError(f"cannot read {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise TimelineError(f"{path} is not a timeline (not text)") from None
    events = _parse(text)
    if events is None or not any(isinstance(e, dict) and "ph" in e for e in events):
        raise TimelineError(f"{path} is not a timeline (a Chrome-trace JSON array of events, as "
                            "--timeline-filename / HOROVOD_TIMELINE write)")
    return [e for e in events if isinstance(e, dict)]


def _parse(text: str) -> "list | None":
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        data = data.get("traceEvents")
    if isinstance(data, list):
        return data
    if not text.lstrip().startswith("["):
        return None
    # Cut short: our writer puts one event per line, each followed by a comma.
    events = []
    for line in text.lstrip()[1:].splitlines():
        line = line.strip().rstrip(",")
        if not line or line == "]":
            continue
        try:
            events.append(json.loads(line))
        except ValueError:
            continue  # the half-written last line
    return events


def summarize(events: "list[dict]") -> Summary:
    if any(e.get("ph") == "B" for e in events):
        return _summarize_spans(events)
    return _summarize_rows(events)


def _summarize_spans(events: "list[dict]") -> Summary:
    """Horovod's layout: op names from each pid's process_name, phases from B/E pairs per
    (pid, tid), the rank being the tid (0 in Horovod's own files, which have none)."""
    ops_by_pid: "dict[Any, str]" = {}
    for event in events:
        if event.get("ph") == "M" and event.get("name") == "process_name":
            name = (event.get("args") or {}).get("name")
            if name is not None:
                ops_by_pid[event.get("pid")] = str(name)
    phases: "dict[str, dict[str, float]]" = defaultdict(lambda: defaultdict(float))
    counts: "dict[tuple[str, Any], dict[str, int]]" = defaultdict(lambda: defaultdict(int))
    open_spans: "dict[tuple[Any, Any], list[list]]" = defaultdict(list)  # [name, start, nested time]
    steps: "list[Step]" = []
    ranks: "set[int]" = set()
    for event in events:
        ph, pid, rank = event.get("ph"), event.get("pid"), event.get("tid", 0)
        try:
            ts = float(event.get("ts", 0.0))
        except (TypeError, ValueError):
            continue
        if ph == "X" and event.get("name") == STEP and isinstance(rank, int):
            args = event.get("args") or {}
            ranks.add(rank)
            try:
                steps.append(Step(rank, int(args.get("step", len(steps))), float(args.get("compute_s", 0.0)),
                                  float(args.get("wait_s", 0.0)), float(event.get("dur", 0.0)) / 1e6))
            except (TypeError, ValueError):
                pass
            continue
        op = ops_by_pid.get(pid)
        if op is None or ph not in ("B", "E"):
            continue  # rank-ready ticks (X), markers, metadata
        if isinstance(rank, int):
            ranks.add(rank)
        stack = open_spans[(pid, rank)]
        if ph == "B":
            stack.append([str(event.get("name", "")), ts, 0.0])
            continue
        if not stack:
            continue  # an end whose begin the file lacks (a timeline started mid-op)
        name, start, nested = stack.pop()
        took = max(ts - start, 0.0)
        phases[op][name] += max(took - nested, 0.0)
        if stack:
            stack[-1][2] += took
        else:
            counts[(op, rank)][name] += 1
    return _totals(phases, counts, steps, ranks)


def _summarize_rows(events: "list[dict]") -> Summary:
    """Earlier mtrain versions' layout: pid = rank, one thread row per op name, X per phase."""
    rows: "dict[tuple[Any, Any], str]" = {}
    for event in events:
        if event.get("ph") == "M" and event.get("name") == "thread_name":
            rows[(event.get("pid"), event.get("tid"))] = str((event.get("args") or {}).get("name", ""))
    phases: "dict[str, dict[str, float]]" = defaultdict(lambda: defaultdict(float))
    counts: "dict[tuple[str, Any], dict[str, int]]" = defaultdict(lambda: defaultdict(int))
    steps: "list[Step]" = []
    ranks: "set[int]" = set()
    for event in events:
        pid = event.get("pid")
        if isinstance(pid, int):
            ranks.add(pid)
        if event.get("ph") != "X":
            continue
        try:
            dur = float(event.get("dur", 0.0))
        except (TypeError, ValueError):
            continue
        name = str(event.get("name", ""))
        if name == STEP and isinstance(pid, int):
            args = event.get("args") or {}
            try:
                steps.append(Step(pid, int(args.get("step", len(steps))), float(args.get("compute_s", 0.0)),
                                  float(args.get("wait_s", 0.0)), dur / 1e6))
            except (TypeError, ValueError):
                pass
            continue
        op = rows.get((pid, event.get("tid")), name)
        phases[op][name] += dur
        counts[(op, pid)][name] += 1
    return _totals(phases, counts, steps, ranks)


def _totals(phases: "dict[str, dict[str, float]]", counts: "dict[tuple[str, Any], dict[str, int]]",
            steps: "list[Step]", ranks: "set[int]") -> Summary:
    runs: "dict[str, int]" = defaultdict(int)
    for (op, _), by_phase in counts.items():
        runs[op] += max(by_phase.values())  # each run of an op has each of its phases once
    ops = [OpTotal(op, runs[op], sum(by_phase.values()), dict(by_phase)) for op, by_phase in phases.items()]
    ops.sort(key=lambda o: (-o.total_us, o.name))
    steps.sort(key=lambda s: (s.rank, s.number))
    return Summary(sorted(ranks), ops, steps)


def rank_steps(steps: "list[Step]") -> "list[RankSteps]":
    by_rank: "dict[int, list[Step]]" = defaultdict(list)
    for step in steps:
        by_rank[step.rank].append(step)
    return [RankSteps(rank, len(mine), statistics.median(s.compute_s for s in mine),
                      statistics.median(s.wait_s for s in mine), statistics.median(s.total_s for s in mine))
            for rank, mine in sorted(by_rank.items())]


def report(summary: Summary, top: int) -> str:
    """The text `mtrain timeline-summary` prints."""
    lines = [f"ranks: {len(summary.ranks)} ({_ranges(summary.ranks)})"]
    everything = sum(o.total_us for o in summary.ops) or 1.0
    shown = summary.ops[:top]
    lines.append(f"top {len(shown)} of {len(summary.ops)} ops by time (summed over ranks):")
    width = max([len(o.name) for o in shown] + [2])
    lines.append(f"  {'op':<{width}}  {'runs':>6}  {'total ms':>10}  {'mean ms':>9}  {'share':>6}  phases")
    for op in shown:
        parts = ", ".join(f"{phase} {us / op.total_us:.0%}" if op.total_us else phase
                          for phase, us in sorted(op.phases.items(), key=lambda item: -item[1]))
        lines.append(f"  {op.name:<{width}}  {op.runs:>6}  {op.total_us / 1e3:>10.3f}  "
                     f"{op.total_us / 1e3 / max(op.runs, 1):>9.3f}  {op.total_us / everything:>6.1%}  {parts}")
    if not shown:
        lines.append("  (none: the timeline has no op phases)")
    per_rank = rank_steps(summary.steps)
    if per_rank:
        lines.append("steps per rank (medians):")
        lines.append(f"  {'rank':>4}  {'steps':>6}  {'step ms':>9}  {'compute ms':>10}  {'wait ms':>9}")
        for r in per_rank:
            lines.append(f"  {r.rank:>4}  {r.steps:>6}  {r.total_s * 1e3:>9.3f}  {r.compute_s * 1e3:>10.3f}  "
                         f"{r.wait_s * 1e3:>9.3f}")
    else:
        lines.append("steps: none recorded (the timeline has no STEP events)")
    return "\n".join(lines)


def _ranges(ranks: "list[int]") -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    spans: "list[list[int]]" = []
    for rank in ranks:
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans) or "-"


def draw(summary: Summary, png: str) -> int:
    """Per rank, compute and wait of each step as stacked bars over the step index; returns
    how many ranks it drew. Raises ImportError without matplotlib."""
    import matplotlib
    matplotlib.use("Agg")  # no display: a file only
    import matplotlib.pyplot as plt

    by_rank: "dict[int, list[Step]]" = defaultdict(list)
    for step in summary.steps:
        by_rank[step.rank].append(step)
    ranks = sorted(by_rank)[:MAX_DRAWN_RANKS]
    figure, axes = plt.subplots(len(ranks), 1, sharex=True, squeeze=False,
                                figsize=(10, 1.2 + 1.6 * len(ranks)))
    for ax, rank in zip(axes[:, 0], ranks):
        mine = by_rank[rank]
        index = [s.number for s in mine]
        compute = [s.compute_s * 1e3 for s in mine]
        wait = [s.wait_s * 1e3 for s in mine]
        ax.bar(index, compute, width=0.9, color="tab:blue", label="compute")
        ax.bar(index, wait, width=0.9, bottom=compute, color="tab:orange", label="wait")
        ax.set_ylabel(f"rank {rank}\nms")
    axes[0, 0].legend(loc="upper right", fontsize="small")
    axes[0, 0].set_title("compute and wait per step, per rank")
    axes[-1, 0].set_xlabel("step")
    figure.tight_layout()
    figure.savefig(png, dpi=100)
    plt.close(figure)
    return len(ranks)
