#!/usr/bin/env bash
# Regenerate the committed stubs graders/proto/grader_pb2{,_grpc}.py{,i} from protos/grader.proto.
#
# Why an old grpcio-tools: stubs made by grpcio-tools 1.85 (protobuf 6/7 gencode) refuse to
# import under an older grpcio/protobuf runtime, and the GPU image ships older ones. grpcio-tools
# 1.62.3 emits protobuf 4.25 gencode with no runtime version check, which imports under
# protobuf 4.25 ... 7.x and grpcio 1.62 ... 1.85 (see protos/README.md).
#
# Usage: bash protos/generate.sh        (run from anywhere; uses a throwaway venv in /tmp)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS_VENV="${STUBGEN_VENV:-/tmp/stubgen-venv}"
TOOLS_VERSION="1.62.3"

if ! "$TOOLS_VENV/bin/python" -c "import grpc_tools, sys; import importlib.metadata as m; \
sys.exit(m.version('grpcio-tools') != '$TOOLS_VERSION')" 2>/dev/null; then
  python3 -m venv "$TOOLS_VENV"
  "$TOOLS_VENV/bin/pip" install -q "grpcio-tools==$TOOLS_VERSION"
fi

cd "$ROOT"
# -Igraders/proto=protos maps the file to the virtual path graders/proto/grader.proto, so the
# _grpc module imports `from graders.proto import grader_pb2` (a package-absolute import).
"$TOOLS_VENV/bin/python" -m grpc_tools.protoc \
  -Igraders/proto=protos \
  --python_out=. --pyi_out=. --grpc_python_out=. \
  protos/grader.proto
echo "generated: $(ls graders/proto/grader_pb2*.py* | tr '\n' ' ')"
