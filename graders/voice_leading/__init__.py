"""Voice-leading verifier: a pure-Python port of the reference task (shared/voice-leading-spec.md).

``score(progression, completion, voices, style, checker)`` is the entry point; everything here is
pure (no I/O, no Ray/gRPC). See README.md for the map from modules to spec sections.
"""

from graders.voice_leading.chords import VOCABULARY, Chord, Key, parse_chord_symbol, parse_key
from graders.voice_leading.openings import (
    forced_prefix,
    named_chord_count,
    opening_alphabet,
    opening_of,
    signature_of,
)
from graders.voice_leading.parser import SpecEntry, parse_completion
from graders.voice_leading.prompt import build_messages
from graders.voice_leading.render import Frame, render_frames
from graders.voice_leading.rules import RULES, STYLES, Verdict, verify
from graders.voice_leading.score import CHECKERS, ScoreResult, completion_from_messages, score

__all__ = [
    "CHECKERS",
    "RULES",
    "STYLES",
    "VOCABULARY",
    "Chord",
    "Frame",
    "Key",
    "ScoreResult",
    "SpecEntry",
    "Verdict",
    "build_messages",
    "completion_from_messages",
    "forced_prefix",
    "named_chord_count",
    "opening_alphabet",
    "opening_of",
    "parse_chord_symbol",
    "parse_completion",
    "parse_key",
    "render_frames",
    "score",
    "signature_of",
    "verify",
]
