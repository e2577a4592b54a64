"""Vowel-share grader: a synthetic reward for speed benchmarks (`task`: the registered
`vowel-share` task and its driver-side profile). Settings: config/vowel_share.py, the
`grader.vowel_share` section."""
