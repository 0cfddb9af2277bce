#!/usr/bin/env bash
# Regenerate the committed stubs in diloco/v1 from protos/diloco/v1/*.proto.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I protos \
  --python_out=. --pyi_out=. --grpc_python_out=. \
  protos/diloco/v1/*.proto
