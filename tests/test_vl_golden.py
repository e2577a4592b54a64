"""Golden cases: outputs computed by V8 running the reference bridge (spec §2-§11).

Generated once with a scratch Node.js harness transcribing the reference modules
(parseSpecResponse, renderSpecRealization, verifyVoiceLeading, scoreVoicing; the chord
vocabulary and styles from the spec) on random progression/completion pairs, chosen to cover
every verdict and rule and all three styles. They pin the JavaScript semantics (JSON.parse,
Number(), Math.round, toString) a Python port easily gets wrong. During development the same
harness agreed with this module on about 150 000 random cases (rewards, failing-rule sets,
frames, openings). Row: (key, [(measure, chordSymbol)], completion, voices, style, reward,
verdict, sorted failing rules, format_ok, sounding, expected, first_measure_ok, voice_count,
opening).
"""

from __future__ import annotations

import pytest

from graders.voice_leading import score

GOLDEN = [('',
  [(0, 'Gbmadd9'), (1, 'C#7sus4'), (2, 'Eb9'), (3, 'H7'), (4, 'C\nm'), (5, 'C#maj7'), (6, 'Cmaj'),
   (7, 'Bb')],
  '[{"measure": 0, "degrees": [6, 3, 0], "bass_octave": -3}, {"measure": 1, "degrees": []}, '
  '{"measure": 2, "degrees": []}, {"m": [3], "degrees": [2, 3], "bass_octave": 3.1}, {"measure"',
  2, 'lead-sheet', 0.0, 'structure', ('structure',), False, 0, 8, False, None, '(none)'),
 ('Eb\tmajor', [(4, 'Ebm7b5'), (5, 'c'), (3, 'Gmin7'), (1, 'DΔ7'), (2, 'Gb°')],
  '```Json[{"measure":4,"voices":[0,1,0,0]},{"measure":5,"degrees":[3,1,0,2]},{"measure":3,"degrees":[]},{"measure":1,"degrees":[0,2,1.5,3],"bassOctave":3.25},{"measure":2,"degrees":[2,0,3,3],"bassOctave":-2},{"measure":5,"degrees":[3,1,".5",3],"bassOctave":3.5}]```',
  4, 'common-practice', 0.0, 'structure', ('structure',), True, 3, 5, True, 4, '0,1,0,0'),
 ('BB major', [(1, 'Cmaj'), (2, 'C6/9'), (3, ' N/C')],
  '[{"measure": 1, "degrees": [0, 0, 6]}, {"measure": 2, "degrees": [0, 1, 3], "bassOctave": -2}, '
  '{"measure": 3, "degrees": [0, 0]}, {"measure": 1, "voices": [3, -2]}]',
  3, 'common-practice', 0.0, 'structure', ('structure',), True, 1, 3, True, 3, '0,0,6'),
 ('Cb major',
  [(1, 'Fm7b5'), (2, 'Cm7b5'), (3, 'N/C'), (4, 'Gø'), (5, 'N/C'), (6, 'Dbø'), (7, 'D+')],
  '[{"measure": 1, "degrees": [1, 3, 0, 2]}, {"measure": 2, "degrees": [2, 0, 3, 0]}, {"measure": '
  '4, "degrees": [1, 2, 2, 1]}, {"measure": 6, "degrees": [1, 0, 1, 1]}, {"measure": 7, "degrees": '
  '[3, 2, 3, 0], "bassOctave": 3.1}]',
  4, 'common-practice', 0.0, 'chordMembership,parallels,hidden,overlap,tendencySeventh',
  ('chordMembership', 'hidden', 'overlap', 'parallels', 'tendencySeventh'), True, 5, 5, True, 4,
  '1,3,0,2'),
 ('c maj', [(1, 'E#madd9'), (2, 'F#6'), (3, 'F/A/C')],
  '```json\n'
  '[{"measure": 1, "degrees": [1, 0, 2]}, {"measure": 2, "degrees": [2, 4]}, {"measure": 3, '
  '"tones": [[], 3]}]\n'
  '```',
  2, 'film-ambient', 0.0, 'hidden,overlap', ('hidden', 'overlap'), True, 3, 3, True, 2, '1,0,2'),
 ('E# minor', [(1, 'Fdim')], '[{"measure":true,"degrees":[3,-1]}]', 2, 'common-practice', 1.0,
  'admitted', (), True, 1, 1, True, 2, '3,-1'),
 ('bb major', [(0, 'Cbmaj9')], '[{"bar": 0, "degrees": [], "bassOctave": null}]', 3,
  'common-practice', 0.0, 'structure', ('structure',), False, 0, 1, False, None, '(none)'),
 ('BB major', [(1, 'Adim'), (2, 'Aø7'), (3, 'Cbm7b5'), (4, 'Cmaj7'), (5, 'Fbm9'), (6, 'Dbdim7')],
  '[{"measure": 1, "degrees": []}, {"bar": 2, "degrees": [3, 2, 1, 0], "bassOctave": 3.1}, '
  '{"measure": 3, "degrees": [2, 3, 0, 3], "bassOctave": 1}, {"measure": 4, "degrees": []}, '
  '{"measure": 5, "tones": [0.49999999999999994, 3, 1], "bassOctave": 3.5}, {"measure": 6, '
  '"degrees": [3, 2, "0x3", 1]}]',
  4, 'lead-sheet', 0.0, 'structure', ('structure',), True, 4, 6, False, 4, '3,2,1,0'),
 ('f# MINOR', [(2, 'F#m7'), (1, 'Abm9')],
  '{"a": [{"m": 2, "degrees": []}, {"measure": 1, "degrees": [2, "", 3, 1], "octave": 6}]}', 4,
  'common-practice', 0.0, 'structure', ('structure',), True, 1, 2, False, 4, '2,0,3,1'),
 ('Cb major', [(1, 'F#maj7'), (2, 'DΔ7')],
  '[{"measure":1,"degrees":[1,2,3,[]]},{"measure":2,"degrees":[6,1,2]}]', 4, 'lead-sheet', 0.0,
  'overlap,tendencySeventh', ('overlap', 'tendencySeventh'), True, 2, 2, True, 4, '1,2,3,0'),
 ('Cb major', [(1, 'Ab°'), (2, 'F#min7'), (3, 'CΔ'), (4, 'C#°7'), (5, 'Bbsus2')],
  '[{"measure":null,"degrees":[1,1]},{"measure":2,"degrees":[0,0,1],"bass_octave":10},{"measure":3,"voices":[2,3,0]},{"measure":4,"degrees":[2,3],"bass_octave":2},{"measure":5,"tones":[0,1,0]}]',
  2, 'film-ambient', 0.0, 'structure', ('structure',), True, 4, 5, False, 2, '0,0,1'),
 ('EB minor', [(3, 'F#maj7')], '\n[{"measure":3,"tones":[2,0,2]}]', 3, 'film-ambient', 1.0,
  'admitted', (), True, 1, 1, True, 3, '2,0,2'),
 ('Bb major', [(3, 'F#9'), (2, 'E'), (1, 'Ab7sus4')],
  '[{"measure": 3, "degrees": [2, 3], "bassOctave": 3.1}, {"measure": 2, "degrees": [3, 0]}, '
  '{"measure": 1, "degrees": [2, 1], "bassOctave": 10}]',
  2, 'lead-sheet', 0.0, 'chordMembership,parallels,hidden,overlap,leap',
  ('chordMembership', 'hidden', 'leap', 'overlap', 'parallels'), True, 3, 3, True, 2, '2,3'),
 ('c maj', [(1, 'Bb6'), (2, 'Cadd9'), (3, 'F#Δ7'), (4, 'Dbmadd9'), (5, 'C7sus4')],
  '[{"measure": 1, "degrees": [1, 2, 0], "bassOctave": 3}, {"measure": 2, "degrees": [2, 3, 3]}, '
  '{"measure": 3, "degrees": [0, 1, 3]}, {"measure": 4, "degrees": [2, 3, 2], "bassOctave": 10}, '
  '{"measure": 5, "degrees": [3, 0, 3], "bassOctave": 3.1}]',
  3, 'common-practice', 0.0, 'chordMembership,parallels,hidden,overlap,leap,tendencySeventh',
  ('chordMembership', 'hidden', 'leap', 'overlap', 'parallels', 'tendencySeventh'), True, 5, 5,
  True, 3, '1,2,0'),
 ('A minor',
  [(0, 'Bbm7b5'), (1, 'Fbmadd9'), (2, 'Gb+'), (3, 'C\nm'), (4, 'H7'), (5, 'Bb6'), (6, 'Gbm9')],
  '\xa0[{"m": 0, "degrees": [1, 2, 1], "octave": 3.5}, {"measure": 1, "degrees": [2, 3, 2]}, '
  '{"measure": 2, "degrees": [5, 0, 1]}, {"m": 3, "notes": [3, -1]}, {"measure": 4, "degrees": '
  '[]}, {"measure": 5, "notes": 3}, {"m": 6, "degrees": [[2], 1e+21, 3, -0.5]}]',
  3, 'common-practice', 0.0, 'structure', ('structure',), True, 4, 7, True, 3, '1,2,1'),
 (' G major ', [(1, 'Bb6'), (2, 'Bsus4'), (3, 'Bm7b5'), (4, 'F7sus4'), (5, 'FM7')],
  'Using [0, 1]: [{"measure": 1, "degrees": [0, [], 1]}, {"measure": 2, "degrees": [0, 0, 3, 0]}, '
  '{"bar": 3, "voices": [1, 1, 1]}, {"measure": 4, "degrees": [1, -1, 1, 2]}, {"measure": 5, '
  '"voices": [2, 3, 0, "Infinity"], "bassOctave": ""}] ok',
  3, 'film-ambient', 0.0, 'structure', ('structure',), False, 0, 5, False, None, '(none)'),
 ('Bb major', [(3, 'E#m9'), (4, 'Dm6'), (5, 'Ebadd9')],
  '[{"measure":3,"degrees":[1,2,-1,1]},{"measure":4,"degrees":3},{"bar":5,"degrees":[" 1 ",3,0]}]',
  3, 'common-practice', 0.0, 'structure', ('structure',), True, 2, 3, True, 3, '1,2,-1,1'),
 ('Cb major', [(4, 'C#madd9'), (3, 'FM7')],
  '[{"measure": 4, "degrees": [0, 2, 0], "bassOctave": -2}, {"measure": 3, "degrees": [1, 0, 1]}]',
  3, 'common-practice', 0.0, 'chordMembership,hidden,overlap,leap',
  ('chordMembership', 'hidden', 'leap', 'overlap'), True, 2, 2, True, 3, '0,2,0'),
 ('C dorian', [(1, 'Cbsus2'), (2, 'DM7'), (3, 'Ebsus4'), (4, 'c'), (5, 'Am'), (6, 'F#Δ7')],
  '[{"measure":1,"degrees":[,],"bassOctave":4.3},{"bar":2,"degrees":null},{"measure":3,"degrees":[1,0]},{"measure":4,"degrees":[3,1]},{"measure":"5","degrees":[2,3],"bass_octave":"4"},{"measure":6,"voices":[2,2,1],"bassOctave":6},{"bar":1,"degrees":[2]}]',
  2, 'lead-sheet', 0.0, 'structure', ('structure',), False, 0, 6, False, None, '(none)'),
 ('f# MINOR', [(1, 'Cbadd9'), (2, 'Gm7b5'), (3, 'Fb7sus4')],
  '[{"bar": 1, "notes": [2, 2, 2], "bassOctave": 2.7}, {"measure": 2, "degrees": [0, 0, 1]}, '
  '{"measure": "3", "degrees": [2, 3, 1]}]',
  3, 'lead-sheet', 0.0, 'chordMembership,overlap,leap', ('chordMembership', 'leap', 'overlap'),
  True, 3, 3, True, 3, '2,2,2'),
 ('BB major', [(0, 'Cbmaj7'), (1, 'E#m6'), (2, 'E#m7b5'), (3, 'Bmin7'), (4, ' C ')],
  '8 5{8`3s17ss]\xa0.1`421]3 s71', 3, 'film-ambient', 0.0, 'structure', ('structure',), False, 0, 5,
  False, None, '(none)'),
 ('f# MINOR', [(3, 'Cmaj9'), (4, 'C#'), (5, 'Em9')],
  '[{"measure": 3, "degrees": [0, 3, 2]}, {"measure": 4, "degrees": [2, 3, 2]}, {"measure": 5, '
  '"degrees": [0, 1, 0]}]',
  3, 'common-practice', 0.0, 'parallels,hidden,overlap,tendencySeventh',
  ('hidden', 'overlap', 'parallels', 'tendencySeventh'), True, 3, 3, True, 3, '0,3,2'),
 ('Cb major', [(1, 'Bbdim'), (2, 'Aaug'), (3, 'FΔ'), (4, 'Bbsus4')],
  '[{"measure": 1, "degrees": [2, 0]}, {"measure": 2, "degrees": [0, 3]}, {"measure": 3, '
  '"degrees": [0, 3]}, {"measure": 4, "degrees": [3, 0]}]',
  2, 'lead-sheet', 0.0, 'hidden,tendencySeventh', ('hidden', 'tendencySeventh'), True, 4, 4, True,
  2, '2,0'),
 ('C dorian', [(5, 'E#madd9'), (2, 'C#M7'), (3, 'Gsus4'), (4, 'DbM7'), (1, 'Ab°7')],
  '[{"measure": 5, "degrees": null, "bassOctave": true}, {"measure": 2, "tones": ["2", 2, 0], '
  '"octave": -3}, {"bar": 3, "degrees": [2, 1, -7, 1, 1]}, {"measure": 4, "notes": [1e+300, 1, '
  '2]}, {"measure": 1, "degrees": [0, 0, 0], "bass_octave": 10}, {"measure": 4, "degrees": []}]',
  4, 'lead-sheet', 0.0, 'structure', ('structure',), True, 4, 5, False, 4, '2,2,0'),
 ('BB major', [(3, 'F#aug'), (4, 'BΔ'), (5, 'Bmaj9')],
  '[{"measure": 3, "degrees": [2, 0, 2]}, {"measure": 4, "degrees": [2, 0, 2]}, {"measure": 5, '
  '"degrees": [1, 0, 0]}]',
  3, 'film-ambient', 1.0, 'admitted', ('hidden', 'parallels'), True, 3, 3, True, 3, '2,0,2'),
 ('EB minor', [(2, 'Bm9'), (1, 'Bmadd9'), (3, 'Gbm')],
  '[{"bar": 1, "notes": {"a": [1]}}, {"m": 3, "degrees": [0, 1, 1, 6, 1], "bassOctave": ""}, '
  '{"measure": 2, "degrees": [1, 2, "Infinity", 2, 2], "bassOctave": "high"}]',
  4, 'common-practice', 0.0, 'structure', ('structure',), True, 2, 3, False, 4, '0,1,1,6,1'),
 ('bb major', [(0, 'Ebdim7')], '[{"measure": 0, "degrees": [2, 1, 3], "bassOctave": 2}]', 3,
  'lead-sheet', 1.0, 'admitted', (), True, 1, 1, True, 3, '2,1,3'),
 ('Bb major', [(0, 'B#6')], '```[]', 4, 'common-practice', 0.0, 'structure', ('structure',), False,
  0, 1, False, None, '(none)'),
 ('C major',
  [(1, 'C°'), (2, 'D9'), (3, 'Db7sus4'), (4, 'G7/B'), (5, 'Cmaj9'), (6, 'Aø7'), (7, 'A+'),
   (8, 'Ebmaj7')],
  '82:29.6, n.,5o{.\xa0}:o\n"" :9]', 3, 'lead-sheet', 0.0, 'structure', ('structure',), False, 0, 8,
  False, None, '(none)'),
 ('C major', [(0, 'Cadd9'), (1, 'Gbmin7')],
  '[{"measure": 0, "notes": [0, 0], "octave": null}, {"measure": 1, "degrees": [0, '
  '0.49999999999999994, 1]}, {"measure": 7, "degrees": [0, 0]}]',
  3, 'lead-sheet', 1.0, 'admitted', ('parallels',), True, 2, 2, True, 3, '0,0'),
 ('f# MINOR', [(0, 'AbΔ'), (1, 'Ebaug'), (2, 'E#m6')],
  '```json\n'
  '[{"bar":0,"degrees":[3,3,3],"bassOctave":-1},{"measure":1,"degrees":[6,1,1,3],"bassOctave":-0.7},{"bar":2,"degrees":[3,0.5,2,3],"bassOctave":null}]\n'
  '```',
  4, 'lead-sheet', 0.0, 'chordMembership,hidden,overlap,leap,tendencySeventh',
  ('chordMembership', 'hidden', 'leap', 'overlap', 'tendencySeventh'), True, 3, 3, True, 4,
  '3,3,3'),
 ('C dorian', [(0, 'Cb7sus4')],
  '\ufeff[{"measure": 0, "notes": [0, 1], "bassOctave": ""}, {"measure": 6, "degrees": [3, 1, 1]}]',
  3, 'common-practice', 1.0, 'admitted', (), True, 1, 1, True, 3, '0,1'),
 ('Eb\tmajor', [(1, 'Em9')], '[{"measure": 1, "degrees": [3, 1]}]', 2, 'film-ambient', 1.0,
  'admitted', (), True, 1, 1, True, 2, '3,1'),
 ('bb major', [(1, 'N/C'), (2, 'AbΔ7')], '[{"measure": 2, "degrees": [2, 0], "bassOctave": 2}]', 2,
  'common-practice', 1.0, 'admitted', (), True, 1, 1, True, 2, '2,0'),
 ('Eb\tmajor', [(3, 'A9')], '[{"measure": 3, "degrees": [0, 1, 0, 3]}]', 4, 'lead-sheet', 1.0,
  'admitted', (), True, 1, 1, True, 4, '0,1,0,3'),
 ('H minor', [(0, 'B#7sus4'), (1, ' C '), (2, 'Fb7sus4')],
  '[{"measure": 0, "degrees": [2, 2]}, {"measure": 1, "degrees": [0, 0, 1], "bassOctave": ', 3,
  'film-ambient', 0.0, 'structure', ('structure',), False, 0, 3, False, None, '(none)'),
 ('c maj', [(3, 'F6')], '[{"measure":3,"degrees":[3,0.5]}]', 2, 'film-ambient', 1.0, 'admitted', (),
  True, 1, 1, True, 2, '3,0.5'),
 (' G major ', [(1, 'Dbdim'), (2, 'Cmaj'), (3, 'Dmadd9'), (4, 'E7'), (2.5, 'Dbm6')],
  '{"0": [{"m": 1, "degrees": [0, 2], "bassOctave": 11}, {"m": 2, "degrees": [3, -1]}, {"measure": '
  '4, "degrees": []}, {"measure": 2.5, "degrees": [4, 0, 3]}]}',
  2, 'film-ambient', 0.0, 'structure', ('structure',), True, 2, 5, True, 2, '0,2'),
 ('E# minor', [(1, 'N/C'), (2.5, 'Fsus2'), (3, 'N/C'), (4, 'Dbadd9')],
  '[{"measure": 2.5, "degrees": [0, 0, 2, 1]}, {"measure": 4, "degrees": [0, 1, 1, 0]}]', 4,
  'film-ambient', 1.0, 'admitted', ('hidden',), True, 2, 2, True, 4, '0,0,2,1'),
 ('C dorian',
  [(1, 'n/c'), (2, 'F#sus4'), (3, 'Dbmin7'), (4, 'Fb°'), (5, 'Bsus2'), (6, 'B7'), (7, 'F#add9'),
   (8, 'F#m7b5')],
  '\ns]Ee] 9,02}",s76nE,[8]50o0E87.`7E\xa0`', 2, 'common-practice', 0.0, 'structure',
  ('structure',), False, 0, 8, False, None, '(none)'),
 ('C major',
  [(0, 'F#min7'), (1, 'C\nm'), (2, 'n/c'), (3, 'n/c'), (4, 'C#sus2'), (5, 'Ddim'), (6, 'Abm7')],
  '[{"measure":1,"degrees":[1,3,2]},{"m":2,"degrees":[0,6,2]},{"measure":3,"degrees":[3,3,1]},{"m":4,"degrees":[]},{"measure":5,"degrees":[2,3,1,3]},{"measure":6,"voices":[1,1,0,0]}]',
  3, 'lead-sheet', 0.0, 'structure', ('structure',), True, 2, 7, False, 3, '1,3,2'),
 ('EB minor', [(1, 'C#°7'), (2, 'BΔ7'), (3, 'Gb'), (4, '/E'), (5, 'B#sus2'), (6, '')],
  '[{"measure":1,"degrees":[],"bassOctave":-1.9},{"measure":2,"degrees":[],"bassOctave":5},{"measure":3,"degrees":[-1,3,1,1],"octave":2.7},{"measure":4,"notes":[]},{"measure":5,"degrees":[2,0,2,[[1]]],"bassOctave":"4"}]',
  4, 'common-practice', 0.0, 'structure', ('structure',), True, 2, 5, False, 4, '-1,3,1,1'),
 ('', [(3, 'Gb6'), (4, 'Bb+')],
  '[{"measure": 3, "degrees": [3, 0]}, {"measure": 4, "degrees": [1, 3]}]', 2, 'film-ambient', 1.0,
  'admitted', (), True, 2, 2, True, 2, '3,0'),
 ('BB major', [(1, 'C7'), (2, 'Fmaj7')],
  '[{"measure": 1, "degrees": [1, 0, 0, 3]}, {"measure": 2, "degrees": [2, 2, 2, 3]}]', 4,
  'film-ambient', 1.0, 'admitted', ('tendencySeventh',), True, 2, 2, True, 4, '1,0,0,3'),
 ('A minor', [(3, 'Bbm7b5'), (4, 'Cb7'), (5, 'F#add9'), (6, 'Bbdim'), (7, 'Dø'), (8, 'Ebdim7')],
  '[{"measure": 3, "notes": [0, 0, 0, 3, 0], "bass_octave": 3}, {"measure": null, "degrees": []}, '
  '{"measure": 5, "degrees": []}, {"bar": 6, "degrees": [1, 0, 2, 1], "bassOctave": 8}, '
  '{"measure": 7, "degrees": [2, 1, 0, 2], "bassOctave": ""}, {"m": 8, "degrees": [5, 1, 2, 0], '
  '"octave": -0.7}]',
  4, 'lead-sheet', 0.0, 'structure', ('structure',), True, 4, 6, True, 4, '0,0,0,3,0'),
 ('Bb major', [(1, 'E+'), (2, 'B#m7'), (3, ' C ')], '40]8}e,`E\n.j.\nE2oo9,\nn5`9[2}[ ', 3,
  'lead-sheet', 0.0, 'structure', ('structure',), False, 0, 3, False, None, '(none)'),
 ('C dorian', [(1, 'B#maj9'), (2, 'F#6')],
  '[{"m":null,"degrees":[1,3,[]]},{"measure":2,"voices":[1,2,0]}]', 3, 'common-practice', 0.0,
  'structure', ('structure',), True, 1, 2, False, 3, '1,2,0'),
 ('', [(1, 'Cbø7'), (2, 'DM7'), (3, 'E#ø7'), (4, 'E#sus2'), (5, 'E#9')],
  'Here: [{"measure": 1, "voices": [1e+300, 1]}, {"measure": 2, "degrees": null}, {"measure": 3, '
  '"degrees": [1, 5]}, {"measure": 4, "degrees": [3, 2]}, {"measure": 5, "degrees": [6], '
  '"bassOctave": [3]}]',
  2, 'lead-sheet', 0.0, 'structure', ('structure',), True, 4, 5, True, 2, '1e+300,1'),
 (' G major ',
  [(3, 'Gbsus2'), (4, 'Dbdim7'), (5, 'C#9'), (6, 'Ddim7'), (7, 'Ebdim7'), (8, 'E7sus4')],
  '[{"measure": 3, "degrees": [3, 1, 1]}, {"measure": 4, "degrees": [3, 2, 3]}, {"measure": 5, '
  '"degrees": [2, 2, 2]}, {"measure": 6, "degrees": [2, 2, 1]}, {"measure": 7, "degrees": [2, 1, '
  '1]}, {"measure": 8, "degrees": [1, 0, 1], "bassOctave": 4}]',
  3, 'common-practice', 0.0, 'hidden,overlap', ('hidden', 'overlap'), True, 6, 6, True, 3,
  '3,1,1'),
 ('', [(1, 'Gbmadd9'), (2, 'Ebaug'), (3, 'Bbm'), (4, 'Gdim7'), (5, 'Gaug'), (6, 'F#°')],
  '[{"measure": 1, "degrees": [3, 0, 3, 3]}, {"measure": 2, "degrees": [0, 0, 3, 2]}, {"measure": '
  '3, "degrees": [2, 3, 3, 1], "bassOctave": 3}, {"measure": 4, "degrees": [1, 0, 3, 2]}, '
  '{"measure": 5, "degrees": [3, 3, 2, 0]}, {"measure": 6, "degrees": [3, 2, 0, 1]}]',
  4, 'film-ambient', 0.0, 'parallels,hidden,overlap', ('hidden', 'overlap', 'parallels'), True, 6,
  6, True, 4, '3,0,3,3'),
 ('C major', [(3, ' C ')], '```json\n[{"measure":3,"degrees":[1,2,1],"bass_octave":-1.9}]\n```', 3,
  'film-ambient', 1.0, 'admitted', (), True, 1, 1, True, 3, '1,2,1'),
 ('C dorian', [(1, 'Ebdim'), (2, 'C#sus2'), (3, 'Gb°')],
  '[{"measure": 1, "degrees": [2, 0, 3, 3]}, {"measure": 2, "degrees": [2, 3, 3, 3]}, {"measure": '
  '3, "degrees": [1, 2, 3, 3]}]',
  4, 'film-ambient', 1.0, 'admitted', ('parallels',), True, 3, 3, True, 4, '2,0,3,3'),
 ('', [(3, 'EΔ7'), (4, 'Asus4'), (5, 'Ebm7b5')],
  '[{"measure": 3, "degrees": [0, 2]}, {"measure": 4, "degrees": [3, 0]}, {"measure": 5, '
  '"degrees": [3, 3]}]',
  2, 'lead-sheet', 0.0, 'parallels,hidden', ('hidden', 'parallels'), True, 3, 3, True, 2, '0,2'),
 ('C dorian', [(1, 'Bbsus2')], '[{"measure": 1, "degrees": [0, 2, 0, 0]}]', 4, 'lead-sheet', 1.0,
  'admitted', (), True, 1, 1, True, 4, '0,2,0,0'),
 ('Cb major', [(0, 'Abaug'), (1, 'Bbdim7')],
  '[{"measure": 0, "degrees": [2, 2, 0, 1]}, {"measure": 1, "degrees": [1, 1, 3, 1]}]', 4,
  'film-ambient', 1.0, 'admitted', ('parallels',), True, 2, 2, True, 4, '2,2,0,1'),
 ('Eb\tmajor',
  [(1, 'C#m9'), (2, 'Gø7'), (3, 'Edim'), (4, 'Abm6'), (5, 'Am7b5'), (6, 'Abmadd9'), (7, 'A7')],
  '[{"measure": 1, "degrees": [1, 3]}, {"measure": 2, "degrees": [2, 0], "bassOctave": 3.1}, '
  '{"measure": 3, "degrees": [3, 2]}, {"measure": 4, "degrees": [0, 3]}, {"measure": 5, "degrees": '
  '[2, 1]}, {"measure": 6, "degrees": [2, 2], "bassOctave": 2}, {"measure": 7, "degrees": [2, 1]}]',
  2, 'film-ambient', 0.0, 'chordMembership,hidden,overlap,tendencySeventh',
  ('chordMembership', 'hidden', 'overlap', 'tendencySeventh'), True, 7, 7, True, 2, '1,3'),
 ('H minor', [(6, 'C#maj9'), (2, 'Cmadd9'), (4, 'Fmaj7'), (1, 'F#m'), (5, 'F#sus2'), (3, 'Fdim')],
  '[{"measure": 6, "degrees": [1, 3, 3, 2]}, {"measure": 2, "degrees": [3, 2, 2, 2]}, {"measure": '
  '4, "degrees": [0, 2, 1, 0]}, {"measure": 1, "degrees": [3, 2, 0, 1]}, {"measure": 5, "degrees": '
  '[0, 3, 1, 2]}, {"measure": 3, "degrees": [1, 0, 1, 3], "bassOctave": 3}]',
  4, 'film-ambient', 1.0, 'admitted', ('parallels', 'tendencySeventh'), True, 6, 6, True, 4,
  '1,3,3,2'),
 ('c maj',
  [(4, 'Ebm9'), (9, 'E6'), (8, 'Db7sus4'), (6, 'Edim'), (3, 'Abmin7'), (7, 'F#ø'), (5, 'Fm')],
  '[{"measure": 4, "degrees": [3, 0, 1]}, {"measure": 9, "degrees": [3, 2, 3]}, {"measure": 8, '
  '"degrees": [3, 3, 3]}, {"measure": 6, "degrees": [1, 3, 0], "bassOctave": 2}, {"measure": 3, '
  '"degrees": [3, 0, 2]}, {"measure": 7, "degrees": [3, 2, 3]}, {"measure": 5, "degrees": [0, 1, '
  '2]}]',
  3, 'film-ambient', 0.0, 'parallels,overlap,tendencySeventh',
  ('overlap', 'parallels', 'tendencySeventh'), True, 7, 7, True, 3, '3,0,1'),
 ('bb major', [(1, 'Db°7'), (2, 'Gmadd9'), (3, 'F#Δ7')],
  '[{"measure": 1, "degrees": [1, 3, 2, 0], "bassOctave": 3.1}, {"measure": 2, "degrees": [0, 2, '
  '3, 0]}, {"measure": 3, "degrees": [3, 0, 3, 1]}]',
  4, 'common-practice', 0.0, 'chordMembership,hidden,overlap,tendencySeventh',
  ('chordMembership', 'hidden', 'overlap', 'tendencySeventh'), True, 3, 3, True, 4, '1,3,2,0'),
 ('Bb major', [(2.5, 'Am6')], '[{"measure": 2.5, "degrees": [1, 2], "bassOctave": 3.1}]', 2,
  'lead-sheet', 0.0, 'chordMembership', ('chordMembership',), True, 1, 1, True, 2, '1,2'),
 ('EB minor', [(1, 'Bm7b5')], '[{"measure": 1, "degrees": [1, 2, 2, 2]}]', 4, 'common-practice',
  1.0, 'admitted', (), True, 1, 1, True, 4, '1,2,2,2'),
 ('f# MINOR', [(3, 'F°'), (4, 'B6'), (5, 'Bsus2'), (6, 'F#M7')],
  '[{"measure": 3, "degrees": [0, 2, 3, 0]}, {"measure": 4, "degrees": [2, 1, 2, 2]}, {"measure": '
  '5, "degrees": [3, 0, 1, 2]}, {"measure": 6, "degrees": [3, 3, 3, 0]}]',
  4, 'film-ambient', 0.0, 'parallels,overlap', ('overlap', 'parallels'), True, 4, 4, True, 4,
  '0,2,3,0'),
 ('E# minor', [(0, 'Abdim')], '[{"measure":0,"degrees":[2,1],"bassOctave":-3}]', 2, 'film-ambient',
  0.0, 'chordMembership', ('chordMembership',), True, 1, 1, True, 2, '2,1'),
 ('Bb major',
  [(3, 'Gm7'), (4, 'Db6'), (5, 'BbΔ'), (6, 'Gbmaj7'), (7, 'Bbm7'), (8, 'B'), (9, 'Gb6')],
  '[{"measure": 3, "degrees": [3, 2]}, {"measure": 4, "degrees": [1, 2], "bassOctave": 4}, '
  '{"measure": 5, "degrees": [2, 3]}, {"measure": 6, "degrees": [3, 3]}, {"measure": 7, "degrees": '
  '[2, 2]}, {"measure": 8, "degrees": [3, 2]}, {"measure": 9, "degrees": [3, 1], "bassOctave": 4}]',
  2, 'common-practice', 0.0, 'parallels,hidden,overlap,tendencySeventh',
  ('hidden', 'overlap', 'parallels', 'tendencySeventh'), True, 7, 7, True, 2, '3,2'),
 ('c maj', [(0, 'Dbm'), (1, 'Cdim')],
  '[{"measure": 0, "degrees": [0, 1, 0, 3]}, {"measure": 1, "degrees": [2, 3, 3, 3]}]', 4,
  'lead-sheet', 0.0, 'parallels,overlap', ('overlap', 'parallels'), True, 2, 2, True, 4,
  '0,1,0,3'),
 ('Cb major', [(0, 'Bsus4'), (1, 'Gm'), (2, 'Esus4'), (3, 'N/C'), (4, 'Abmin7')],
  '[{"measure": 0, "degrees": [3, 1, 0]}, {"measure": 1, "degrees": [1, 1, 2]}, {"measure": 2, '
  '"degrees": [2, 3, 3]}, {"measure": 4, "degrees": [1, 2, 2]}]',
  3, 'film-ambient', 1.0, 'admitted', ('parallels',), True, 4, 4, True, 3, '3,1,0'),
 ('Bb major', [(5, 'F6'), (6, 'A7sus4'), (4, 'E°'), (8, 'Gbmin7'), (7, 'Bmaj9'), (3, 'C#°7')],
  '[{"measure": 5, "degrees": [1, 3]}, {"measure": 6, "degrees": [1, 1]}, {"measure": 4, '
  '"degrees": [0, 0]}, {"measure": 8, "degrees": [0, 1], "bassOctave": 3.1}, {"measure": 7, '
  '"degrees": [2, 3]}, {"measure": 3, "degrees": [3, 3]}]',
  2, 'common-practice', 0.0, 'chordMembership,parallels,hidden',
  ('chordMembership', 'hidden', 'parallels'), True, 6, 6, True, 2, '1,3'),
 ('f# MINOR', [(1, 'N/C'), (2, 'Ebø7'), (3, 'Bdim')],
  '[{"measure": 2, "degrees": [1, 3, 1]}, {"measure": 3, "degrees": [3, 0, 1]}]', 3,
  'common-practice', 0.0, 'overlap', ('overlap',), True, 2, 2, True, 3, '1,3,1'),
 ('H minor', [(2.5, 'F#Δ7')], '[{"measure": 2.5, "degrees": [1, 0, 2], "octave": 4}]', 2,
  'lead-sheet', 1.0, 'admitted', (), True, 1, 1, True, 2, '1,0,2'),
 ('EB minor', [(3, 'C#aug'), (4, 'Gbsus4'), (5, 'Fdim')],
  '[{"measure": 3, "degrees": [1, 3]}, {"measure": 4, "degrees": [0, 0]}, {"measure": 5, '
  '"degrees": [1, 3]}]',
  2, 'common-practice', 0.0, 'hidden', ('hidden',), True, 3, 3, True, 2, '1,3'),
 ('C major', [(3, 'Eb°7')], '[{"measure": 3, "degrees": [0, 0], "bassOctave": -2}]', 2,
  'common-practice', 1.0, 'admitted', (), True, 1, 1, True, 2, '0,0'),
 ('', [(3, 'A9'), (4, 'Daug'), (5, 'Dmin7'), (6, 'F#dim7')],
  '[{"measure": 3, "degrees": [3, 1, 0, 1]}, {"measure": 4, "degrees": [0, 0, 1, 3]}, {"measure": '
  '5, "degrees": [0, 0, 2, 2]}, {"measure": 6, "degrees": [1, 0, 1, 0]}]',
  4, 'lead-sheet', 1.0, 'admitted', ('parallels', 'tendencySeventh'), True, 4, 4, True, 4,
  '3,1,0,1'),
 ('A minor', [(3, 'Gaug'), (4, 'Bbm7b5')],
  '```[{"measure":3,"tones":[0,2]},{"measure":4,"degrees":[2,2]}]', 2, 'film-ambient', 1.0,
  'admitted', (), True, 2, 2, True, 2, '0,2'),
 ('E# minor', [(0, 'Dmaj7')], '[{"measure": 0, "degrees": [3, 2], "bassOctave": 4}]', 2,
  'lead-sheet', 1.0, 'admitted', (), True, 1, 1, True, 2, '3,2'),
 ('f# MINOR', [(1, 'N/C'), (2, 'F7sus4'), (3, 'Eadd9'), (4, 'Cmadd9'), (5, 'D7sus4')],
  '[{"measure": 2, "degrees": [3, 3], "bassOctave": 2}, {"measure": 3, "degrees": [0, 2]}, '
  '{"measure": 4, "degrees": [0, 0]}, {"measure": 5, "degrees": [3, 0]}]',
  2, 'lead-sheet', 0.0, 'parallels,hidden', ('hidden', 'parallels'), True, 4, 4, True, 2, '3,3'),
 ('A minor', [(1, 'Gm6'), (2, 'Bdim'), (3, 'N/C')],
  '[{"measure": 1, "degrees": [2, 0]}, {"measure": 2, "degrees": [0, 2]}]', 2, 'lead-sheet', 0.0,
  'overlap', ('overlap',), True, 2, 2, True, 2, '2,0'),
 ('bb major', [(3, 'Ebmaj9'), (4, 'N/C'), (5, 'Abdim7'), (6, 'Dbmin7')],
  '[{"measure": 3, "degrees": [2, 3]}, {"measure": 5, "degrees": [2, 2]}, {"measure": 6, '
  '"degrees": [2, 2], "bassOctave": 3}]',
  2, 'lead-sheet', 0.0, 'parallels,hidden', ('hidden', 'parallels'), True, 3, 3, True, 2, '2,3'),
 ('f# MINOR', [(0, 'Bmadd9')],
  ' [{"m": 0, "degrees": [1, 1, 2], "bassOctave": 11}, {"measure": 2, "degrees": [0, 3, 1]}]', 3,
  'film-ambient', 0.0, 'chordMembership', ('chordMembership',), True, 1, 1, True, 3, '1,1,2'),
 ('bb major', [(1, 'C#m7')], '[{"measure": 1, "degrees": [2, 0, 1], "bassOctave": 10}]', 3,
  'common-practice', 0.0, 'chordMembership', ('chordMembership',), True, 1, 1, True, 3, '2,0,1'),
 ('E# minor', [(1, 'Bb°'), (2, 'Gø7'), (3, 'Cdim')],
  '[{"measure": 1, "degrees": [2, 3, 2, 1]}, {"measure": 2, "degrees": [0, 1, 2, 0]}, {"measure": '
  '3, "degrees": [1, 2, 0, 1]}]',
  4, 'common-practice', 0.0, 'parallels,hidden,overlap', ('hidden', 'overlap', 'parallels'), True,
  3, 3, True, 4, '2,3,2,1'),
 ('E# minor', [(0, 'DΔ7'), (1, 'EM7'), (2, 'Gb°'), (3, 'Db6')],
  '[{"measure": 0, "degrees": [2, 1]}, {"measure": 1, "degrees": [2, 2]}, {"measure": 2, '
  '"degrees": [3, 3]}, {"measure": 3, "degrees": [0, 2]}]',
  2, 'lead-sheet', 0.0, 'parallels,hidden', ('hidden', 'parallels'), True, 4, 4, True, 2, '2,1'),
 ('H minor', [(1, 'Em7')],
  '[{"measure":true,"voices":[0,4,4,1]},{"measure":1,"voices":[1,12345678901234567891,0,2,2],"octave":3.1}]',
  4, 'film-ambient', 0.0, 'chordMembership', ('chordMembership',), True, 1, 1, True, 4, '0,4,4,1'),
 ('C major', [(1, 'Dbdim')], '[{"measure": 1, "degrees": [2, 2, 3, 1], "bassOctave": -2}]', 4,
  'common-practice', 0.0, 'chordMembership', ('chordMembership',), True, 1, 1, True, 4, '2,2,3,1'),
 ('Bb major', [(5, 'E7'), (3, 'F#sus2'), (4, 'BbΔ7')],
  '[{"measure": 5, "degrees": [1, 1], "bassOctave": 2}, {"measure": 3, "degrees": [1, 3]}, '
  '{"measure": 4, "degrees": [1, 3]}]',
  2, 'lead-sheet', 0.0, 'hidden', ('hidden',), True, 3, 3, True, 2, '1,1'),
 ('Cb major', [(1, 'DΔ'), (2, 'N/C'), (3, 'Ebdim'), (4, 'C#7'), (5, 'F#sus4'), (6, 'Cmaj9')],
  '[{"measure": 1, "degrees": [1, 2, 1]}, {"measure": 3, "degrees": [3, 1, 2]}, {"measure": 4, '
  '"degrees": [3, 1, 2], "bassOctave": 3.1}, {"measure": 5, "degrees": [1, 1, 0], "bassOctave": '
  '2}, {"measure": 6, "degrees": [1, 2, 3]}]',
  3, 'common-practice', 0.0, 'chordMembership,overlap', ('chordMembership', 'overlap'), True, 5, 5,
  True, 3, '1,2,1'),
 ('H minor', [(3, 'C#ø7')], '[{"measure": 3, "degrees": [1, 2, 1], "bassOctave": 3.1}]', 3,
  'common-practice', 0.0, 'chordMembership', ('chordMembership',), True, 1, 1, True, 3, '1,2,1'),
 (' G major ', [(1, 'C6'), (2, 'C7sus4'), (3, 'Gm7b5'), (4, 'Dø7'), (5, 'Dbdim')],
  '[{"measure": 1, "degrees": [0, 0]}, {"measure": 2, "degrees": [1, 3]}, {"measure": 3, '
  '"degrees": [1, 0]}, {"measure": 4, "degrees": [2, 1], "bassOctave": 3.1}, {"measure": 5, '
  '"degrees": [0, 2], "bassOctave": 4}]',
  2, 'common-practice', 0.0, 'chordMembership', ('chordMembership',), True, 5, 5, True, 2, '0,0'),
 ('Cb major', [(1, 'Gbsus4'), (2, 'Eadd9')],
  '[{"measure": 1, "degrees": [2, 0]}, {"measure": 2, "degrees": [1, 0]}]', 2, 'film-ambient', 0.0,
  'overlap', ('overlap',), True, 2, 2, True, 2, '2,0'),
 ('A minor', [(1, 'B#M7'), (2, 'G7/B'), (3, 'F9')],
  '[{"bar": [1], "degrees": [3, 0, 3, 1]}, {"bar": 2, "voices": [0, 1, "0b1", 0]}, {"measure": 3, '
  '"degrees": [3, 0, 6, 3], "bassOctave": 3.25}]',
  4, 'film-ambient', 0.0, 'chordMembership', ('chordMembership',), True, 3, 3, True, 4, '3,0,3,1'),
 (' G major ', [(1, 'DΔ7'), (2, 'N/C'), (3, 'E6'), (4, 'Bsus2'), (5, 'Bmaj9')],
  '[{"measure": 1, "degrees": [1, 1]}, {"measure": 3, "degrees": [0, 2]}, {"measure": 4, '
  '"degrees": [2, 0]}, {"measure": 5, "degrees": [1, 0]}]',
  2, 'common-practice', 0.0, 'hidden', ('hidden',), True, 4, 4, True, 2, '1,1'),
 ('BB major', [(1, 'Ebm7')], '[{"measure": 1, "degrees": [3, 3, 0, 3], "bassOctave": 3.1}]', 4,
  'film-ambient', 0.0, 'chordMembership', ('chordMembership',), True, 1, 1, True, 4, '3,3,0,3'),
 ('Cb major', [(1, 'Ebmaj9')], '[{"measure": 1, "degrees": [3, 0, 2, 1], "bassOctave": -2}]', 4,
  'common-practice', 0.0, 'chordMembership', ('chordMembership',), True, 1, 1, True, 4, '3,0,2,1'),
 ('EB minor', [(0, 'Baug'), (1, 'Abø7')],
  '[{"measure": 0, "degrees": [3, 1, 3, 0], "bassOctave": 3}, {"measure": 1, "degrees": [1, 2, 3, '
  '3]}]',
  4, 'common-practice', 0.0, 'parallels', ('parallels',), True, 2, 2, True, 4, '3,1,3,0'),
 ('C major', [(1, 'Aaug'), (2, 'F#6')],
  '[{"measure": 1, "degrees": [3, 2, 3]}, {"measure": 2, "degrees": [1, 0, 1]}]', 3,
  'common-practice', 0.0, 'parallels', ('parallels',), True, 2, 2, True, 3, '3,2,3'),
 ('Cb major', [(1, 'C#maj9'), (2, 'Dm9'), (3, 'N/C')],
  '[{"measure": 1, "degrees": [-1]}, {"measure": 2, "degrees": [1, 3]}]', 2, 'lead-sheet', 0.0,
  'hidden', ('hidden',), True, 2, 2, True, 2, '-1'),
 ('bb major', [(1, 'Dbadd9'), (2, 'Gaug'), (3, 'DM7'), (4, 'Absus2')],
  '[{"measure": 1, "degrees": [0, 2, 3, 3]}, {"measure": 2, "degrees": [0, 1, 1, 1]}, {"measure": '
  '3, "degrees": [0, 0, 1, 0]}, {"measure": 4, "degrees": [0, 2, 1, 2]}]',
  4, 'lead-sheet', 0.0, 'parallels,hidden', ('hidden', 'parallels'), True, 4, 4, True, 4,
  '0,2,3,3'),
 ('f# MINOR', [(1, 'FM7'), (2, 'E6'), (3, 'D')],
  '[{"measure": 1, "degrees": [2, 0, 0]}, {"measure": 2, "degrees": [2, 1, 2], "bassOctave": 2}, '
  '{"measure": 3, "degrees": [3, 1, 3], "bassOctave": 3}]',
  3, 'common-practice', 0.0, 'parallels,hidden', ('hidden', 'parallels'), True, 3, 3, True, 3,
  '2,0,0'),
 ('Eb\tmajor',
  [(0, 'Bmaj9'), (1, 'N/C'), (2, 'Bm7'), (3, 'Amaj9'), (4, 'Fmaj7'), (5, 'Abm9'), (6, 'Cadd9')],
  '[{"measure": 0, "degrees": [2, 1]}, {"measure": 2, "degrees": [1, 3]}, {"measure": 3, '
  '"degrees": [0, 0], "bassOctave": 2}, {"measure": 4, "degrees": [3, 1]}, {"measure": 5, '
  '"degrees": [2, 2]}, {"measure": 6, "degrees": [1, 1]}]',
  2, 'lead-sheet', 0.0, 'parallels,hidden', ('hidden', 'parallels'), True, 6, 6, True, 2, '2,1'),
 ('A minor', [(2.5, 'Bb°7'), (2, 'Cmaj9'), (3, 'N/C')],
  '[{"measure": 2.5, "degrees": [3, 2, 1]}, {"measure": 2, "degrees": [1, 2, 1]}]', 3, 'lead-sheet',
  0.0, 'hidden', ('hidden',), True, 2, 2, True, 3, '3,2,1'),
 ('Cb major', [(0, 'Fsus4'), (1, 'Bb6'), (2, 'Bbmin7')],
  '[{"measure": 0, "degrees": [1, 3, 3]}, {"measure": 1, "degrees": [0, 1, 1]}, {"measure": 2, '
  '"degrees": [2, 0, 2]}]',
  3, 'lead-sheet', 0.0, 'parallels,hidden', ('hidden', 'parallels'), True, 3, 3, True, 3, '1,3,3'),
 ('H minor', [(3, 'Fø7'), (4, 'Gb7sus4'), (5, 'Db')],
  '[{"measure": 3, "notes": [1, 2], "bassOctave": null}, {"measure": 4, "degrees": [2]}, '
  '{"measure": 5, "degrees": [2, 2]}]',
  2, 'common-practice', 0.0, 'hidden', ('hidden',), True, 3, 3, True, 2, '1,2'),
 ('A minor', [(1, 'Bbdim'), (2, 'C#sus2'), (2.5, 'C#sus2'), (4, 'Ebaug')],
  '[{"measure": 1, "degrees": [0, 1, 2, 1]}, {"measure": 2, "degrees": [3, 3, 1, 2]}, {"measure": '
  '2.5, "degrees": [1, 2, 2, 0]}, {"measure": 4, "degrees": [0, 0, 2, 0]}]',
  4, 'lead-sheet', 0.0, 'hidden', ('hidden',), True, 4, 4, True, 4, '0,1,2,1'),
 (' G major ', [(0, 'Csus2'), (1, 'Em'), (2, 'Dm'), (3, 'Gbm6')],
  '[{"measure": 0, "degrees": [2, 3, 1, 1]}, {"measure": 1, "degrees": [0, 1, 0, 2]}, {"measure": '
  '2, "degrees": [0, 3, 2, 1]}, {"measure": 3, "degrees": [3, 2, 0, 0]}]',
  4, 'lead-sheet', 0.0, 'parallels,hidden', ('hidden', 'parallels'), True, 4, 4, True, 4,
  '2,3,1,1'),
 ('Cb major', [(2, 'Absus2'), (1, 'Dm6')],
  '[{"measure": 2, "degrees": [3, 2, 0, 0]}, {"measure": 1, "degrees": [1, 2, 2, 1]}]', 4,
  'common-practice', 0.0, 'parallels,hidden', ('hidden', 'parallels'), True, 2, 2, True, 4,
  '3,2,0,0'),
 ('BB major', [(3, 'Eø'), (4, 'C#m6'), (5, 'Db7sus4'), (6, 'Cb7'), (3, 'C#6')],
  '[{"measure":3,"degrees":[3,3]},{"measure":4,"degrees":[0,0,3]},{"measure":5,"degrees":[2,3]},{"bar":6,"degrees":[1,0,0]},{"measure":3,"voices":[3,1]}]',
  2, 'lead-sheet', 0.0, 'hidden', ('hidden',), True, 5, 5, True, 2, '3,3'),
 ('BB major', [(1, 'Bb+'), (2, 'Abmaj7')],
  '[{"measure": 1, "degrees": [0, 3]}, {"measure": 2, "degrees": [2, 2]}]', 2, 'common-practice',
  0.0, 'parallels,hidden', ('hidden', 'parallels'), True, 2, 2, True, 2, '0,3'),
 ('C major', [(1, 'Db°7'), (2, 'Dm7'), (3, 'F6')],
  '[{"measure": 1, "degrees": [3, 3, 3]}, {"measure": 2, "degrees": [2, 2, 2]}, {"measure": 3, '
  '"degrees": [0, 0, 0]}]',
  3, 'common-practice', 0.0, 'parallels,hidden', ('hidden', 'parallels'), True, 3, 3, True, 3,
  '3,3,3'),
 ('bb major', [(1, 'C+'), (2, 'C#sus2'), (3, 'Fm'), (4, 'Absus4')],
  '[{"measure": 1, "degrees": [0, 3, 3]}, {"measure": 2, "degrees": [2, 0, 2]}, {"measure": 3, '
  '"degrees": [0, 0, 0]}, {"measure": 4, "degrees": [2, 3, 3]}]',
  3, 'common-practice', 0.0, 'parallels', ('parallels',), True, 4, 4, True, 3, '0,3,3'),
 ('C major', [(1, 'Amin7'), (2.5, 'Cm6')],
  '[{"measure": 1, "degrees": [1, 0]}, {"measure": 2.5, "degrees": [3, 3]}]', 2, 'lead-sheet', 0.0,
  'hidden', ('hidden',), True, 2, 2, True, 2, '1,0'),
 (' G major ', [(1, 'F#m7b5'), (2, 'F#9'), (3, 'Gsus4')],
  '[{"measure": 1, "degrees": [1, 0, 0]}, {"measure": 2, "degrees": [1, 3, 0], "bassOctave": 3.1}, '
  '{"measure": 3, "degrees": [3, 2, 1]}]',
  3, 'lead-sheet', 0.0, 'chordMembership,tendencyLeadingTone',
  ('chordMembership', 'tendencyLeadingTone'), True, 3, 3, True, 3, '1,0,0'),
 ('BB major', [(2, 'B7sus4'), (3, 'Am'), (4, 'Gbm'), (1, 'CΔ')],
  '[{"measure": 2, "degrees": [1, 3]}, {"measure": 3, "degrees": [3, 0]}, {"measure": 4, '
  '"degrees": [1, 3]}, {"measure": 1, "degrees": [1, 0]}]',
  2, 'common-practice', 0.0, 'hidden', ('hidden',), True, 4, 4, True, 2, '1,3'),
 ('EB minor', [(2, 'Bsus4'), (3, 'Bdim7'), (1, 'Gsus2')],
  '[{"measure": 2, "degrees": [1, 2]}, {"measure": 3, "degrees": [2, 0]}, {"measure": 1, '
  '"degrees": [0, 2]}]',
  2, 'common-practice', 0.0, 'hidden', ('hidden',), True, 3, 3, True, 2, '1,2'),
 ('E# minor', [(1, 'Fmin7'), (2, 'Gbsus4')],
  '[{"measure": 1, "degrees": [2, 1]}, {"measure": 2, "degrees": [3, 3]}]', 2, 'lead-sheet', 0.0,
  'hidden', ('hidden',), True, 2, 2, True, 2, '2,1'),
 ('Cb major', [(0, 'Bbsus4'), (1, 'A7sus4')],
  '[{"measure": 0, "degrees": [1, 0]}, {"measure": 1, "degrees": [3, 0]}]', 2, 'common-practice',
  0.0, 'hidden', ('hidden',), True, 2, 2, True, 2, '1,0'),
 ('', [(1, 'Abm7b5'), (2, 'Cadd9'), (3, 'Bmaj7'), (4, 'Dbaug'), (5, 'Dbm9'), (6, 'C7')],
  '[{"measure": 1, "degrees": [0, 1]}, {"measure": 2, "degrees": [2, 0]}, {"measure": 3, '
  '"degrees": [0, 2]}, {"measure": 4, "degrees": [2, 0]}, {"measure": 5, "degrees": [0, 0]}, '
  '{"measure": 6, "degrees": [3, 2]}]',
  2, 'lead-sheet', 0.0, 'hidden', ('hidden',), True, 6, 6, True, 2, '0,1'),
 ('c maj', [(3, 'Ebadd9'), (4, 'E°'), (5, 'F#maj7')],
  '[{"measure": 3, "degrees": [1, 0]}, {"measure": 4, "degrees": [2, 2]}, {"measure": 5, '
  '"degrees": [0, 2]}]',
  2, 'common-practice', 0.0, 'hidden', ('hidden',), True, 3, 3, True, 2, '1,0'),
 ('Eb\tmajor', [(3, 'D+'), (4, 'Ebdim7'), (5, 'Ab'), (6, 'Gø')],
  '[{"measure": 3, "degrees": [2, 0, 3]}, {"measure": 4, "degrees": [0, 0, 2]}, {"measure": 5, '
  '"degrees": [0, 1, 1]}, {"measure": 6, "degrees": [3, 2, 3]}]',
  3, 'common-practice', 0.0, 'hidden,tendencyLeadingTone', ('hidden', 'tendencyLeadingTone'), True,
  4, 4, True, 3, '2,0,3'),
 ('bb major',
  [(3, 'EbM7'), (4, 'Fsus4'), (5, 'F6'), (6, 'Bbmaj7'), (7, 'Gb°'), (8, 'Badd9'), (9, 'Bb6')],
  '[{"measure": 3, "degrees": [0, 2], "bassOctave": 2}, {"measure": 4, "degrees": [3, 1]}, '
  '{"measure": 5, "degrees": [1, 1]}, {"measure": 6, "degrees": [3, 0]}, {"measure": 7, "degrees": '
  '[1, 2]}, {"measure": 8, "degrees": [3, 3]}, {"measure": 9, "degrees": [1, 0], "bassOctave": 4}]',
  2, 'lead-sheet', 0.0, 'hidden,overlap,tendencyLeadingTone',
  ('hidden', 'overlap', 'tendencyLeadingTone'), True, 7, 7, True, 2, '0,2'),
 ('A minor',
  [(1, 'Bbm'), (2, 'Gm6'), (3, 'F#9'), (4, 'Emaj9'), (5, 'A7sus4'), (6, 'Am6'), (7, 'Aø7')],
  '[{"measure": 1, "degrees": [2, 1]}, {"measure": 2, "degrees": [2, 1]}, {"measure": 3, '
  '"degrees": [0, 2]}, {"measure": 4, "degrees": [2, 1]}, {"measure": 5, "degrees": [1, 1]}, '
  '{"measure": 6, "degrees": [1, 2]}, {"measure": 7, "degrees": [2, 0], "bassOctave": 3.1}]',
  2, 'common-practice', 0.0, 'chordMembership,hidden,overlap,tendencyLeadingTone',
  ('chordMembership', 'hidden', 'overlap', 'tendencyLeadingTone'), True, 7, 7, True, 2, '2,1'),
 ('Bb major', [(1, 'Dbsus4'), (2, 'Cm9'), (1, 'A+'), (4, 'Bbmadd9')],
  '[{"measure": 1, "degrees": [2, 1, 3]}, {"measure": 2, "degrees": [0, 0, 1]}, {"measure": 1, '
  '"degrees": [0, 2, 3]}, {"measure": 4, "degrees": [1, 0, 2]}]',
  3, 'common-practice', 0.0, 'hidden,overlap,tendencyLeadingTone',
  ('hidden', 'overlap', 'tendencyLeadingTone'), True, 4, 4, True, 3, '2,1,3'),
 ('BB major', [(3, 'Fb+'), (4, 'F#sus4'), (5, 'F#7sus4')],
  '[{"measure":4,"degrees":[3,2,-1,6]},{"measure":3,"degrees":[2,3,1,1,3]},{"measure":5,"notes":[1,3,0,3],"bassOctave":-1.9}]',
  4, 'common-practice', 0.0, 'chordMembership,hidden,overlap,spacing,leap',
  ('chordMembership', 'hidden', 'leap', 'overlap', 'spacing'), True, 3, 3, False, 4, '3,2,-1,6'),
 ('', [(1, 'Dbm7b5')], '[{"measure": 1, "degrees": [3, 3, 3, 0, 3], "bassOctave": -1.9}]', 4,
  'common-practice', 0.0, 'chordMembership,spacing', ('chordMembership', 'spacing'), True, 1, 1,
  True, 4, '3,3,3,0,3'),
 ('A minor', [(1, 'Ab'), (2, 'Am6'), (3, 'F7'), (4, 'F#M7')],
  '[{"measure": 1, "degrees": [2, 1, 3]}, {"measure": 2, "degrees": [2, 2, 2], "bassOctave": 2}, '
  '{"measure": 3, "degrees": [0, 3, 1]}, {"measure": 4, "degrees": [3, 1, 2]}]',
  3, 'lead-sheet', 0.0, 'hidden,overlap,tendencyLeadingTone',
  ('hidden', 'overlap', 'tendencyLeadingTone'), True, 4, 4, True, 3, '2,1,3'),
 (' G major ', [(0, 'C#m'), (1, 'Cbsus2'), (2, 'F#maj9')],
  '```json\n'
  '[{"bar": 0, "degrees": []}, {"bar": 1, "degrees": [0, 0, 3], "bassOctave": -1.9}, {"measure": '
  '2, "notes": [1, 1, ".5"]}, {"measure": 0, "degrees": [3.0, 2, 2], "bassOctave": 2}]\n'
  '```',
  3, 'lead-sheet', 0.0, 'chordMembership,hidden,overlap,spacing,leap',
  ('chordMembership', 'hidden', 'leap', 'overlap', 'spacing'), True, 3, 3, False, 3, '0,0,3')]


@pytest.mark.parametrize("row", GOLDEN, ids=[f"golden{i}" for i in range(len(GOLDEN))])
def test_golden_case(row):
    key, chords, completion, voices, style, *expected = row
    progression = {"key": key, "chords": [{"measure": m, "chordSymbol": s} for m, s in chords]}
    r = score(progression, completion, voices, style)
    assert [
        r.reward, r.verdict, r.failing_rules, r.format_ok, r.sounding_frames,
        r.expected_frames, r.first_measure_ok, r.voice_count, r.opening,
    ] == expected


def test_golden_set_covers_every_outcome():
    assert {row[6] for row in GOLDEN} >= {"admitted", "structure"}
    assert {rule for row in GOLDEN for rule in row[7]} == {
        "structure", "chordMembership", "parallels", "hidden", "overlap", "spacing", "leap",
        "tendencySeventh", "tendencyLeadingTone",
    }
    assert {row[4] for row in GOLDEN} == {"common-practice", "lead-sheet", "film-ambient"}
