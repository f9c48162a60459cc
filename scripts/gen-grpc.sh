#!/usr/bin/env bash
# Regenerates the committed protobuf modules:
#   lockgate/protocol/grpc/inference_pb2*.py from inference.proto (the gRPC frontend);
#   lockgate/core/triton/model_config_pb2.py from Triton's model_config.proto (config.pbtxt).
#
# The generated modules are committed, so serving needs only grpcio and protobuf. They are
# generated with grpcio-tools 1.66.2 (protobuf 5.27 gencode) in a throwaway venv: the output
# then runs on grpcio >= 1.66.2 and protobuf >= 5.27.2, old enough for most installs.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TOOLS_VERSION=${TOOLS_VERSION:-1.66.2}
if [ -z "${GEN_VENV:-}" ]; then  # a throwaway venv unless one is given
  GEN_VENV=$(mktemp -d)
  trap 'rm -rf "$GEN_VENV"' EXIT
fi
if [ ! -x "$GEN_VENV/bin/python" ]; then
  "$PYTHON" -m venv "$GEN_VENV"
  "$GEN_VENV/bin/python" -m pip install -q "grpcio-tools==$TOOLS_VERSION"
fi

# Triton's clients register the same `inference.*` names in protobuf's default pool, so a
# process that imports tritonclient.grpc and lockgate would fail with "duplicate symbol":
# lockgate's messages live in pools of their own (the wire and text formats do not depend on it).
own_pool() {
  sed -i 's/^DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile(/POOL = _descriptor_pool.DescriptorPool()\nDESCRIPTOR = POOL.AddSerializedFile(/' \
    "$1"
  grep -q '^POOL = ' "$1" || { echo "gen-grpc: pool rewrite failed in $1" >&2; exit 1; }
}

out=lockgate/protocol/grpc
"$GEN_VENV/bin/python" -m grpc_tools.protoc -I "$out" \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" "$out/inference.proto"
# grpc_tools writes `import inference_pb2`; make it a package import.
sed -i 's/^import inference_pb2 as inference__pb2$/from lockgate.protocol.grpc import inference_pb2 as inference__pb2/' \
  "$out/inference_pb2_grpc.py"
own_pool "$out/inference_pb2.py"
echo "generated $out/inference_pb2.py, inference_pb2.pyi, inference_pb2_grpc.py"

# Triton's model configuration schema, which config.pbtxt is read against. It lives in
# lockgate/core (its only reader), so core never imports the protocol package.
out=lockgate/core/triton
"$GEN_VENV/bin/python" -m grpc_tools.protoc -I "$out" \
  --python_out="$out" --pyi_out="$out" "$out/model_config.proto"
own_pool "$out/model_config_pb2.py"
echo "generated $out/model_config_pb2.py, model_config_pb2.pyi"
