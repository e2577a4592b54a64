"""music21 as an independent second opinion on the motion rules (parallels, hidden, overlap).

Random in-vocabulary progressions are rendered by our renderer (2-4 voices, integer bass
octaves 2-4, so no clamping and no unisons), and every transition is judged both by our
verifier and by ``music21.voiceLeading.VoiceLeadingQuartet`` on each pair of voices.

Where the two definitions differ, the case is filtered out (and counted), never adapted:
- music21 spells intervals (A#->F is a diminished sixth, not a fifth), ours counts semitones.
  Each quartet is therefore spelled so that a vertical of 0 or 7 semitones (mod 12) is a
  perfect unison/octave/fifth (the upper note is the lower note transposed by P1/P5 + octaves);
  a held note keeps its spelling. This is spelling, not a change of either definition.
- parallels: ours also counts unison <-> octave (interval class 0 both times); music21 keeps
  unisons and octaves distinct. Transitions with a unison in a pair are filtered.
  music21's parallelFifth/parallelOctave also count *antiparallel* (contrary) motion; ours
  requires the same direction, so we ask music21 for ``parallelMotion(P5|P8|P1,
  allowOctaveDisplacement=True)``, the similar-motion half of those methods.
- hidden: ours fires whatever the previous interval was, but only when the top voice moves
  more than 2 semitones; music21's hiddenFifth/hiddenOctave exclude arrivals by parallel
  motion of any generic interval. Compared only where the top moves > 2 and music21 does not
  see parallel motion of the outer pair.
- overlap: identical definitions on each adjacent pair (strict comparisons, landing on the
  other voice's previous pitch allowed); compared everywhere.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from music21 import interval, pitch, voiceLeading

from graders.voice_leading import VOCABULARY, SpecEntry, render_frames
from graders.voice_leading.rules import failing_rules

ROOTS = ["C", "C#", "Db", "D", "Eb", "E", "F", "F#", "Gb", "G", "Ab", "A", "Bb", "B"]
SUFFIXES = sorted(VOCABULARY)
P5 = interval.Interval("P5")
RULES = ("parallels", "hidden", "overlap")


def spelled(midi: int) -> pitch.Pitch:
    """music21's default spelling, made explicit (an inferred spelling gets re-inferred on
    transposition: G#2 + P5 would come back as E-3, a diminished sixth)."""
    return pitch.Pitch(pitch.Pitch(midi=midi).nameWithOctave)


def spell_above(lower: pitch.Pitch, midi: int) -> pitch.Pitch:
    """The pitch ``midi``, spelled as a perfect interval above ``lower`` when it is one."""
    semitones = midi - int(lower.ps)
    if semitones % 12 == 0:
        upper = pitch.Pitch(lower.nameWithOctave)
    elif semitones % 12 == 7:
        upper = lower.transpose(P5)
    else:
        return spelled(midi)
    upper.octave += round((midi - upper.ps) / 12)
    assert upper.ps == midi
    return upper


def quartet(a_low: int, a_high: int, b_low: int, b_high: int) -> voiceLeading.VoiceLeadingQuartet:
    low_a = spelled(a_low)
    high_a = spell_above(low_a, a_high)
    low_b = low_a if b_low == a_low else spelled(b_low)
    high_b = high_a if b_high == a_high else spell_above(low_b, b_high)
    # music21 order: voice 1 (upper) first note, second note, then voice 2 (lower)
    return voiceLeading.VoiceLeadingQuartet(high_a, high_b, low_a, low_b)


def m21_parallel(q: voiceLeading.VoiceLeadingQuartet) -> bool:
    return any(q.parallelMotion(name, allowOctaveDisplacement=True) for name in ("P5", "P8", "P1"))


@dataclass
class Tally:
    compared: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RULES, 0))
    agreed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RULES, 0))
    filtered: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RULES, 0))
    fired: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RULES, 0))
    disagreements: list = field(default_factory=list)

    def record(self, rule: str, ours: bool, theirs: bool, case) -> None:
        self.compared[rule] += 1
        self.fired[rule] += ours
        if ours == theirs:
            self.agreed[rule] += 1
        else:
            self.disagreements.append((rule, ours, theirs, case))


def random_transitions(rng: random.Random, count: int):
    while count > 0:
        voices = rng.randint(2, 4)
        symbols = [rng.choice(ROOTS) + rng.choice(SUFFIXES) for _ in range(2)]
        progression = {"key": "C major", "chords": [{"measure": 1, "chordSymbol": symbols[0]},
                                                    {"measure": 2, "chordSymbol": symbols[1]}]}
        specs = [
            SpecEntry(float(m), tuple(float(rng.randint(0, 4)) for _ in range(voices)),
                      rng.choice([None, 2.0, 3.0, 4.0]))
            for m in (1, 2)
        ]
        a, b = (f.voices for f in render_frames(progression, specs, voices))
        yield voices, progression, specs, tuple(map(int, a)), tuple(map(int, b))
        count -= 1


def compare(cases: int, seed: int) -> Tally:
    rng = random.Random(seed)
    tally = Tally()
    for voices, progression, specs, a, b in random_transitions(rng, cases):
        ours = set(failing_rules(render_frames(progression, specs, voices), "C major", voices))
        case = (a, b)
        pairs = [(x, y) for x in range(voices) for y in range(x + 1, voices)]
        quartets = {(x, y): quartet(a[x], a[y], b[x], b[y]) for x, y in pairs}

        if any(a[x] == a[y] or b[x] == b[y] for x, y in pairs):
            tally.filtered["parallels"] += 1
        else:
            theirs = any(m21_parallel(q) for q in quartets.values())
            tally.record("parallels", "parallels" in ours, theirs, case)

        outer = quartets[(0, voices - 1)]
        if abs(b[-1] - a[-1]) <= 2 or outer.parallelMotion(allowOctaveDisplacement=True):
            tally.filtered["hidden"] += 1
        else:
            theirs = outer.hiddenFifth() or outer.hiddenOctave()
            tally.record("hidden", "hidden" in ours, theirs, case)

        theirs = any(quartets[(k, k + 1)].voiceOverlap() for k in range(voices - 1))
        tally.record("overlap", "overlap" in ours, theirs, case)
    return tally


def test_spelling_helper_makes_perfect_intervals_perfect():
    for low in range(36, 48):
        lower = spelled(low)
        assert interval.Interval(lower, spell_above(lower, low + 7)).simpleName == "P5"
        assert interval.Interval(lower, spell_above(lower, low + 19)).semiSimpleName == "P5"
        assert interval.Interval(lower, spell_above(lower, low + 12)).semiSimpleName == "P8"


def test_music21_agrees_on_motion_rules():
    tally = compare(cases=1000, seed=20260913)
    assert tally.disagreements == []
    assert tally.agreed == tally.compared
    # the filters must leave a real comparison behind, with both outcomes well represented
    assert tally.compared["parallels"] >= 900
    assert tally.compared["hidden"] >= 250
    assert tally.compared["overlap"] == 1000
    for rule, fired in tally.fired.items():
        assert 10 <= fired <= tally.compared[rule] - 10, (rule, fired, tally.compared[rule])
