"""The chat prompt shown to the model (spec §5): a system message depending only on N and a
user message with the progression as a measure/chord table. Both joined with LF, no trailing
newline. The wording follows the reference's prompt for parity with its runs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from graders.voice_leading.jsnum import MISSING, value_to_string


def template_string(value: Any) -> str:
    """How a JavaScript template literal ``${value}`` prints a JSON value (MISSING: undefined)."""
    if value is MISSING:
        return "undefined"
    if value is None:
        return "null"
    # Otherwise String(value); top-level null/undefined are the only values join() prints differently.
    return value_to_string(value)


def system_message(voices: int) -> str:
    """The 18-line system message (blank lines 5, 12, 16); the example is always 4-voice."""
    return "\n".join(
        [
            "You are a keyboard part-writer. Given a FIXED chord progression in a key, choose",
            f"a VOICING for each chord as exactly {voices} voices, low to high (bass first).",
            "You do NOT write pitches \u2014 you choose, for each voice, "
            "WHICH note OF THE CHORD it",
            "sings, and a renderer places the octaves.",
            "",
            "Number the chord's notes from 0: 0 = the root, 1 = the next chord note up, 2 = the",
            "next, and so on. For a triad the notes are 0=root, 1=third, 2=fifth; for a seventh",
            f'chord add 3=seventh. Give a "degrees" array of {voices} such numbers, low to high:',
            "- the FIRST number is the bass (0 = root position, 1 = first inversion, \u2026);",
            "- repeat a number to DOUBLE that chord note (e.g. double the root or the fifth);",
            '- "bassOctave" (optional, default 3) sets the register of the bass.',
            "",
            "Write good voice-leading: prefer common tones and small moves between chords,",
            "avoid parallel perfect fifths/octaves, double the root or fifth (never the third",
            "or the leading tone).",
            "",
            "Output ONLY a JSON array, one object per measure, no prose. Example (4 voices):",
            '[{"measure": 1, "degrees": [0, 1, 2, 0], "bassOctave": 3}, '
            '{"measure": 2, "degrees": [2, 0, 1, 2]}]',
        ]
    )


def user_message(progression: Mapping[str, Any], voices: int) -> str:
    """Heading with the key verbatim, the chord table (every chord, N/C included), instruction."""
    lines = [
        f"# Voice this progression in {template_string(progression.get('key', MISSING))} \u2014 "
        f"{voices} voices per chord, bass to soprano.",
        "",
        "| Measure | Chord |",
        "|---------|-------|",
    ]
    for chord in progression["chords"]:
        measure = template_string(chord.get("measure", MISSING))
        lines.append(f"| {measure} | {template_string(chord.get('chordSymbol', MISSING))} |")
    lines.append("")
    lines.append(
        f'Return one JSON object per measure above with its "degrees" '
        f"({voices} chord-note numbers, low\u2192high)."
    )
    return "\n".join(lines)


def build_messages(progression: Mapping[str, Any], voices: int) -> list[dict[str, str]]:
    """``[{"role": "system", ...}, {"role": "user", ...}]`` for one progression and N."""
    return [
        {"role": "system", "content": system_message(voices)},
        {"role": "user", "content": user_message(progression, voices)},
    ]
