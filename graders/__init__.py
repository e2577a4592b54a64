"""Verifiers and the gRPC grader service.

Pure rule code lives in subpackages (e.g. ``graders.voice_leading``) with no gRPC or Ray
import; ``graders.service`` and ``graders.serve_app`` are the thin shells around them.
"""
