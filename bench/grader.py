"""Grader throughput: completions scored per second along three paths.

  in-process   graders.voice_leading.score() in this process
  grpc         ScoreBatch against a local `counterpoint grader serve` (a subprocess), batches of
               --batch completions over one channel
  music21      a baseline: the same realizations (frames rendered by our renderer) checked with
               music21 (a Chord per frame; VoiceLeadingQuartet parallel/hidden fifth/octave and
               overlap checks for every voice pair of consecutive frames)

Completions are seeded: for every case of the shipped train pool, a JSON answer with random
degrees (mostly well-formed, some prose, some lost-prefix continuations).

    python bench/grader.py [--n 2000] [--batch 64] [--save out.json] [--baseline old.json]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from config.runtime_env import apply_defaults  # noqa: E402

apply_defaults()


def make_completions(n: int, seed: int) -> list[tuple[dict, str, str]]:
    """(progression, case_id, completion) triples over the train pool."""
    from graders.voice_leading.pool import load_pool

    cases = load_pool().take(0)
    rng = random.Random(seed)
    out = []
    for i in range(n):
        case = cases[i % len(cases)]
        entries = [
            {"measure": c["measure"], "degrees": [rng.randrange(4) for _ in range(case.voices)]}
            for c in case.progression["chords"]
        ]
        text = json.dumps(entries)
        roll = rng.random()
        if roll < 0.1:
            text = "Here is my voicing:\n```json\n" + text + "\n```"
        elif roll < 0.15:
            text = "I would write this in Python: def voice(): pass"
        elif roll < 0.2:
            text = text[text.index("},") + 3:]  # a forced prefix that got lost
        out.append((case.progression, case.id, text))
    return out


def bench_in_process(items) -> float:
    from graders.voice_leading import score

    for progression, _, text in items[:100]:  # warm the chord-parse caches, like a server
        score(progression, text)
    start = time.perf_counter()
    for progression, _, text in items:
        score(progression, text)
    return time.perf_counter() - start


def bench_grpc(items, batch: int) -> float:
    from graders.client import GraderClient

    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "grader", "serve", "--port", "0"],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline()
        address = line.split("serving on ")[1].split()[0]
        pairs = [(case_id, text) for _, case_id, text in items]
        with GraderClient(address) as client:
            client.score_batch(pairs[:batch])  # warm the channel
            start = time.perf_counter()
            for i in range(0, len(pairs), batch):
                client.score_batch(pairs[i : i + batch])
            return time.perf_counter() - start
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def music21_check(frames) -> list[str]:
    """Parallels / hidden / overlap on consecutive sounding frames, the music21 way."""
    from music21 import chord, note, voiceLeading

    failing = set()
    sounding = [f for f in frames if f.voices]
    for f in sounding:
        chord.Chord([int(round(v)) for v in f.voices])  # membership/spelling object per frame
    for a, b in zip(sounding, sounding[1:]):
        if len(a.voices) != len(b.voices):
            continue
        na = [note.Note(int(round(v))) for v in a.voices]
        nb = [note.Note(int(round(v))) for v in b.voices]
        n = len(na)
        for lo in range(n):
            for hi in range(lo + 1, n):
                q = voiceLeading.VoiceLeadingQuartet(na[hi], nb[hi], na[lo], nb[lo])
                if q.parallelFifth() or q.parallelUnisonOrOctave():
                    failing.add("parallels")
                if lo == 0 and hi == n - 1 and (q.hiddenFifth() or q.hiddenOctave()):
                    failing.add("hidden")
                if hi == lo + 1 and q.voiceOverlap():
                    failing.add("overlap")
    return sorted(failing)


def bench_music21(items) -> tuple[float, str]:
    """Seconds, and how often music21 agrees with our verifier on parallels/hidden/overlap."""
    import music21  # noqa: F401  (import time is not throughput)

    from graders.voice_leading import parse_completion, render_frames, score

    start = time.perf_counter()
    found = [music21_check(render_frames(p, parse_completion(t), 2)) for p, _, t in items]
    seconds = time.perf_counter() - start
    rules = ("parallels", "hidden", "overlap")
    agree = total = 0
    for (progression, _, text), theirs in zip(items, found, strict=True):
        result = score(progression, text)
        if result.verdict == "structure":
            continue
        total += 1
        agree += [r for r in rules if r in result.failing_rules] == [r for r in rules if r in theirs]
    return seconds, f"music21 agrees with ours on {{parallels, hidden, overlap}}: {agree}/{total}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000, help="completions per path")
    parser.add_argument("--n-music21", type=int, default=300, help="completions for music21")
    parser.add_argument("--batch", type=int, default=64, help="ScoreBatch size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", type=Path, help="write this run's figures as JSON")
    parser.add_argument("--baseline", type=Path, help="a saved run to compare against")
    args = parser.parse_args()

    items = make_completions(args.n, args.seed)
    runs = {
        "in-process": (len(items), bench_in_process(items)),
        f"grpc ScoreBatch x{args.batch}": (len(items), bench_grpc(items, args.batch)),
    }
    m21_seconds, agreement = bench_music21(items[: args.n_music21])
    runs["music21 baseline"] = (args.n_music21, m21_seconds)
    figures = {name: {"n": n, "seconds": s, "per_s": n / s} for name, (n, s) in runs.items()}
    baseline = json.loads(args.baseline.read_text()) if args.baseline else {}

    from rich.console import Console
    from rich.table import Table

    table = Table(title="grader throughput (completions/s)")
    for col in ("path", "completions", "seconds", "completions/s"):
        table.add_column(col, justify="right" if col != "path" else "left")
    if baseline:
        table.add_column(f"baseline ({args.baseline.name})", justify="right")
        table.add_column("ratio", justify="right")
    for name, f in figures.items():
        row = [name, str(f["n"]), f"{f['seconds']:.3f}", f"{f['per_s']:,.0f}"]
        if baseline:
            old = baseline.get(name, {}).get("per_s")
            row += [f"{old:,.0f}" if old else "-", f"{f['per_s'] / old:.2f}x" if old else "-"]
        table.add_row(*row)
    Console(width=120).print(table)
    print(agreement)
    if args.save:
        args.save.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
