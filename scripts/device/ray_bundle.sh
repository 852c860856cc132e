#!/usr/bin/env bash
# Builds .ray/ in the repository root: Ray for the lent GPU machine, which cannot download it.
#
# Ray's wheel (79 MB) alone is over the device's 64 MiB carry limit, and a Ray run there also
# needs the vLLM bundle (.vllm, 23 MB) and the repository (~13 MB). What this keeps is what
# `ray.init` on one node, placement groups and actors use: the core binaries (symbols stripped),
# the Python core, the dashboard and runtime-env agents' code. What it drops: the Java jar, the
# dashboard's web client and the libraries (rllib, data, train, tune, serve, llm, air, workflow).
# Ray's own dependencies come as wheels; setup-ray.sh installs only those the device lacks, so
# the device's packages (protobuf for onnx, say) are not shadowed.
#
# Usage (repository root):  bash scripts/device/ray_bundle.sh          (~1 min, xz -9)
# On the device, in a `run` call with carry [".ray", ...]:  source .ray/setup-ray.sh
set -euo pipefail
ray_version=${RAY_VERSION:-2.60.0}
out=.ray
grep -qxF "/$out/" .git/info/exclude 2>/dev/null || echo "/$out/" >> .git/info/exclude
rm -rf "$out" && mkdir -p "$out/whl"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
wheel_args=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
            --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any)
python3 -m pip download -q "${wheel_args[@]}" -d "$tmp" "ray==$ray_version"
mkdir "$tmp/x"
unzip -q "$tmp"/ray-"$ray_version"-*.whl -d "$tmp/x" -x 'ray/jars/*' 'ray/dashboard/client/*' \
  'ray/rllib/*' 'ray/data/*' 'ray/train/*' 'ray/tune/*' 'ray/serve/*' 'ray/llm/*' 'ray/air/*' 'ray/workflow/*'
# Debug symbols are a third of the binaries; the dynamic symbols Python and the loader need stay.
strip --strip-unneeded "$tmp/x/ray/_raylet.so" "$tmp/x/ray/core/src/ray/gcs/gcs_server" \
  "$tmp/x/ray/core/src/ray/raylet/raylet"
tar -C "$tmp/x" -cf - . | xz -T0 -9 > "$out/ray-$ray_version-trim.tar.xz"
# Ray's requirements (and theirs), plus transitions, which the vLLM bundle does not carry.
python3 -m pip download -q "${wheel_args[@]}" -d "$out/whl" click filelock jsonschema msgpack packaging \
  protobuf pyyaml requests attrs referencing rpds-py jsonschema-specifications transitions==0.9.3
cat > "$out/setup-ray.sh" <<SETUP
# Sourced on the device: unpacks Ray to /tmp/ray-rt once and puts it on PYTHONPATH.
_rb=\$(cd "\$(dirname "\${BASH_SOURCE[0]}")" && pwd)
if [ ! -d /tmp/ray-rt/ray ]; then
  mkdir -p /tmp/ray-rt /tmp/ray-deps
  tar -C /tmp/ray-rt -xJf "\$_rb"/ray-$ray_version-trim.tar.xz
  for whl in "\$_rb"/whl/*.whl; do  # only what the device lacks
    module=\$(basename "\$whl" | cut -d- -f1 | tr 'A-Z' 'a-z' | sed 's/^pyyaml\$/yaml/; s/^protobuf\$/google.protobuf/; s/^rpds_py\$/rpds/')
    python3 -c "import \$module" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile \\
      --target /tmp/ray-deps "\$whl"
  done
fi
export PYTHONPATH="/tmp/ray-rt:/tmp/ray-deps\${PYTHONPATH:+:\$PYTHONPATH}"
python3 -c "import ray; print('ray', ray.__version__, 'from', ray.__file__)"
SETUP
du -sh "$out"
echo "carry [\".ray\"]; on the device: source .ray/setup-ray.sh"
