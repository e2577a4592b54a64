"""Generated gRPC stubs for protos/grader.proto (committed; regenerate with protos/generate.sh).

Import as ``from graders.proto import grader_pb2, grader_pb2_grpc``.
"""
